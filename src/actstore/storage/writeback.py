"""Positional writes with rolling writeback, and making them durable: the system calls
the writer pipeline (:mod:`actstore.formats.pipeline`) is built on, in one place.

* :func:`pwrite_all` writes buffers that follow each other in a file at an offset
  (``pwritev``, resumed after short writes): positional, so several threads can write
  different parts of the same file at once;
* :func:`start_writeback` asks the kernel to start writing those pages to disk now,
  without waiting (Linux ``sync_file_range``), so the disk works while the capture goes on
  and a later ``fsync`` waits only for the tail;
* :class:`DirectFile` writes around the page cache (``O_DIRECT``) where the file system
  offers it: the disk reads the bytes from the writer's memory, no CPU copies them into the
  kernel, and the writes do not wait on the kernel's dirty-page throttling; unaligned
  writes and file systems without direct I/O (tmpfs) go through the page cache as above;
  :class:`Appender` does the same for a file written front to back (``torch.save``);
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
import errno
import mmap
import os
import struct
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import ConfigError

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
_STATX = _libc(
    "statx", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_char_p]
)
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


#: ``ACTSTORE_DIRECT_IO=0`` sends every write through the page cache (what writers did
#: before direct I/O; a benchmark's A/B, or a file system that misbehaves with it).
DIRECT_ENV = "ACTSTORE_DIRECT_IO"

#: Bytes one thread copies unaligned data through, and an :class:`Appender` stages,
#: before a direct write: a few of the disk's largest requests.
BOUNCE_BYTES = 8 << 20

_STATX_DIOALIGN = 0x2000
_AT_FDCWD = -100


def direct_io_enabled() -> bool:
    """Whether writes may go around the page cache: ``ACTSTORE_DIRECT_IO`` unset or 1
    (0: never); any other value is a :class:`~actstore.errors.ConfigError`."""
    value = os.environ.get(DIRECT_ENV, "1").strip()
    if value not in ("0", "1"):
        raise ConfigError(f"{DIRECT_ENV} must be 0 or 1, not {value!r}; unset it to write directly")
    return value == "1"


def direct_alignment(path: str | os.PathLike) -> int:
    """The alignment in bytes (memory address, file offset, length) that direct I/O to
    ``path``'s file system needs (Linux ``statx`` ``STATX_DIOALIGN``); 0 where it offers
    none (tmpfs), where the kernel does not say, or with ``ACTSTORE_DIRECT_IO=0``."""
    if _STATX is None or not direct_io_enabled():
        return 0
    buf = ctypes.create_string_buffer(256)
    if _STATX(_AT_FDCWD, os.fsencode(path), 0, _STATX_DIOALIGN, buf) != 0:
        return 0
    if not struct.unpack_from("<I", buf, 0)[0] & _STATX_DIOALIGN:
        return 0
    mem, offset = struct.unpack_from("<II", buf, 152)  # stx_dio_mem_align, _offset_align
    if not mem or not offset:
        return 0
    return max(mem, offset)


def direct_alignment_in(directory: str | os.PathLike) -> int:
    """:func:`direct_alignment` of a new file in ``directory`` (made and removed)."""
    fd, probe = tempfile.mkstemp(prefix=".actstore-probe-", dir=directory)
    try:
        return direct_alignment(probe)
    finally:
        os.close(fd)
        os.unlink(probe)


_buffers: list[np.ndarray] = []
_buffers_lock = threading.Lock()


def _take_buffer() -> np.ndarray:
    """A page-aligned buffer of :data:`BOUNCE_BYTES` (a bounce buffer, an
    :class:`Appender`'s stage), reused: fresh memory costs a page fault per 4 KiB."""
    with _buffers_lock:
        if _buffers:
            return _buffers.pop()
    return np.frombuffer(mmap.mmap(-1, BOUNCE_BYTES), np.uint8)


def _give_buffer(buf: np.ndarray) -> None:
    with _buffers_lock:
        if len(_buffers) < 8:
            _buffers.append(buf)


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, np.uint8).ctypes.data) if len(view) else 0


class DirectFile:
    """Positional writes to one file, around the page cache where they can be.

    ``fd`` is the file's ordinary descriptor (the caller's: it truncates, fsyncs and
    closes it). Where the file system offers direct I/O a second descriptor is opened
    with ``O_DIRECT``: a write whose offset and length are multiples of the alignment
    goes there, straight from the caller's buffers when they are aligned, else through
    a bounce buffer. Every other write goes through the page cache with
    rolling writeback. Reads see the same bytes either way; ``fsync`` of ``fd`` makes
    both durable. Safe to use from several threads for different ranges.
    """

    def __init__(self, path: str | os.PathLike, fd: int) -> None:
        self.fd = fd
        self.align = direct_alignment(path)
        self.direct_fd = -1
        self.direct_bytes = 0  # written around the page cache (what tests and benchmarks see)
        self.refused = False
        self._lock = threading.Lock()
        if self.align:
            try:
                self.direct_fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
            except OSError:
                self.align = 0

    def write(
        self,
        views: Sequence[memoryview],
        offset: int,
        released: Callable[[], None] | None = None,
    ) -> None:
        """Write ``views`` one after another from byte ``offset``. ``released`` is called
        once they are no longer read (copied into the bounce buffer, before its write to
        the disk; or written), so their owner may reuse them while the disk works."""
        views = [v for v in views if len(v)]
        nbytes = sum(len(v) for v in views)
        if self.direct and nbytes and not offset % self.align and not nbytes % self.align:
            try:
                self._direct(views, offset, released)
                return
            except OSError as err:
                if err.errno != errno.EINVAL:
                    raise
                self.refused = True  # the kernel refused after all: the page cache from now on
        pwrite_all(self.fd, views, offset)
        start_writeback(self.fd, offset, nbytes)
        if released is not None:
            released()

    @property
    def direct(self) -> bool:
        """Whether aligned writes go around the page cache."""
        return self.direct_fd >= 0 and not self.refused

    def _direct(
        self, views: list[memoryview], offset: int, released: Callable[[], None] | None
    ) -> None:
        a, nbytes = self.align, sum(len(v) for v in views)
        if all(not len(v) % a and not _address(v) % a for v in views):
            pwrite_all(self.direct_fd, views, offset)
        else:
            bounce, fill, left = _take_buffer(), 0, nbytes
            try:
                for v in views:
                    src = np.frombuffer(v, np.uint8)
                    while len(src):
                        take = min(len(src), BOUNCE_BYTES - fill)
                        np.copyto(bounce[fill : fill + take], src[:take])
                        fill, src, left = fill + take, src[take:], left - take
                        if fill == BOUNCE_BYTES or not left:
                            if not left and released is not None:
                                released()  # the last bytes are in the bounce buffer
                                released = None
                            self._bounced(bounce[:fill].data, offset)
                            offset, fill = offset + fill, 0
            finally:
                _give_buffer(bounce)
        with self._lock:
            self.direct_bytes += 0 if self.refused else nbytes
        if released is not None:
            released()

    def _bounced(self, data: memoryview, offset: int) -> None:
        """Write one bounce buffer's bytes; if the kernel refuses them direct, through the
        page cache from the same buffer (the caller's views may be reused already)."""
        if not self.refused:
            try:
                pwrite_all(self.direct_fd, [data], offset)
                return
            except OSError as err:
                if err.errno != errno.EINVAL:
                    raise
                self.refused = True
        pwrite_all(self.fd, [data], offset)
        start_writeback(self.fd, offset, len(data))

    def close(self) -> None:
        """Close the direct descriptor once every write returned (``fd`` stays the
        caller's); idempotent."""
        fd, self.direct_fd = self.direct_fd, -1
        if fd >= 0:
            os.close(fd)


class Appender:
    """Appends to a :class:`DirectFile` front to back. With direct I/O, writes are staged
    in a buffer of its own and written a whole buffer at a time (aligned: direct); the
    last, partial one at :meth:`finish`. Without, each write goes to the page cache at
    once. Either way the caller may reuse a buffer as soon as :meth:`write` returns."""

    def __init__(self, file: DirectFile, start: int = 0) -> None:
        self.file, self.size = file, start
        self._flushed, self._fill = start, 0
        self._stage: np.ndarray | None = None
        self._staged = file.direct and not start % file.align

    def write(self, view: memoryview) -> None:
        """Append ``view``."""
        n = len(view)
        if not self._staged:
            self.file.write([view], self.size)
            self.size += n
            self._flushed = self.size
            return
        if self._stage is None:
            self._stage = _take_buffer()
        src = np.frombuffer(view, np.uint8)
        while len(src):
            take = min(len(src), BOUNCE_BYTES - self._fill)
            np.copyto(self._stage[self._fill : self._fill + take], src[:take])
            self._fill, src = self._fill + take, src[take:]
            if self._fill == BOUNCE_BYTES:
                self._drain()
        self.size += n

    def _drain(self) -> None:
        if self._fill:
            assert self._stage is not None
            self.file.write([self._stage[: self._fill].data], self._flushed)
            self._flushed += self._fill
            self._fill = 0

    def finish(self) -> None:
        """Write what is staged: its aligned head directly, its tail through the page
        cache (both durable at the file's ``fsync``)."""
        if self._fill:
            assert self._stage is not None
            head = self._fill - self._fill % self.file.align if self.file.direct else 0
            stage = self._stage.data
            if head:
                self.file.write([stage[:head]], self._flushed)
            if self._fill > head:
                self.file.write([stage[head : self._fill]], self._flushed + head)
            self._flushed += self._fill
            self._fill = 0
        if self._stage is not None:
            _give_buffer(self._stage)
            self._stage = None


def pool_size(limit: int = 16) -> int:
    """Worker threads for CPU work that releases the GIL: this process's CPUs (its
    affinity mask, not the machine's count), at most ``limit``."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(limit, n))
