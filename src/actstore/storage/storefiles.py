"""What a format reads a store through: :class:`StoreFiles`, the files of one store
directory read by byte range, whatever holds them. The backends are
:class:`~actstore.storage.localfiles.LocalFiles` (local disk) and
:class:`~actstore.storage.s3files.S3Files` (object storage);
:func:`~actstore.storage.files.open_files` picks one for a location.
"""

from __future__ import annotations

import abc
import builtins
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Self

import numpy as np

from ..errors import CorruptStoreError, StorageError, StoreNotFoundError
from .local import IO_CHUNK, parse_json


class StoreFiles(abc.ABC):
    """Named files of one store directory (names are ``/``-separated, relative)."""

    #: The location as the user wrote it (a path or ``s3://bucket/prefix``).
    url: str
    #: The directory on local disk, or None for remote stores.
    local_path: Path | None = None
    #: Whether :meth:`open_read` gives descriptors that can be memory-mapped (local files).
    mappable: bool = False
    #: Whether :meth:`version` is the MD5 ETag of the bytes (S3), comparable with a hash.
    md5_versions: bool = False

    @abc.abstractmethod
    def list(self) -> dict[str, int]:
        """Every file below the directory: name -> size in bytes, sorted by name."""

    @abc.abstractmethod
    def size(self, name: str) -> int | None:
        """Size of ``name`` in bytes, or None if it does not exist."""

    @abc.abstractmethod
    def read_range(
        self,
        name: str,
        offset: int,
        length: int,
        out: bytearray | memoryview | Any = None,
        *,
        cache: bool = True,
    ) -> memoryview:
        """Bytes ``[offset, offset + length)`` of ``name``, into ``out`` (any writable
        buffer of exactly ``length`` bytes, e.g. a numpy array) or a new buffer. ``cache``:
        keep the range in the local cache tier, if there is one."""

    def read_view(self, name: str, offset: int, length: int) -> memoryview:
        """Bytes ``[offset, offset + length)`` of ``name`` as a read-only buffer, for callers
        that place the bytes themselves: a mapped cache entry on a hit (no copy)."""
        return self.read_range(name, offset, length)

    def read_ranges(self, name: str, ranges: Sequence[tuple[int, Any]]) -> None:
        """Fill each ``(offset, out)`` buffer from ``name`` (no caching)."""
        for offset, out in ranges:
            view = bytes_view(out)
            self.read_range(name, offset, len(view), view, cache=False)

    def read_rows(
        self, name: str, offsets: np.ndarray, row_bytes: int, out: np.ndarray, slots: np.ndarray
    ) -> None:
        """Read ``row_bytes`` at each of ``offsets`` (ascending, not overlapping) of ``name``
        into row ``slots[i]`` of ``out`` (``[n, ...]`` with contiguous rows of ``row_bytes``),
        skipping ``slots[i] < 0``: rows land in place, with no intermediate buffer where the
        backend allows (local files: vectored ``preadv``, nearby rows coalesced)."""
        keep = slots >= 0
        self.read_ranges(name, [(int(o), out[int(s)]) for o, s in zip(offsets[keep], slots[keep])])

    def map(self, name: str) -> memoryview:
        """The whole of ``name`` as a read-only buffer: a memory map on local disk (pages
        read as they are touched), the fetched bytes on object storage."""
        return memoryview(self.read_bytes(name))

    def open_read(self, name: str) -> int:
        """A new read-only descriptor of ``name`` (the caller closes it), for a memory map
        (:mod:`actstore.storage.mapped`); only where :attr:`mappable`."""
        raise StorageError(f"{self.url_of(name)} cannot be memory-mapped (not a local file)")

    def read_exact(self, name: str, out: Any) -> bool:
        """Read the whole of ``name`` into ``out`` (a writable buffer of exactly its size),
        without keeping the file open (chunk stores hold millions of files). False if the
        file does not exist; :class:`CorruptStoreError` if it is not ``len(out)`` bytes."""
        view = bytes_view(out)
        size = self.size(name)
        if size is None:
            return False
        if size != len(view):
            raise CorruptStoreError(
                f"{self.url_of(name)} has {size} bytes, expected {len(view)} "
                f"({'truncated' if size < len(view) else 'too long'}): restore it or re-create the store"
            )
        self.read_range(name, 0, len(view), view)
        return True

    def exists(self, name: str) -> bool:
        return self.size(name) is not None

    def symlinks(self) -> builtins.list[str]:
        """Names below the directory that are symbolic links (a store holds none)."""
        return []

    def outside_links(self, links: builtins.list[str] | None = None) -> builtins.list[str]:
        """Symbolic links below the directory (or of ``links``) that lead out of it."""
        return []

    def listing(self) -> tuple[dict[str, int], builtins.list[str]]:
        """:meth:`list` and :meth:`symlinks` at once (one walk of a local tree)."""
        return self.list(), self.symlinks()

    def refresh(self) -> None:
        """Forget a listing kept from an earlier call (object storage keeps one): the
        next call lists again. Nothing is kept by default."""

    def read_bytes(self, name: str) -> bytes:
        """The whole of ``name``."""
        size = self.require(name)
        return bytes(self.read_range(name, 0, size, cache=False))

    def read_json(self, name: str) -> Any:
        """``name`` parsed as UTF-8 JSON (clear errors for missing or damaged files)."""
        return parse_json(self.read_bytes(name), self.url_of(name))

    def iter_chunks(self, name: str, chunk: int = IO_CHUNK) -> Iterator[memoryview]:
        """The bytes of ``name`` in order, ``chunk`` bytes at a time (one reused buffer)."""
        size = self.require(name)
        buf = new_buffer(min(chunk, max(size, 1)))
        for start in range(0, size, chunk):
            n = min(chunk, size - start)
            yield self.read_range(name, start, n, buf[:n], cache=False)

    def require(self, name: str) -> int:
        """Size of ``name``; :class:`StoreNotFoundError` naming it if it is missing."""
        size = self.size(name)
        if size is None:
            raise StoreNotFoundError(f"{self.url_of(name)} does not exist")
        return size

    def url_of(self, name: str) -> str:
        return f"{self.url.rstrip('/')}/{name}"

    def version(self, name: str) -> str:
        """A string that changes when ``name`` is replaced (the ETag on S3)."""
        return ""

    def close(self) -> None:
        """Release file handles and threads (reopened on next use). Dropping the object
        releases them too (the backends close them from a ``weakref.finalize``)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def new_buffer(n: int) -> memoryview:
    """A fresh writable buffer of ``n`` bytes, not zero-filled (every byte is read into)."""
    return np.empty(n, dtype=np.uint8).data


def bytes_view(out: Any) -> memoryview:
    """``out`` (any buffer: bytes, a numpy array...) as a flat ``memoryview`` of bytes."""
    view = memoryview(out)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")
