"""The zarr format runs the shared Writer/Reader conformance suite.

The suite's synthetic examples become prompt/response samples: example ``i`` has a prompt of
``1 + i % (T - 1)`` tokens and a response of the rest, given through ``Batch.extras`` as a
prompt/response capture gives them. Blocks are (sample, part) slices in storage order, so
their rows are the suite's rows in the suite's order. Run once with one chunk per
(sample, layer) and once with 2-token chunks (several chunk files per read).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
from conformance import ConformanceSuite, FormatCase

from actstore.formats.zarr import ZarrOptions, ZarrWriter


def prompt_lengths(plan) -> np.ndarray:
    return 1 + np.arange(plan.n_examples) % (plan.tokens_per_example - 1)


def as_prompt_response(plan, batches):
    """The suite's plan and batches, split into prompt and response via extras."""
    p = prompt_lengths(plan)
    r = plan.tokens_per_example - p
    plan = dataclasses.replace(plan, extras={"prompt_lengths": p, "response_lengths": r})
    out = []
    for batch in batches:
        ids = batch.example_ids
        out.append(
            dataclasses.replace(batch, extras={"prompt_len": p[ids], "response_len": r[ids]})
        )
    return plan, out


class ZarrCase(FormatCase):
    stored_dtype = "float16"

    def __init__(self, t_chunk: int | None = None) -> None:
        self.options = ZarrOptions(
            p_max=5, r_max=5, t_chunk_prompt=t_chunk, t_chunk_response=t_chunk, samples_per_shard=5
        )

    def _writer(self, root: Path, plan, batches):
        plan, batches = as_prompt_response(plan, batches)
        return ZarrWriter.from_plan(plan, root, self.options), batches

    def open_writer(self, root, plan, batches):
        return self._writer(root, plan, batches)

    def write_unpublished(self, root, plan, batches):
        writer, batches = self._writer(root, plan, batches)
        for batch in batches:
            writer.write(batch)
        writer.abort()  # never closed: as after a crash
        return str(writer.final)

    def open(self, location):
        from actstore.formats.registry import get_format

        return get_format("zarr").open_reader(location)

    def damage(self, location):
        chunk = Path(location) / "arrays" / "prompt_activations" / "4.1.0.0"
        assert chunk.exists()
        os.chmod(chunk, 0o644)
        with open(chunk, "r+b") as f:
            f.truncate(chunk.stat().st_size - 2)


class TestZarrConformance(ConformanceSuite):
    case = ZarrCase()


class TestZarrSmallChunksConformance(ConformanceSuite):
    case = ZarrCase(t_chunk=2)
