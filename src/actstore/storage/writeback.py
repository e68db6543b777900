"""Positional writes with rolling writeback, and making them durable: the system calls
the writer pipeline (:mod:`actstore.formats.pipeline`) is built on, in one place.

* :func:`pwrite_all` writes buffers that follow each other in a file at an offset
  (``pwritev``, resumed after short writes): positional, so several threads can write
  different parts of the same file at once;
* :func:`start_writeback` asks the kernel to start writing those pages to disk now,
  without waiting (Linux ``sync_file_range``), so the disk works while the capture goes on
  and a later ``fsync`` waits only for the tail;
* :func:`sync_files` makes files durable: ``fsync`` each, or one ``syncfs`` of the file
  system when there are many (zarr's chunk files).

Example:
    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     fd = os.open(os.path.join(d, "f"), os.O_WRONLY | os.O_CREAT, 0o644)
    ...     n = pwrite_all(fd, [memoryview(b"abc"), memoryview(b"def")], 2)
    ...     start_writeback(fd, 2, 6); sync_files([fd]); os.close(fd)
    ...     open(os.path.join(d, "f"), "rb").read()
    b'\\x00\\x00abcdef'
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from typing import Any

#: Above this many files, :func:`sync_files` flushes the whole file system once.
SYNCFS_ABOVE = 64


def _libc(name: str, argtypes: list[Any]) -> Any:
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (AttributeError, OSError):
        return None
    fn.argtypes = argtypes
    return fn


_SYNC_FILE_RANGE = _libc(
    "sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
)
_SYNCFS = _libc("syncfs", [ctypes.c_int])
_MAX_IOV = min(1024, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 16


def pwrite_all(fd: int, views: Sequence[memoryview], offset: int) -> int:
    """Write ``views`` one after another from byte ``offset`` of ``fd``; returns the bytes
    written. The file position is not used, so threads may write other ranges at once."""
    views = [v for v in views if len(v)]
    total = 0
    i = 0
    while i < len(views):
        group = views[i : i + _MAX_IOV]
        done = os.pwritev(fd, group, offset + total)
        total += done
        for view in group:  # skip the views written, trim a partly written one
            if done >= len(view):
                done -= len(view)
                i += 1
                continue
            views[i] = view[done:]
            break
    return total


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing ``[offset, offset + nbytes)`` of ``fd`` to disk without waiting (a
    hint: nothing happens where ``sync_file_range`` is missing)."""
    if _SYNC_FILE_RANGE is not None and nbytes > 0:
        _SYNC_FILE_RANGE(fd, ctypes.c_int64(offset), ctypes.c_int64(nbytes), 2)  # _WRITE


def sync_files(fds: Sequence[int]) -> None:
    """Make every file of ``fds`` durable: ``fsync`` each, or, for more than
    :data:`SYNCFS_ABOVE` files, one ``syncfs`` of their file system (Linux), which flushes
    them all at once instead of one journal commit per file."""
    if len(fds) > SYNCFS_ABOVE and _SYNCFS is not None and _SYNCFS(fds[0]) == 0:
        return
    for fd in fds:
        os.fsync(fd)


def sync_paths(paths: Sequence[str | os.PathLike], directory: str | os.PathLike) -> None:
    """Make files other code wrote durable (a library writing through its own store):
    ``fsync`` each, or one ``syncfs`` of ``directory``'s file system for more than
    :data:`SYNCFS_ABOVE` (no descriptor is held for each of thousands of files)."""
    if len(paths) > SYNCFS_ABOVE and _SYNCFS is not None:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            if _SYNCFS(fd) == 0:
                return
        finally:
            os.close(fd)
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def pool_size(limit: int = 16) -> int:
    """Worker threads for CPU work that releases the GIL: this process's CPUs (its
    affinity mask, not the machine's count), at most ``limit``."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(limit, n))
