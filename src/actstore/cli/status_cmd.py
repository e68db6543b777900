"""``actstore status OUT``: the finished and unfinished stores under an output root.

``inspect`` and ``verify`` use the same listing when they are given an output root
instead of a store.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import typer

from ..progress import human_bytes
from .application import app

#: How deep under an output root stores are looked for (saev's dialect nests 3 levels).
MAX_DEPTH = 4


@dataclass(frozen=True)
class StoreEntry:
    """One store under an output root: published (``fmt`` set) or an unfinished write."""

    path: Path
    fmt: str | None
    n_bytes: int

    @property
    def finished(self) -> bool:
        return self.fmt is not None


def _tree_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue
    return total


def _format_of(path: Path) -> str | None:
    from ..formats.registry import format_of

    spec = format_of(path)
    return None if spec is None else spec.name


def find_stores(root: str | os.PathLike) -> list[StoreEntry]:
    """Every published store and every unfinished (``*.partial``) write under ``root``."""
    from ..storage.location import final_of_partial

    root = Path(root)
    out: list[StoreEntry] = []

    def walk(path: Path, depth: int) -> None:
        if final_of_partial(path.name) is not None:
            out.append(StoreEntry(path, None, _tree_bytes(path)))
            return
        fmt = _format_of(path)
        if fmt is not None:
            out.append(StoreEntry(path, fmt, _tree_bytes(path)))
            return
        if depth >= MAX_DEPTH:
            return
        try:
            children = sorted(p for p in path.iterdir() if p.is_dir() and not p.is_symlink())
        except OSError:
            return
        for child in children:
            walk(child, depth + 1)

    if root.is_dir():
        walk(root, 0)
    return out


def refuse_output_root(location: str, command: str) -> None:
    """If ``location`` is a local directory holding stores (an --out root) rather than a
    store, raise one line that names them."""
    from ..errors import ConfigError

    path = Path(location).expanduser()
    if "://" in location or not path.is_dir() or _format_of(path) is not None:
        return
    entries = find_stores(path)
    finished = [e for e in entries if e.finished]
    if not entries:
        return
    if not finished:
        raise ConfigError(
            f"{location} holds no finished store, only {len(entries)} unfinished "
            f"write(s); see `actstore status {location}`"
        )
    names = ", ".join(str(e.path) for e in finished[:3])
    more = f" and {len(finished) - 3} more" if len(finished) > 3 else ""
    raise ConfigError(
        f"{location} is an output root, not a store; it holds {names}{more}: give one, "
        f"e.g. `actstore {command} {finished[0].path}` (`actstore status {location}` lists all)"
    )


@app.command()
def status(
    out: str = typer.Argument("actstore-data", help="An output root (what capture's --out named)."),
) -> None:
    """List the finished and unfinished stores under an output root, with their sizes and
    how to resume or remove each.

    Example: actstore status actstore-data
    """
    from ..errors import StoreNotFoundError

    path = Path(out).expanduser()
    if not path.is_dir():
        raise StoreNotFoundError(f"{out} is not a directory; give the --out of a capture")
    entries = find_stores(path)
    finished = [e for e in entries if e.finished]
    unfinished = [e for e in entries if not e.finished]
    typer.echo(f"{out}: {len(finished)} finished, {len(unfinished)} unfinished")
    for e in finished:
        typer.echo(f"  finished    {e.fmt:<9} {human_bytes(e.n_bytes):>10}  {e.path}")
        typer.echo(f"      read: actstore inspect {e.path}; check: actstore verify {e.path}")
    for e in unfinished:
        typer.echo(f"  unfinished  {'':<9} {human_bytes(e.n_bytes):>10}  {e.path}")
        typer.echo(
            "      resume: rerun the capture command that wrote it (same options); "
            f"remove: rm -rf {e.path}"
        )
