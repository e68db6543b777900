"""The zarr format runs the shared Writer/Reader conformance suite.

The suite's synthetic examples become prompt/response samples: example ``i`` has a prompt of
``1 + i % (T - 1)`` tokens and a response of the rest, given through ``Batch.extras`` as a
prompt/response capture gives them. Blocks are (sample, part) slices in storage order, so
their rows are the suite's rows in the suite's order. Run once with one chunk per
(sample, layer) and once with 2-token chunks (several chunk files per read).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from actstore.formats.zarr import ZarrOptions
from actstore.testing import ConformanceSuite, FormatCase


def prompt_lengths(plan) -> np.ndarray:
    return 1 + np.arange(plan.n_examples) % (plan.tokens_per_example - 1)


class ZarrCase(FormatCase):
    """Zarr stores prompt/response samples: the suite's examples get prompt and response
    lengths, as a prompt/response capture gives them."""

    def __init__(self, t_chunk: int | None = None) -> None:
        options = ZarrOptions(
            p_max=5, r_max=5, t_chunk_prompt=t_chunk, t_chunk_response=t_chunk, samples_per_shard=5
        )
        super().__init__(
            "zarr",
            options,
            round_trip_through=None,
            cannot_hold={"labels": "zarr keeps per-sample hallucination labels, not classes"},
            check_crashes=True if t_chunk is None else "checked with one chunk per sample",
        )

    def plan(self, **overrides):
        plan = super().plan(**overrides)
        p = prompt_lengths(plan)
        extras = {"prompt_lengths": p, "response_lengths": plan.tokens_per_example - p}
        return dataclasses.replace(plan, extras=extras)

    def batches(self, plan, acts):
        p = prompt_lengths(plan)
        r = plan.tokens_per_example - p
        return [
            dataclasses.replace(
                b, extras={"prompt_len": p[b.example_ids], "response_len": r[b.example_ids]}
            )
            for b in super().batches(plan, acts)
        ]

    def expected_examples(self, plan, acts, site):
        """``reader[...]``'s token axis: the prompt, then the response, each zero-padded to
        P_max and R_max."""
        rows = acts[str(site)].astype(self.stored_dtype)
        out = np.zeros((plan.n_examples, 10, plan.d_model), dtype=rows.dtype)
        for i, n in enumerate(prompt_lengths(plan)):
            out[i, :n] = rows[i, :n]
            out[i, 5 : 5 + plan.tokens_per_example - n] = rows[i, n:]
        return out

    def expected_tokens(self, plan):
        """Prompt tokens, then response tokens, each padded with -1 to P_max and R_max."""
        ids, p = super().expected_tokens(plan), prompt_lengths(plan)
        out = np.full((plan.n_examples, 10), -1, dtype=ids.dtype)
        for i, n in enumerate(p):
            out[i, :n] = ids[i, :n]
            out[i, 5 : 5 + plan.tokens_per_example - n] = ids[i, n:]
        return out


class TestZarrConformance(ConformanceSuite):
    case = ZarrCase()


class TestZarrSmallChunksConformance(ConformanceSuite):
    case = ZarrCase(t_chunk=2)
