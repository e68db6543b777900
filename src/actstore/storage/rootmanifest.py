"""What ``actstore-manifest.json`` holds: :class:`RootManifest` and its :class:`FileEntry`
items, the names of the manifest's own files, and the signing key
(``$ACTSTORE_MANIFEST_KEY``). :mod:`actstore.storage.manifest` writes it;
:mod:`actstore.storage.integrity` checks a store against it."""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import xxhash

from .._version import __version__
from ..errors import ConfigError, CorruptStoreError
from .digests import canonical_json
from .local import load_json

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
        body["self"] = xxhash.xxh3_128_hexdigest(canonical_json(body))
        key = manifest_key()
        if key is not None:
            body["hmac"] = hmac.new(key, canonical_json(body), hashlib.sha256).hexdigest()
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
        if own != xxhash.xxh3_128_hexdigest(canonical_json(doc)):
            raise CorruptStoreError(
                f"{source} does not match its own digest: the root manifest was edited or "
                "damaged; restore it or re-create the store"
            )
        key = manifest_key()
        if key is not None:
            signed = {**doc, "self": own}
            want = hmac.new(key, canonical_json(signed), hashlib.sha256).hexdigest()
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


def skipped(name: str, skip: Iterable[str]) -> str:
    """The folder of ``skip`` (those a format checks through its own digest file) holding
    ``name`` when it is a chunk file there (not a ``.zarray``-like metadata file), else ""."""
    folder, _, base = name.rpartition("/")
    if base.startswith("."):
        return ""
    return next((s for s in skip if (folder + "/").startswith(s)), "")


def jsonable(doc: Any) -> Any:
    return json.loads(json.dumps(doc, default=str))
