"""What a store's identity says of its data: a digest of exactly the examples it was made
from, computed from what capture reads anyway.

- Packed text (every text kind: .txt, .jsonl, token files, datasets, the embedded corpus):
  the token ids of the packed contexts, int32 ``[n, T]``, hashed once as the packer
  hands them over (``token_digest``). They are what the model sees and what ``tokens.bin``
  holds, so any edit of the corpus that changes one stored token changes the digest, and
  an edit that changes none (a line after the budget) does not.
- Image folders: the bytes of each image file used, with its path under the root, in
  example order (``image_digest``), read once when the source opens, before the store is
  named (the operating system's cache then serves the capture's own reads).
- Images of a ``datasets`` dataset: the bytes (or, for decoded images, the pixels) of each
  example's image.
- Prompt/response samples: the token ids of each prompt and response (``sample_digest``).

Every digest is xxh3-128 (hex), taken over a layout that includes lengths, so two
different example sequences never hash the same bytes.

Example:
    >>> token_digest(np.arange(6, dtype=np.int32).reshape(2, 3))
    '62328a24cef4f5358a56fb6075bb5bb9'
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xxhash

#: Bytes read per call when hashing a file.
CHUNK = 1 << 20
#: Image files read at once when hashing a folder (the reads wait on the disk).
READERS = 8


def token_digest(token_ids: np.ndarray) -> str:
    """xxh3-128 of packed contexts: their shape, then the ids as little-endian int32."""
    ids = np.ascontiguousarray(token_ids, dtype="<i4")
    h = xxhash.xxh3_128()
    h.update(np.asarray(ids.shape, dtype="<i8").tobytes())
    h.update(ids.data.cast("B"))
    return h.hexdigest()


def sequences_digest(sequences: Iterable[Sequence[int] | np.ndarray]) -> str:
    """xxh3-128 of a sequence of token-id lists (each: its length, then its ids)."""
    h = xxhash.xxh3_128()
    for seq in sequences:
        ids = np.ascontiguousarray(seq, dtype="<i8").reshape(-1)
        h.update(np.int64(len(ids)).tobytes())
        h.update(ids.data.cast("B"))
    return h.hexdigest()


def _file_digest(path: str) -> bytes:
    h = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.digest()


def files_digest(paths: Sequence[str], root: str) -> str:
    """xxh3-128 over each file's path under ``root`` and the digest of its bytes, in order
    (files are read concurrently; the result does not depend on it)."""
    h = xxhash.xxh3_128()
    with ThreadPoolExecutor(max_workers=min(READERS, max(len(paths), 1))) as pool:
        for path, digest in zip(paths, pool.map(_file_digest, paths)):
            name = os.path.relpath(path, root).encode("utf-8", "surrogateescape")
            h.update(np.int64(len(name)).tobytes())
            h.update(name)
            h.update(digest)
    return h.hexdigest()


def blobs_digest(blobs: Iterable[bytes]) -> str:
    """xxh3-128 of a sequence of byte strings (each: its length, then its bytes)."""
    h = xxhash.xxh3_128()
    for blob in blobs:
        h.update(np.int64(len(blob)).tobytes())
        h.update(blob)
    return h.hexdigest()
