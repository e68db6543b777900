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

#: What the kit's second capture adds to :func:`make_plan`'s (besides bfloat16 input, which
#: every format takes): feature -> what it is. A :class:`~actstore.testing.FormatCase`
#: declares the ones its format cannot hold (``cannot_hold``), with the reason.
FEATURES = {
    "attn_out": "an attention sub-layer's output site (attn_out.2)",
    "mlp_out": "an MLP sub-layer's output site (mlp_out.3)",
    "cls": "a CLS token at position 0 of every example (has_cls)",
    "labels": "a class label per example, with class names (has_labels, classes)",
}
CLASSES = ["cat", "dog", "eel"]


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


def rich_overrides(features: Any = tuple(FEATURES)) -> dict[str, Any]:
    """The :class:`CapturePlan` fields that add ``features`` (keys of :data:`FEATURES`) to
    :func:`make_plan`'s capture: attention and MLP sites beside ``resid.1``, a CLS token,
    labels of :data:`CLASSES`.

    Example:
        >>> plan = make_plan(**rich_overrides())
        >>> [str(s) for s in plan.sites], plan.has_cls, plan.classes
        (['resid.1', 'attn_out.2', 'mlp_out.3'], True, ['cat', 'dog', 'eel'])
    """
    unknown = set(features) - set(FEATURES)
    if unknown:
        raise ValueError(f"unknown features {sorted(unknown)}; choose from {list(FEATURES)}")
    sites = [Site("resid", 1)]
    if "attn_out" in features:
        sites.append(Site("attn_out", 2))
    if "mlp_out" in features:
        sites.append(Site("mlp_out", 3))
    return {
        "sites": tuple(sites),
        "has_cls": "cls" in features,
        "has_labels": "labels" in features,
        "classes": list(CLASSES) if "labels" in features else None,
    }


def make_acts(plan: CapturePlan, seed: int = 0, dtype: str = "float32") -> dict[str, np.ndarray]:
    """Activations per site name, ``[N, T, D]`` float32, a different magnitude per site;
    with ``dtype="bfloat16"`` every value is one bfloat16 holds exactly (what a bfloat16
    capture gives, widened)."""
    rng = np.random.default_rng(seed)
    shape = (plan.n_examples, plan.tokens_per_example, plan.d_model)
    out = {
        str(s): (rng.standard_normal(shape) * (1 + i)).astype(np.float32)
        for i, s in enumerate(plan.sites)
    }
    if dtype != "float32":
        wide = getattr(torch, dtype)
        out = {k: torch.from_numpy(v).to(wide).to(torch.float32).numpy() for k, v in out.items()}
    return out


def make_labels(plan: CapturePlan) -> np.ndarray:
    """The class labels ``[N]`` int64 :func:`make_batches` gives each example (when the plan
    keeps labels)."""
    return np.arange(plan.n_examples, dtype=np.int64) % max(1, len(plan.classes or [1]))


def make_tokens(plan: CapturePlan) -> np.ndarray:
    """The token ids ``[N, T]`` int32 :func:`make_batches` gives each example."""
    n, t = plan.n_examples, plan.tokens_per_example
    return ((np.arange(n * t, dtype=np.int64).reshape(n, t) % 250) + 4).astype(np.int32)


def make_batches(
    plan: CapturePlan, acts: dict[str, np.ndarray], dtype: str = "float32"
) -> list[Batch]:
    """``acts`` cut into the plan's batches, as tensors of ``dtype`` (the capture dtype:
    ``"bfloat16"`` as a bfloat16 capture hands them over), with token ids, texts, and
    labels when the plan keeps them."""
    tokens = make_tokens(plan)
    labels = make_labels(plan) if plan.has_labels else None
    wide = getattr(torch, dtype)
    out = []
    for lo in range(0, plan.n_examples, plan.batch_size):
        hi = min(lo + plan.batch_size, plan.n_examples)
        out.append(
            Batch(
                acts={k: torch.from_numpy(v[lo:hi].copy()).to(wide) for k, v in acts.items()},
                example_ids=np.arange(lo, hi, dtype=np.int64),
                token_ids=tokens[lo:hi],
                texts=[f"example {i}" for i in range(lo, hi)],
                labels=None if labels is None else labels[lo:hi],
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
