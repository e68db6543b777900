"""Train a sparse autoencoder on stored activations, and evaluate it on held-out shards.

:func:`train_sae` is the loop (any iterable of ``[B, d_model]`` batches); :func:`evaluate`
reads every row of a store once; :func:`train_run` does both for a run directory, reading
the train shards through the shared loader (:mod:`actstore.loader`) and writing
``checkpoint/sae.pt`` and ``checkpoint/config.json``.

Optimisation: Adam, linear warm-up over ``warmup_steps``, constant, then a linear decay to
zero over the last ``decay_fraction`` of the steps; gradients clipped to norm 1; the part of
the decoder gradient along each row is removed and rows are renormalised after every step.

Example:
    >>> from actstore.runs import Run
    >>> config = TrainConfig(kind="topk", k=32, steps=2000)
    >>> result = train_run(Run("runs/k3x9q2ab"), config)  # doctest: +SKIP
    >>> result.metrics["val"]["explained_variance"]  # doctest: +SKIP
    0.87
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from ..errors import ConfigError
from ..progress import bar_switch
from ..stats import RunningStats
from .metrics import DeadLatents, ReconstructionStats
from .model import KINDS, SAEConfig, SparseAutoencoder
from .rows import TOKEN_CHOICES, ordered_rows, token_positions

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """How to train. Defaults suit a real run on a GPU; tests shrink them."""

    layer: int | None = None
    """Stored layer to train on (default: the last stored layer)."""
    kind: str = "topk"
    """``topk`` or ``relu`` (ReLU with an L1 penalty)."""
    expansion: int = 16
    """Latents per input dimension: ``d_sae = expansion * d_model``."""
    k: int = 32
    """Active latents per token (``topk``)."""
    l1_coeff: float = 5.0
    """Weight of the L1 penalty against the squared error, both summed over dimensions of
    normalised inputs (``relu``)."""
    steps: int = 10_000
    batch_size: int = 4096
    """Rows (tokens) per optimiser step."""
    lr: float = 4e-4
    warmup_steps: int = 500
    decay_fraction: float = 0.2
    tokens: str = "content"
    """``content`` skips a leading CLS token (ViTs), ``all`` trains on every stored token."""
    normalise: bool = True
    """Centre and scale inputs with the store's statistics.json."""
    dead_window: int = 1_000_000
    """A latent that has not fired on this many consecutive training tokens is dead."""
    log_every: int = 100
    seed: int = 0
    device: str = "auto"
    """``auto`` (CUDA when available), ``cpu``, ``cuda``, ``cuda:1``..."""
    autocast: str | None = None
    """``bfloat16``: run the SAE's forward pass and loss under ``torch.autocast`` in
    bfloat16 (matmuls in bf16, parameters, optimiser and metrics in float32). None: fp32."""
    loader: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the shared loader (pool size, workers...)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"kind must be one of {KINDS}, not {self.kind!r}")
        if self.tokens not in TOKEN_CHOICES:
            raise ConfigError(f"tokens must be one of {TOKEN_CHOICES}, not {self.tokens!r}")
        for name in ("expansion", "k", "steps", "batch_size", "log_every", "dead_window"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, not {getattr(self, name)}")
        if not self.lr > 0 or self.l1_coeff < 0 or self.warmup_steps < 0:
            raise ConfigError("lr must be > 0, l1_coeff and warmup_steps >= 0")
        if not 0 <= self.decay_fraction <= 1:
            raise ConfigError(f"decay_fraction must be in [0, 1], not {self.decay_fraction}")
        if self.autocast not in (None, "bfloat16"):
            raise ConfigError(f"autocast must be None or 'bfloat16', not {self.autocast!r}")

    def sae_config(self, d_model: int) -> SAEConfig:
        return SAEConfig(d_model=d_model, d_sae=self.expansion * d_model, kind=self.kind, k=self.k)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def resolve_device(device: str) -> torch.device:
    """``auto`` -> CUDA if available, else CPU; anything else as given."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def lr_factor(step: int, config: TrainConfig) -> float:
    """Learning-rate multiplier at ``step`` (warm-up, constant, linear decay).

    Example:
        >>> cfg = TrainConfig(steps=100, warmup_steps=10, decay_fraction=0.2)
        >>> [round(lr_factor(s, cfg), 2) for s in (0, 9, 50, 90, 99)]
        [0.1, 1.0, 1.0, 0.5, 0.05]
    """
    warm = min(1.0, (step + 1) / config.warmup_steps) if config.warmup_steps else 1.0
    decay_steps = math.floor(config.steps * config.decay_fraction)
    decay_start = config.steps - decay_steps
    decay = 1.0 if step < decay_start else (config.steps - step) / max(decay_steps, 1)
    return warm * decay


@dataclass
class TrainResult:
    """The trained SAE and what was measured."""

    sae: SparseAutoencoder
    metrics: dict[str, Any]
    history: list[dict[str, float]]


def train_sae(
    config: TrainConfig,
    batches: Iterable[torch.Tensor],
    *,
    d_model: int,
    statistics: RunningStats | None = None,
    progress: bool = True,
) -> TrainResult:
    """Train for ``config.steps`` steps on ``batches`` (raw activations ``[B, d_model]``).

    ``statistics`` (the store's, for the trained layer) sets the input normalisation when
    ``config.normalise``. Metrics over each ``log_every`` window are logged, shown on the
    progress bar and returned in ``history``.
    """
    device = resolve_device(config.device)
    torch.manual_seed(config.seed)
    sae = SparseAutoencoder(config.sae_config(d_model))
    if config.normalise:
        if statistics is None:
            raise ConfigError(
                "the store has no statistics.json to normalise with; pass normalise=False "
                "(--no-normalise) or re-capture with actstore"
            )
        sae.set_normalisation(statistics.mean, statistics.var)
    sae.to(device).train()
    optimiser = torch.optim.Adam(sae.parameters(), lr=config.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimiser, lambda s: lr_factor(s, config))
    dead = DeadLatents(sae.config.d_sae, config.dead_window, device)
    window = ReconstructionStats(d_model)
    history: list[dict[str, float]] = []
    t0 = time.perf_counter()
    step, loss_sum = 0, torch.zeros((), device=device)
    bar = tqdm(
        total=config.steps,
        desc=f"train {config.kind}",
        unit="step",
        **bar_switch(progress),
        dynamic_ncols=True,
    )
    autocast = torch.autocast(
        device.type, dtype=torch.bfloat16, enabled=config.autocast == "bfloat16"
    )
    with bar:
        for batch in batches:
            with autocast:
                x_n = sae.normalise(batch.to(device, torch.float32, non_blocking=True))
                f = sae.encode_normalised(x_n)
                x_hat = sae.decode_normalised(f)
                loss = (x_n - x_hat).float().square().sum(-1).mean() / d_model
                if config.kind == "relu":
                    loss = loss + config.l1_coeff * f.float().sum(-1).mean() / d_model
            optimiser.zero_grad(set_to_none=True)
            loss.backward()
            sae.remove_parallel_grad()
            torch.nn.utils.clip_grad_norm_(sae.parameters(), 1.0)
            optimiser.step()
            schedule.step()
            sae.normalise_decoder()
            window.update(x_n, x_hat, f)
            dead.update(f)
            loss_sum += loss.detach()
            step += 1
            bar.update(1)
            if step % config.log_every == 0 or step == config.steps:
                n_steps = step - (history[-1]["step"] if history else 0)
                entry = {
                    "step": step,
                    "loss": float(loss_sum) / n_steps,
                    "explained_variance": window.explained_variance,
                    "l0": window.l0,
                    "dead_fraction": dead.fraction,
                    "lr": float(schedule.get_last_lr()[0]),  # a tensor for a tensor lr
                }
                history.append(entry)
                log.info(
                    "step %d: loss %.4g, explained variance %.3f, L0 %.1f, dead %.1f%%",
                    step,
                    entry["loss"],
                    entry["explained_variance"],
                    entry["l0"],
                    100 * entry["dead_fraction"],
                )
                bar.set_postfix(
                    loss=f"{entry['loss']:.3g}",
                    ev=f"{entry['explained_variance']:.3f}",
                    l0=f"{entry['l0']:.1f}",
                    dead=f"{entry['dead_fraction']:.1%}",
                )
                window, loss_sum = ReconstructionStats(d_model), torch.zeros((), device=device)
            if step >= config.steps:
                break
    if step < config.steps:
        raise ConfigError(f"the data ran out after {step} of {config.steps} steps")
    seconds = time.perf_counter() - t0
    sae.eval()
    metrics = {
        "steps": step,
        "tokens": step * config.batch_size,
        "seconds": seconds,
        "train": history[-1] if history else {},
        "dead_latents": int(dead.dead.sum()),
    }
    return TrainResult(sae=sae, metrics=metrics, history=history)


@torch.inference_mode()
def evaluate(
    sae: SparseAutoencoder,
    reader,
    layer: int,
    *,
    tokens: str = "content",
    batch_rows: int = 8192,
    progress: bool = True,
) -> dict[str, float]:
    """Reconstruction metrics of ``sae`` over every row of ``layer`` in ``reader``.

    Returns ``explained_variance``, ``mse`` (input units), ``l0``, ``dead_fraction``
    (latents that never fired on these rows) and ``rows``.
    """
    device = sae.W_enc.device
    stats = ReconstructionStats(sae.config.d_model)
    fired = torch.zeros(sae.config.d_sae, dtype=torch.bool, device=device)
    total = reader.n_examples * len(token_positions(reader, tokens))
    with tqdm(
        total=total,
        desc="evaluate",
        unit="tok",
        **bar_switch(progress),
        leave=False,
        dynamic_ncols=True,
    ) as bar:
        for rows in ordered_rows(reader, layer, tokens=tokens, batch_rows=batch_rows):
            x = torch.from_numpy(rows.acts).to(device)
            x_hat, f = sae(x)
            stats.update(x, x_hat, f)
            fired |= (f > 0).any(0)
            bar.update(len(rows.acts))
    return {
        "explained_variance": stats.explained_variance,
        "mse": stats.mse,
        "l0": stats.l0,
        "dead_fraction": float((~fired).float().mean()),
        "rows": stats.n,
    }


def training_batches(reader, layer: int, config: TrainConfig) -> Iterator[torch.Tensor]:
    """Shuffled ``[batch_size, d_model]`` batches of ``layer`` from the shared loader,
    epoch after epoch (each epoch in a fresh order), without end.

    ``config.loader`` passes extra :class:`~actstore.loader.LoaderConfig` options
    (``pool_blocks``, ``io_threads``...). On CUDA, batches arrive pinned and on the device.
    """
    from ..loader import ActivationLoader, LoaderConfig

    device = resolve_device(config.device)
    options = {"device": str(device)} if device.type == "cuda" else {}
    loader = ActivationLoader(
        reader,
        LoaderConfig(
            site=layer,
            batch_size=config.batch_size,
            seed=config.seed,
            drop_last=True,
            drop_cls=config.tokens == "content" and reader.metadata.cls_token,
            **{**options, **config.loader},
        ),
    )
    if len(loader) == 0:
        raise ConfigError(
            f"{loader.n_rows} training rows cannot fill one batch of {config.batch_size}; "
            "lower --batch-size or capture more examples"
        )
    log.info(
        "loader: %d rows per epoch, %d batches, shuffle window of %d blocks (%.0f MiB)",
        loader.n_rows,
        len(loader),
        loader.pool_blocks,
        loader.memory_bytes / 2**20,
    )
    while True:
        yield from loader


def train_run(run, config: TrainConfig, *, progress: bool = True) -> TrainResult:
    """Train on the run's train shards, evaluate on its val shards, write ``checkpoint/``.

    ``checkpoint/config.json`` records the architecture, this configuration, the data
    (shard directories, layer) and the metrics (training history, held-out evaluation).
    """
    from ..formats.saev import SaevReader
    from ..storage import atomic_write_json, hash_file
    from .checkpoint import save_sae

    train_dir, val_dir = run.shards("train"), run.shards("val")
    train_reader, val_reader = SaevReader(train_dir), SaevReader(val_dir)
    layer = train_reader.layers[-1] if config.layer is None else config.layer
    train_reader.metadata.layer_index(layer)  # a clear error if it is not stored
    if layer not in val_reader.layers or val_reader.d_model != train_reader.d_model:
        raise ConfigError(
            f"the val shards {val_dir} (layers {list(val_reader.layers)}, d_model "
            f"{val_reader.d_model}) do not match the train shards at layer {layer} "
            f"(d_model {train_reader.d_model}); link val shards captured the same way"
        )
    log.info("training a %s SAE on layer %d of %s", config.kind, layer, train_dir)
    result = train_sae(
        config,
        training_batches(train_reader, layer, config),
        d_model=train_reader.d_model,
        statistics=train_reader.statistics(layer) if config.normalise else None,
        progress=progress,
    )
    result.metrics["val"] = evaluate(
        result.sae, val_reader, layer, tokens=config.tokens, progress=progress
    )
    log.info(
        "held-out: explained variance %.3f, L0 %.1f, dead %.1f%%",
        result.metrics["val"]["explained_variance"],
        result.metrics["val"]["l0"],
        100 * result.metrics["val"]["dead_fraction"],
    )
    run.checkpoint_dir.mkdir(exist_ok=True)
    save_sae(result.sae, run.sae_path)
    md = train_reader.metadata
    atomic_write_json(
        run.config_path,
        {
            "sae": result.sae.config.to_dict(),
            "train": config.to_dict(),
            "data": {
                "layer": layer,
                "d_model": md.d_model,
                "model": md.ckpt,
                "family": md.family,
                "train_shards": str(train_dir),
                "val_shards": str(val_dir),
                "train_rows_per_epoch": md.n_examples
                * len(token_positions(train_reader, config.tokens)),
            },
            "checkpoint": {
                "file": run.sae_path.name,
                "format": "safetensors",
                "sha256": hash_file(run.sae_path),
            },
            "metrics": result.metrics,
            "history": result.history,
        },
    )
    return result
