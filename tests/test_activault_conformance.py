"""The activault format runs the shared Writer/Reader conformance suite: on local disk in the
default bfloat16 and in float32, and on a real S3 server (moto on 127.0.0.1)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conformance import ConformanceSuite, FormatCase

from actstore.formats.activault import ActivaultOptions, ActivaultWriter, hook_name
from actstore.formats.activault.layout import parse_data_file


class LocalCase(FormatCase):
    """One row per file (the conformance store has 23 examples of 6 tokens: no tail)."""

    def __init__(self, dtype: str = "bfloat16") -> None:
        self.dtype = dtype
        self.stored_dtype = "float16" if dtype == "float16" else "float32"

    def out(self, root: Path) -> str:
        return str(root)

    #: (rows, tokens) per file: 1 x 6 gives 23 files per hook, one per example.
    file_shape = (1, 0)

    def _writer(self, root, plan) -> ActivaultWriter:
        rows, seq = self.file_shape
        return ActivaultWriter(
            plan,
            self.out(root),
            ActivaultOptions(rows_per_file=rows, sequence_length=seq, dtype=self.dtype),
        )

    def open_writer(self, root, plan, batches):
        return self._writer(root, plan), batches

    def write_unpublished(self, root, plan, batches):
        writer = self._writer(root, plan)
        for batch in batches:
            writer.write(batch)
        writer.abort()
        return str(writer.location)

    def damage(self, location):
        hook = Path(location) / "models.layers.3.post"
        victim = sorted(p for p in hook.iterdir() if parse_data_file(p.name))[4]
        with open(victim, "r+b") as f:
            f.truncate(victim.stat().st_size - 4)

    def expected_rows(self, plan, acts, site):
        rows = torch.from_numpy(acts[str(site)].reshape(-1, plan.d_model))
        return rows.to(getattr(torch, self.dtype)).to(torch.float32).numpy()


class S3Case(LocalCase):
    env = None  # set per test by the autouse fixture
    #: 3 rows of 23 tokens: rows cross example boundaries; 2 files per hook (fewer requests).
    file_shape = (3, 23)

    def out(self, root: Path) -> str:
        return self.env.url(root.parent.name, root.name)

    def damage(self, location):
        keys = sorted(
            k
            for k in self.env.keys()  # noqa: SIM118 - S3Env.keys() lists the bucket
            if "models.layers.1.post/" in k and k.endswith(".pt") and location.split("/", 3)[3] in k
        )
        client = self.env.client()
        data = client.get_object(Bucket=self.env.bucket, Key=keys[1])["Body"].read()
        client.put_object(Bucket=self.env.bucket, Key=keys[1], Body=data[:-100])


class TestActivaultLocalConformance(ConformanceSuite):
    case = LocalCase("bfloat16")

    def test_statistics_match_numpy(self, store):
        """Statistics describe the stored (bfloat16-rounded) values exactly."""
        plan, acts, location = store
        reader = self.case.open(location)
        for site in plan.sites:
            stats = reader.statistics(hook_name(site))
            rows = self.case.expected_rows(plan, acts, site).astype(np.float64)
            assert stats.count == rows.shape[0]
            np.testing.assert_allclose(stats.mean, rows.mean(0), rtol=1e-9, atol=1e-12)
            np.testing.assert_allclose(stats.var, rows.var(0), rtol=1e-9)


class TestActivaultLocalFloat32Conformance(ConformanceSuite):
    case = LocalCase("float32")


class TestActivaultS3Conformance(ConformanceSuite):
    case = S3Case("float32")

    @pytest.fixture(autouse=True)
    def _bucket(self, s3):
        self.case.env = s3
        yield
        self.case.env = None
