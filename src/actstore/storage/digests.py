"""The keyed block digest, the one formula behind every digest a root manifest records
(:mod:`actstore.storage.manifest`) and a format keeps for files it lists itself.

A block's digest is the xxh3-64 of its bytes XORed with a key derived from the store id,
the file name and the block index (:func:`block_keys`); a file's digest is the xxh3-128 of
its block digests (:func:`file_digest`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash


def store_id_of(record: Any) -> str:
    """A store's id: 16 hex digits of the xxh3-64 of its capture record (deterministic, so a
    resumed or merged store gets the id an uninterrupted one gets)."""
    return xxhash.xxh3_64_hexdigest(canonical_json(record))


def canonical_json(doc: Any) -> bytes:
    """``doc`` as the bytes its digests are taken over: JSON, keys sorted, no spaces."""
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


class KeyedHasher:
    """Streaming xxh3-64 of one block, keyed at the end."""

    def __init__(self, key: int) -> None:
        self.key, self.h = key, xxhash.xxh3_64()

    def update(self, data: Any) -> None:
        self.h.update(data)

    def intdigest(self) -> int:
        return self.h.intdigest() ^ self.key
