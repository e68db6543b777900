"""Checked arrays of per-example rows kept in one file (``tokens.bin``, ``labels.bin``).

A :class:`RowFile` behaves like a read-only numpy array for indexing (``tokens[12]``,
``tokens[3:9, :4]``, ``np.asarray(tokens)``) but reads only the rows asked for, through the
store's files layer, and checks each row against the root manifest (a row is one block)
before returning it.

Example:
    >>> import tempfile
    >>> from actstore.formats import open_store
    >>> from actstore.testing import FormatCase, make_acts, make_batches, make_plan
    >>> plan, out = make_plan(), tempfile.TemporaryDirectory()  # 23 examples of 6 tokens
    >>> batches = make_batches(plan, make_acts(plan))
    >>> reader = open_store(FormatCase("saev").write(out.name, plan, batches))
    >>> rows = RowFile(reader.files, reader.checks, "tokens.bin", "<i4", (23, 6))
    >>> rows[12][:4], rows[3:9, :2].shape
    (array([76, 77, 78, 79], dtype=int32), (6, 2))
"""

from __future__ import annotations

import abc
from typing import Any

import numpy as np
import numpy.typing as npt

from ..storage.files import StoreFiles
from ..storage.integrity import Integrity


class LazyRows(abc.ABC):
    """A read-only ``shape = (n, ...)`` array whose rows are fetched (and checked) only when
    indexed: ``rows(index)`` gives the rows of an int64 index array."""

    def __init__(self, dtype: npt.DTypeLike, shape: tuple[int, ...]) -> None:
        self.dtype = np.dtype(dtype)
        self.shape = tuple(int(x) for x in shape)
        self.row_shape = self.shape[1:]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    @abc.abstractmethod
    def rows(self, index: np.ndarray) -> np.ndarray:
        """Rows ``index`` (an int64 array of valid row numbers), read and checked."""

    def __getitem__(self, key: Any) -> np.ndarray:
        from .blocks import as_indices

        key = key if isinstance(key, tuple) else (key,)
        rows = as_indices(key[0], len(self), "row")
        data = self.rows(rows)
        data = data[(slice(None), *key[1:])]
        return data[0] if isinstance(key[0], (int, np.integer)) else data

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        data = self.rows(np.arange(len(self)))
        return data if dtype is None else data.astype(dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dtype={self.dtype}, shape={self.shape})"


class RowFile(LazyRows):
    """A ``shape = (n, ...)`` array of ``dtype`` stored row-major in file ``name``."""

    def __init__(
        self,
        files: StoreFiles,
        checks: Integrity,
        name: str,
        dtype: npt.DTypeLike,
        shape: tuple[int, ...],
    ) -> None:
        super().__init__(dtype, shape)
        self.files, self.checks, self.name = files, checks, name
        self.row_bytes = int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize

    def __repr__(self) -> str:
        return f"RowFile({self.files.url_of(self.name)!r}, dtype={self.dtype}, shape={self.shape})"

    def rows(self, index: np.ndarray) -> np.ndarray:
        """Rows ``index`` (an int64 array of valid row numbers), read and checked."""
        out = np.empty((len(index), *self.row_shape), dtype=self.dtype)
        if not len(index):
            return out
        order = np.argsort(index, kind="stable")
        ranked = index[order]
        unique = np.unique(ranked)
        runs = np.flatnonzero(np.diff(unique) != 1) + 1
        got = np.empty((len(unique), *self.row_shape), dtype=self.dtype)
        for lo, hi in zip([0, *runs.tolist()], [*runs.tolist(), len(unique)]):
            offset = int(unique[lo]) * self.row_bytes
            part = got[lo:hi]
            self.files.read_range(self.name, offset, part.nbytes, part)
            self.checks.check(self.name, offset, part)
        slot = np.searchsorted(unique, ranked)
        out[order] = got[slot]
        return out
