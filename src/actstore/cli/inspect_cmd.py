"""``actstore inspect`` and ``actstore verify``: what a store holds, and is it intact."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import typer

from . import app
from .common import human_bytes


@app.command()
def inspect(
    path: Path = typer.Argument(..., help="A store directory (e.g. actstore-data/<hash>)."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON summary instead."),
    values: int = typer.Option(6, help="How many leading values of a sample vector to show."),
) -> None:
    """Show what a store holds: format, model, shapes, sizes, statistics and a few values.

    Example: actstore inspect actstore-data/3f1c0e...
    """
    from ..formats import open_store

    reader = open_store(path)
    md = reader.metadata
    files = sorted(p for p in reader.path.iterdir() if p.is_file())
    summary = {
        "path": str(reader.path),
        "format": "saev protocol " + md.protocol,
        "dialect": reader.dialect,
        "family": md.family,
        "ckpt": md.ckpt,
        "layers": list(md.layers),
        "n_examples": md.n_examples,
        "tokens_per_example": md.tokens_per_ex,
        "cls_token": md.cls_token,
        "d_model": md.d_model,
        "n_shards": md.n_shards,
        "examples_per_shard": md.examples_per_shard,
        "dataset": md.dataset,
        "bytes": sum(p.stat().st_size for p in files),
        "files": [p.name for p in files],
        "statistics": {},
    }
    for layer in md.layers:
        stats = reader.statistics(layer)
        if stats is not None:
            summary["statistics"][str(layer)] = {
                "count": stats.count,
                "mean_norm": round(stats.norm_mean, 6),
                "mean_abs_mean": round(float(np.abs(stats.mean).mean()), 6),
                "mean_var": round(float(stats.var.mean()), 6),
            }
    sample = reader[0, md.layers[0], 0][:values] if md.n_examples else np.zeros(0)
    summary["sample"] = {"example": 0, "layer": md.layers[0], "token": 0,
                         "values": [round(float(v), 6) for v in sample]}  # fmt: skip
    tokens = reader.tokens
    if tokens is not None and md.n_examples:
        summary["sample"]["token_ids"] = tokens[0, :16].tolist()
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
        return
    typer.echo(f"{summary['path']}\n  {summary['format']}, dialect {summary['dialect']}")
    typer.echo(f"  model     {md.ckpt} ({md.family})")
    typer.echo(f"  dataset   {md.dataset}")
    typer.echo(
        f"  shape     {md.n_examples} examples x {len(md.layers)} layers {list(md.layers)} x "
        f"{md.tokens_per_ex} tokens{' (CLS at 0)' if md.cls_token else ''} x {md.d_model} dims"
    )
    typer.echo(
        f"  shards    {md.n_shards} x up to {md.examples_per_shard} examples, "
        f"{human_bytes(summary['bytes'])} on disk in {len(files)} files"
    )
    for layer, s in summary["statistics"].items():
        typer.echo(
            f"  layer {layer:>3} mean L2 norm {s['mean_norm']:.4g}, mean variance "
            f"{s['mean_var']:.4g} over {s['count']} vectors"
        )
    typer.echo(f"  [0, {md.layers[0]}, 0][:{values}] = {summary['sample']['values']}")
    if "token_ids" in summary["sample"]:
        typer.echo(f"  token ids of example 0: {summary['sample']['token_ids']} ...")


@app.command()
def verify(
    path: Path = typer.Argument(..., help="A store directory."),
    progress: bool = typer.Option(True, help="Show a progress bar while hashing."),
) -> None:
    """Check a store's integrity: metadata vs shards.json vs file sizes, every checksum,
    the content hash, zero padding and NaN/Inf values. Exits 1 on any fault.

    Example: actstore verify actstore-data/3f1c0e...
    """
    from tqdm.auto import tqdm

    from ..errors import ActstoreError
    from ..formats import open_store

    try:
        reader = open_store(path)
    except ActstoreError as err:
        typer.secho(f"FAULT: {err}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    total = sum(p.stat().st_size for p in reader.path.iterdir() if p.is_file())
    with tqdm(total=total, unit="B", unit_scale=True, desc="verify", disable=not progress) as bar:
        report = reader.verify(progress=bar.update)
    for note in report.notes:
        typer.echo(f"note: {note}")
    for fault in report.faults:
        typer.secho(f"FAULT: {fault}", fg=typer.colors.RED, err=True)
    if not report.ok:
        raise typer.Exit(1)
    typer.secho(
        f"OK: {report.files_checked} files, {human_bytes(report.bytes_checked)} checked in "
        f"{reader.path}",
        fg=typer.colors.GREEN,
    )
