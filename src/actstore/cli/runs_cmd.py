"""``actstore new-run``, ``train``, ``inference``, ``visuals``: the saev run layout end to end.

Every command but ``new-run`` takes one ``--run`` directory and resolves everything else
from it (``links/``, ``checkpoint/``, ``inference/``).
"""

from __future__ import annotations

import typer

from .application import app
from .common import parse_int_list

_RUN_HELP = "Run directory ($SAEV_NFS/saev/runs/<run_id>), as printed by `actstore new-run`."
_SHARDS_HELP = "Which activations: 'val' or 'train' (the run's links) or a shard directory."


@app.command(
    "new-run",
    epilog="""\b
Example:
  actstore capture --model openai/clip-vit-base-patch16 --dataset ~/imgs/train \\
      --layers -2 --dialect saev --out $SAEV_SCRATCH
  actstore capture ... --dataset ~/imgs/val ...
  actstore new-run --train-shards $SAEV_SCRATCH/saev/shards/<hash> \\
      --val-shards $SAEV_SCRATCH/saev/shards/<hash>
""",
)
def new_run(
    train_shards: str = typer.Option(..., help="Shard directory to train on (one capture)."),
    val_shards: str = typer.Option(..., help="Held-out shard directory (a separate capture)."),
    train_dataset: str = typer.Option(
        None,
        help="Original dataset of the train shards (default: their metadata's 'dataset' field).",
    ),
    val_dataset: str = typer.Option(
        None, help="Original dataset of the val shards (default: their metadata's 'dataset' field)."
    ),
    run_id: str = typer.Option(None, help="Run id (default: 8 random characters)."),
    runs_root: str = typer.Option(
        None,
        help="Where runs live (default: $SAEV_NFS/saev/runs, or "
        "~/.local/share/actstore/saev/runs when SAEV_NFS is unset).",
    ),
) -> None:
    """Create a run: checkpoint/, inference/ and links/ to the shards and datasets.

    The links are symlinks; the shard directories are only ever read.
    """
    from ..runs import Run

    run = Run.create(
        train_shards=train_shards,
        val_shards=val_shards,
        train_dataset=train_dataset,
        val_dataset=val_dataset,
        run_id=run_id,
        root=runs_root,
    )
    typer.echo(
        f"Created run {run.path}\n\nNext:\n  actstore train --run {run.path}\n"
        f"  actstore inference --run {run.path}\n  actstore visuals --run {run.path}"
    )


@app.command(
    epilog="""\b
Examples:
  actstore train --run $SAEV_NFS/saev/runs/k3x9q2ab                 # TopK, k=32, 16x
  actstore train --run ... --kind relu --l1-coeff 5 --steps 20000
"""
)
def train(
    run: str = typer.Option(..., help=_RUN_HELP),
    kind: str = typer.Option(
        "topk",
        help="'topk' (keep the k largest latents) or 'relu' "
        "(ReLU latents sparsified by an L1 penalty).",
    ),
    k: int = typer.Option(32, help="TopK: active latents per token."),
    expansion: int = typer.Option(16, help="Latents per input dimension (d_sae / d_model)."),
    l1_coeff: float = typer.Option(
        5.0, help="ReLU: weight of the L1 penalty against the squared error."
    ),
    steps: int = typer.Option(10_000, help="Optimiser steps."),
    batch_size: int = typer.Option(4096, help="Tokens per step."),
    lr: float = typer.Option(4e-4, help="Adam learning rate."),
    warmup_steps: int = typer.Option(500, help="Linear learning-rate warm-up."),
    layer: int = typer.Option(None, help="Stored layer to train on (default: the last one)."),
    tokens: str = typer.Option(
        "content", help="'content' skips a leading CLS token (ViTs); 'all' keeps it."
    ),
    normalise: bool = typer.Option(
        True, help="Centre and scale inputs with the shards' statistics.json."
    ),
    device: str = typer.Option("auto", help="'auto' (CUDA if available), 'cpu', 'cuda', ..."),
    seed: int = typer.Option(0, help="Seed of initialisation and data order."),
    log_every: int = typer.Option(100, help="Steps between metric logs."),
    progress: bool = typer.Option(True, help="Show progress bars."),
) -> None:
    """Train a sparse autoencoder on the run's train shards; evaluate it on the val shards.

    Reads shuffled rows through the shared loader, normalises them with the stored
    statistics, logs loss, explained variance, L0 and dead latents, and writes
    checkpoint/sae.pt (safetensors) and checkpoint/config.json (config and metrics).
    """
    from ..runs import Run
    from ..sae import TrainConfig, train_run

    config = TrainConfig(
        kind=kind,
        k=k,
        expansion=expansion,
        l1_coeff=l1_coeff,
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        warmup_steps=warmup_steps,
        layer=layer,
        tokens=tokens,
        normalise=normalise,
        device=device,
        seed=seed,
        log_every=log_every,
    )
    the_run = Run(run)
    result = train_run(the_run, config, progress=progress)
    val = result.metrics["val"]
    typer.echo(
        f"Trained {result.sae.config.kind} SAE ({result.sae.config.d_sae} latents) for "
        f"{result.metrics['steps']} steps in {result.metrics['seconds']:.1f}s.\n"
        f"Held-out: explained variance {val['explained_variance']:.4f}, L0 {val['l0']:.1f}, "
        f"dead latents {100 * val['dead_fraction']:.1f}%\n"
        f"Wrote {the_run.sae_path} and {the_run.config_path}\n\n"
        f"Next: actstore inference --run {the_run.path}"
    )


@app.command()
def inference(
    run: str = typer.Option(..., help=_RUN_HELP),
    shards: str = typer.Option("val", help=_SHARDS_HELP),
    tokens: str = typer.Option(
        "content",
        help="'content' skips a leading CLS token (saev's row layout: one row per patch); "
        "'all' keeps every stored token.",
    ),
    batch_rows: int = typer.Option(4096, help="Tokens encoded at once."),
    device: str = typer.Option("auto", help="'auto' (CUDA if available), 'cpu', 'cuda', ..."),
    force: bool = typer.Option(False, help="Recompute even if an up-to-date result exists."),
    progress: bool = typer.Option(True, help="Show a progress bar."),
) -> None:
    """Encode every stored token with the run's SAE into inference/<shard_hash>/.

    patch_acts.npz is a sparse CSR matrix (rows = tokens, columns = latents) in scipy's
    save_npz layout; config.json beside it says how rows map to (example, token).
    See docs/runs.md.
    """
    from ..runs import Run
    from ..sae import InferenceConfig, infer_run, load_inference

    the_run = Run(run)
    config = InferenceConfig(tokens=tokens, batch_rows=batch_rows, device=device, force=force)
    out = infer_run(the_run, shards, config, progress=progress)
    record, acts = load_inference(out)
    typer.echo(
        f"{acts.n_rows} tokens x {acts.d_sae} latents, {acts.nnz / max(acts.n_rows, 1):.1f} "
        f"active per token, {record['alive_latents']} latents ever active\n"
        f"  {out / 'patch_acts.npz'}\n\nNext: actstore visuals --run {the_run.path}"
        + ("" if shards == "val" else f" --shards {shards}")
    )


@app.command()
def visuals(
    run: str = typer.Option(..., help=_RUN_HELP),
    shards: str = typer.Option("val", help=_SHARDS_HELP),
    n_latents: int = typer.Option(32, help="How many top latents (by total activation)."),
    latents: str = typer.Option(None, help="Comma-separated latent indices to show instead."),
    n_examples: int = typer.Option(8, help="Highest-activating examples per latent."),
    image_size: int = typer.Option(160, help="Pixels per side of each example image."),
    progress: bool = typer.Option(True, help="Show a progress bar."),
) -> None:
    """Draw the highest-activating examples of the top latents: PNGs and an HTML index.

    ViT data: each image as the model saw it (from the run's dataset link), and again with
    the latent's activation tinted over its patches. Text: token contexts with each
    token highlighted by its activation. Run `actstore inference` first.
    """
    from ..runs import Run
    from ..visuals import VisualsConfig, render_run

    chosen = tuple(parse_int_list(latents, "--latents")) if latents else ()
    config = VisualsConfig(
        n_latents=n_latents, latents=chosen, n_examples=n_examples, image_size=image_size
    )
    out = render_run(Run(run), shards, config, progress=progress)
    typer.echo(f"Wrote {out / 'index.html'}\nOpen it in a browser: file://{out / 'index.html'}")
