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
    """int64 ``[n_blocks]``: block indices in read order."""
    window_bounds: np.ndarray
    """int64 ``[n_windows + 1]``: window ``w`` is ``block_order[bounds[w]:bounds[w+1]]``."""
    row_starts: np.ndarray
    """int64 ``[n_windows + 1]``: first stream row of each window (prefix sums of rows)."""

    @property
    def n_windows(self) -> int:
        return len(self.window_bounds) - 1

    @property
    def n_rows(self) -> int:
        return int(self.row_starts[-1])

    def window_blocks(self, w: int) -> np.ndarray:
        """Block indices of window ``w``, in the order their rows are numbered."""
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
) -> EpochPlan:
    """Plan epoch ``epoch``: ``block_rows[i]`` is the number of rows block ``i`` serves;
    blocks are shuffled in runs of ``run_blocks`` consecutive blocks."""
    rows = np.asarray(block_rows, dtype=np.int64)
    if pool_blocks < 1 or run_blocks < 1:
        raise ConfigError(
            f"pool_blocks and run_blocks must be >= 1, not {pool_blocks}, {run_blocks}"
        )
    order = run_order(len(rows), run_blocks, key(seed, epoch, 0))
    bounds = np.unique(np.minimum(np.arange(0, len(rows) + pool_blocks, pool_blocks), len(rows)))
    per_block = np.concatenate([[0], np.cumsum(rows[order])])
    return EpochPlan(
        seed=seed,
        epoch=epoch,
        block_order=order,
        window_bounds=bounds.astype(np.int64),
        row_starts=per_block[bounds].astype(np.int64),
    )


def run_order(n_blocks: int, run_blocks: int, k: int) -> np.ndarray:
    """Blocks ``0..n_blocks-1`` as runs of ``run_blocks`` consecutive blocks (the last run
    may be short) in the order ``permutation(k, n_runs)``."""
    if run_blocks == 1:
        return permutation(k, n_blocks)
    n_runs = -(-n_blocks // run_blocks)
    starts = permutation(k, n_runs) * run_blocks
    order = (starts[:, None] + np.arange(run_blocks)).reshape(-1)
    return order[order < n_blocks]


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
