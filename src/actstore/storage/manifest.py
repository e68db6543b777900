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
written; :class:`~actstore.storage.integrity.Integrity` is the read side.

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
import hashlib
import hmac
import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from .._version import __version__
from ..errors import ConfigError, CorruptStoreError
from .local import IO_CHUNK, atomic_write_bytes, load_json

MANIFEST = "actstore-manifest.json"
BLOCKS = "actstore-blocks.xxh3"
#: Files of the manifest itself (not listed in it).
OWN_FILES = (MANIFEST, BLOCKS)
#: Environment variable holding a key: manifests are then signed (HMAC-SHA256) and checked.
KEY_ENV = "ACTSTORE_MANIFEST_KEY"
VERSION = 1

BLOCKS_MAGIC = b"ACTBLK\x00\x01"
WHOLE_BLOCKS_BYTES = 64 << 20
"""Largest ``actstore-blocks.xxh3`` a reader loads whole on first use (8 bytes per block)."""


def store_id_of(record: Any) -> str:
    """A store's id: 16 hex digits of the xxh3-64 of its capture record (deterministic, so a
    resumed or merged store gets the id an uninterrupted one gets)."""
    return xxhash.xxh3_64_hexdigest(_canonical(record))


def _canonical(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str).encode()


def block_keys(store_id: str, name: str, first: int, count: int) -> np.ndarray:
    """The keys of blocks ``first .. first + count - 1`` of file ``name``: one per block,
    derived from the store, the file and the block's index (its identity). A block's digest
    is ``xxh3_64(bytes) ^ key``, so a copy or merge that renames files re-keys digests
    without reading data (:func:`rekey`)."""
    key = int(store_id, 16)
    prefix = name.encode() + b"\x00"
    return np.fromiter(
        (
            xxhash.xxh3_64_intdigest(prefix + str(i).encode(), seed=key)
            for i in range(first, first + count)
        ),
        dtype="<u8",
        count=count,
    )


def keyed_digest(store_id: str, name: str, data: Any, *, plain: int | None = None) -> int:
    """The keyed digest of ``data`` held whole as block 0 of ``name``: the digest the root
    manifest records for a one-block file, and the one a format keeps for a file or chunk
    it lists itself (an Activault megabatch file, a zarr chunk). ``plain``: the unkeyed
    xxh3-64 of ``data`` when the caller has it already."""
    if plain is None:
        plain = xxhash.xxh3_64_intdigest(data)
    return plain ^ int(block_keys(store_id, name, 0, 1)[0])


def present_digest(store_id: str, name: str, data: Any, *, plain: int | None = None) -> int:
    """:func:`keyed_digest`, never 0: where a table of digests marks a chunk that was not
    stored with 0 (zarr's chunk digests), a stored chunk whose digest is 0 records 1."""
    return keyed_digest(store_id, name, data, plain=plain) or 1


def digest_ranges(
    view: memoryview, bounds: Sequence[tuple[int, int]], keys: np.ndarray
) -> np.ndarray:
    """Keyed digests of ``view[o : o + n]`` for each ``(o, n)`` of ``bounds``."""
    plain = np.fromiter(
        (xxhash.xxh3_64_intdigest(view[o : o + n]) for o, n in bounds),
        dtype="<u8",
        count=len(bounds),
    )
    return plain ^ keys


def digest_blocks(store_id: str, name: str, blocks: Sequence[memoryview], first: int) -> np.ndarray:
    """Keyed digests of consecutive blocks of file ``name`` held in separate buffers, the
    first being block ``first`` (one call for all of a write's blocks)."""
    plain = np.fromiter(
        (xxhash.xxh3_64_intdigest(b) for b in blocks), dtype="<u8", count=len(blocks)
    )
    return plain ^ block_keys(store_id, name, first, len(blocks))


def rekey(digests: np.ndarray, old: tuple[str, str], new: tuple[str, str]) -> np.ndarray:
    """Digests of a file's blocks keyed for ``old = (store_id, name)`` re-keyed for ``new``
    (the same bytes published elsewhere, e.g. by a merge)."""
    n = len(digests)
    return digests ^ block_keys(*old, 0, n) ^ block_keys(*new, 0, n)


def file_digest(digests: np.ndarray) -> str:
    """A file's digest: the xxh3-128 of its block digests (little-endian uint64)."""
    return xxhash.xxh3_128_hexdigest(np.ascontiguousarray(digests, dtype="<u8").tobytes())


# ---------------------------------------------------------------------- the manifest


@dataclass(frozen=True)
class FileEntry:
    """One file of a store: its size, how it splits into blocks, and its digest."""

    size: int
    digest: str
    """xxh3-128 of the file's block digests."""
    unit: int = 0
    """Fixed block size in bytes (the last block may be shorter); 0: see :attr:`ranges`, or
    the whole file is one block."""
    ranges: tuple[tuple[int, int], ...] | None = None
    """Explicit blocks ``(offset, length)`` tiling the file, when read units are not a fixed
    size (the values of one Arrow record batch column; see :func:`tile`)."""
    at: int = -1
    """Index of the first block digest in ``actstore-blocks.xxh3`` (-1: one block, whose
    digest :attr:`single` holds)."""
    single: str = ""
    """The block digest (16 hex) of a one-block file."""

    @property
    def n_blocks(self) -> int:
        if self.ranges is not None:
            return len(self.ranges)
        if self.unit:
            return max(1, math.ceil(self.size / self.unit))
        return 1

    def bounds(self, first: int = 0, count: int | None = None) -> list[tuple[int, int]]:
        """``(offset, length)`` of blocks ``first .. first + count - 1`` (default: all), in
        order; O(count), so a read of a few blocks of a large file costs a few tuples."""
        stop = self.n_blocks if count is None else min(first + count, self.n_blocks)
        if self.ranges is not None:
            return list(self.ranges[first:stop])
        if self.unit:
            return [
                (o, min(self.unit, self.size - o))
                for o in range(first * self.unit, stop * self.unit, self.unit)
            ]
        return [(0, self.size)][first:stop]

    @cached_property
    def starts(self) -> np.ndarray:
        """Start offsets of the explicit :attr:`ranges` (computed once per entry)."""
        return np.array([o for o, _ in self.ranges or ()], dtype=np.int64)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"size": self.size, "digest": self.digest}
        if self.unit:
            out["unit"] = self.unit
        if self.ranges is not None:
            out["ranges"] = [list(r) for r in self.ranges]
        if self.at >= 0:
            out["at"] = self.at
        else:
            out["xxh3"] = self.single
        return out

    @classmethod
    def from_dict(cls, doc: Any, source: str) -> FileEntry:
        try:
            ranges = doc.get("ranges")
            entry = cls(
                size=int(doc["size"]),
                digest=str(doc["digest"]),
                unit=int(doc.get("unit", 0)),
                ranges=None if ranges is None else tuple((int(o), int(n)) for o, n in ranges),
                at=int(doc.get("at", -1)),
                single=str(doc.get("xxh3", "")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise CorruptStoreError(f"{source} has a malformed file entry ({err!r})") from err
        if entry.size < 0 or entry.unit < 0 or (entry.at < 0 and len(entry.single) != 16):
            raise CorruptStoreError(f"{source} has a malformed file entry {doc!r}")
        return entry


@dataclass(frozen=True)
class RootManifest:
    """What ``actstore-manifest.json`` holds."""

    format: str
    store_id: str
    record: str
    """Digest of the capture record (a rerun with an equal one finds the store complete)."""
    summary: dict[str, Any]
    """What a reader trusts from metadata, checked against what it parses on open."""
    files: dict[str, FileEntry]
    blocks: str = ""
    """xxh3-128 of ``actstore-blocks.xxh3`` ("" when there is none)."""
    skip: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Folders whose files a format checks through a digest file of its own (zarr chunk
    directories, which can hold millions of files) with how many files and bytes they hold:
    their files are not listed one by one, but a listing that counts otherwise is refused."""
    nested: tuple[str, ...] = ()
    """Folders holding stores with root manifests of their own (a zarr run's shards)."""
    created_by: str = f"actstore {__version__}"

    def body(self) -> dict[str, Any]:
        return {
            "actstore": "root manifest",
            "version": VERSION,
            "format": self.format,
            "store_id": self.store_id,
            "record": self.record,
            "summary": self.summary,
            "skip": {k: list(v) for k, v in sorted(self.skip.items())},
            "nested": list(self.nested),
            "blocks": self.blocks,
            "created_by": self.created_by,
            "files": {n: e.to_dict() for n, e in sorted(self.files.items())},
        }

    def to_bytes(self) -> bytes:
        body = self.body()
        body["self"] = xxhash.xxh3_128_hexdigest(_canonical(body))
        key = manifest_key()
        if key is not None:
            body["hmac"] = hmac.new(key, _canonical(body), hashlib.sha256).hexdigest()
        return _layout(body)

    @staticmethod
    def layout_fault(data: bytes, source: str) -> str:
        """What is wrong with the bytes of manifest ``data`` (from ``source``) beyond what
        its own digest covers (the parsed JSON): "" when they are exactly the bytes a writer
        lays that JSON out as, else a fault. A whitespace or key-order change leaves every
        value, and the digest, as they were; ``verify`` still reports it, since the store's
        content changed."""
        try:
            doc = load_json(data)
        except ValueError:
            return ""  # not JSON: the manifest's own check says so
        if _layout(doc) == data:
            return ""
        return (
            f"{source} is not laid out as actstore writes it (whitespace, key order or number "
            "spelling changed, same values): the manifest was edited; restore it or "
            "re-create the store"
        )

    @classmethod
    def from_bytes(cls, data: bytes, source: str) -> RootManifest:
        try:
            doc = load_json(data)
        except ValueError as err:
            raise CorruptStoreError(
                f"{source} is not valid JSON ({err}); the store's root manifest is damaged: "
                "restore it or re-create the store"
            ) from err
        if not isinstance(doc, dict) or doc.get("actstore") != "root manifest":
            raise CorruptStoreError(f"{source} is not an actstore root manifest")
        signature = doc.pop("hmac", None)
        own = doc.pop("self", None)
        if own != xxhash.xxh3_128_hexdigest(_canonical(doc)):
            raise CorruptStoreError(
                f"{source} does not match its own digest: the root manifest was edited or "
                "damaged; restore it or re-create the store"
            )
        key = manifest_key()
        if key is not None:
            signed = {**doc, "self": own}
            want = hmac.new(key, _canonical(signed), hashlib.sha256).hexdigest()
            if not isinstance(signature, str) or not hmac.compare_digest(
                signature.encode("utf-8", "surrogatepass"), want.encode()
            ):
                raise CorruptStoreError(
                    f"{source} is not signed with the key in ${KEY_ENV}: the store was not "
                    "written with that key, or its manifest was rewritten; do not trust it"
                )
        version = doc.get("version", 0)
        if not isinstance(version, int) or isinstance(version, bool):
            raise CorruptStoreError(
                f"{source} is malformed (version {version!r} is not an integer); restore it or "
                "re-create the store"
            )
        if version > VERSION:
            raise CorruptStoreError(
                f"{source} is manifest version {version}; upgrade actstore to read it"
            )
        try:
            manifest = cls(
                format=str(doc["format"]),
                store_id=str(doc["store_id"]),
                record=str(doc["record"]),
                summary=dict(doc["summary"]),
                files={
                    str(n): FileEntry.from_dict(e, f"{source} ({n})")
                    for n, e in doc["files"].items()
                },
                blocks=str(doc.get("blocks", "")),
                skip={str(k): (int(v[0]), int(v[1])) for k, v in doc.get("skip", {}).items()},
                nested=tuple(str(s) for s in doc.get("nested", ())),
                created_by=str(doc.get("created_by", "")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise CorruptStoreError(
                f"{source} is malformed ({err!r}); restore it or re-create the store"
            ) from err
        bad = _not_hex(manifest)
        if bad:
            raise CorruptStoreError(
                f"{source} is malformed ({bad}); restore it or re-create the store"
            )
        return manifest


def _layout(doc: Any) -> bytes:
    """The bytes of a root manifest holding ``doc``, as :meth:`RootManifest.to_bytes` writes
    them."""
    return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()


def _is_hex(text: str, length: int) -> bool:
    return len(text) == length and all(c in "0123456789abcdef" for c in text)


def _not_hex(m: RootManifest) -> str:
    """What of ``m`` that readers parse as hex digits is not (empty when all is well)."""
    if not _is_hex(m.store_id, 16):
        return f"store_id {m.store_id!r} is not 16 hex digits"
    if m.blocks and not _is_hex(m.blocks, 32):
        return f"blocks {m.blocks!r} is not 32 hex digits"
    for name, e in m.files.items():
        if not _is_hex(e.digest, 32):
            return f"{name}: digest {e.digest!r} is not 32 hex digits"
        if e.at < 0 and not _is_hex(e.single, 16):
            return f"{name}: xxh3 {e.single!r} is not 16 hex digits"
    return ""


def manifest_key() -> bytes | None:
    """The signing key from ``$ACTSTORE_MANIFEST_KEY`` (None when unset). Set but empty is
    refused (:class:`ConfigError`): an empty key would sign nothing, and reading it as unset
    would turn the signature checks off without a word.

    Example:
        >>> import os
        >>> os.environ[KEY_ENV] = ""
        >>> manifest_key()
        Traceback (most recent call last):
        ...
        actstore.errors.ConfigError: ACTSTORE_MANIFEST_KEY is set but empty, which would turn manifest signatures off; set it to your key, or unset it (unset ACTSTORE_MANIFEST_KEY) to read and write without signatures
        >>> del os.environ[KEY_ENV]
    """
    text = os.environ.get(KEY_ENV)
    if text is None:
        return None
    if not text:
        raise ConfigError(
            f"{KEY_ENV} is set but empty, which would turn manifest signatures off; set it to "
            f"your key, or unset it (unset {KEY_ENV}) to read and write without signatures"
        )
    return text.encode("utf-8", "surrogateescape")


# ---------------------------------------------------------------------- writing


class KeyedHasher:
    """Streaming xxh3-64 of one block, keyed at the end."""

    def __init__(self, key: int) -> None:
        self.key, self.h = key, xxhash.xxh3_64()

    def update(self, data: Any) -> None:
        self.h.update(data)

    def intdigest(self) -> int:
        return self.h.intdigest() ^ self.key


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


def skipped(name: str, skip: Iterable[str]) -> str:
    """The folder of ``skip`` (those a format checks through its own digest file) holding
    ``name`` when it is a chunk file there (not a ``.zarray``-like metadata file), else ""."""
    folder, _, base = name.rpartition("/")
    if base.startswith("."):
        return ""
    return next((s for s in skip if (folder + "/").startswith(s)), "")


def jsonable(doc: Any) -> Any:
    return json.loads(json.dumps(doc, default=str))


__all__ = [
    "BLOCKS",
    "BLOCKS_MAGIC",
    "MANIFEST",
    "BlockHasher",
    "FileEntry",
    "ManifestBuilder",
    "RootManifest",
    "block_keys",
    "file_digest",
    "hash_file_blocks",
    "hash_ranges",
    "jsonable",
    "rekey",
    "skipped",
    "store_id_of",
]
