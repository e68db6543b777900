"""What a capture plan makes of a prompt/response store: its layout (``P_max``, ``R_max``,
chunking), the group's attributes, the fingerprint of what was captured, and the shard
size (:class:`~actstore.formats.zarr.writer.ZarrWriter` writes by them; verify checks
them)."""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..._version import __version__
from ...batch import CapturePlan
from .layout import (
    CONFIG_FILE,
    FORMAT_TAG,
    PARTS,
    SCHEMA_VERSION,
    STATISTICS_FILE,
    ZarrLayout,
    choose_layout,
)
from .options import ZarrOptions

if TYPE_CHECKING:
    pass
else:
    pass

log = logging.getLogger(__name__)

#: Bytes of activations a writer shard holds (a resume restarts at most this far back).
SHARD_BYTES = 256 << 20


def plan_lengths(plan: CapturePlan) -> tuple[np.ndarray, np.ndarray]:
    """Full prompt and response lengths of every sample of ``plan``.

    A prompt/response source puts them in ``plan.extras``; otherwise every example is a
    prompt of ``tokens_per_example`` tokens with no response.
    """
    if "prompt_lengths" in plan.extras:
        return (
            np.asarray(plan.extras["prompt_lengths"], dtype=np.int64),
            np.asarray(plan.extras["response_lengths"], dtype=np.int64),
        )
    return (
        np.full(plan.n_examples, plan.tokens_per_example, dtype=np.int64),
        np.zeros(plan.n_examples, dtype=np.int64),
    )


def store_attrs(
    plan: CapturePlan, options: ZarrOptions, choice_attrs: dict[str, Any], layout: ZarrLayout
) -> dict[str, Any]:
    """The global attributes (``.zattrs``) of a store captured by ``plan``.

    The writer adds the truncation record of the samples it stored and the creation time.
    """
    dataset = options.dataset_name or Path(plan.dataset_root).name or plan.dataset_root
    attrs = {
        "model_id": plan.ckpt,
        "model_family": plan.family,
        "model_num_layers": plan.n_model_layers,
        "dataset": dataset,
        "dataset_root": plan.dataset_root,
        "statistics": STATISTICS_FILE,
        "config": CONFIG_FILE,
        "actstore_version": __version__,
        "git_commit": _git_commit(),
        **choice_attrs,
        **layout_attrs(layout),
    }
    attrs["fingerprint"] = fingerprint(attrs, plan.data, options)
    return attrs


def layout_attrs(layout: ZarrLayout) -> dict[str, Any]:
    """The attributes every store carries about its layout (the writer always sets them)."""
    return {
        "format": FORMAT_TAG,
        "schema_version": SCHEMA_VERSION,
        "num_layers": layout.n_layers,
        "layers": list(layout.layers),
        "sites": list(layout.sites),
        "hidden_size": layout.hidden_size,
        "dtype": "float16",
        "n_samples": layout.n_samples,
        "P_max": layout.p_max,
        "R_max": layout.r_max,
        "T_max": layout.p_max + layout.r_max,
        "T_chunk_prompt": layout.t_chunk_prompt,
        "T_chunk_response": layout.t_chunk_response,
        "chunks": {p: list(layout.chunk_shape(p)) for p in PARTS},
        "prompt_keep": layout.prompt_keep,
        "layout": layout.to_dict(),
    }


def fingerprint(attrs: dict[str, Any], data: dict[str, Any], options: ZarrOptions) -> str:
    """sha256 of what determines a store's content (a rerun with the same one is a no-op)."""
    keep = {
        k: v
        for k, v in attrs.items()
        if k not in ("git_commit", "actstore_version", "fingerprint", "shard")
    }
    text = json.dumps(
        {"attrs": keep, "data": data, "options": options.__dict__}, sort_keys=True, default=str
    )
    return hashlib.sha256(text.encode()).hexdigest()


def _git_commit() -> str | None:
    """The git commit of the actstore checkout that wrote the store, when it is one."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def plan_store(plan: CapturePlan, options: ZarrOptions) -> tuple[ZarrLayout, dict, dict]:
    """Layout, attributes and ``meta/config.json`` content of the store for ``plan``."""
    prompt_lengths, response_lengths = plan_lengths(plan)
    choice = choose_layout(
        n_samples=plan.n_examples,
        sites=[str(s) for s in plan.sites],
        layers=plan.layers,
        hidden_size=plan.d_model,
        prompt_lengths=prompt_lengths,
        response_lengths=response_lengths,
        p_max=options.p_max,
        r_max=options.r_max,
        quantile=options.quantile,
        t_chunk_prompt=options.t_chunk_prompt,
        t_chunk_response=options.t_chunk_response,
        prompt_keep=options.prompt_keep,
    )
    attrs = store_attrs(plan, options, choice.attrs, choice.layout)
    config = {
        "model": {
            "ckpt": plan.ckpt,
            "family": plan.family,
            "modality": plan.modality,
            "n_layers": plan.n_model_layers,
            "d_model": plan.d_model,
            "has_cls": plan.has_cls,
        },
        "sites": [str(s) for s in plan.sites],
        "classes": plan.classes,
        "dataset": {"root": plan.dataset_root, **plan.data},
        "options": dict(options.__dict__),
        "layout": choice.layout.to_dict(),
        "batch_size": plan.batch_size,
    }
    return choice.layout, attrs, config


def truncation_attrs_from_counts(counts: dict[str, int], n: int) -> dict[str, Any]:
    """The spec's truncation record from per-part counts over ``n`` samples."""
    return {
        f"{p}_truncated_{k}": (counts[p] if k == "count" else counts[p] / n)
        for p in PARTS
        for k in ("count", "fraction")
    }


def samples_per_shard(layout: ZarrLayout, options: ZarrOptions) -> int:
    """``S``: samples per writer shard (``options.samples_per_shard``, else about
    :data:`SHARD_BYTES` of activations)."""
    if options.samples_per_shard is not None:
        return options.samples_per_shard
    return max(1, min(layout.n_samples, 4096, SHARD_BYTES // max(layout.sample_nbytes(), 1)))
