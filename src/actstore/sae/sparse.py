"""Sparse SAE activations, stored as ``patch_acts.npz`` in scipy's CSR ``save_npz`` layout.

One row per stored token, one column per latent. The file is a plain (uncompressed) numpy
``.npz`` archive, readable with ``numpy.load(..., allow_pickle=False)`` or as a sparse matrix
with ``scipy.sparse.load_npz`` (what saev's own analysis scripts call):

============  ==========  ==============================================================
member        dtype       content
============  ==========  ==============================================================
``format``    ``|S3``     ``b"csr"``
``shape``     int64 [2]   ``(n_rows, d_sae)``
``indptr``    int64       ``[n_rows + 1]``: row ``r``'s entries are ``indptr[r]:indptr[r+1]``
``indices``   int32       ``[nnz]``: latent index of each entry, increasing within a row
``data``      float32     ``[nnz]``: activation value of each entry (all > 0)
``_is_array`` bool        ``True`` (scipy returns a ``csr_array``)
============  ==========  ==============================================================

Which token a row is (``rows_per_example`` and ``first_token`` are in the inference
config.json beside it): ``example = row // rows_per_example`` and
``token = first_token + row % rows_per_example`` (``first_token`` is 1 when a leading CLS
token was skipped, else 0).

Example:
    >>> acts = SparseActs.from_dense(np.array([[0, 2.0, 0], [1.0, 0, 0]], dtype=np.float32))
    >>> acts.indptr.tolist(), acts.indices.tolist(), acts.data.tolist()
    ([0, 1, 2], [1, 0], [2.0, 1.0])
    >>> acts.column(0)
    (array([1]), array([1.], dtype=float32))
"""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import CorruptStoreError, StoreNotFoundError
from ..storage.local import atomic_write

_MEMBERS = ("format", "shape", "indptr", "indices", "data")


@dataclass(frozen=True)
class SparseActs:
    """CSR matrix ``[n_rows, d_sae]`` of SAE activations."""

    data: np.ndarray
    indices: np.ndarray
    indptr: np.ndarray
    d_sae: int

    def __post_init__(self) -> None:
        n = len(self.indptr) - 1
        if (
            n < 0
            or self.indptr[0] != 0
            or self.indptr[-1] != len(self.data)
            or len(self.indices) != len(self.data)
            or np.any(np.diff(self.indptr) < 0)
        ):
            raise CorruptStoreError("sparse activations: indptr, indices and data disagree")
        if len(self.indices) and (self.indices.min() < 0 or self.indices.max() >= self.d_sae):
            raise CorruptStoreError(
                f"sparse activations: a latent index is outside 0..{self.d_sae - 1}"
            )

    @property
    def n_rows(self) -> int:
        return len(self.indptr) - 1

    @property
    def nnz(self) -> int:
        return len(self.data)

    @classmethod
    def from_dense(cls, dense: np.ndarray) -> SparseActs:
        """CSR of a dense ``[n_rows, d_sae]`` array (zeros dropped)."""
        rows, cols = np.nonzero(dense)
        indptr = np.zeros(dense.shape[0] + 1, dtype=np.int64)
        np.cumsum(np.bincount(rows, minlength=dense.shape[0]), out=indptr[1:])
        return cls(
            dense[rows, cols].astype(np.float32), cols.astype(np.int32), indptr, dense.shape[1]
        )

    @classmethod
    def concatenate(cls, parts: list[SparseActs], d_sae: int) -> SparseActs:
        """Stack row blocks in order."""
        if not parts:
            return cls(np.zeros(0, np.float32), np.zeros(0, np.int32), np.zeros(1, np.int64), d_sae)
        offsets = np.cumsum([0] + [p.nnz for p in parts[:-1]])
        indptr = np.concatenate([[0]] + [p.indptr[1:] + o for p, o in zip(parts, offsets)])
        return cls(
            np.concatenate([p.data for p in parts]),
            np.concatenate([p.indices for p in parts]),
            indptr.astype(np.int64),
            d_sae,
        )

    def row(self, r: int) -> tuple[np.ndarray, np.ndarray]:
        """(latent indices, values) of row ``r``."""
        lo, hi = self.indptr[r], self.indptr[r + 1]
        return self.indices[lo:hi], self.data[lo:hi]

    def dense_rows(self, lo: int, hi: int) -> np.ndarray:
        """Rows ``lo:hi`` as a dense float32 array ``[hi - lo, d_sae]``."""
        out = np.zeros((hi - lo, self.d_sae), dtype=np.float32)
        start, stop = self.indptr[lo], self.indptr[hi]
        rows = np.repeat(np.arange(hi - lo), np.diff(self.indptr[lo : hi + 1]))
        out[rows, self.indices[start:stop]] = self.data[start:stop]
        return out

    def column(self, latent: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows, values) where ``latent`` is active, rows increasing."""
        where = np.flatnonzero(self.indices == latent)
        rows = np.searchsorted(self.indptr, where, side="right") - 1
        return rows, self.data[where]

    def latent_summary(self) -> dict[str, np.ndarray]:
        """Per latent: ``count`` of active rows, ``total`` and ``max`` activation."""
        count = np.bincount(self.indices, minlength=self.d_sae)
        total = np.bincount(self.indices, weights=self.data, minlength=self.d_sae)
        peak = np.zeros(self.d_sae, dtype=np.float32)
        np.maximum.at(peak, self.indices, self.data)
        return {"count": count, "total": total, "max": peak}

    # ------------------------------------------------------------------ files

    def save(self, path: str | os.PathLike) -> None:
        """Write ``path`` atomically in scipy's ``save_npz`` CSR layout (see module doc)."""
        with atomic_write(path) as f:
            np.savez(
                f,
                format=np.array(b"csr"),
                shape=np.array([self.n_rows, self.d_sae], dtype=np.int64),
                indptr=self.indptr.astype(np.int64, copy=False),
                indices=self.indices.astype(np.int32, copy=False),
                data=self.data.astype(np.float32, copy=False),
                _is_array=np.array(True),
            )

    @classmethod
    def load(cls, path: str | os.PathLike) -> SparseActs:
        """Read a file written by :meth:`save` (or by ``scipy.sparse.save_npz`` of a CSR)."""
        path = Path(path)
        if not path.is_file():
            raise StoreNotFoundError(f"{path} does not exist")
        try:
            with np.load(path, allow_pickle=False) as npz:
                missing = [m for m in _MEMBERS if m not in npz.files]
                if missing:
                    raise CorruptStoreError(f"{path} lacks members {missing}; not a CSR npz")
                fmt = npz["format"].item()
                fmt = fmt.decode("ascii") if isinstance(fmt, bytes) else fmt
                if fmt != "csr":
                    raise CorruptStoreError(f"{path} holds a {fmt!r} matrix, expected csr")
                n_rows, d_sae = (int(v) for v in npz["shape"])
                out = cls(
                    npz["data"].astype(np.float32, copy=False),
                    npz["indices"].astype(np.int32, copy=False),
                    npz["indptr"].astype(np.int64, copy=False),
                    d_sae,
                )
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as err:
            if isinstance(err, CorruptStoreError):
                raise
            raise CorruptStoreError(f"{path} is not a readable npz archive: {err}") from err
        if out.n_rows != n_rows:
            raise CorruptStoreError(f"{path}: shape says {n_rows} rows, indptr has {out.n_rows}")
        return out
