"""Exact, mergeable running statistics of activation vectors.

:class:`RunningStats` keeps ``count``, the per-dimension ``mean`` and ``m2`` (sum of squared
deviations) and the mean L2 norm, all in float64. Chunks are folded in with the parallel
form of Welford's algorithm (Chan, Golub & LeVeque 1979): the within-chunk variance is
included, so merging the statistics of several writers gives the statistics of all their
rows, up to float64 rounding.

Example:
    >>> import numpy as np
    >>> a, b = RunningStats.of(np.ones((2, 3))), RunningStats.of(np.zeros((2, 3)))
    >>> merged = a.merge(b)
    >>> merged.count, merged.mean.tolist(), merged.var.tolist()
    (4, [0.5, 0.5, 0.5], [0.25, 0.25, 0.25])
"""

from __future__ import annotations

import base64
import binascii
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import ConfigError, CorruptStoreError
from .forksafe import ForkSafeLock

if TYPE_CHECKING:
    import torch
else:
    from ._lazy import torch

#: Bytes of float64 a chunk's rows would take: it fixes the chunking, hence the float
#: rounding: statistics are folded in runs of :attr:`RunningStats.rows_per_chunk` rows.
SCRATCH_BYTES = 8 << 20

#: Bytes of float64 :func:`chunk_moments` widens and reduces at a time: small enough to
#: stay in a core's L2 cache.
BLOCK_BYTES = 1 << 20


#: One chunk's moments: row count, per-dimension sum and sum of squares (float64), and the
#: sum of the rows' L2 norms.
Moments = tuple[int, np.ndarray, np.ndarray, float]


def chunk_moments(rows: np.ndarray | torch.Tensor, scratch: np.ndarray | None = None) -> Moments:
    """The :data:`Moments` of ``rows`` (``[n, d]``: a numpy array of any float dtype, or a
    CPU tensor such as bfloat16, any strides), in float64.

    Blocks of rows are widened into ``scratch`` (float64 ``[k, d]``, about
    :data:`BLOCK_BYTES`; allocated when None), a tensor by torch's own conversion, then
    reduced with numpy ufuncs: both release the GIL, so threads folding different chunks
    run in parallel. The result depends only on the rows, so statistics merged from chunks
    in a fixed order are identical for any thread count. A float32 value's square is exact
    in float64, so ``sumsq - sum**2 / n`` loses only what float64 sums of a chunk lose.

    Example:
        >>> n, s, ss, norms = chunk_moments(np.array([[3.0, 4.0], [0.0, 0.0]]))
        >>> n, s.tolist(), ss.tolist(), norms
        (2, [3.0, 4.0], [9.0, 16.0], 5.0)
    """
    n, d = rows.shape
    total, sumsq = np.zeros(d), np.zeros(d)
    if n == 0:
        return 0, total, sumsq, 0.0
    k = block_rows(d)
    if scratch is None or scratch.shape[0] < min(n, k) or scratch.shape[1] != d:
        scratch = np.empty((min(n, k), d), np.float64)
    rows = _widenable(rows)
    norms = np.empty(n)
    for lo in range(0, n, k):
        hi = min(n, lo + k)
        x = scratch[: hi - lo]
        _widen(x, rows[lo:hi])
        _fold_block(x, total, sumsq, norms[lo:hi])
    np.sqrt(norms, out=norms)
    return n, total, sumsq, float(np.add.reduce(norms))


def block_rows(d: int) -> int:
    """Rows of width ``d`` that :func:`chunk_moments` widens and reduces at a time."""
    return max(1, BLOCK_BYTES // (8 * d))


def _fold_block(x: np.ndarray, total: np.ndarray, sumsq: np.ndarray, norms: np.ndarray) -> None:
    """Fold one widened block ``x`` (float64, overwritten) into ``total`` and ``sumsq``;
    each row's squared L2 norm goes to ``norms``."""
    np.add(total, np.add.reduce(x, axis=0), out=total)
    np.multiply(x, x, out=x)
    np.add(sumsq, np.add.reduce(x, axis=0), out=sumsq)
    np.add.reduce(x, axis=1, out=norms)


def _widenable(rows: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor:
    if (
        isinstance(rows, np.ndarray)
        and rows.dtype == np.float16
        and rows.flags.writeable
        and all(st >= 0 for st in rows.strides)
    ):  # numpy widens float16 at a third of torch's speed (torch takes these arrays only)
        return torch.from_numpy(rows)
    return rows


def _widen(x: np.ndarray, rows: np.ndarray | torch.Tensor) -> None:
    """Copy ``rows`` (as :func:`_widenable` hands them) into the float64 block ``x``."""
    if isinstance(rows, np.ndarray):
        np.copyto(x, rows)
    elif rows.dtype == torch.float16:  # through float32 (exact): torch's float16 ->
        half = _half_scratch(x.shape)  # float64 is 3x slower
        torch.from_numpy(half).copy_(rows)
        np.copyto(x, half)
    else:  # torch widens bfloat16 (which numpy lacks) straight to float64
        torch.from_numpy(x).copy_(rows)


_scratch = threading.local()


def _half_scratch(shape: tuple[int, ...]) -> np.ndarray:
    """This thread's float32 buffer of ``shape`` (kept: no page faults on fresh memory)."""
    buf = getattr(_scratch, "half", None)
    if buf is None or buf.shape[1] != shape[1] or buf.shape[0] < shape[0]:
        buf = _scratch.half = np.empty((block_rows(shape[1]), shape[1]), np.float32)
    return buf[: shape[0]]


def moments(rows: np.ndarray | torch.Tensor) -> Moments:
    """:func:`chunk_moments` with a float64 scratch buffer kept per thread (what a pool
    folding chunks calls).

    Example:
        >>> moments(np.ones((3, 2)))[:3]
        (3, array([3., 3.]), array([3., 3.]))
    """
    d = rows.shape[1]
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.shape[1] != d:
        buf = _scratch.buf = np.empty((block_rows(d), d), np.float64)
    return chunk_moments(rows, buf)


class RunMoments:
    """The :data:`Moments` of one run of rows handed over in pieces (a statistics run that
    spans several batches). Each piece is widened straight into a float64 block of
    :func:`chunk_moments`' height and every full block is reduced, so :meth:`result`
    equals ``chunk_moments`` of the whole run, bit for bit, and no copy of the rows is
    kept. Its block comes from a shared free list (taken on the first rows, given back by
    :meth:`result`). Not thread-safe: one piece at a time.

    Example:
        >>> rows = np.arange(12.0).reshape(6, 2)
        >>> run = RunMoments(2)
        >>> run.add(rows[:1]); run.add(rows[1:])
        >>> [np.array_equal(a, b) for a, b in zip(run.result(), chunk_moments(rows))]
        [True, True, True, True]
    """

    def __init__(self, d: int) -> None:
        self.d, self.k = d, block_rows(d)
        self._block: np.ndarray | None = None
        self._reset()

    def _reset(self) -> None:
        self.n, self._fill = 0, 0
        self._total, self._sumsq = np.zeros(self.d), np.zeros(self.d)
        self._norms: list[np.ndarray] = []

    def add(self, rows: np.ndarray | torch.Tensor) -> None:
        """Fold the run's next ``rows`` (``[m, d]``)."""
        rows, m, i = _widenable(rows), rows.shape[0], 0
        while i < m:
            if self._block is None:
                self._block = _take_block(self.k, self.d)
            take = min(self.k - self._fill, m - i)
            _widen(self._block[self._fill : self._fill + take], rows[i : i + take])
            self._fill += take
            i += take
            if self._fill == self.k:
                self._reduce()
        self.n += m

    def _reduce(self) -> None:
        assert self._block is not None
        norms = np.empty(self._fill)
        _fold_block(self._block[: self._fill], self._total, self._sumsq, norms)
        self._norms.append(norms)
        self._fill = 0

    def result(self) -> Moments:
        """The run's moments; the run is then empty again."""
        if self._fill:
            self._reduce()
        if self._block is not None:
            _give_block(self._block)
            self._block = None
        norms = np.concatenate(self._norms) if self._norms else np.zeros(0)
        np.sqrt(norms, out=norms)
        out = (self.n, self._total, self._sumsq, float(np.add.reduce(norms)))
        self._reset()
        return out


_blocks: dict[tuple[int, int], list[np.ndarray]] = {}
_blocks_lock = ForkSafeLock()


def _take_block(k: int, d: int) -> np.ndarray:
    with _blocks_lock:
        free = _blocks.get((k, d))
        if free:
            return free.pop()
    return np.empty((k, d), np.float64)


def _give_block(block: np.ndarray) -> None:
    with _blocks_lock:
        free = _blocks.setdefault(block.shape, [])  # type: ignore[arg-type]
        if len(free) < 64:  # about the sites of a model in flight at once
            free.append(block)


@dataclass
class RunningStats:
    """Running count, mean, M2 and mean L2 norm over rows of width ``d``."""

    d: int
    count: int = 0
    # None: zeros of width d, filled in by __post_init__ (readers always see arrays)
    mean: np.ndarray = field(default=None)  # type: ignore[arg-type]
    m2: np.ndarray = field(default=None)  # type: ignore[arg-type]
    norm_mean: float = 0.0

    def __post_init__(self) -> None:
        if self.mean is None:
            self.mean = np.zeros(self.d, dtype=np.float64)
        if self.m2 is None:
            self.m2 = np.zeros(self.d, dtype=np.float64)

    @classmethod
    def of(cls, rows: np.ndarray) -> RunningStats:
        """Statistics of ``rows`` (any shape ``[..., d]``)."""
        stats = cls(d=rows.shape[-1])
        stats.update(rows)
        return stats

    @property
    def var(self) -> np.ndarray:
        """Population variance per dimension (``m2 / count``)."""
        return self.m2 / max(self.count, 1)

    @property
    def std(self) -> np.ndarray:
        """Population standard deviation per dimension."""
        return np.sqrt(self.var)

    @property
    def rows_per_chunk(self) -> int:
        """Rows folded at a time (the float64 scratch buffer's height)."""
        return max(16, SCRATCH_BYTES // (8 * self.d))

    def update(self, rows: np.ndarray) -> None:
        """Fold ``rows`` (shape ``[..., d]``, any strides) into the statistics, in place,
        in runs of :attr:`rows_per_chunk` rows (each run's moments by :func:`chunk_moments`,
        merged in order)."""
        rows = np.asarray(rows)
        if rows.shape[-1] != self.d:
            raise ConfigError(f"rows have width {rows.shape[-1]}, statistics expect {self.d}")
        rows = rows.reshape(-1, self.d)
        per = self.rows_per_chunk
        for start in range(0, len(rows), per):
            self.add(moments(rows[start : start + per]))

    def add(self, moments: Moments) -> None:
        """Merge one chunk's :class:`Moments` (Chan et al.'s pairwise update)."""
        n, total, sumsq, norm_sum = moments
        if n == 0:
            return
        mean = total / n
        m2 = np.maximum(sumsq - total * mean, 0.0)
        self._merge_moments(n, mean, m2, norm_sum / n)

    def merge(self, other: RunningStats) -> RunningStats:
        """Return the statistics of the union of both row sets (neither is modified)."""
        if other.d != self.d:
            raise ConfigError(f"cannot merge statistics of width {self.d} and {other.d}")
        out = RunningStats(self.d, self.count, self.mean.copy(), self.m2.copy(), self.norm_mean)
        out._merge_moments(other.count, other.mean, other.m2, other.norm_mean)
        return out

    def _merge_moments(self, n_b: int, mean_b: np.ndarray, m2_b: np.ndarray, norm_b: float):
        if n_b == 0:
            return
        n_a = self.count
        n = n_a + n_b
        delta = mean_b - self.mean
        self.mean = self.mean + delta * (n_b / n)
        self.m2 = self.m2 + m2_b + delta * delta * (n_a * n_b / n)
        self.norm_mean = self.norm_mean + (norm_b - self.norm_mean) * (n_b / n)
        self.count = n

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; floats keep full float64 precision through ``json``."""
        return {
            "count": self.count,
            "d": self.d,
            "mean": self.mean.tolist(),
            "m2": self.m2.tolist(),
            "var": self.var.tolist(),
            "norm_mean": self.norm_mean,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunningStats:
        """Inverse of :meth:`to_dict` and :meth:`to_packed`."""
        try:
            d = int(data["d"])
            mean, m2 = (_floats(data, key, d) for key in ("mean", "m2"))
            return cls(
                d=d,
                count=int(data["count"]),
                mean=mean,
                m2=m2,
                norm_mean=float(data["norm_mean"]),
            )
        except (KeyError, TypeError, ValueError, binascii.Error) as err:
            raise CorruptStoreError(f"malformed statistics record: {err!r}") from err

    def to_packed(self) -> dict[str, Any]:
        """A JSON-ready dict with ``mean`` and ``m2`` as base64 of their little-endian
        float64 bytes: exact, and ~30x faster to encode than lists of floats (a writer's
        journal line per shard); :meth:`from_dict` reads both forms.

        Example:
            >>> s = RunningStats.of(np.array([[0.1, 2.0]]))
            >>> RunningStats.from_dict(s.to_packed()).mean.tolist() == s.mean.tolist()
            True
        """
        return {
            "count": self.count,
            "d": self.d,
            "mean_f8": _pack(self.mean),
            "m2_f8": _pack(self.m2),
            "norm_mean": self.norm_mean,
        }


def _pack(values: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(values, "<f8").tobytes()).decode("ascii")


def _floats(data: dict[str, Any], key: str, d: int) -> np.ndarray:
    packed = data.get(f"{key}_f8")
    if packed is None:
        return np.asarray(data[key], dtype=np.float64)
    values = np.frombuffer(base64.b64decode(packed, validate=True), "<f8").astype(np.float64)
    if values.shape != (d,):
        raise ValueError(f"{key} holds {values.size} values, not d={d}")
    return values


def merge_all(parts: list[RunningStats]) -> RunningStats:
    """Merge statistics in list order (order fixes the float rounding, so it is kept).

    Example:
        >>> merge_all([RunningStats.of(np.ones((1, 2)))]).count
        1
    """
    if not parts:
        raise ConfigError("merge_all needs at least one RunningStats")
    out = parts[0]
    for part in parts[1:]:
        out = out.merge(part)
    return out
