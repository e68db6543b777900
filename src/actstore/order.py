"""The loader's order of rows: pure functions of (block sizes, seed, epoch) and the split.

One epoch is planned as follows (every step is a pure function, so any process computes
the same plan without talking to the others):

1. The blocks are permuted in *runs* of ``run_blocks`` (g) consecutive blocks:
   ``block_order`` lists run ``permutation(key(seed, epoch, 0), n_runs)[0]``'s blocks, then
   the next run's, and so on (g = 1: ``block_order = permutation(key(seed, epoch, 0),
   n_blocks)``). Consecutive blocks are usually adjacent on disk, so a run is one long
   sequential read; it does not change how many examples a window mixes.
2. Consecutive groups of ``pool_blocks`` (K) blocks of that order form *windows*.
3. The rows of window ``w`` (block after block in window order, storage order inside a
   block, dropped rows left out) are permuted by ``permutation(key(seed, epoch, 1, w), R_w)``.
4. The epoch's *stream* is window 0's permuted rows, then window 1's, and so on.
5. Rank ``r`` of ``W`` takes a contiguous share of the stream; its share is cut into
   batches of ``B`` rows; DataLoader worker ``j`` of ``N`` takes a contiguous run of those
   batches (:func:`rank_span`, :func:`worker_span`).

With ``mix`` m > 1 every block is split into m *slabs* (:func:`slab_rows`: slab ``j`` is
tokens ``[j*T//m, (j+1)*T//m)`` of each example when blocks hold whole examples of ``T``
rows, else the ``j``-th of m contiguous row ranges) and the plan runs over the
``m * n_blocks`` *units* (block ``i``, slab ``j``), numbered ``u = j * n_blocks + i``: step 1
permutes runs of ``g`` consecutive blocks' slab ``j`` (``m * n_runs`` runs), step 2 puts
``K * m`` units in a window (the same memory as K blocks, rows from m times as many
examples), steps 3-5 are unchanged. m = 1 is exactly the plan above.

``permutation(key, n)`` is ``argsort(splitmix64(arange(n) ^ key))`` and ``key`` folds its
integer arguments with splitmix64. splitmix64 is a bijection, so the sort keys are
distinct and every sort algorithm gives the same permutation. Both are spelled out here,
not taken from numpy's ``Generator``, so the order (and therefore resume) never changes
with the numpy version.

Example:
    >>> plan = plan_epoch([4, 4, 2], pool_blocks=2, seed=0, epoch=0)
    >>> plan.n_rows, plan.n_windows
    (10, 2)
    >>> sorted(plan.window_permutation(0)) == list(range(plan.window_rows(0)))
    True
    >>> rank_span(10, rank=1, world_size=2, batch_size=4, drop_last=False)
    Span(start=5, stop=10, n_batches=2)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .errors import ConfigError

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_U64 = (1 << 64) - 1


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser, elementwise on ``uint64`` (a bijection of 64-bit words)."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = x + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * _MUL1
        x = (x ^ (x >> np.uint64(27))) * _MUL2
    return x ^ (x >> np.uint64(31))


def key(*parts: int) -> int:
    """A 64-bit key from non-negative integers: ``h = splitmix64(h ^ part)`` from ``h = 0``."""
    h = np.zeros(1, dtype=np.uint64)
    for part in parts:
        if part < 0:
            raise ConfigError(f"seed, epoch and window numbers must be >= 0, not {part}")
        h = splitmix64(h ^ np.uint64(int(part) & _U64))
    return int(h[0])


def permutation(k: int, n: int) -> np.ndarray:
    """A pseudo-random permutation of ``range(n)`` (int64) determined by key ``k``."""
    keys = splitmix64(np.arange(n, dtype=np.uint64) ^ np.uint64(k))
    return np.argsort(keys)  # distinct keys: the result does not depend on the algorithm


@dataclass(frozen=True)
class EpochPlan:
    """Which blocks form each window, and where each window starts in the epoch's stream."""

    seed: int
    epoch: int
    block_order: np.ndarray
    """int64 ``[n_units]``: units in read order (with ``mix`` 1 units are blocks)."""
    window_bounds: np.ndarray
    """int64 ``[n_windows + 1]``: window ``w`` is ``block_order[bounds[w]:bounds[w+1]]``."""
    row_starts: np.ndarray
    """int64 ``[n_windows + 1]``: first stream row of each window (prefix sums of rows)."""
    mix: int = 1
    """Slabs per block: unit ``u`` is slab ``u // n_blocks`` of block ``u % n_blocks``."""
    n_blocks: int = 0

    def unit(self, u: int) -> tuple[int, int]:
        """``(block, slab)`` of unit ``u``."""
        slab, block = divmod(int(u), max(self.n_blocks, 1))
        return block, slab

    @property
    def n_windows(self) -> int:
        return len(self.window_bounds) - 1

    @property
    def n_rows(self) -> int:
        return int(self.row_starts[-1])

    def window_blocks(self, w: int) -> np.ndarray:
        """Units (blocks when ``mix`` is 1) of window ``w``, in the order their rows are
        numbered."""
        return self.block_order[self.window_bounds[w] : self.window_bounds[w + 1]]

    def window_rows(self, w: int) -> int:
        return int(self.row_starts[w + 1] - self.row_starts[w])

    def window_of(self, row: int) -> int:
        """The window holding stream row ``row`` (``0 <= row < n_rows``)."""
        return int(np.searchsorted(self.row_starts, row, side="right") - 1)

    def window_permutation(self, w: int) -> np.ndarray:
        """Stream position ``p`` of window ``w`` serves window row ``perm[p]``."""
        return permutation(key(self.seed, self.epoch, 1, w), self.window_rows(w))


def plan_epoch(
    block_rows: Sequence[int] | np.ndarray,
    *,
    pool_blocks: int,
    seed: int,
    epoch: int,
    run_blocks: int = 1,
    mix: int = 1,
) -> EpochPlan:
    """Plan epoch ``epoch``: ``block_rows[i]`` is the number of rows block ``i`` serves
    (with ``mix`` m > 1: ``[m, n_blocks]``, the rows of each unit, slab by slab); blocks
    are shuffled in runs of ``run_blocks`` consecutive blocks, ``pool_blocks * mix``
    units to a window."""
    rows = np.asarray(block_rows, dtype=np.int64)
    if pool_blocks < 1 or run_blocks < 1 or mix < 1:
        raise ConfigError(
            f"pool_blocks, run_blocks and mix must be >= 1, not {pool_blocks}, {run_blocks}, {mix}"
        )
    if rows.ndim == 1 and mix == 1:
        rows = rows[None]
    if rows.ndim != 2 or rows.shape[0] != mix:
        raise ConfigError(f"with mix={mix} give the rows of each unit as [{mix}, n_blocks]")
    n_blocks = rows.shape[1]
    rows = rows.reshape(-1)
    order = run_order(n_blocks, run_blocks, key(seed, epoch, 0), mix=mix)
    per_window = pool_blocks * mix
    bounds = np.unique(np.minimum(np.arange(0, len(rows) + per_window, per_window), len(rows)))
    per_unit = np.concatenate([[0], np.cumsum(rows[order])])
    return EpochPlan(
        seed=seed,
        epoch=epoch,
        block_order=order,
        window_bounds=bounds.astype(np.int64),
        row_starts=per_unit[bounds].astype(np.int64),
        mix=mix,
        n_blocks=n_blocks,
    )


def run_order(n_blocks: int, run_blocks: int, k: int, *, mix: int = 1) -> np.ndarray:
    """Units ``j * n_blocks + i`` (slab ``j`` of block ``i``) as runs of ``run_blocks``
    consecutive blocks of one slab (the last run of a slab may be short), runs in the
    order ``permutation(k, mix * n_runs)``; with ``mix`` 1 units are blocks."""
    if run_blocks == 1:
        return permutation(k, n_blocks * mix)
    n_runs = -(-n_blocks // run_blocks)
    runs = permutation(k, n_runs * mix)
    slab, run = np.divmod(runs, n_runs)
    first = run * run_blocks
    block = first[:, None] + np.arange(run_blocks)
    order = (slab[:, None] * n_blocks + block).reshape(-1)
    return order[(block < n_blocks).reshape(-1)]


def slab_bounds(period: int, mix: int) -> np.ndarray:
    """int64 ``[mix + 1]``: slab ``j`` covers ``[b[j], b[j+1])`` of ``period`` positions
    (``b[j] = j * period // mix``; sizes differ by at most one)."""
    return np.arange(mix + 1, dtype=np.int64) * period // mix


def slab_rows(n_rows: int, period: int | None, mix: int, slab: int) -> np.ndarray:
    """Block-local rows (ascending) of slab ``slab`` of ``mix`` of a block of ``n_rows``
    rows: with ``period`` T (whole examples of T contiguous rows) tokens
    ``[slab*T//mix, (slab+1)*T//mix)`` of every example, else the ``slab``-th of ``mix``
    contiguous row ranges.

    Example:
        >>> slab_rows(8, 4, 2, 1).tolist(), slab_rows(8, None, 2, 1).tolist()
        ([2, 3, 6, 7], [4, 5, 6, 7])
    """
    if mix == 1:
        return np.arange(n_rows, dtype=np.int64)
    if period:
        lo, hi = slab_bounds(period, mix)[slab : slab + 2]
        starts = np.arange(0, n_rows, period, dtype=np.int64)
        return (starts[:, None] + np.arange(lo, hi)).reshape(-1)
    lo, hi = slab_bounds(n_rows, mix)[slab : slab + 2]
    return np.arange(lo, hi, dtype=np.int64)


def slab_of(local: np.ndarray, n_rows: int, period: int | None, mix: int) -> np.ndarray:
    """The slab of each block-local row in ``local`` (see :func:`slab_rows`)."""
    local = np.asarray(local, dtype=np.int64)
    bounds = slab_bounds(period or n_rows, mix)
    pos = local % period if period else local
    return np.searchsorted(bounds, pos, side="right") - 1


class Span(NamedTuple):
    """Stream rows ``[start, stop)`` served as ``n_batches`` batches (the last may be short)."""

    start: int
    stop: int
    n_batches: int


def rank_span(n_rows: int, *, rank: int, world_size: int, batch_size: int, drop_last: bool) -> Span:
    """The share of an epoch's ``n_rows`` stream rows that ``rank`` serves.

    Ranks take contiguous shares of ``n_rows // world_size`` rows, the first
    ``n_rows % world_size`` ranks one more, so every row goes to exactly one rank. With
    ``drop_last`` every rank serves the same number of full batches,
    ``(n_rows // world_size) // batch_size``, and skips the rest of its share.
    """
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank must lie in 0..{world_size - 1}, not {rank}")
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, not {batch_size}")
    base, extra = divmod(n_rows, world_size)
    start = rank * base + min(rank, extra)
    size = base + (rank < extra)
    if drop_last:
        n_batches = base // batch_size
        return Span(start, start + n_batches * batch_size, n_batches)
    return Span(start, start + size, -(-size // batch_size))


def worker_span(span: Span, *, worker: int, num_workers: int, batch_size: int) -> Span:
    """Worker ``worker`` of ``num_workers``: a contiguous run of ``span``'s batches.

    Worker ``j`` gets ``M // N`` batches, the first ``M % N`` workers one more, so a
    DataLoader's round-robin over workers never skips one until all are done: output
    ``k`` is worker ``k % N``'s batch ``k // N``.
    """
    if not 0 <= worker < num_workers:
        raise ConfigError(f"worker must lie in 0..{num_workers - 1}, not {worker}")
    base, extra = divmod(span.n_batches, num_workers)
    first = worker * base + min(worker, extra)
    count = base + (worker < extra)
    start = span.start + first * batch_size
    return Span(min(start, span.stop), min(start + count * batch_size, span.stop), count)


def batches_done_by_worker(batches_done: int, *, worker: int, num_workers: int) -> int:
    """How many of worker ``worker``'s batches are among a DataLoader's first
    ``batches_done`` outputs (round-robin, see :func:`worker_span`)."""
    return batches_done // num_workers + (worker < batches_done % num_workers)
