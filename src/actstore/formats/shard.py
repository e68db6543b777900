"""What a format writes for :class:`~actstore.formats.writer.ShardedWriter`: one
:class:`ShardSink` per shard, which only encodes (its bytes go through
:class:`~actstore.formats.pipeline.ShardOutput`); :class:`WrittenFile` records; and
:class:`ShardStats`, which folds a shard's per-site statistics on the writer's thread pool
the same way whatever the batch sizes and the number of threads."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..batch import Batch
from ..sites import Site
from ..stats import Moments, RunningStats, moments
from ..storage.manifest import FileEntry

if TYPE_CHECKING:
    import torch

    from .pipeline import ShardOutput, StageClock
else:
    from .._lazy import torch


@dataclass(frozen=True)
class WrittenFile:
    """One durable file of a shard: its name in the store, manifest entry and digests, and
    what the format needs of it at publication (``info``, kept in the progress record)."""

    name: str
    entry: FileEntry
    digests: np.ndarray
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


class ShardSink(abc.ABC):
    """Encodes one shard into named files through a
    :class:`~actstore.formats.pipeline.ShardOutput`; it never opens, writes, fsyncs or
    hashes a file itself. The writer hands it the shard's examples in order.

    Rules (the conformance kit checks them): a sink keeps no reference to a batch's memory
    after :meth:`append` returns, except through buffers handed to ``out.write`` (the
    pipeline is done with those before the batch is the caller's again); its bytes depend
    only on the examples, never on batch sizes, time or threads."""

    @abc.abstractmethod
    def open(self, out: ShardOutput) -> None:
        """Declare the shard's files (``out.declare`` / ``out.stream``)."""

    @abc.abstractmethod
    def append(self, batch: Batch, acts: Mapping[Site, torch.Tensor], out: ShardOutput) -> None:
        """Encode the next examples of this shard. ``acts``: each site's values already
        cast to the writer's :attr:`~actstore.formats.writer.ShardedWriter.stored_dtype`
        (C-contiguous CPU tensors ``[n, T, D]``, cast once for the sink and the
        statistics)."""

    def finish(self, out: ShardOutput) -> None:
        """Write what ends the shard (padding, footers; heavy encoding may run on the pool
        through ``out.submit``). The pipeline then makes the files durable and digests
        them. Default: nothing."""

    def info(self) -> dict[str, dict[str, Any]]:
        """Once the shard's files are durable: what publication needs of each file (kept in
        the journal). Default: nothing."""
        return {}

    def abort(self) -> None:
        """Drop what the sink holds (the pipeline closes the files)."""

    def chunk_files(self) -> list[str]:
        """After :meth:`finish`: files of this shard the format checks through its own
        digests (declared ``listed=False``), sealed with the shard for an uploader to send
        early. Default: none."""
        return []


#: Rows the statistics fold: numpy arrays, or tensors of a dtype numpy lacks (bfloat16).
Rows = Any


class ShardStats:
    """Per-site statistics of one shard, folded in runs of ``rows_per_chunk`` rows counted
    from the shard's start: the result does not depend on how batches split the shard, nor
    on how many threads fold the runs (each run's :func:`~actstore.stats.chunk_moments` is
    computed on ``pool`` and merged in run order at :meth:`finish`)."""

    def __init__(
        self,
        sites: Sequence[Site],
        d: int,
        pool: Executor | None = None,
        clock: StageClock | None = None,
    ) -> None:
        self.sites, self.d, self.pool, self.clock = tuple(sites), d, pool, clock
        self.per = RunningStats(d).rows_per_chunk
        self._parts: dict[Site, list[Future | Moments]] = {s: [] for s in self.sites}
        # two staging buffers per site for runs that straddle batches (made on first use,
        # of the rows' type): one may still be folded (submitted during this batch) while
        # the other takes the batch's tail
        self._stage: list[dict[Site, Rows]] = [{}, {}]
        self._cur = 0
        self._fill = 0

    def update(self, rows: Mapping[Site, np.ndarray | torch.Tensor]) -> None:
        """Fold the shard's next rows (``[n, D]`` per site, the same ``n`` for every site).
        Runs are folded on the pool; the rows must stay unchanged until :meth:`settle`."""
        arrays = {s: _float_rows(r) for s, r in rows.items()}
        n = len(next(iter(arrays.values()))) if arrays else 0
        i = 0
        if self._fill or n < self.per:
            stage = self._staging(self._cur, arrays)
            take = min(self.per - self._fill, n)
            for site, part in arrays.items():
                stage[site][self._fill : self._fill + take] = part[:take]
            self._fill += take
            i = take
            if self._fill == self.per:
                self._fold(stage)
                self._cur, self._fill = 1 - self._cur, 0
        while n - i >= self.per:
            self._fold({s: part[i : i + self.per] for s, part in arrays.items()})
            i += self.per
        if i < n:
            stage = self._staging(self._cur, arrays)
            for site, part in arrays.items():
                stage[site][: n - i] = part[i:]
            self._fill = n - i

    def _staging(self, k: int, like: Mapping[Site, Rows]) -> dict[Site, Rows]:
        stage = self._stage[k]
        for site, rows in like.items():
            held = stage.get(site)
            if held is None or held.dtype != rows.dtype or type(held) is not type(rows):
                stage[site] = (
                    np.empty((self.per, self.d), rows.dtype)
                    if isinstance(rows, np.ndarray)
                    else torch.empty((self.per, self.d), dtype=rows.dtype)
                )
        return stage

    def settle(self) -> None:
        """Wait until no run still reads the rows given to :meth:`update`."""
        for parts in self._parts.values():
            for p in parts:
                if isinstance(p, Future):
                    p.result()

    def finish(self) -> dict[Site, RunningStats]:
        """The shard's statistics (the runs merged in order)."""
        if self._fill:
            stage = self._stage[self._cur]
            self._fold({s: b[: self._fill] for s, b in stage.items()})
            self._fill = 0
        out = {}
        for site, parts in self._parts.items():
            stats = RunningStats(self.d)
            for p in parts:
                stats.add(p.result() if isinstance(p, Future) else p)
            out[site] = stats
        return out

    def _fold(self, chunks: Mapping[Site, Rows]) -> None:
        for site, chunk in chunks.items():
            if self.pool is None:
                self._parts[site].append(moments(chunk))
            elif self.clock is not None:
                self._parts[site].append(
                    self.pool.submit(self.clock.timed, "statistics", moments, chunk)
                )
            else:
                self._parts[site].append(self.pool.submit(moments, chunk))


def _float_rows(rows: np.ndarray | torch.Tensor) -> Rows:
    """Rows :func:`~actstore.stats.chunk_moments` folds without a copy: numpy arrays as
    they are, tensors as a numpy view when numpy has their dtype, else the tensor itself
    (bfloat16: widened straight to float64 block by block on the pool, exactly)."""
    if isinstance(rows, np.ndarray):
        return rows
    rows = rows.detach()
    return rows if rows.dtype == torch.bfloat16 else rows.numpy()
