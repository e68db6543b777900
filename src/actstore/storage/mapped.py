"""A store's files mapped read-only into one stretch of address space: :class:`MappedFiles`.

The training loader gathers rows straight from the page cache into its batches: every
file it reads is mapped (``mmap``, read-only, shared) at a page-aligned place of one
reserved region, so a row of any file is a run of elements of one tensor
(:meth:`MappedFiles.elements`) and a batch is one ``torch.index_select`` from it, with no
read into a buffer first. Files are mapped when first used; :meth:`MappedFiles.populate`
faults a range in ahead of use (and turns a file shrunk under the mapping into an error,
where touching it would kill the process with ``SIGBUS``); :meth:`MappedFiles.let_go`
drops this process's page-table entries of a range it is done with (the data stays in
the page cache), so a long epoch does not leave the whole store in the process's
resident set.

Linux only (``MAP_FIXED`` placement, ``MADV_POPULATE_READ``); :func:`available` says
whether a store's files can be mapped here (local files on Linux).

Example:
    >>> import tempfile, pathlib, numpy as np, torch
    >>> from actstore.storage.localfiles import LocalFiles
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> np.arange(12, dtype="<f4").tofile(d / "a.bin")
    >>> region = MappedFiles(LocalFiles(d), {"a.bin": 48})
    >>> rows = region.elements(torch.float32, 4)  # element-granular rows of 4 values
    >>> at = region.offset("a.bin") // 4          # the file's first element
    >>> rows[at + 4].tolist()                     # 4 values from element 4 of a.bin
    [4.0, 5.0, 6.0, 7.0]
    >>> region.close()
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
from collections.abc import Mapping

import numpy as np
import torch

from ..errors import CorruptStoreError, StorageError
from ..forksafe import ForkSafeLock
from .storefiles import StoreFiles

PAGE = mmap.PAGESIZE
#: Files are placed at multiples of this (2 MiB) and advised ``MADV_HUGEPAGE``: the kernel
#: then reads them into the page cache in 2 MiB folios and maps each with one page-table
#: entry, not 512 (measured: faulting a warm window in 0.001 s of CPU per GB instead of
#: 0.08-0.14, and letting it go 0.0007 instead of 0.03-0.04).
ALIGN = 2 << 20
_LINUX = sys.platform.startswith("linux")
_PROT_NONE = 0
_MAP_FIXED = 0x10  # Linux
_MAP_NORESERVE = 0x4000  # Linux
_MADV_DONTNEED, _MADV_HUGEPAGE, _MADV_POPULATE_READ = 4, 14, 22  # POPULATE_READ: Linux 5.14+


def _libc() -> ctypes.CDLL | None:
    if not _LINUX:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


_LIBC = _libc()
_FAILED = ctypes.c_void_p(-1).value
#: Whether ``MADV_POPULATE_READ`` works here (found on first use; older kernels: EINVAL).
_POPULATE = [True]


def available(files: StoreFiles) -> bool:
    """Whether ``files`` can be mapped here: local files, on Linux, unless
    ``ACTSTORE_MAP=0`` (then the loader reads windows into buffers instead)."""
    if _LIBC is None or os.environ.get("ACTSTORE_MAP", "1").strip() in ("0", "off", "no"):
        return False
    return files.mappable


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def _unmap(base: int, size: int) -> None:
    if _LIBC is not None and size:
        _LIBC.munmap(base, size)


class _Reservation:
    """Owns the reserved region: unmapped when the last buffer over it is gone (every view
    and tensor of the region refers to it), never under a live tensor."""

    def __init__(self, base: int, size: int) -> None:
        self.base, self.size = base, size

    def __del__(self) -> None:
        _unmap(self.base, self.size)


class MappedFiles:
    """Files of one store (``sizes``: name -> the size each must have) mapped read-only, on
    first use, each at a page-aligned byte offset of one reserved region of address space.
    Thread-safe; belongs to the process that made it (a forked child makes its own)."""

    def __init__(self, files: StoreFiles, sizes: Mapping[str, int]) -> None:
        if _LIBC is None:
            raise StorageError("memory-mapped reads need Linux")
        self.files = files
        self._sizes = dict(sizes)
        self._at: dict[str, int] = {}
        at = 0
        for name, size in self._sizes.items():
            self._at[name] = at
            at += _round_up(max(size, 0), ALIGN)
        self.nbytes = max(at, ALIGN)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        # reserved with room to start at a multiple of ALIGN; the rest is given back
        base = _LIBC.mmap(None, self.nbytes + ALIGN, _PROT_NONE, flags, -1, 0)
        if base in (None, _FAILED):
            err = ctypes.get_errno()
            raise StorageError(
                f"cannot reserve {self.nbytes / 2**30:.1f} GiB of address space to map "
                f"{files.url}: {os.strerror(err)} (a virtual memory limit, ulimit -v?)"
            )
        lead = -base % ALIGN
        _unmap(base, lead)
        _unmap(base + lead + self.nbytes, ALIGN - lead)
        base += lead
        self.base: int = base
        self._mapped: set[str] = set()
        self._closed = False
        self._lock = ForkSafeLock()
        raw = (ctypes.c_char * self.nbytes).from_address(base)
        raw.owner = _Reservation(base, self.nbytes)  # type: ignore[attr-defined]
        self._memory = memoryview(raw).cast("B")
        self._bytes = np.frombuffer(self._memory, dtype=np.uint8)
        self._elements: dict[tuple[torch.dtype, int], torch.Tensor] = {}

    def offset(self, name: str) -> int:
        """Byte offset of ``name``'s first byte in the region (mapping it on first use)."""
        if name not in self._mapped:
            self._map(name)
        return self._at[name]

    def _open(self) -> None:
        """Refuse use after :meth:`close` (the reservation may be gone: never touch it)."""
        if self._closed:
            raise StorageError(f"the mapped files of {self.files.url} were closed")

    def _map(self, name: str) -> None:
        assert _LIBC is not None
        with self._lock:
            self._open()
            if name in self._mapped:
                return
            size = self._sizes[name]
            fd = self.files.open_read(name)
            try:
                found = os.fstat(fd).st_size
                if found != size:
                    raise CorruptStoreError(
                        f"{self.files.url_of(name)} has {found} bytes, not the {size} its "
                        "store lists: restore it or re-create the store"
                    )
                if size:
                    flags = mmap.MAP_SHARED | _MAP_FIXED
                    got = _LIBC.mmap(self.base + self._at[name], size, mmap.PROT_READ, flags, fd, 0)
                    if got != self.base + self._at[name]:
                        err = ctypes.get_errno()
                        raise StorageError(
                            f"cannot map {self.files.url_of(name)}: {os.strerror(err)}; set "
                            "ACTSTORE_MAP=0 to read into buffers"
                        )
                    # read and mapped in 2 MiB folios where the kernel can (THP for files;
                    # refused quietly where it cannot): one page-table entry per 2 MiB
                    _LIBC.madvise(got, size, _MADV_HUGEPAGE)
            finally:
                os.close(fd)
            self._mapped.add(name)

    def elements(self, dtype: torch.dtype, width: int) -> torch.Tensor:
        """The whole region as overlapping rows of ``width`` elements of ``dtype``: row
        ``e`` holds elements ``e .. e + width - 1``, so the row that starts at byte ``b``
        of the region is row ``b // itemsize`` (``index_select`` gathers rows that start
        anywhere). Only rows inside mapped files may be read."""
        self._open()
        key = (dtype, width)
        found = self._elements.get(key)
        if found is None:
            item = torch.empty(0, dtype=dtype).element_size()
            flat = torch.from_numpy(self._bytes).view(dtype)
            n = self.nbytes // item
            found = self._elements[key] = flat.as_strided((max(n - width + 1, 1), width), (1, 1))
        return found

    def view(self, start: int, nbytes: int) -> memoryview:
        """Bytes ``[start, start + nbytes)`` of the region (inside one mapped file)."""
        self._open()
        return self._memory[start : start + nbytes]

    def populate(self, name: str, start: int, nbytes: int) -> None:
        """Fault in ``[start, start + nbytes)`` of the region now (reading what is not in
        the page cache), so gathers from it do not stop on page faults. A range beyond
        the end of a file that shrank since it was mapped is a :class:`CorruptStoreError`
        here, instead of a ``SIGBUS`` at the first touch."""
        self._open()
        if not _POPULATE[0] or nbytes <= 0:
            return
        assert _LIBC is not None
        lo = start - start % PAGE
        if _LIBC.madvise(self.base + lo, start + nbytes - lo, _MADV_POPULATE_READ) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EFAULT:
            raise CorruptStoreError(
                f"{self.files.url_of(name)} is shorter than when it was opened (changed "
                "in place while being read): restore it or re-create the store"
            )
        if err in (errno.EINVAL, errno.ENOSYS):
            _POPULATE[0] = False  # a kernel before 5.14: pages fault in as they are read
            return
        raise StorageError(f"cannot read {self.files.url_of(name)}: {os.strerror(err)}")

    def let_go(self, start: int, nbytes: int) -> None:
        """Drop this process's page-table entries of ``[start, start + nbytes)`` (the data
        stays in the page cache; a later touch maps it again)."""
        self._advise(start, nbytes, _MADV_DONTNEED)

    def _advise(self, start: int, nbytes: int, advice: int) -> None:
        if nbytes > 0 and _LIBC is not None and not self._closed:
            lo = start - start % PAGE
            _LIBC.madvise(self.base + lo, start + nbytes - lo, advice)

    def close(self) -> None:
        """Let go of the mapped files: the region is unmapped once no tensor or view of it
        is left."""
        self._closed = True
        self._elements.clear()
        self._bytes = np.empty(0, dtype=np.uint8)
        self._memory = memoryview(b"")
