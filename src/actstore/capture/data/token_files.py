"""Token files: a stream of token ids on disk, memory-mapped and read only as far as the
budget needs.

- ``.npy``: any integer dtype, 1-D (one stream) or 2-D (rows, joined in order);
- ``.bin`` with llm.c's header (256 int32, magic 20240520; version 1: uint16 tokens,
  version 2: uint32), as llm.c and modded-nanogpt write;
- ``.bin`` without a header, as nanoGPT's ``prepare.py`` writes: raw uint16 when the
  model's vocabulary fits 16 bits, else uint32. A raw file whose every other uint16 is 0
  (uint32 tokens read as uint16) is refused.

Example:
    >>> import tempfile
    >>> tmp = tempfile.TemporaryDirectory(); path = Path(tmp.name) / "train.bin"
    >>> np.arange(100, dtype=np.uint16).tofile(path)  # raw GPT-2 token ids
    >>> stream, facts = open_token_file(path, vocab_size=50257)
    >>> facts["format"], facts["dtype"], stream[:3]
    ('raw', 'uint16', memmap([0, 1, 2], dtype=uint16))
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import ConfigError, CorruptStoreError
from .packing import TextSource, check_vocabulary

if TYPE_CHECKING:
    from ..models import LoadedModel

log = logging.getLogger(__name__)

TOKEN_FILE_SUFFIXES = (".npy", ".bin")
#: llm.c's header: 256 int32 values, the first this magic number.
LLMC_MAGIC = 20240520
LLMC_HEADER_BYTES = 256 * 4
_LLMC_DTYPES = {1: np.uint16, 2: np.uint32}


def open_token_file(path: Path, vocab_size: int | None) -> tuple[np.ndarray, dict[str, Any]]:
    """The file's tokens as one flat (memory-mapped) array, and what identifies it."""
    if path.suffix.lower() == ".npy":
        return _npy(path)
    return _bin(path, vocab_size)


def _npy(path: Path) -> tuple[np.ndarray, dict[str, Any]]:
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as err:
        raise CorruptStoreError(f"{path} is not a readable .npy array ({err})") from None
    if array.dtype.kind not in "iu" or array.ndim not in (1, 2):
        raise ConfigError(
            f"{path} holds a {array.ndim}-D {array.dtype} array; a token file is a 1-D or 2-D "
            "array of integer token ids"
        )
    facts = {"format": "npy", "dtype": str(array.dtype), "shape": list(array.shape)}
    return array.reshape(-1), facts


def _bin(path: Path, vocab_size: int | None) -> tuple[np.ndarray, dict[str, Any]]:
    size = path.stat().st_size
    header = np.fromfile(path, dtype="<i4", count=3) if size >= LLMC_HEADER_BYTES else None
    if header is not None and int(header[0]) == LLMC_MAGIC:
        dtype = _LLMC_DTYPES.get(int(header[1]))
        if dtype is None:
            raise CorruptStoreError(f"{path}: llm.c token file version {int(header[1])} is unknown")
        count = int(header[2])
        if size != LLMC_HEADER_BYTES + count * np.dtype(dtype).itemsize:
            raise CorruptStoreError(
                f"{path}: its llm.c header promises {count:,} tokens but the file holds "
                f"{size - LLMC_HEADER_BYTES:,} bytes after it"
            )
        stream: np.ndarray = np.memmap(
            path, dtype=dtype, mode="r", offset=LLMC_HEADER_BYTES, shape=(count,)
        )
        return stream, {"format": "llm.c", "dtype": np.dtype(dtype).name}
    dtype = np.uint16 if vocab_size is not None and vocab_size <= 1 << 16 else np.uint32
    itemsize = np.dtype(dtype).itemsize
    if size % itemsize:
        raise ConfigError(
            f"{path} is {size:,} bytes, not a whole number of {np.dtype(dtype).name} tokens; "
            "a raw .bin holds uint16 ids (uint32 for vocabularies over 65,536)"
        )
    stream = np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype=dtype)
    if dtype == np.uint16:
        _refuse_wide(path, stream)
    return stream, {"format": "raw", "dtype": np.dtype(dtype).name}


def _refuse_wide(path: Path, stream: np.ndarray) -> None:
    """uint32 ids below 65,536 read as uint16 leave every odd uint16 zero."""
    head = np.asarray(stream[: 1 << 20])
    if len(head) >= 64 and not head[1::2].any() and head[0::2].any():
        raise ConfigError(
            f"{path}: every other 16-bit value is 0, as when uint32 token ids are read as "
            "uint16; save the ids with np.save as a .npy (it records the dtype)"
        )


def token_file_source(
    path: Path,
    model: LoadedModel,
    *,
    context_length: int,
    limit: int | None,
    vocab_size: int | None,
) -> TextSource:
    """Cut the file's first ``limit`` contexts (all when None) straight from the stream."""
    stream, facts = open_token_file(path, vocab_size)
    total = int(stream.size)
    n = total // context_length if limit is None else min(limit, total // context_length)
    if n == 0:
        raise ConfigError(
            f"{path} has fewer tokens ({total:,}) than one context of {context_length}; "
            "lower --context-length"
        )
    used = np.asarray(stream[: n * context_length])
    check_vocabulary(used, vocab_size, str(path), model.ckpt, token_file=True)
    windows = np.ascontiguousarray(used.astype(np.int32).reshape(n, context_length))
    log.info(
        "packed %s contexts of %d tokens from the first %s of %s tokens of %s; %s left unread",
        f"{n:,}",
        context_length,
        f"{used.size:,}",
        f"{total:,}",
        path.name,
        f"{total - used.size:,}",
    )
    description = {
        "kind": "token_file",
        "path": str(path),
        **facts,
        "n_tokens": total,
        "context_length": context_length,
    }
    return TextSource(windows, str(path), description, model)
