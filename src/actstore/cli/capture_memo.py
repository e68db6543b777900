"""A memo of finished captures, so that rerunning one answers "Already captured" before
torch, transformers or the dataset load.

A capture's key is the sha256 of everything that decides which store it writes: every
option as given, the absolute ``--out``, the files (path, size, mtime, inode and ctime:
an edit that puts the old size and mtime back still moves the ctime) of the model
directory and of the dataset, the Python version, actstore's source files, and the entry
file (``__init__.py``: size, mtime) of each library that reads and tokenises the data
(transformers, tokenizers, datasets, pyarrow, numpy), which changes when one is upgraded
or reinstalled (not each of their source files). Only captures into a local directory, of
a local model directory (or the embedded model) over a local dataset (or the embedded
corpus), on one machine, are memoised; the rest, and any whose files cannot all be
listed (a dangling symlink, an unreadable file), always take the full path (preflight). A
memo names the store and the size, mtime and inode of its root manifest
(``actstore-manifest.json`` and ``actstore-blocks.xxh3``) and of its index files at the top
of the store at publication (every format, zarr and Activault included); it
answers only while those are unchanged, so a removed, rewritten or damaged-and-recaptured
store is never reported from the memo.

Memos live in ``$ACTSTORE_MEMO_DIR``, else ``$XDG_CACHE_HOME/actstore/captures`` (default
``~/.cache/...``); a directory that cannot be written only costs the speed-up.

Example:
    >>> hit = recall(params)  # doctest: +SKIP
    >>> hit.location if hit else None  # doctest: +SKIP
    '/abs/actstore-data/47f4f78b...'
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Options that do not change what is stored.
_IGNORED = frozenset({"progress", "break_lock", "space_check", "num_workers"})
#: Libraries whose code decides the examples (tokenisation, reading data files).
_LIBRARIES = ("transformers", "tokenizers", "datasets", "pyarrow", "numpy")
#: Files listed at most, per model directory or dataset folder.
_MAX_FILES = 20_000


@dataclass(frozen=True)
class Memo:
    """A finished capture: where its store is and what the command printed about it."""

    location: str
    summary: str


def memo_dir() -> Path:
    """``$ACTSTORE_MEMO_DIR``, else ``$XDG_CACHE_HOME/actstore/captures`` (``~/.cache``)."""
    if os.environ.get("ACTSTORE_MEMO_DIR"):
        return Path(os.environ["ACTSTORE_MEMO_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "actstore" / "captures"


def capture_key(params: dict[str, Any]) -> str | None:
    """The key of a capture with these CLI ``params``; None when it is not memoised."""
    if params.get("ray") or params.get("machine_id") is not None:
        return None
    if params.get("num_machines") is not None or "SLURM_ARRAY_TASK_ID" in os.environ:
        return None
    out = str(params.get("out", ""))
    if "://" in out:
        return None
    try:  # a file that cannot be listed (dangling symlink, no permission): no memo
        model = _model_files(str(params.get("model")))
        data = _dataset_files(str(params.get("dataset")))
        if model is None or data is None:
            return None
        doc = {
            "options": {k: v for k, v in sorted(params.items()) if k not in _IGNORED},
            "out": str(Path(out).expanduser().absolute()),
            "model": model,
            "dataset": data,
            "python": sys.version,
            "code": _code_files(),
        }
    except OSError:
        return None
    text = json.dumps(doc, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def recall(params: dict[str, Any]) -> Memo | None:
    """The memo of this capture, if there is one and its store is unchanged."""
    key = capture_key(params)
    if key is None:
        return None
    try:
        doc = json.loads((memo_dir() / f"{key}.json").read_text(encoding="utf-8"))
        manifests = {str(k): list(v) for k, v in doc["manifests"].items()}
        location, summary = str(doc["location"]), str(doc["summary"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not manifests or _stats(location, list(manifests)) != manifests:
        return None
    return Memo(location, summary)


#: The root manifest's files (:mod:`actstore.storage.manifest`), named here so that
#: recalling a memo imports nothing.
ROOT_FILES = ("actstore-manifest.json", "actstore-blocks.xxh3")


def remember(
    params: dict[str, Any], location: Any, summary: str, manifests: tuple[str, ...]
) -> None:
    """Record a finished capture (nothing when it is not memoised or cannot be written):
    the stats of its root manifest files (the manifest must exist: every publication
    writes it anew) and of those of its format's index files ``manifests`` that are at the
    top of the store (a zarr store's ``.zmetadata``; an Activault run's ``cfg.json``, its
    per-hook ``metadata.json`` being in the hook folders)."""
    key = capture_key(params)
    if key is None or not Path(str(location)).is_dir():
        return
    stats = _stats(str(location), list(dict.fromkeys([*manifests, *ROOT_FILES])))
    if ROOT_FILES[0] not in stats:
        return
    doc = {"location": str(location), "summary": summary, "manifests": stats}
    directory = memo_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(doc), encoding="utf-8")
        os.replace(tmp, directory / f"{key}.json")
    except OSError:
        return


def _stats(location: str, names: list[str]) -> dict[str, list[int]]:
    out = {}
    for name in names:
        try:
            st = os.stat(os.path.join(location, name))
        except OSError:
            continue
        out[name] = [st.st_size, st.st_mtime_ns, st.st_ino]
    return out


def _listing(root: Path) -> list[list[Any]] | None:
    """(relative path, size, mtime, inode, ctime) of every file under ``root`` (a file:
    itself); an
    entry that cannot be listed or stat'ed raises :class:`OSError`."""
    if root.is_file():
        return [[root.name, *_identity(root.stat())]]
    out: list[list[Any]] = []
    for dirpath, dirs, files in os.walk(root, onerror=_raise):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(dirpath, name)
            out.append([os.path.relpath(path, root), *_identity(os.stat(path))])
            if len(out) > _MAX_FILES:
                return None
    return out


def _identity(st: os.stat_result) -> list[int]:
    """What says a file is unchanged without reading it: its size and mtime, and its inode
    and ctime, which every write (and every ``touch``/``cp -p`` putting an old mtime back)
    moves and no user can set."""
    return [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]


def _raise(err: OSError) -> None:
    raise err


def _model_files(model: str) -> dict[str, Any] | None:
    from ..hub import resolve_checkpoint

    try:
        path = Path(resolve_checkpoint(model)).expanduser()
    except Exception:  # noqa: BLE001 - the full path reports what is wrong
        return None
    if not path.is_dir():
        return None  # a Hub id: its newest revision is only known by asking
    files = _listing(path.resolve())
    return None if files is None else {"path": str(path.resolve()), "files": files}


def _dataset_files(dataset: str) -> dict[str, Any] | None:
    if dataset == "embedded":
        spec = importlib.util.find_spec("pydoc_data.topics")
        origin = Path(spec.origin) if spec and spec.origin else None
        return None if origin is None else {"embedded": _listing(origin)}
    path = Path(dataset).expanduser()
    if not path.exists():
        return None
    files = _listing(path.resolve())
    return None if files is None else {"path": str(path.resolve()), "files": files}


def _code_files() -> list[Any]:
    """actstore's source files, and each installed library's entry file (size, mtime): not
    their other source files."""
    root = Path(__file__).resolve().parents[1]
    out: list[Any] = [
        [str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns]
        for p in sorted(root.rglob("*.py"))
    ]
    for name in _LIBRARIES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            st = os.stat(spec.origin)
            out.append([name, spec.origin, st.st_size, st.st_mtime_ns])
    return out
