"""``actstore ls``: what an object-store (or local) location holds, Activault-aware.

Works on damaged or unfinished runs too: it only lists and reads the small JSON files.
"""

from __future__ import annotations

import json
from typing import Any

import typer

from ..progress import human_bytes
from .application import app


def _hook_summary(store, prefix: str) -> dict[str, Any]:
    from ..formats.activault.layout import METADATA, STATISTICS, parse_data_file
    from ..storage.object import join_key

    found: list[tuple[Any, str, int]] = []
    strays: list[tuple[str, int]] = []
    for obj in store.list(prefix + "/"):
        name = obj.key[len(prefix) + 1 :]
        if name in (METADATA, STATISTICS) or name.endswith("cfg.json"):
            continue
        parsed = parse_data_file(name)
        if parsed is None:
            strays.append((name, obj.size))
        else:
            found.append((parsed.sort_key, name, obj.size))
    found.sort(key=lambda f: f[0])  # upload order
    files = [(name, size) for _, name, size in found]
    out: dict[str, Any] = {"files": len(files), "bytes": sum(s for _, s in files)}
    md_key = join_key(prefix, METADATA)
    if store.size(md_key) is not None:
        md = store.get_json(md_key)
        out.update(
            shape=md.get("shape"), dtype=md.get("dtype"), bytes_per_file=md.get("bytes_per_file")
        )
        wrong = [n for n, s in files if s != md.get("bytes_per_file")]
        if wrong:
            out["wrong_size"] = wrong
    if strays:
        out["not_megabatches"] = [n for n, _ in strays]
    out["listing"] = files
    return out


@app.command("ls")
def ls(
    location: str = typer.Argument(
        ..., help="s3://bucket[/run[/hook]] (or gs://, az://), file:///path or a path."
    ),
    show_all: bool = typer.Option(False, "--all", help="List every file, not the first 10."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    endpoint_url: str = typer.Option(
        None, help="S3 endpoint (default: $S3_ENDPOINT_URL, $AWS_ENDPOINT_URL, else AWS)."
    ),
) -> None:
    """List a store of any format (its shape, sites and size), the stores under an output
    root (what capture's --out named), the runs, hooks and megabatch files of an
    unfinished or foreign Activault layout, or any prefix.

    \b
    Examples:
      actstore ls s3://bucket                    # runs in the bucket
      actstore ls s3://bucket/run                # hooks: files, sizes, shapes, progress
      actstore ls s3://bucket/run/models.layers.6.post --all
      actstore ls s3://bucket/acts/3f1c0e        # a store of any format
      actstore ls actstore-data                  # the stores under an output root
    """
    from ..errors import StoreNotFoundError
    from ..formats.activault.layout import CFG, METADATA
    from ..storage.object import is_internal, join_key, open_location
    from .common import s3_options

    store, prefix = open_location(location, s3_options(endpoint_url, location))
    if store.local_root is None:
        store.check_bucket()
    elif not (store.local_root / prefix).exists():
        raise StoreNotFoundError(f"{store.url(prefix)} does not exist")
    described = _store_summary(location, store.url(prefix))
    if described is not None:
        _print_store(described, as_json)
        return
    if store.size(join_key(prefix, METADATA)) is not None:
        summary = {"hook": store.url(prefix), **_hook_summary(store, prefix)}
        _print_hook(summary, show_all, as_json)
        return
    dirs = store.list_dirs(prefix)
    cfg = store.get_json(join_key(prefix, CFG)) if store.size(join_key(prefix, CFG)) else None
    hooks = {
        d: _hook_summary(store, join_key(prefix, d))
        for d in dirs
        if _is_hook(store, join_key(prefix, d, METADATA))
    }
    if cfg is None and not hooks:
        root = _output_root(location, store, prefix, dirs)
        if root is not None:
            _print_root(root, as_json)
            return
        listed = store.list(prefix.rstrip("/") + "/" if prefix else "")
        objects = [o for o in listed if not is_internal(o.key)][:1000]
        out: dict[str, Any] = {
            "location": store.url(prefix),
            "folders": dirs,
            "objects": len(objects),
            "bytes": sum(o.size for o in objects),
        }
        if as_json:
            typer.echo(json.dumps(out, indent=2))
            return
        typer.echo(
            f"{out['location']}: {len(dirs)} folders, {out['objects']} objects "
            f"({human_bytes(out['bytes'])})"
        )
        for d in dirs:
            typer.echo(f"  {d}/")
        return
    _print_run(store.url(prefix), cfg, hooks, as_json)


def _is_hook(store, key: str) -> bool:
    """Whether ``key`` is the metadata.json of an Activault hook folder (its keys), not
    another format's (a saev store's metadata.json under an output root)."""
    if store.size(key) is None:
        return False
    try:
        doc = store.get_json(key)
    except Exception:  # noqa: BLE001 - unreadable: not a hook's
        return False
    return isinstance(doc, dict) and {"shape", "dtype", "bytes_per_file"} <= set(doc)


def _output_root(location: str, store, prefix: str, dirs: list[str]) -> dict[str, Any] | None:
    """The stores under a local output root (what capture's --out named), as ``actstore
    status`` finds them: every published store of any format, with its shape and size, and
    every unfinished one. None when there is none, or on object storage (where the folder
    listing names them)."""
    stores: list[dict[str, Any]] = []
    unfinished: list[dict[str, Any]] = []
    if store.local_root is None:
        return None  # object storage: the folder listing below names them
    from .status_cmd import find_stores

    for entry in find_stores(store.local_root / prefix):
        if entry.finished:
            found = _store_summary(str(entry.path), str(entry.path)) or {}
            stores.append({"store": str(entry.path), "format": entry.fmt, **found})
            stores[-1]["bytes"] = entry.n_bytes
        else:
            unfinished.append({"store": str(entry.path), "bytes": entry.n_bytes})
    if not stores and not unfinished:
        return None
    return {"root": store.url(prefix), "stores": stores, "unfinished": unfinished}


def _print_root(root: dict[str, Any], as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(root, indent=2, default=str))
        return
    stores, unfinished = root["stores"], root["unfinished"]
    typer.echo(f"{root['root']}: output root, {len(stores)} finished, {len(unfinished)} unfinished")
    for s in stores:
        typer.echo(
            f"  {s.get('format', '?'):<9} {human_bytes(s.get('bytes', 0)):>10}  {s['store']}"
        )
        if s.get("shape"):
            typer.echo(f"  {'':<9} {'':>10}  {s['shape']}")
    for s in unfinished:
        size = human_bytes(s["bytes"]) if "bytes" in s else "?"
        typer.echo(f"  {'unfinished':<9} {size:>10}  {s['store']}")


def _store_summary(location: str, url: str) -> dict[str, Any] | None:
    """``describe()`` of the store at ``location`` in whichever format it is (None: no
    store opens there, e.g. an unfinished Activault run: the listing below shows it)."""
    from ..errors import ActstoreError
    from ..formats.registry import format_of

    spec = format_of(location)
    if spec is None:
        return None
    try:
        reader = spec.open_reader(location)
    except ActstoreError as err:
        typer.secho(f"note: {err}", fg=typer.colors.YELLOW, err=True)
        return None
    return {"store": url, **reader.describe()}


def _print_store(summary: dict[str, Any], as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(summary, indent=2, default=str))
        return
    typer.echo(f"{summary['store']}: {summary['format']}, {human_bytes(summary['bytes'])}")
    typer.echo(f"  {summary['shape']}")
    typer.echo(f"  {summary['files']} files, sites {', '.join(summary['sites'])}")


def _print_hook(summary: dict[str, Any], show_all: bool, as_json: bool) -> None:
    listing = summary.pop("listing")
    if as_json:
        typer.echo(json.dumps({**summary, "listing": listing}, indent=2))
        return
    typer.echo(
        f"{summary['hook']}: {summary['files']} files, {human_bytes(summary['bytes'])}, "
        f"shape {summary.get('shape')} {summary.get('dtype')}, "
        f"{summary.get('bytes_per_file')} bytes per file"
    )
    for name, size in listing if show_all else listing[:10]:
        typer.echo(f"  {size:>14,}  {name}")
    if not show_all and len(listing) > 10:
        typer.echo(f"  ... {len(listing) - 10} more (--all lists them)")
    for key in ("wrong_size", "not_megabatches"):
        if key in summary:
            typer.secho(f"  {key.replace('_', ' ')}: {summary[key][:5]}", fg=typer.colors.RED)


def _print_run(url: str, cfg: dict | None, hooks: dict[str, dict], as_json: bool) -> None:
    record = (cfg or {}).get("actstore") or {}
    if as_json:
        typer.echo(json.dumps({"run": url, "cfg": cfg, "hooks": hooks}, indent=2, default=str))
        return
    model = ((cfg or {}).get("transformer_config") or {}).get("model_name")
    state = ("complete" if record.get("complete") else "unfinished") if record else "Activault run"
    typer.echo(
        f"{url}: model {model}, {(cfg or {}).get('total_tokens', '?')} tokens, "
        f"{(cfg or {}).get('n_total_files', '?')} files per hook, {state}"
    )
    for hook, s in hooks.items():
        line = (
            f"  {hook:<32} {s['files']:>6} files {human_bytes(s['bytes']):>10}  "
            f"{s.get('shape')} {s.get('dtype')}"
        )
        typer.echo(line)
        for key in ("wrong_size", "not_megabatches"):
            if key in s:
                typer.secho(f"    {key.replace('_', ' ')}: {s[key][:5]}", fg=typer.colors.RED)
