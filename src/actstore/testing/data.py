"""Synthetic captures for format tests: a plan, its activations and its batches, as a capture
would hand them to a writer; and :func:`resign`, which rewrites a store's root manifest over
edited files as a careless tool (or an attacker without the HMAC key) could."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..batch import Batch, CapturePlan
from ..sites import Site

N_EXAMPLES, N_TOKENS, D_MODEL = 23, 6, 8
SITES = (Site("resid", 1), Site("resid", 3))


def make_plan(**overrides: Any) -> CapturePlan:
    """A text capture of :data:`N_EXAMPLES` examples of :data:`N_TOKENS` tokens at
    :data:`SITES` of a 4-block gpt2-family model (``overrides`` replace any field).

    Example:
        >>> make_plan(n_examples=5).n_examples
        5
    """
    values: dict[str, Any] = {
        "ckpt": "tiny-test-model",
        "family": "gpt2",
        "modality": "text",
        "sites": SITES,
        "n_model_layers": 4,
        "d_model": D_MODEL,
        "tokens_per_example": N_TOKENS,
        "has_cls": False,
        "n_examples": N_EXAMPLES,
        "dataset_root": "/nowhere",
        "data": {"kind": "test"},
        "classes": None,
        "has_labels": False,
        "has_tokens": True,
        "batch_size": 4,
    }
    values.update(overrides)
    return CapturePlan(**values)


def make_acts(plan: CapturePlan, seed: int = 0) -> dict[str, np.ndarray]:
    """Activations per site name, ``[N, T, D]`` float32, a different magnitude per site."""
    rng = np.random.default_rng(seed)
    shape = (plan.n_examples, plan.tokens_per_example, plan.d_model)
    return {
        str(s): (rng.standard_normal(shape) * (1 + i)).astype(np.float32)
        for i, s in enumerate(plan.sites)
    }


def make_tokens(plan: CapturePlan) -> np.ndarray:
    """The token ids ``[N, T]`` int32 :func:`make_batches` gives each example."""
    n, t = plan.n_examples, plan.tokens_per_example
    return ((np.arange(n * t, dtype=np.int64).reshape(n, t) % 250) + 4).astype(np.int32)


def make_batches(plan: CapturePlan, acts: dict[str, np.ndarray]) -> list[Batch]:
    """``acts`` cut into the plan's batches, with token ids and texts."""
    tokens = make_tokens(plan)
    out = []
    for lo in range(0, plan.n_examples, plan.batch_size):
        hi = min(lo + plan.batch_size, plan.n_examples)
        out.append(
            Batch(
                acts={k: torch.from_numpy(v[lo:hi].copy()) for k, v in acts.items()},
                example_ids=np.arange(lo, hi, dtype=np.int64),
                token_ids=tokens[lo:hi],
                texts=[f"example {i}" for i in range(lo, hi)],
            )
        )
    return out


def resign(store: str | os.PathLike, *, summary: dict[str, Any] | None = None) -> None:
    """Rewrite the root manifest of local store ``store`` over its files as they are now,
    so sizes, keyed digests and the manifest's own digest all match again: what a careless
    tool or an attacker with write access could do. Only the summary check (what readers
    parse against what was published) and an HMAC key (``ACTSTORE_MANIFEST_KEY``) tell it
    apart."""
    from ..storage.manifest import MANIFEST, OWN_FILES, ManifestBuilder, RootManifest, skipped

    root = Path(store)
    old = RootManifest.from_bytes((root / MANIFEST).read_bytes(), MANIFEST)
    builder = ManifestBuilder(format=old.format, store_id=old.store_id, record=old.record)
    for path in sorted(root.rglob("*")):
        name = path.relative_to(root).as_posix()
        if not path.is_file() or name in OWN_FILES or skipped(name, old.skip):
            continue
        if any(name.startswith(folder) for folder in old.nested):
            continue  # a nested store's file: its own manifest lists it
        entry = old.files.get(name)
        if entry is not None and entry.ranges is not None:
            builder.add_file(root, name, ranges=[r for r in entry.ranges if r[1]])
        else:
            builder.add_file(root, name, unit=entry.unit if entry else 0)
    builder.skip = dict(old.skip)
    builder.nested = list(old.nested)
    for name in OWN_FILES:
        if (root / name).exists():
            (root / name).chmod(0o644)
    builder.write(root, summary=summary if summary is not None else old.summary)
