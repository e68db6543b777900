"""``actstore inspect`` and ``actstore verify``: what a store holds, and is it intact.

Both work on any registered format: they call the reader's ``describe()`` and ``verify()``.
"""

from __future__ import annotations

import json

import numpy as np
import typer

from ..progress import human_bytes
from .application import app


def _site_label(reader, site) -> str:
    """A stored site's canonical name (``resid.3``), with the format's own name beside it
    when that says more (an Activault hook folder, a SAELens column)."""
    native = reader.native_name(site)
    return (
        str(site)
        if native in (str(site), str(site.layer), f"layer_{site.layer}")
        else f"{site} ({native})"
    )


def _site_summary(reader, site, values: int) -> dict:
    out: dict = {}
    stats = reader.statistics(site)
    if stats is not None:
        out.update(
            count=stats.count,
            mean_norm=round(stats.norm_mean, 6),
            mean_var=round(float(stats.var.mean()), 6),
        )
    blocks = reader.blocks(site)
    if blocks:
        first = reader.read_block(blocks[0])[0, :values]
        out["first_row"] = [round(float(v), 6) for v in np.asarray(first, dtype=np.float64)]
    out["rows"] = sum(b.n_rows for b in blocks)
    return out


#: Digests of the examples a store was made from (``CapturePlan.data``), as shown.
_DIGESTS = ("token_digest", "image_digest", "sample_digest")
_NARROWER = {"float16", "bfloat16"}


def provenance(reader) -> dict[str, str]:
    """Where the store's data came from and at what precision: the dataset and the digest
    of the examples consumed, the identity of the model's weights (digest or Hub revision)
    and the compute dtype, the store it was converted from (its format, id and stored
    dtype), and the precision of its values (a float32 store of float16 values says so)."""
    from ..errors import ActstoreError

    try:
        plan = reader.capture_plan()
    except (ActstoreError, KeyError, TypeError, ValueError):
        return {}
    data = plan.data if isinstance(plan.data, dict) else {}
    out: dict[str, str] = {}
    where = next(
        (str(data[k]) for k in ("path", "root", "id") if data.get(k)), plan.dataset_root or "?"
    )
    digests = [f"{k} {data[k]}" for k in _DIGESTS if data.get(k)]
    out["data"] = f"{data.get('kind', 'dataset')} {where}; " + (
        ", ".join(digests) if digests else "no digest of its examples recorded"
    )
    weights = data.get("weights")
    if isinstance(weights, dict) and weights:
        out["weights"] = ", ".join(f"{k} {v}" for k, v in sorted(weights.items()))
    out["compute dtype"] = str(data.get("compute_dtype") or "not recorded")
    if data.get("clean_tokens"):
        out["token cleaning"] = "on (special and chat-template tokens not stored)"
    stored = reader.stored_dtype()
    source = data.get("converted_from")
    if isinstance(source, dict):
        name = source.get("store_id") or source.get("location") or "?"
        out["converted from"] = (
            f"a {source.get('format', '?')} store ({name}), values stored as "
            f"{source.get('dtype', '?')}"
        )
        was = source.get("dtype")
        if was in _NARROWER and stored not in _NARROWER:
            out["precision"] = f"{stored}, holding {was} values (rounded in the source)"
        else:
            out["precision"] = str(stored)
    else:
        out["precision"] = str(stored)
    return out


@app.command()
def inspect(
    location: str = typer.Argument(..., help="A store: directory or URL (s3://bucket/run/hook)."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON summary instead."),
    values: int = typer.Option(6, help="Leading values of each site's first row to show."),
) -> None:
    """Show what a store holds: format, model, shapes, sizes, statistics and a few values.

    Example: actstore inspect actstore-data/3f1c0e...
    """
    from ..formats import open_store
    from .status_cmd import refuse_output_root

    refuse_output_root(location, "inspect")
    with open_store(location) as reader:  # everything read here, then closed
        summary = reader.describe()
        summary["per_site"] = {
            _site_label(reader, s): _site_summary(reader, s, values) for s in reader.sites
        }
        origin = provenance(reader)
    if as_json:
        summary["provenance"] = origin
        typer.echo(json.dumps(summary, indent=2, default=str))
        return
    typer.echo(summary.pop("path", location))
    per_site = summary.pop("per_site")
    files = summary.pop("files", None)
    for key, value in summary.items():
        if key == "bytes":
            value = human_bytes(value) + (f" in {files} files" if files else "")
        typer.echo(f"  {key:<18} {value}")
    for key, value in origin.items():
        typer.echo(f"  {key:<18} {value}")
    for site, s in per_site.items():
        line = f"  site {site:<13} {s['rows']} rows"
        if "mean_norm" in s:
            line += f", mean L2 norm {s['mean_norm']:.4g}, mean variance {s['mean_var']:.4g}"
        typer.echo(line)
        if "first_row" in s:
            typer.echo(f"  {'':<18} first row: {s['first_row']} ...")


def _manifest_faults(location: str) -> list[str]:
    """Every fault of the store's files against its root manifest (sizes, listing, each
    block), for a store its format cannot open even unchecked."""
    from ..errors import ActstoreError
    from ..storage.integrity import Integrity
    from ..storage.location import Location

    faults: list[str] = []
    try:
        files = Location.parse(location).files(cache=False)
        Integrity.open(files, verify_reads=False).verify(faults)
    except ActstoreError as err:
        faults.append(str(err))
    return faults


@app.command()
def verify(
    location: str = typer.Argument(..., help="A store: directory or URL."),
    progress: bool = typer.Option(True, help="Show a progress bar while hashing."),
) -> None:
    """Check a store's integrity: every file against the root manifest
    (actstore-manifest.json: sizes, the listing, and the keyed digest of every block, so a
    block changed, moved or copied from another store is found), metadata against the
    index, the format's own checksums and content hashes, and NaN/Inf values. Lists every
    fault and exits 1 on any; exits 2 on a usage error (no such store, a missing optional
    dependency).

    Example: actstore verify actstore-data/3f1c0e...
    """
    from tqdm.auto import tqdm

    from ..errors import (
        ActstoreError,
        CorruptStoreError,
        IndexOutOfRangeError,
        InvalidIndexError,
        LayerNotStoredError,
        MissingDependencyError,
        StorageError,
        StoreNotFoundError,
        UnsafeDataError,
    )
    from ..formats import open_store
    from ..formats.report import VerifyReport
    from ..progress import bar_switch
    from ..storage.location import Location
    from .status_cmd import refuse_output_root

    refuse_output_root(location, "verify")
    if not Location.parse(location).exists():  # a usage error (exit 2), not a fault found
        raise StoreNotFoundError(f"{location} does not exist; give a store directory or URL")
    faults: list[str] = []
    # the store's faults are listed (exit 1); any other error (a missing dependency, a bad
    # option) is the user's to fix: one error line, exit 2
    store_faults = (
        CorruptStoreError,
        StoreNotFoundError,
        UnsafeDataError,
        LayerNotStoredError,
        IndexOutOfRangeError,
        InvalidIndexError,
    )
    try:
        reader = open_store(location)
    except store_faults as err:
        faults.append(str(err))
        try:  # open it unchecked, so every fault is found and listed, not only the first
            reader = open_store(location, verify_reads=False)
        except store_faults as again:
            # the format cannot read it at all: still check every byte against the manifest
            faults += [f for f in [str(again), *_manifest_faults(location)] if f not in faults]
            for fault in faults:
                typer.secho(f"FAULT: {fault}", fg=typer.colors.RED, err=True)
            raise typer.Exit(1) from None
    with reader:  # closed when done: its descriptors and threads
        try:  # describe() may read data (pkl.gz token ids): a fault there is verify's to list
            total = reader.describe().get("bytes")
        except ActstoreError:
            total = None
        bar_options = bar_switch(progress)
        with tqdm(total=total, unit="B", unit_scale=True, desc="verify", **bar_options) as bar:
            try:
                report = reader.verify(progress=bar.update)
            except ActstoreError as err:  # what the store's content raised: a fault, listed
                if isinstance(err, (MissingDependencyError, StorageError)):
                    raise  # the user's to fix (an extra to install, this machine's I/O): exit 2
                report = VerifyReport(location, faults=[str(err)])
    for note in report.notes:
        typer.echo(f"note: {note}")
    faults += [f for f in report.faults if f not in faults]
    for fault in faults:
        typer.secho(f"FAULT: {fault}", fg=typer.colors.RED, err=True)
    if faults:
        raise typer.Exit(1)
    typer.secho(
        f"OK: {report.files_checked} files, {human_bytes(report.bytes_checked)} checked in "
        f"{report.location}",
        fg=typer.colors.GREEN,
    )
