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
from ..errors import CorruptStoreError
from ..sites import Site
from ..stats import Moments, RunMoments, RunningStats, moments
from ..storage.manifest import FileEntry

if TYPE_CHECKING:
    import torch

    from .pipeline import ShardOutput
    from .threads import StageClock
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


@dataclass(frozen=True)
class ShardRecord:
    """One finished shard, as the journal records it once its files are durable and as
    :meth:`~actstore.formats.writer.ShardedWriter.write_index` receives it at publication
    (in shard order, a part's shards numbered as in the whole store)."""

    #: the shard's number in the whole store
    index: int
    n_examples: int
    #: its listed files (name relative to the store -> manifest entry), in the order the
    #: sink declared them
    files: Mapping[str, FileEntry]
    #: what the sink's :meth:`ShardSink.info` said of each listed file (JSON values)
    info: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    #: files the sink put whole (:meth:`~actstore.formats.pipeline.ShardOutput.put`: zarr's
    #: chunks), checked through digests the format keeps in its own listed files
    chunks: tuple[str, ...] = ()
    #: each side file's size once this shard was written (``tokens.bin``...)
    sides: Mapping[str, int] = dataclasses.field(default_factory=dict)
    #: this shard's statistics per site (``str(site)`` -> :meth:`RunningStats.to_packed`)
    stats: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    #: the same statistics as the writer folded them (the record of a shard this process
    #: wrote): :meth:`site_stats` then decodes nothing; None for a record read back
    folded: Mapping[str, RunningStats] | None = dataclasses.field(
        default=None, compare=False, repr=False
    )

    def site_stats(self, site: Site) -> RunningStats:
        """This shard's statistics of ``site`` (a copy of what the writer folded, or
        decoded from :attr:`stats`: the packed form is exact, so both are the same)."""
        if self.folded is not None:
            st = self.folded[str(site)]
            return RunningStats(st.d, st.count, st.mean.copy(), st.m2.copy(), st.norm_mean)
        return RunningStats.from_dict(dict(self.stats[str(site)]))

    def to_doc(self) -> dict[str, Any]:
        """The record as JSON (the journal's line, less its ``elapsed``; ``part.json``)."""
        return {
            "index": self.index,
            "n_examples": self.n_examples,
            "files": {name: e.to_dict() for name, e in self.files.items()},
            "chunks": list(self.chunks),
            "info": {name: dict(i) for name, i in self.info.items()},
            "sides": dict(self.sides),
            "stats": {site: dict(st) for site, st in self.stats.items()},
        }

    @classmethod
    def from_doc(cls, doc: Any, source: str) -> ShardRecord:
        """The record of a journal line or ``part.json`` entry; a malformed one is a
        :class:`~actstore.errors.CorruptStoreError` naming ``source``."""
        try:
            files = {
                str(n): FileEntry.from_dict(e, f"{source} ({n})") for n, e in doc["files"].items()
            }
            record = cls(
                index=_whole(doc["index"]),
                n_examples=_whole(doc["n_examples"]),
                files=files,
                info={str(n): dict(i) for n, i in doc.get("info", {}).items()},
                chunks=tuple(str(c) for c in doc.get("chunks", ())),
                sides={str(n): _whole(v) for n, v in doc.get("sides", {}).items()},
                stats={str(s): dict(st) for s, st in doc.get("stats", {}).items()},
            )
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise CorruptStoreError(f"{source} has a malformed shard record ({err!r})") from err
        if record.index < 0 or record.n_examples < 0 or set(record.info) - set(files):
            raise CorruptStoreError(f"{source} has a malformed shard record (index {record.index})")
        return record


def _whole(value: Any) -> int:
    """A JSON whole number (not a bool, not a float)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{value!r} is not a whole number")
    return value


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
    on how many threads fold the runs. A run that lies whole in a batch is folded by
    :func:`~actstore.stats.chunk_moments` on ``pool``; a run that spans batches is
    accumulated piece by piece (:class:`~actstore.stats.RunMoments`; the sites' pieces of a
    batch in at most ``tasks`` tasks, bit-identical, no copy of the rows); runs are
    merged in order at :meth:`finish`."""

    def __init__(
        self,
        sites: Sequence[Site],
        d: int,
        pool: Executor | None = None,
        clock: StageClock | None = None,
        tasks: int = 1,
    ) -> None:
        self.sites, self.d, self.pool, self.clock = tuple(sites), d, pool, clock
        self.tasks = max(1, int(tasks))
        self.per = RunningStats(d).rows_per_chunk
        self._parts: dict[Site, list[Future | _Picked | Moments]] = {s: [] for s in self.sites}
        self._runs = {s: RunMoments(d) for s in self.sites}  # the run spanning batches
        self._unsettled: list[Any] = []  # every task since the last settle
        self._fill = 0  # rows of the current run so far

    def update(self, rows: Mapping[Site, np.ndarray | torch.Tensor]) -> None:
        """Fold the shard's next rows (``[n, D]`` per site, the same ``n`` for every site).
        Runs are folded on the pool; the rows must stay unchanged until :meth:`settle`,
        which must come before the next call."""
        arrays = {s: _float_rows(r) for s, r in rows.items()}
        n = len(next(iter(arrays.values()))) if arrays else 0
        if n == 0:
            return
        head = min(self.per - self._fill, n) if self._fill or n < self.per else 0
        ends = head > 0 and self._fill + head == self.per
        full = (n - head) // self.per * self.per
        tail = n - head - full
        small = []  # (site, pieces): head then tail, in order, on one task: they share the run
        for site, part in arrays.items():
            pieces = [p for p in (part[:head], part[n - tail :]) if len(p)]
            if pieces:
                small.append((site, pieces))
        # the sites' pieces in at most `tasks` tasks (a few per batch, not one per site);
        # a run the head piece ends comes before this batch's full runs, in order
        for k in range(min(self.tasks, len(small))):
            group = small[k :: self.tasks]
            jobs = [(self._runs[site], pieces) for site, pieces in group]
            task = self._submit(self._accumulate, jobs, ends)
            if ends:  # else it only accumulates: settle waits for it all the same
                for i, (site, _) in enumerate(group):
                    self._parts[site].append(_Picked(task, i))
        for site, part in arrays.items():
            for lo in range(head, head + full, self.per):
                self._parts[site].append(self._submit(moments, part[lo : lo + self.per]))
        self._fill = tail if ends or not head else self._fill + head

    @staticmethod
    def _accumulate(jobs: list[tuple[RunMoments, list[Rows]]], ends: bool) -> list[Moments | None]:
        """For each site's run: add the head piece (ending the run when ``ends``: its
        moments are returned), then the tail piece, which starts the next run."""
        out: list[Moments | None] = []
        for run, pieces in jobs:
            run.add(pieces[0])
            out.append(run.result() if ends else None)
            for piece in pieces[1:]:
                run.add(piece)
        return out

    def _submit(self, fn: Any, *args: Any) -> Any:  # a Future, or the result inline
        if self.pool is None:
            return fn(*args)
        if self.clock is not None:
            task = self.pool.submit(self.clock.timed, "statistics", fn, *args)
        else:
            task = self.pool.submit(fn, *args)
        self._unsettled.append(task)
        return task

    def settle(self) -> None:
        """Wait until no run still reads the rows given to :meth:`update` (the tasks
        submitted since the last settle: this batch's, not every run of the shard's)."""
        unsettled, self._unsettled = self._unsettled, []
        for task in unsettled:
            task.result()

    def finish(self) -> dict[Site, RunningStats]:
        """The shard's statistics (the runs merged in order)."""
        self.settle()
        out = {}
        for site, parts in self._parts.items():
            stats = RunningStats(self.d)
            for p in parts:
                done = p.result() if isinstance(p, (Future, _Picked)) else p
                stats.add(done)  # type: ignore[arg-type]
            if self._fill:
                stats.add(self._runs[site].result())
            out[site] = stats
        self._fill = 0
        return out


class _Picked:
    """Item ``i`` of a task's (or an inline call's) list of results."""

    def __init__(self, task: Any, i: int) -> None:
        self.task, self.i = task, i

    def result(self) -> Any:
        found = self.task.result() if isinstance(self.task, Future) else self.task
        return found[self.i]


def _float_rows(rows: np.ndarray | torch.Tensor) -> Rows:
    """Rows :func:`~actstore.stats.chunk_moments` folds without a copy: numpy arrays as
    they are, tensors as a numpy view when numpy has their dtype, else the tensor itself
    (bfloat16: widened straight to float64 block by block on the pool, exactly)."""
    if isinstance(rows, np.ndarray):
        return rows
    rows = rows.detach()
    return rows if rows.dtype == torch.bfloat16 else rows.numpy()
