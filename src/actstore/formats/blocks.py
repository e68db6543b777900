"""What readers serve rows in: a :class:`Block` (a contiguous run of rows of one site,
one sequential read), an :class:`Extent` (where a block's rows lie raw in a file), the
per-thread scratch buffers a block is read into and checked in before its rows are placed,
and :func:`as_indices` (positions of ``reader[...]``).

Example:
    >>> Block(site=Site("resid", 3), n_rows=197, loc=(0, 5)).n_rows
    197
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ..errors import IndexOutOfRangeError, InvalidIndexError
from ..sites import Site

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Block:
    """``n_rows`` contiguous rows of ``site``; ``loc`` is the format's own locator."""

    site: Site
    n_rows: int
    loc: tuple[int, ...]


@dataclass(frozen=True)
class Extent:
    """Where a block's rows lie raw in one of the store's files: the block's ``n_rows``
    contiguous rows of ``d_model`` little-endian values of ``dtype`` from byte ``offset`` of
    file ``name``, covering whole blocks of the store's manifest (so they are checked where
    they lie)."""

    name: str
    offset: int
    dtype: torch.dtype


class _Scratch(threading.local):
    """Reusable buffers per thread (a block read, checked, then placed elsewhere): allocated
    once and reused, so reads do not fault in fresh pages."""

    def __init__(self) -> None:
        self.bufs: dict[int, np.ndarray] = {}


_SCRATCH = _Scratch()

#: Scratch slots: a block being assembled, and a file read into it piece by piece.
BLOCK_SLOT, PIECE_SLOT = 0, 1


def scratch(n: int, d: int, dtype: npt.DTypeLike, slot: int = BLOCK_SLOT) -> np.ndarray:
    """This thread's scratch buffer ``slot`` as ``[n, d]`` of ``dtype`` (valid until that
    slot's next use; a read that assembles a block from pieces reads them into another slot)."""
    dtype = np.dtype(dtype)
    need = n * d * dtype.itemsize
    buf = _SCRATCH.bufs.get(slot)
    if buf is None or buf.size < need:
        buf = _SCRATCH.bufs[slot] = np.empty(max(need, 1 << 16), dtype=np.uint8)
    return buf[:need].view(dtype).reshape(n, d)


def place(out: np.ndarray, rows: np.ndarray, data: np.ndarray) -> None:
    """Row ``i`` of ``data`` into ``out[rows[i]]``, skipping ``rows[i] < 0``."""
    keep = rows >= 0
    if keep.all():
        out[rows] = data
    else:
        out[rows[keep]] = data[keep]


def as_indices(index: Any, n: int, what: str) -> np.ndarray:
    """An int, slice or int array of positions in ``range(n)`` as an int64 array
    (negatives count from the end); :class:`IndexOutOfRangeError` past either end."""
    if isinstance(index, slice):
        return np.arange(n)[index]
    arr = np.asarray(index)
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
        raise InvalidIndexError(f"{what} index must be an int, slice or int array")
    arr = np.atleast_1d(arr).astype(np.int64)
    bad = (arr < -n) | (arr >= n)
    if bad.any():
        raise IndexOutOfRangeError(
            f"{what} {int(arr[bad][0])} out of range (0..{n - 1}; negatives count from the end)"
        )
    return np.where(arr < 0, arr + n, arr)
