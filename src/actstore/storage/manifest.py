"""The root manifest: one file per store, written last, that every byte served is checked
against.

``actstore-manifest.json`` lists every file of the store with its size and digest, the
digest of what a reader trusts from metadata (:attr:`RootManifest.summary`: sites in order,
shapes, counts, dtype), and where each file's block digests lie in ``actstore-blocks.xxh3``.
A *block* is the unit a reader reads at once (one example of one layer, one Arrow record
batch column, one zarr chunk, one whole shard). Its digest is xxh3-64 **keyed by its
identity**: the xxh3-64 of its bytes XORed with a key derived from the store id, the file
name and the block index (:func:`block_keys`), so a block moved within a file, a file
renamed or swapped, or a file
copied in from another store fails exactly like a flipped byte. A file's digest is the
xxh3-128 of its block digests, so one sequential pass checks both.

:class:`ManifestBuilder` is the write side, fed by :class:`BlockHasher` as files are
written; :class:`~actstore.storage.integrity.Integrity` is the read side. What the manifest
holds (:class:`RootManifest`, :class:`FileEntry`) is :mod:`actstore.storage.rootmanifest`'s,
the keyed digest :mod:`actstore.storage.digests`'; both are importable from here.

Example:
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / "data.bin").write_bytes(bytes(range(256)) * 16)
    >>> builder = ManifestBuilder(format="doc", store_id=store_id_of({"a": 1}), record={"a": 1})
    >>> builder.add_file(d, "data.bin", unit=1024)
    >>> builder.write(d, summary={"rows": 4})
    >>> sorted(RootManifest.from_bytes((d / MANIFEST).read_bytes(), MANIFEST).files)
    ['data.bin']
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from ..errors import CorruptStoreError
from .digests import (
    KeyedHasher,
    block_keys,
    digest_blocks,
    digest_ranges,
    file_digest,
    keyed_digest,
    present_digest,
    rekey,
    store_id_of,
)
from .local import IO_CHUNK, atomic_write_bytes
from .rootmanifest import (
    BLOCKS,
    BLOCKS_MAGIC,
    KEY_ENV,
    MANIFEST,
    OWN_FILES,
    VERSION,
    WHOLE_BLOCKS_BYTES,
    FileEntry,
    RootManifest,
    jsonable,
    manifest_key,
    skipped,
)

# ---------------------------------------------------------------------- writing


class BlockHasher:
    """Keyed block digests of one file, fed its bytes in order as they are written.

    ``unit``: fixed block size (0: the whole file is one block).
    """

    def __init__(self, store_id: str, name: str, unit: int = 0) -> None:
        self.store_id, self.name, self.unit = store_id, name, unit
        self.size = 0
        self._done: list[np.ndarray] = []
        self._n_done = 0
        self._partial: Any = None
        self._fill = 0

    def _hasher(self, index: int) -> Any:
        return KeyedHasher(int(block_keys(self.store_id, self.name, index, 1)[0]))

    def update(self, data: bytes | memoryview | np.ndarray) -> None:
        # numpy's stubs declare ndarray.__buffer__ (PEP 688) only for Python >= 3.12
        view = memoryview(data).cast("B")  # type: ignore[arg-type]
        self.size += len(view)
        if not self.unit:
            if self._partial is None:
                self._partial = self._hasher(0)
            self._partial.update(view)
            return
        pos = 0
        if self._fill:
            take = min(self.unit - self._fill, len(view))
            self._partial.update(view[:take])
            self._fill += take
            pos = take
            if self._fill == self.unit:
                self._done.append(np.array([self._partial.intdigest()], dtype="<u8"))
                self._n_done += 1
                self._partial, self._fill = None, 0
        whole = (len(view) - pos) // self.unit
        if whole:
            bounds = [(pos + i * self.unit, self.unit) for i in range(whole)]
            keys = block_keys(self.store_id, self.name, self._n_done, whole)
            self._done.append(digest_ranges(view, bounds, keys))
            self._n_done += whole
            pos += whole * self.unit
        if pos < len(view):
            self._partial = self._hasher(self._n_done)
            self._partial.update(view[pos:])
            self._fill = len(view) - pos

    def digests(self) -> np.ndarray:
        """Digests of every block (the last, short one included)."""
        if not self.unit:
            return np.array([(self._partial or self._hasher(0)).intdigest()], dtype="<u8")
        parts = list(self._done)
        if self._fill:
            parts.append(np.array([self._partial.intdigest()], dtype="<u8"))
        elif self.size == 0:
            parts.append(np.array([self._hasher(0).intdigest()], dtype="<u8"))
        return np.concatenate(parts)

    def entry(self) -> tuple[FileEntry, np.ndarray]:
        """The file's manifest entry and its block digests."""
        digests = self.digests()
        return _entry(self.size, digests, unit=self.unit), digests


def file_entry(size: int, digests: np.ndarray, *, unit: int = 0) -> FileEntry:
    """The manifest entry of a file of ``size`` bytes in blocks of ``unit`` (0: one
    block) whose block digests are ``digests``."""
    return _entry(size, digests, unit=unit)


def block_digests(
    store_id: str,
    name: str,
    data: memoryview | bytes | None,
    unit: int,
    first: int = 0,
    *,
    size: int = 0,
) -> np.ndarray:
    """Keyed digests of the blocks of ``data`` (blocks of ``unit`` bytes, the last may be
    shorter), which starts at block ``first`` of file ``name``. ``data=None``: ``size``
    zero bytes (a sparse extension), digested without materializing them past one block."""
    if data is None:
        count = -(-size // unit) if size else 0
        if not count:
            return np.zeros(0, "<u8")
        zeros = bytes(min(unit, size))
        whole = xxhash.xxh3_64_intdigest(zeros)
        plain = np.full(count, whole, dtype="<u8")
        tail = size - (count - 1) * unit
        if tail != unit:
            plain[-1] = xxhash.xxh3_64_intdigest(zeros[:tail])
        return plain ^ block_keys(store_id, name, first, count)
    view = memoryview(data).cast("B")
    n = len(view)
    bounds = [(o, min(unit, n - o)) for o in range(0, n, unit)] or [(0, 0)]
    return digest_ranges(view, bounds, block_keys(store_id, name, first, len(bounds)))


def _entry(size: int, digests: np.ndarray, *, unit: int = 0, ranges=None) -> FileEntry:
    single = f"{int(digests[0]):016x}" if len(digests) == 1 and ranges is None else ""
    return FileEntry(
        size=size,
        digest=file_digest(digests),
        unit=unit if len(digests) > 1 or ranges is not None else 0,
        ranges=None if ranges is None else tuple((int(o), int(n)) for o, n in ranges),
        at=-1 if single else 0,
        single=single,
    )


def tile(ranges: Sequence[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """``ranges`` (ascending, disjoint) with the bytes between and around them added as
    blocks of their own, so the blocks cover the whole file.

    Example:
        >>> tile([(4, 2), (8, 2)], 12)
        [(0, 4), (4, 2), (6, 2), (8, 2), (10, 2)]
    """
    out, pos = [], 0
    for o, n in sorted((int(o), int(n)) for o, n in ranges):
        if o < pos or o + n > size:
            raise CorruptStoreError(
                f"block ranges overlap or pass the end of the file: {(o, n)} of {size} bytes"
            )
        if o > pos:
            out.append((pos, o - pos))
        out.append((o, n))
        pos = o + n
    if pos < size or not out:
        out.append((pos, size - pos))
    return out


def hash_ranges(
    store_id: str, name: str, data: memoryview | bytes, ranges: Sequence[tuple[int, int]]
) -> tuple[FileEntry, np.ndarray]:
    """Entry and digests of a file (all of it in ``data``) whose read units are the byte
    ``ranges`` given; the bytes between them become blocks too (:func:`tile`)."""
    view = memoryview(data).cast("B")
    bounds = tile(ranges, len(view))
    digests = digest_ranges(view, bounds, block_keys(store_id, name, 0, len(bounds)))
    return _entry(len(view), digests, ranges=bounds), digests


def hash_file_blocks(
    store_id: str, path: str | os.PathLike, name: str, unit: int = 0
) -> tuple[FileEntry, np.ndarray]:
    """Entry and digests of the file at ``path`` (to be published as ``name``), read once."""
    hasher = BlockHasher(store_id, name, unit)
    chunk = IO_CHUNK if not unit else max(unit, IO_CHUNK // unit * unit)
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            hasher.update(view[:n])
    return hasher.entry()


class ManifestBuilder:
    """Collects file entries and block digests, then writes the blocks file and the
    manifest (last) into a store directory."""

    def __init__(self, *, format: str, store_id: str, record: Any) -> None:
        self.format, self.store_id = format, store_id
        self.record = record if isinstance(record, str) else store_id_of(record)
        self.files: dict[str, FileEntry] = {}
        self._digests: dict[str, np.ndarray] = {}
        self.skip: dict[str, tuple[int, int]] = {}
        self.nested: list[str] = []

    def add(self, name: str, entry: FileEntry, digests: np.ndarray) -> None:
        self.files[name] = entry
        self._digests[name] = np.asarray(digests, dtype="<u8")

    def add_bytes(self, name: str, data: bytes | memoryview) -> None:
        """Add a one-block file from its bytes."""
        hasher = BlockHasher(self.store_id, name)
        hasher.update(data)
        self.add(name, *hasher.entry())

    def add_file(
        self, directory: str | os.PathLike, name: str, *, unit: int = 0, ranges=None
    ) -> None:
        """Hash ``directory/name`` (fixed blocks of ``unit`` bytes, or ``ranges``) and add it."""
        path = Path(directory) / name
        if ranges is not None:
            entry, digests = hash_ranges(self.store_id, name, path.read_bytes(), ranges)
        else:
            entry, digests = hash_file_blocks(self.store_id, path, name, unit)
        self.add(name, entry, digests)

    def add_tree(
        self, directory: str | os.PathLike, *, skip: Iterable[str] = (), exclude: Iterable[str] = ()
    ) -> None:
        """Add every file below ``directory`` not yet added (one block each), leaving out
        the manifest's own files, the folders of ``skip`` (recorded: their files are
        checked another way) and the top-level names of ``exclude`` (not part of the store)."""
        root = Path(directory)
        for folder in skip:
            self.skip.setdefault(folder.strip("/") + "/", (0, 0))
        excluded = set(exclude)
        folders = [""]  # relative, "" or ending in "/"; walked in sorted order
        while folders:
            prefix = folders.pop()
            with os.scandir(root / prefix if prefix else root) as found:
                entries = sorted(found, key=lambda e: e.name)
            below = []
            for entry in entries:
                rel = prefix + entry.name
                if entry.is_dir():  # a link to a folder is not walked (as os.walk)
                    if not entry.is_symlink() and (prefix or entry.name not in excluded):
                        below.append(rel + "/")
                    continue
                folder = skipped(rel, self.skip)
                if folder:  # a chunk file: counted (its size from the directory scan)
                    count, size = self.skip[folder]
                    self.skip[folder] = (count + 1, size + entry.stat().st_size)
                elif rel not in self.files and rel not in OWN_FILES and rel not in excluded:
                    self.add_file(root, rel)
            folders.extend(reversed(below))

    def build(self, *, summary: dict[str, Any]) -> tuple[bytes, bytes | None]:
        """The manifest's bytes and the blocks file's (None when every file is one block),
        for a store written through an object store."""
        files, blob, at = {}, [BLOCKS_MAGIC], 0
        for name in sorted(self.files):
            entry, digests = self.files[name], self._digests[name]
            if entry.at >= 0:
                entry = dataclasses.replace(entry, at=at)
                blob.append(digests.tobytes())
                at += len(digests)
            files[name] = entry
        data = b"".join(blob) if at else None
        manifest = RootManifest(
            format=self.format,
            store_id=self.store_id,
            record=self.record,
            summary=jsonable(summary),
            files=files,
            blocks="" if data is None else xxhash.xxh3_128_hexdigest(data),
            skip=dict(self.skip),
            nested=tuple(self.nested),
        )
        return manifest.to_bytes(), data

    def write(self, directory: str | os.PathLike, *, summary: dict[str, Any]) -> None:
        """Write ``actstore-blocks.xxh3`` (when any file has several blocks), then the
        manifest: the store's last file."""
        manifest, blocks = self.build(summary=summary)
        if blocks is not None:
            atomic_write_bytes(Path(directory) / BLOCKS, blocks)
        atomic_write_bytes(Path(directory) / MANIFEST, manifest)


__all__ = [
    "BLOCKS",
    "BLOCKS_MAGIC",
    "KEY_ENV",
    "MANIFEST",
    "OWN_FILES",
    "VERSION",
    "WHOLE_BLOCKS_BYTES",
    "BlockHasher",
    "FileEntry",
    "KeyedHasher",
    "ManifestBuilder",
    "RootManifest",
    "block_keys",
    "digest_blocks",
    "digest_ranges",
    "file_digest",
    "hash_file_blocks",
    "hash_ranges",
    "jsonable",
    "keyed_digest",
    "manifest_key",
    "present_digest",
    "rekey",
    "skipped",
    "store_id_of",
]
