"""Dump a trained SAE's activations for every stored token of a shard directory.

Writes ``<run>/inference/<shard_hash>/patch_acts.npz`` (sparse CSR, layout in
:mod:`actstore.sae.sparse`) and ``config.json`` beside it (which checkpoint, which shards,
how rows map to tokens). Both are published atomically, the matrix first, so a crash
leaves the previous result or the new one. Rerunning with the same checkpoint and shards
reports the existing result instead of recomputing it (``force=True`` recomputes).

Example:
    >>> from actstore.runs import Run
    >>> out = infer_run(Run("runs/k3x9q2ab"), "val")  # doctest: +SKIP
    >>> SparseActs.load(out / "patch_acts.npz").n_rows  # doctest: +SKIP
    1530
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from ..errors import ConfigError, CorruptStoreError, LayerNotStoredError, StoreNotFoundError
from ..formats.saev import SaevReader
from ..progress import bar_switch
from ..runs import Run
from ..storage import atomic_write_json, hash_file, read_json
from .checkpoint import load_sae
from .model import SparseAutoencoder
from .rows import TOKEN_CHOICES, ordered_rows, token_positions
from .sparse import SparseActs
from .train import resolve_device

log = logging.getLogger(__name__)

PATCH_ACTS = "patch_acts.npz"
CONFIG = "config.json"


@dataclass(frozen=True, kw_only=True)
class InferenceConfig:
    """Which tokens to encode and how."""

    tokens: str = "content"
    """``content`` (skip a leading CLS: saev's own row layout, one row per patch) or ``all``
    stored tokens (CLS included)."""
    batch_rows: int = 4096
    """Tokens encoded at once (memory: ``batch_rows * d_sae * 4`` bytes on the device)."""
    device: str = "auto"
    force: bool = False
    """Recompute even when a matching result exists."""

    def __post_init__(self) -> None:
        if self.tokens not in TOKEN_CHOICES:
            raise ConfigError(f"tokens must be one of {TOKEN_CHOICES}, not {self.tokens!r}")
        if self.batch_rows < 1:
            raise ConfigError(f"batch_rows must be >= 1, not {self.batch_rows}")


@torch.inference_mode()
def encode_store(
    sae: SparseAutoencoder,
    reader: SaevReader,
    layer: int,
    *,
    tokens: str = "all",
    batch_rows: int = 4096,
    progress: bool = True,
) -> SparseActs:
    """SAE activations of every row of ``layer`` (tokens ``all`` or ``content``), as CSR."""
    device = sae.W_enc.device
    parts: list[SparseActs] = []
    total = reader.n_examples * len(token_positions(reader, tokens))
    with tqdm(
        total=total, desc="inference", unit="tok", **bar_switch(progress), dynamic_ncols=True
    ) as bar:
        for rows in ordered_rows(reader, layer, tokens=tokens, batch_rows=batch_rows):
            for lo in range(0, len(rows.acts), batch_rows):
                x = torch.from_numpy(rows.acts[lo : lo + batch_rows]).to(device)
                parts.append(_encode_csr(sae, x))
                bar.update(len(x))
    return SparseActs.concatenate(parts, sae.config.d_sae)


def _encode_csr(sae: SparseAutoencoder, x: torch.Tensor) -> SparseActs:
    """CSR of the latents of ``x``: TopK straight from its k codes per row, ReLU from the
    dense latents (``nonzero`` lists entries row by row, columns ascending)."""
    if sae.config.kind == "topk":
        values, indices = sae.topk_codes(x)
        keep = values > 0
        counts = keep.sum(1)
        cols, vals = indices[keep], values[keep]  # row-major, so rows stay in order
    else:
        f = sae.encode(x)
        rows, cols = f.nonzero(as_tuple=True)
        vals, counts = f[rows, cols], torch.bincount(rows, minlength=f.shape[0])
    indptr = torch.zeros(x.shape[0] + 1, dtype=torch.int64, device=x.device)
    torch.cumsum(counts, 0, out=indptr[1:])
    return SparseActs(
        vals.float().cpu().numpy(),
        cols.to(torch.int32).cpu().numpy(),
        indptr.cpu().numpy(),
        sae.config.d_sae,
    )


def infer_run(
    run: Run, shards: str = "val", config: InferenceConfig | None = None, *, progress: bool = True
) -> Path:
    """Encode the shards ``shards`` (``train``, ``val`` or a directory) with the run's SAE.

    Returns ``inference/<shard_hash>/``.
    """
    config = config or InferenceConfig()
    ckpt = run.require_checkpoint()
    ckpt_hash = hash_file(ckpt)
    layer = _trained_layer(run, ckpt_hash)
    shard_dir, split = run.resolve_shards(shards)
    reader = SaevReader(shard_dir)
    if layer not in reader.layers:
        raise LayerNotStoredError(
            f"the SAE of run {run.path} was trained on layer {layer}, but {shard_dir} stores "
            f"layers {list(reader.layers)}; choose shards captured at layer {layer}"
        )
    out_dir = run.inference_dir(shard_dir)
    record: dict[str, Any] = {
        "checkpoint": {"path": str(ckpt.relative_to(run.path)), "sha256": ckpt_hash},
        "shards": str(shard_dir),
        "shard_hash": shard_dir.name,
        "split": split,
        "layer": layer,
        "tokens": config.tokens,
        "first_token": int(token_positions(reader, config.tokens)[0]),
        "rows_per_example": len(token_positions(reader, config.tokens)),
        "n_examples": reader.n_examples,
        "tokens_per_example": reader.tokens_per_ex,
        "cls_token": reader.metadata.cls_token,
        "layout": "scipy.sparse CSR (save_npz): row = example * rows_per_example + "
        "(token - first_token), column = latent",
    }
    if not config.force and _up_to_date(out_dir, record):
        log.info(
            "inference for %s is up to date in %s (use force to recompute)", shard_dir, out_dir
        )
        return out_dir
    sae = load_sae(ckpt, device=resolve_device(config.device))
    if sae.config.d_model != reader.d_model:
        raise ConfigError(
            f"the SAE reads d_model={sae.config.d_model} but {shard_dir} stores "
            f"d_model={reader.d_model}; these shards come from another model"
        )
    acts = encode_store(
        sae, reader, layer, tokens=config.tokens, batch_rows=config.batch_rows, progress=progress
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    acts.save(out_dir / PATCH_ACTS)
    summary = acts.latent_summary()
    record.update(
        d_sae=acts.d_sae,
        n_rows=acts.n_rows,
        nnz=acts.nnz,
        patch_acts_bytes=(out_dir / PATCH_ACTS).stat().st_size,
        l0=acts.nnz / max(acts.n_rows, 1),
        alive_latents=int(np.count_nonzero(summary["count"])),
        inference=asdict(config) | {"force": False},
    )
    atomic_write_json(out_dir / CONFIG, record)
    log.info(
        "wrote %d x %d sparse activations (%.1f active per token) to %s",
        acts.n_rows,
        acts.d_sae,
        record["l0"],
        out_dir / PATCH_ACTS,
    )
    return out_dir


def _trained_layer(run: Run, ckpt_hash: str) -> int:
    """The layer the checkpoint was trained on, from ``checkpoint/config.json``, checked to
    describe this very ``sae.pt`` (a crash between the two writes of training leaves a new
    ``sae.pt`` beside the previous ``config.json``)."""
    retrain = f"retrain with `actstore train --run {run.path}`"
    if not run.config_path.is_file():
        raise StoreNotFoundError(
            f"run {run.path} has checkpoint/sae.pt but no checkpoint/config.json (which layer "
            f"it was trained on is unknown); {retrain}"
        )
    trained = read_json(run.config_path)
    try:
        layer = int(trained["data"]["layer"])
        recorded = trained["checkpoint"]["sha256"]
    except (KeyError, TypeError, ValueError):
        raise CorruptStoreError(
            f"{run.config_path} lacks data.layer or checkpoint.sha256, so it was not written "
            f"by `actstore train`; {retrain}"
        ) from None
    if recorded != ckpt_hash:
        raise CorruptStoreError(
            f"{run.config_path} describes another checkpoint than {run.sae_path} (sha256 "
            f"{str(recorded)[:12]}... recorded, {ckpt_hash[:12]}... found: training was "
            f"interrupted between writing the two, or sae.pt was replaced); {retrain}"
        )
    return layer


def _up_to_date(out_dir: Path, record: dict[str, Any]) -> bool:
    config_path, acts_path = out_dir / CONFIG, out_dir / PATCH_ACTS
    if not config_path.is_file() or not acts_path.is_file():
        return False
    try:
        old = read_json(config_path)
    except CorruptStoreError:
        return False
    same = all(old.get(key) == value for key, value in record.items())
    return same and old.get("patch_acts_bytes") == acts_path.stat().st_size


def load_inference(out_dir: str | Path) -> tuple[dict[str, Any], SparseActs]:
    """(config.json, activations) of an inference directory, checked against each other."""
    out_dir = Path(out_dir)
    record = read_json(out_dir / CONFIG)
    acts = SparseActs.load(out_dir / PATCH_ACTS)
    want = record["n_examples"] * record["rows_per_example"]
    if acts.n_rows != want or acts.d_sae != record.get("d_sae"):
        raise CorruptStoreError(
            f"{out_dir / PATCH_ACTS} has {acts.n_rows} x {acts.d_sae} entries but its "
            f"config.json describes {want} x {record.get('d_sae')}; rerun inference with --force"
        )
    return record, acts
