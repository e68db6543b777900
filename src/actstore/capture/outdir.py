"""Checks of where a capture writes, before any weights load: the output is a writable
directory not inside a store (:func:`check_output`, :func:`check_not_inside_a_store`), what
it holds fits what the format does with it (:func:`check_out_target`), and its file system
has room for the store (:func:`store_bytes`, :func:`check_space`). Run by
:func:`actstore.capture.preflight.preflight`, and by ``convert`` for its output."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ..batch import CapturePlan
from ..errors import ConfigError, StorageError
from ..progress import human_bytes

#: Bytes per stored value, by the format's stored dtype.
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def is_url(location: str) -> bool:
    """True for ``s3://...`` and other URLs (no local checks apply)."""
    return "://" in str(location)


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_output(out: str, what: str = "--out") -> None:
    """``out`` (named ``what`` in messages) is a directory, or can be created, and a file
    can be written there."""
    if is_url(out):
        return
    path = Path(out).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise ConfigError(
            f"{what} {out} is an existing file; give a directory (it is created if missing)"
        )
    base = _nearest_existing(path)
    if not base.is_dir():
        raise ConfigError(f"{what} {out} cannot be created: {base} is a file, not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".actstore-write-test-", dir=base)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ConfigError(
            f"{what} {out} is not writable ({base}: {err.strerror or err}); "
            "choose a directory you can write to"
        ) from None


#: The file every store actstore publishes holds (``actstore.storage.manifest``).
_ROOT_MANIFEST = "actstore-manifest.json"


def _store_markers() -> frozenset[str]:
    """Names whose presence at the top of a directory makes it worth asking every format
    whether it is a store (asking lists the whole tree): the root manifest and each
    format's :attr:`~actstore.formats.registry.FormatSpec.store_markers`."""
    from ..formats.registry import available_formats

    return frozenset({_ROOT_MANIFEST, *(m for s in available_formats() for m in s.store_markers)})


def _store_at(path: Path, markers: frozenset[str] | None = None) -> str | None:
    """The format of the store at ``path`` ("unfinished" for a writer's partial
    directory), or None; only a directory holding one of ``markers`` is asked."""
    from ..storage.location import final_of_partial

    if final_of_partial(path.name) is not None:
        return "unfinished"
    try:
        names = set(os.listdir(path))
    except OSError:
        return None
    if not names or not names & (_store_markers() if markers is None else markers):
        return None
    from ..formats.registry import format_of

    spec = format_of(path)
    if spec is not None:
        return spec.name
    return "actstore" if _ROOT_MANIFEST in names else None


def check_not_inside_a_store(out: str, what: str = "--out") -> None:
    """``out`` (named ``what``) is not inside a store or an unfinished one: whatever is
    written there would change a store it does not belong to."""
    if is_url(out):
        return
    path = Path(out).expanduser().absolute()
    for parent in path.parents:  # a store actstore published (asking lists the whole tree)
        kind = _store_at(parent, frozenset({_ROOT_MANIFEST}))
        if kind is None:
            continue
        if kind == "unfinished":
            raise ConfigError(
                f"{what} {out} is inside {parent}, an unfinished capture's directory; "
                "give a directory outside it"
            )
        raise ConfigError(
            f"{what} {out} is inside the {kind} store {parent}; writing there would change "
            "that store: give a directory outside it"
        )


def check_out_target(
    out: str, spec: Any, options: Any, plan: CapturePlan, what: str = "--out"
) -> None:
    """What ``out`` (named ``what``) holds fits what format ``spec`` does with it, or one
    line: a format whose store is the output itself (pkl.gz, SAELens, Activault, zarr's
    ``*.zarr``) takes a new or empty directory, or its own store there (finished:
    reported; unfinished: resumed; another capture's: refused by the writer); a format that
    writes its store under the output as a root (saev's ``<hash>``, zarr's
    ``activations.zarr``) takes any directory that is not itself a store. A store of
    another format, or foreign files, are never written into. ``plan`` is the capture's
    (or :func:`probe_plan`'s: where the store goes depends on the format, not the data)."""
    if is_url(out):
        return
    path = Path(out).expanduser().absolute()
    if not path.is_dir():
        return
    from ..storage.location import Location

    try:
        store = Location.parse(spec.writer.store_location(plan, Location.parse(path), options))
        at_out = store.path() == path
    except ConfigError:
        store, at_out = None, True
    kind = _store_at(path)
    if at_out:
        if kind == spec.name:
            return  # its own store: finished (reported), unfinished or another capture
        if kind is None and not any(path.iterdir()):
            return
        held = f"the {kind} store" if kind else "files that are not a store"
        raise ConfigError(
            f"{what} {out} holds {held}; a {spec.name} store is written at {what} itself, "
            "never into other files: give a new or empty directory"
        )
    if kind is not None:
        raise ConfigError(
            f"{what} {out} is a {kind} store, not an output root; a {spec.name} store is "
            f"written inside {what}: give the store's parent or a new directory"
        )
    store_path = store.path() if store is not None else path
    inner = _store_at(store_path) if store_path.is_dir() else None
    if inner is not None and inner != spec.name:
        raise ConfigError(
            f"{what} {out}: {store_path}, where the {spec.name} store goes, is a {inner} "
            "store; give another directory"
        )


def store_bytes(plan: CapturePlan, stored_dtype: str) -> int:
    """Upper estimate of a store's size: every site's vectors plus token ids."""
    values = plan.n_examples * len(plan.sites) * plan.tokens_per_example * plan.d_model
    tokens = plan.n_examples * plan.tokens_per_example * 4 if plan.has_tokens else 0
    return values * _ITEMSIZE.get(stored_dtype, 4) + tokens


def check_space(out: str, need: int) -> None:
    """Refuse when the file system of ``out`` has less than ``need`` bytes free."""
    if is_url(out) or need <= 0:
        return
    base = _nearest_existing(Path(out).expanduser().absolute())
    free = shutil.disk_usage(base).free
    if free < need:
        raise StorageError(
            f"--out {out}: the store needs about {human_bytes(need)} but {base} has {human_bytes(free)} "
            "free; free some space, choose another --out, or pass --no-space-check"
        )
