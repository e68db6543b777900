"""Creating, consolidating and publishing one Zarr v2 store directory (shared by the writer
and the merge).

Every store is built under a temporary sibling ``.<name>.<random>.partial/``, consolidated
(``.zmetadata``), fsynced file by file and renamed into place; then its files are made
read-only. A crash at any point leaves only the ``.partial`` directory, which no reader opens.

Example:
    >>> tmp = new_partial_dir(Path("out/activations.zarr"))  # doctest: +SKIP
    >>> root = create_arrays(tmp, layout, optional={"hallu_label"})  # doctest: +SKIP
    >>> publish(tmp, Path("out/activations.zarr"))  # doctest: +SKIP
"""

from __future__ import annotations

import os
import stat
import tempfile
import warnings
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import ConfigError, require
from ...storage import fsync_dir, publish_dir
from .layout import (
    ACT_DTYPE,
    ACTIVATIONS,
    DIGEST,
    DIGEST_DTYPE,
    FULL_LENGTHS,
    HALLU_LABEL,
    LENGTHS,
    PARTS,
    SAMPLE_CHUNK_ROWS,
    SAMPLE_KEY,
    SAMPLE_KEY_DTYPE,
    SPLIT,
    TARGET_CHUNK_BYTES,
    TOKEN_IDS,
    ZarrLayout,
)

#: Threads flushing files before a store is published.
FSYNC_THREADS = 8
#: Per-sample arrays a store may hold besides the required ones, with their dtype.
OPTIONAL_ARRAYS = {"hallu_label": (HALLU_LABEL, np.dtype("i1")), "split": (SPLIT, np.dtype("i1"))}


def byte_view(array: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, without a copy (also for zero-size arrays)."""
    if not array.flags.c_contiguous:
        raise ConfigError("the output array must be C-contiguous")
    return memoryview(array.reshape(-1).view(np.uint8))


def zarr_module():
    """zarr-python, or a clear error naming the extra to install."""
    return require("zarr", "zarr")


def new_partial_dir(final: Path) -> Path:
    """A fresh temporary directory beside ``final`` (never shared by two writers)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".partial", dir=final.parent))


def sample_arrays(
    layout: ZarrLayout, *, token_ids: bool, optional: Iterable[str] = ()
) -> dict[str, tuple[tuple[int, ...], np.dtype, Any]]:
    """Per-sample arrays of a store: path -> (row shape, dtype, fill value)."""
    out: dict[str, tuple[tuple[int, ...], np.dtype, Any]] = {}
    for part in PARTS:
        out[LENGTHS[part]] = ((), np.dtype("<i4"), 0)
        out[FULL_LENGTHS[part]] = ((), np.dtype("<i4"), 0)
        if token_ids:
            out[TOKEN_IDS[part]] = ((layout.max_len(part),), np.dtype("<i4"), -1)
    out[SAMPLE_KEY] = ((), SAMPLE_KEY_DTYPE, b"")
    out[DIGEST] = ((), DIGEST_DTYPE, b"")
    for name in optional:
        path, dtype = OPTIONAL_ARRAYS[name]
        out[path] = ((), dtype, -1)
    return out


def rows_per_chunk(row_shape: tuple[int, ...], dtype: np.dtype, n_samples: int) -> int:
    """Chunk length of a per-sample array: up to 64Ki rows and about 1 MiB."""
    row_bytes = int(np.prod(row_shape, dtype=np.int64)) * dtype.itemsize
    return max(1, min(n_samples, SAMPLE_CHUNK_ROWS, TARGET_CHUNK_BYTES // max(row_bytes, 1)))


def create_arrays(
    directory: Path, layout: ZarrLayout, *, token_ids: bool, optional: Iterable[str] = ()
) -> Any:
    """Create the group and every array (metadata only; no chunk is written yet)."""
    zarr = zarr_module()
    root = zarr.open_group(str(directory), mode="w", zarr_format=2)
    arrays = root.require_group("arrays")
    for part in PARTS:
        arrays.create_array(
            ACTIVATIONS[part].split("/", 1)[1],
            shape=layout.shape(part),
            chunks=layout.chunk_shape(part),
            dtype=ACT_DTYPE,
            compressors=None,
            filters=None,
            fill_value=0,
            order="C",
        )
    for path, (row_shape, dtype, fill) in sample_arrays(
        layout, token_ids=token_ids, optional=optional
    ).items():
        shape = (layout.n_samples, *row_shape)
        chunks = (rows_per_chunk(row_shape, dtype, layout.n_samples), *row_shape)
        arrays.create_array(
            path.split("/", 1)[1],
            shape=shape,
            chunks=chunks,
            dtype=dtype,
            compressors=None,
            filters=None,
            fill_value=fill,
            order="C",
        )
    return root


def consolidate(directory: Path) -> None:
    """Write ``.zmetadata``. The plain ``text/`` and ``meta/`` folders are not Zarr nodes;
    zarr-python warns about them while listing, which is expected here."""
    zarr = zarr_module()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not recognized as a component.*")
        zarr.consolidate_metadata(str(directory), zarr_format=2)


def fsync_tree(directory: Path) -> None:
    """fsync every file and directory below ``directory`` (before it is renamed into place),
    on a few threads: fsync releases the GIL and the device queues the flushes."""
    files, dirs = [], []
    for dirpath, _, filenames in os.walk(directory):
        files += [os.path.join(dirpath, name) for name in filenames]
        dirs.append(dirpath)
    with ThreadPoolExecutor(max_workers=FSYNC_THREADS) as pool:
        list(pool.map(_fsync_file, files))
    for dirpath in reversed(dirs):
        fsync_dir(dirpath)


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_tree_read_only(directory: Path) -> None:
    """Remove write permission from every file below ``directory``."""
    mask = ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)
    for dirpath, _, filenames in os.walk(directory):
        for name in filenames:
            path = os.path.join(dirpath, name)
            os.chmod(path, os.stat(path).st_mode & mask)


def publish(tmp: Path, final: Path) -> None:
    """Consolidate, fsync and atomically rename ``tmp`` to ``final``; then make it read-only."""
    consolidate(tmp)
    fsync_tree(tmp)
    publish_dir(tmp, final)
    make_tree_read_only(final)


class RowAppender:
    """Appends rows to a per-sample array, writing only whole chunks (no read-modify-write)
    and keeping at most one chunk of rows in memory."""

    def __init__(self, array: Any, written: int = 0) -> None:
        self.array = array
        self.rows = int(array.chunks[0])
        self._pending: list[np.ndarray] = []
        self._n_pending = 0
        self.written = written

    def checkpoint(self) -> None:
        """Write the rows held in memory now (a partial chunk: read, modified, written)."""
        self._flush(final=True)

    def append(self, values: np.ndarray) -> None:
        self._pending.append(np.asarray(values, dtype=self.array.dtype))
        self._n_pending += len(values)
        if self._n_pending >= self.rows:
            self._flush(final=False)

    def close(self) -> None:
        self._flush(final=True)

    def _flush(self, *, final: bool) -> None:
        if not self._pending:
            return
        data = np.concatenate(self._pending)
        n_write = len(data) if final else (len(data) // self.rows) * self.rows
        if n_write:
            self.array[self.written : self.written + n_write] = data[:n_write]
            self.written += n_write
        rest = data[n_write:]
        self._pending = [rest] if len(rest) else []
        self._n_pending = len(rest)
