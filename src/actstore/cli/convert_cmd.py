"""``actstore convert``: copy a store into another format, streaming, and verify it."""

from __future__ import annotations

import typer

from ..progress import human_bytes
from .application import app, lazy_epilog


def _epilog() -> str:
    from ..formats.registry import describe_options, format_names, get_format

    lines = [
        "\b",
        "Examples:",
        "  actstore convert actstore-data/3f1c... acts-pkl --to pickle",
        "  actstore convert acts-pkl acts-zarr --to zarr --opt r_max=0",
        "  actstore convert acts-zarr acts-saev --to saev --sites resid.3,resid.5",
        "\b",
        "Target formats (--to) and their options (--opt KEY=VALUE):",
    ]
    for name in format_names():
        try:
            spec = get_format(name)
        except Exception as err:  # noqa: BLE001 - listed as unavailable
            lines.append(f"  {name}: unavailable ({err})")
            continue
        lines.append(f"  {name}: {spec.summary} (stores {spec.stored_dtype})")
        lines += [f"    {k}={d}  {h}" for k, d, h in describe_options(spec)]
    return "\n".join(lines)


@app.command(cls=lazy_epilog(_epilog))
def convert(
    source: str = typer.Argument(..., help="The store to read (any format; detected)."),
    target: str = typer.Argument(
        ...,
        help="Where to write: the target format's output location, as `capture --out` takes it.",
    ),
    to: str = typer.Option(..., "--to", "-t", help="Target format (listed below)."),
    opt: list[str] = typer.Option(
        [], "--opt", help="Target format option KEY=VALUE, repeatable (see below)."
    ),
    batch_size: int = typer.Option(
        64,
        help="Examples per step; memory is bounded by one step "
        "plus one target shard (and one source shard from pkl.gz).",
    ),
    sites: str = typer.Option(
        None,
        help="Comma-separated sites to convert (any spelling: resid.6, 6, "
        "blocks.6.hook_resid_post); default: every stored site.",
    ),
    verify: bool = typer.Option(True, help="Re-read both stores and compare every row."),
    progress: bool = typer.Option(True, help="Show progress bars."),
) -> None:
    """Convert a store to another format: rows stream from the source reader to the target
    writer, then both are compared row by row.

    float32 targets are exact; a float16 or bfloat16 target rounds, and the largest
    absolute error it introduced is reported, with anything the target format cannot keep. Rerunning an interrupted conversion resumes it.
    """
    from ..convert import convert as run_convert
    from ..formats import open_store
    from ..formats.registry import get_format, parse_options

    options = parse_options(get_format(to), opt)
    result = run_convert(
        source,
        target,
        to=to,
        options=options,
        batch_size=batch_size,
        verify=verify,
        progress=progress,
        sites=None if sites is None else [x.strip() for x in sites.split(",") if x.strip()],
    )
    size = open_store(result.location).describe().get("bytes", 0)
    verb = "Already converted" if result.already_complete else "Converted"
    typer.echo(
        f"{verb} {result.n_examples} examples from {result.source_format} to "
        f"{result.target_format} in {result.seconds:.1f}s ({human_bytes(size)}):\n"
        f"  {result.location}"
    )
    if result.verified:
        for site, rows in result.rows.items():
            err = result.max_abs_error[site]
            note = (
                "exact"
                if err == 0.0
                else f"max abs error {err:.3g} ({result.stored_dtype} rounding)"
            )
            typer.echo(f"  site {site}: {rows} rows verified, {note}")
    for name, why in result.dropped.items():
        typer.echo(f"  dropped {name}: {why}")
