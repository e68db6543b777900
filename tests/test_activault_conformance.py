"""The activault format runs the shared Writer/Reader conformance suite: on local disk in the
default bfloat16 and in float32, and on a real S3 server (moto on 127.0.0.1)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from actstore.formats.activault import ActivaultOptions
from actstore.testing import ConformanceSuite, FormatCase


class ActivaultCase(FormatCase):
    """One example of 6 tokens per file: 23 files per hook."""

    def __init__(self, dtype: str = "bfloat16", check_crashes: bool | str = True) -> None:
        super().__init__(
            "activault",
            ActivaultOptions(rows_per_file=1, sequence_length=0, dtype=dtype),
            stored_dtype="float16" if dtype == "float16" else "float32",
            cannot_hold={"labels": "megabatch files hold states and input_ids only"},
            check_crashes=check_crashes,
        )
        self.dtype = dtype

    def expected_rows(self, plan, acts, site):
        rows = torch.from_numpy(acts[str(site)].reshape(-1, plan.d_model))
        return rows.to(getattr(torch, self.dtype)).to(torch.float32).numpy()


class S3Case(ActivaultCase):
    """3 rows of 23 tokens per file: rows cross example boundaries; 2 files per hook (fewer
    requests). Written to the loopback S3 server of the ``s3`` fixture."""

    env = None  # set per test by the autouse fixture

    def __init__(self) -> None:
        super().__init__("float32")
        self.check_crashes = "crash and resume on S3 are tests/test_activault_s3.py's"
        self.options = ActivaultOptions(rows_per_file=3, sequence_length=23, dtype="float32")

    def open_writer(self, out, plan, batches):
        root = Path(out)
        return super().open_writer(self.env.url(root.parent.name, root.name), plan, batches)

    def write_unpublished(self, out, plan, batches):
        root = Path(out)
        return super().write_unpublished(self.env.url(root.parent.name, root.name), plan, batches)

    def overwrite(self, location, name, data):
        key = f"{location.split('/', 3)[3]}/{name}"
        client = self.env.client()
        original = client.get_object(Bucket=self.env.bucket, Key=key)["Body"].read()
        client.put_object(Bucket=self.env.bucket, Key=key, Body=data)
        return original

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
    case = ActivaultCase("bfloat16")

    def test_statistics_match_numpy(self, store):
        """Statistics describe the stored (bfloat16-rounded) values exactly."""
        plan, acts, location = store
        reader = self.case.open(location)
        for site in plan.sites:
            stats = reader.statistics(site)
            rows = self.case.expected_rows(plan, acts, site).astype(np.float64)
            assert stats.count == rows.shape[0]
            np.testing.assert_allclose(stats.mean, rows.mean(0), rtol=1e-9, atol=1e-12)
            np.testing.assert_allclose(stats.var, rows.var(0), rtol=1e-9)


class TestActivaultLocalFloat32Conformance(ConformanceSuite):
    case = ActivaultCase("float32", check_crashes="checked on the bfloat16 run (one writer)")


class TestActivaultS3Conformance(ConformanceSuite):
    case = S3Case()

    @pytest.fixture(autouse=True)
    def _bucket(self, s3):
        self.case.env = s3
        yield
        self.case.env = None
