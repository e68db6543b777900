"""Per-block xxh3 checksums of data files, kept in sidecar files the formats' peers ignore.

A data file ``NAME`` gets a sidecar ``NAME.xxh3``: the 8 bytes ``ACTXXH3\\x01``, the block
size ``unit`` (little-endian uint64), then one xxh3-64 digest (little-endian uint64) per
``unit`` bytes of the file, the last block possibly shorter. Writers feed the bytes they
write to a :class:`BlockHasher` (no second pass over the data); readers call
:meth:`BlockSums.check` on every range they read, right after the bytes arrive, so any
flipped, zeroed or truncated block raises :class:`CorruptStoreError` naming the file,
the block and its byte range.

Example:
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> data = bytes(range(256)) * 64
    >>> _ = (d / "a.bin").write_bytes(data)
    >>> h = BlockHasher(4096); h.update(data); _ = h.write_sidecar(d / "a.bin")
    >>> BlockSums(d).check("a.bin", 4096, data[4096:8192])
"""

from __future__ import annotations

import logging
import math
import os
import struct
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import xxhash

if TYPE_CHECKING:
    from .files import StoreFiles

from ..errors import CorruptStoreError, StoreNotFoundError
from .local import IO_CHUNK, atomic_write_bytes

log = logging.getLogger(__name__)

SUFFIX = ".xxh3"
MAGIC = b"ACTXXH3\x01"
_HEADER = len(MAGIC) + 8
_digest = xxhash.xxh3_64_intdigest


def sidecar_name(name: str) -> str:
    """The sidecar file name of data file ``name``."""
    return name + SUFFIX


def digest_blocks(data: bytes | memoryview | np.ndarray, unit: int) -> np.ndarray:
    """xxh3-64 of each ``unit`` bytes of ``data`` (the last piece may be shorter)."""
    view = memoryview(data).cast("B")
    return np.fromiter(
        (_digest(view[i : i + unit]) for i in range(0, len(view), unit)),
        dtype="<u8",
        count=math.ceil(len(view) / unit),
    )


class BlockHasher:
    """Digests a file's bytes as they are written, one xxh3-64 per ``unit`` bytes."""

    def __init__(self, unit: int) -> None:
        if unit < 1:
            raise ValueError(f"block size must be >= 1, not {unit}")
        self.unit = unit
        self.size = 0
        self._done: list[np.ndarray] = []
        self._partial = xxhash.xxh3_64()
        self._fill = 0

    def update(self, data: bytes | memoryview | np.ndarray) -> None:
        view = memoryview(data).cast("B")
        self.size += len(view)
        pos = 0
        if self._fill:
            take = min(self.unit - self._fill, len(view))
            self._partial.update(view[:take])
            self._fill += take
            pos = take
            if self._fill == self.unit:
                self._done.append(np.array([self._partial.intdigest()], dtype="<u8"))
                self._partial.reset()
                self._fill = 0
        whole = (len(view) - pos) // self.unit * self.unit
        if whole:
            self._done.append(digest_blocks(view[pos : pos + whole], self.unit))
            pos += whole
        if pos < len(view):
            self._partial.update(view[pos:])
            self._fill = len(view) - pos

    def update_blocks(self, views: list[memoryview]) -> None:
        """:meth:`update` with the bytes of ``views`` in order; one digest per view when
        each is exactly one block and none is pending (no copy, no concatenation)."""
        if self._fill or any(len(v) != self.unit for v in views):
            for view in views:
                self.update(view)
            return
        self._done.append(np.fromiter(map(_digest, views), dtype="<u8", count=len(views)))
        self.size += self.unit * len(views)

    def digests(self) -> np.ndarray:
        """Digests of every block so far (the last, unfinished block included)."""
        tail = [np.array([self._partial.intdigest()], dtype="<u8")] if self._fill else []
        parts = self._done + tail
        return np.concatenate(parts) if parts else np.empty(0, dtype="<u8")

    def sidecar_bytes(self) -> bytes:
        return MAGIC + struct.pack("<Q", self.unit) + self.digests().tobytes()

    def write_sidecar(self, data_path: str | os.PathLike) -> Path:
        """Write ``<data_path>.xxh3`` atomically; returns its path."""
        path = Path(str(data_path) + SUFFIX)
        atomic_write_bytes(path, self.sidecar_bytes())
        return path


def hash_blocks_of_file(path: str | os.PathLike, unit: int) -> np.ndarray:
    """Block digests of a whole file, read sequentially."""
    hasher = BlockHasher(unit)
    chunk = max(unit, IO_CHUNK // unit * unit)
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            hasher.update(view[:n])
    return hasher.digests()


def parse_sidecar(raw: bytes, data_size: int, source: str) -> tuple[int, np.ndarray]:
    """``(unit, digests)`` from sidecar bytes, checked against the data file's size."""
    if len(raw) < _HEADER or raw[: len(MAGIC)] != MAGIC or (len(raw) - _HEADER) % 8:
        raise CorruptStoreError(
            f"{source} is not a block checksum file (bad header or length); restore it "
            "or re-capture"
        )
    (unit,) = struct.unpack_from("<Q", raw, len(MAGIC))
    digests = np.frombuffer(raw, dtype="<u8", offset=_HEADER)
    if unit < 1 or len(digests) != math.ceil(data_size / unit):
        raise CorruptStoreError(
            f"{source} holds {len(digests)} block checksums of {unit} bytes, but its data "
            f"file has {data_size} bytes; the file was truncated, extended or replaced"
        )
    return int(unit), digests


class BlockSums:
    """The block checksums of the files in one store directory, loaded lazily.

    ``required``: the store says it has block checksums (its manifest lists them), so a
    missing sidecar is corruption. Otherwise (stores written by other tools) files without
    a sidecar are read unverified and one warning says so. ``enabled=False`` checks nothing.
    """

    def __init__(
        self, root: str | os.PathLike | StoreFiles, *, enabled: bool = True, required: bool = False
    ):
        from .files import LocalFiles, StoreFiles

        self.files = root if isinstance(root, StoreFiles) else LocalFiles(root)
        self.enabled = enabled
        self.required = required
        self._sums: dict[str, tuple[int, np.ndarray] | None] = {}
        self._lock = threading.Lock()
        self._warned = False

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_sums": {}, "_lock": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def sums(self, name: str) -> tuple[int, np.ndarray] | None:
        """``(unit, digests)`` of data file ``name``, or None where it has no sidecar."""
        found = self._sums.get(name, False)
        if found is not False:
            return found
        side = sidecar_name(name)
        if self.files.size(side) is None:
            if self.required:
                raise CorruptStoreError(
                    f"{self.files.url_of(side)} is missing: the store lists block checksums for "
                    f"{name} but the "
                    "file is gone; restore it or re-capture"
                ) from None
            with self._lock:
                if not self._warned:
                    self._warned = True
                    log.warning(
                        "%s has no block checksums (written by another tool or an older "
                        "actstore): its reads are not verified",
                        self.files.url,
                    )
            found = None
        else:
            size = self.files.size(name)
            if size is None:
                raise StoreNotFoundError(
                    f"{self.files.url_of(name)} is missing; restore it or re-capture"
                )
            found = parse_sidecar(self.files.read_bytes(side), size, self.files.url_of(side))
        with self._lock:
            return self._sums.setdefault(name, found)

    def check(self, name: str, offset: int, data: bytes | memoryview | np.ndarray) -> None:
        """Raise :class:`CorruptStoreError` unless ``data``, read from file ``name`` at byte
        ``offset``, matches its block checksums. The range must start on a block boundary
        and end on one or at the end of the file."""
        if not self.enabled:
            return
        found = self.sums(name)
        if found is None:
            return
        unit, digests = found
        view = memoryview(data).cast("B")
        first, misaligned = divmod(offset, unit)
        last = first + math.ceil(len(view) / unit)
        if misaligned or last > len(digests):
            raise CorruptStoreError(
                f"{self.files.url_of(name)}: bytes {offset}-{offset + len(view)} are not whole "
                f"checksum blocks of {unit} bytes within the file's {len(digests)} blocks"
            )
        got = digest_blocks(view, unit)
        bad = np.flatnonzero(got != digests[first:last])
        if len(bad):
            block = first + int(bad[0])
            raise CorruptStoreError(
                f"{self.files.url_of(name)}: block {block} (bytes {block * unit}-"
                f"{block * unit + min(unit, len(view) - int(bad[0]) * unit)}) fails its xxh3 "
                "checksum: the stored data was changed or damaged; restore the file or "
                "re-capture (verify_reads=False reads it anyway)"
            )
