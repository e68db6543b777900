"""``actstore cp``: copy a whole store between local disk and object storage (``s3://``,
``gs://``, ``az://``), either direction."""

from __future__ import annotations

import typer

from ..progress import human_bytes
from .application import app
from .common import s3_options


@app.command("cp")
def cp(
    src: str = typer.Argument(
        ..., help="The store to copy: a directory, s3://, gs:// or az://bucket/prefix."
    ),
    dst: str = typer.Argument(
        ..., help="Where the copy goes: a directory, s3://, gs:// or az://bucket/prefix."
    ),
    threads: int = typer.Option(16, help="Parts copied at once."),
    part_mb: int = typer.Option(16, help="Part size in MiB (>= 5, an S3 limit)."),
    verify: bool = typer.Option(True, help="Check sizes, ETags and the store's checksums."),
    progress: bool = typer.Option(True, help="Show a progress bar."),
    endpoint_url: str = typer.Option(
        None, help="S3 endpoint (default: $S3_ENDPOINT_URL, $AWS_ENDPOINT_URL, else AWS)."
    ),
) -> None:
    """Copy a store (every file under SRC) to DST, in parallel. Run the same command again
    to resume an interrupted copy: files already at DST with the right size are skipped
    when their content matches (compared by checksum or ETag; with --no-verify, by size
    alone), and a large file cut off mid-way resumes from the parts already at DST.
    The store's index (metadata.json, .zmetadata...) and then its root manifest
    (actstore-manifest.json) are written last, so DST opens only once the copy is whole.
    DST must hold nothing but (part of) this store. Exits 1 when the copy's verification
    finds a fault (listed, as actstore verify does; the copy stays to be resumed), 2 on a
    usage error.

    \b
    Examples:
      actstore cp actstore-data/3f1c0e s3://bucket/acts/3f1c0e
      actstore cp s3://bucket/acts/3f1c0e /scratch/3f1c0e
      actstore cp actstore-data/3f1c0e gs://bucket/acts/3f1c0e   # or az://container/...
    """
    from functools import partial

    from tqdm.auto import tqdm

    from ..errors import CopyFaultError
    from ..formats import available_formats, verify_store
    from ..progress import bar_switch
    from ..storage.copy import copy_store
    from ..storage.files import open_files
    from ..storage.manifest import MANIFEST
    from ..storage.object import MiB

    storage = s3_options(endpoint_url, src, dst)
    total = sum(open_files(src, storage=storage, cache=False).list().values())
    try:
        with tqdm(total=total, unit="B", unit_scale=True, desc="cp", **bar_switch(progress)) as bar:
            report = copy_store(
                src,
                dst,
                storage=storage,
                threads=threads,
                part_bytes=part_mb * MiB,
                verify=verify,
                progress=bar.update,
                check_store=partial(verify_store, foreign_ok=True),
                # every format's index, then the root manifest: DST opens only once it is whole
                last=[
                    *sorted({name for spec in available_formats() for name in spec.manifests}),
                    MANIFEST,
                ],
            )
    except CopyFaultError as err:  # a fault found in the copy: listed, exit 1 (as verify)
        typer.secho(f"FAULT: {err}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    reused = f", {report.parts_reused} parts of an interrupted copy kept" * bool(
        report.parts_reused
    )
    typer.secho(
        f"OK: {report.copied} files ({human_bytes(report.bytes_copied)}) copied, "
        f"{report.skipped} already there{reused}; verified: {report.verified}",
        fg=typer.colors.GREEN,
    )
