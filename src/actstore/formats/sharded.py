"""The contract of :class:`~actstore.formats.writer.ShardedWriter`: what a sharded
format implements (:class:`ShardedBase`'s abstract methods and defaults: the format's part),
and the state the writer's jobs share (declared here, set by ``ShardedWriter.__init__``).
The jobs live one module each: the write loop and commit stage in
:mod:`~actstore.formats.writer`, resume in :mod:`~actstore.formats.resume`, publication
in :mod:`~actstore.formats.publish`, merging parts in :mod:`~actstore.formats.merge`."""

from __future__ import annotations

import abc
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from ..batch import Batch, CapturePlan
from ..sites import Site
from ..stats import RunningStats, merge_all
from ..storage.lock import StoreLock
from .journal import append_journal, write_journal
from .pipeline import ShardOutput
from .report import summary_of
from .shard import ShardRecord, ShardSink, ShardStats
from .threads import Pools, StageClock
from .writerbase import FormatWriter

if TYPE_CHECKING:
    import torch


class ShardedBase(FormatWriter):
    """What a sharded format supplies, and what the writer's jobs share.

    A format implements :meth:`shard_examples`, :meth:`open_shard` and
    :meth:`write_index`, and may override the other methods of "the format's part" and
    the class attributes below; the rest is the writer's.
    """

    # ------------------------------------------------------------------ the format's part

    #: Registry name of the format (the manifest and fault points carry it).
    format_name: ClassVar[str] = ""

    #: The format's options dataclass.
    options_type: ClassVar[type] = type(None)

    #: Name of the stored dtype (the manifest summary carries it).
    stored_dtype: str = "float32"

    #: Batches may carry any number of tokens (prompt/response stores pad per batch).
    ragged_tokens: ClassVar[bool] = False

    #: A part is a store of its slice too (its index is written beside ``part.json``): the
    #: pkl.gz spec's machines each write a readable store.
    parts_are_stores: ClassVar[bool] = False

    #: The shard sink writes the cast tensors' own memory (saev's slabs), so a large batch
    #: that direct writes cannot read where it lies is first copied into the aligned cast
    #: buffer (formats that encode or stage every byte anyway leave it where it is).
    writes_batch_memory: ClassVar[bool] = False

    @classmethod
    @abc.abstractmethod
    def shard_examples(cls, plan: CapturePlan, options: Any) -> int:
        """Examples per shard for ``plan`` (distributed slices are aligned on it)."""

    @abc.abstractmethod
    def open_shard(self, index: int, directory: Path) -> ShardSink:
        """A sink writing shard ``index`` (global numbering) into ``directory``."""

    @abc.abstractmethod
    def write_index(
        self, directory: Path, shards: Sequence[ShardRecord], stats: dict[Site, RunningStats]
    ) -> None:
        """The format's index and metadata files of a finished store, written at
        publication: every shard's record in order (:class:`ShardRecord`: its index,
        examples, files and what the sink said of each) and each site's statistics."""

    def init_files(self, directory: Path) -> None:
        """Files the partial directory holds from its creation (saev's metadata.json)."""

    def side_rows(self, batch: Batch) -> dict[str, bytes]:
        """Bytes to append, per example, to the store's per-example side files
        (``tokens.bin``...), for the examples of ``batch``. Default: none."""
        return {}

    def side_unit(self, name: str) -> int:
        """Block size of side file ``name`` in the manifest (whole rows; 0: one block)."""
        return 0

    def stat_rows(
        self, batch: Batch, acts: Mapping[Site, torch.Tensor]
    ) -> Mapping[Site, np.ndarray | torch.Tensor]:
        """The rows statistics are taken over: by default every token of every site, as
        stored (``acts``: the values after the :attr:`stored_dtype` cast, ``[n * T, D]``),
        so the statistics describe what readers serve."""
        return {s: acts[s].reshape(-1, self.plan.d_model) for s in self.sites}

    def summary(self, rows: int) -> dict[str, Any]:
        """What the root manifest records of the metadata (checked by readers on open)."""
        return summary_of(
            sites=self.sites, d_model=self.plan.d_model, dtype=self.stored_dtype, rows=rows
        )

    def manifest_skip(self) -> tuple[str, ...]:
        """Folders whose chunk files (names not starting with ``.``) the manifest leaves to a
        digest file of the format's own (zarr's activation chunks: millions of files)."""
        return ()

    def discard_after(self, directory: Path, position: int) -> None:
        """On resume: remove what an earlier attempt wrote in :meth:`manifest_skip` folders
        for examples from ``position`` on (the resumed capture writes them again)."""

    def put_files(self, entry: ShardRecord) -> Iterable[tuple[str, str, int]] | None:
        """On resume: every file recorded shard ``entry`` put whole
        (:meth:`ShardOutput.put`), as ``(name, ident, digest)`` read from the format's own
        index of them, 0 for a file that must be absent (its fill value); None when that
        index cannot be read (the shard is written again). The pipeline checks each.
        Default: none."""
        return ()

    # ------------------------------------------------------------------ shared state

    plan: CapturePlan
    options: Any
    sites: tuple[Site, ...]
    #: where the store is published, the output it lies in, and where it is written first
    final: Path
    output: Path
    partial: Path
    #: the capture record (what a rerun must match to resume) and the store id it gives
    record: dict[str, Any]
    store_id: str
    examples_per_shard: int
    #: publish a part of a distributed capture (``part.json``, merged later)
    is_part: bool
    example_range: tuple[int, int]
    #: shards are numbered as in the whole store: a part's first shard is not 0
    first_shard: int
    complete: bool
    resume_from: int
    #: CPU seconds per pipeline stage, over the writer's life
    clock: StageClock
    #: the capture's times are fixed (``SOURCE_DATE_EPOCH``): reruns are byte-identical
    reproducible: bool
    #: when the capture's first attempt started (seconds since the epoch, UTC)
    started: float
    _shards: list[ShardRecord]
    _digests: dict[str, np.ndarray]
    _sink: ShardSink | None
    _out: ShardOutput | None
    _stats: ShardStats | None
    _pools: Pools | None
    _commits: ThreadPoolExecutor | None
    _committing: list[Future]
    _shard_index: int
    _in_shard: int
    _written: int
    _sides: dict[str, Any]
    _init_names: list[str]
    _created: bool
    _elapsed_before: float
    _t0: float
    _lock: StoreLock | None

    # ------------------------------------------------------------------ shared by the jobs

    @property
    def position(self) -> int:
        """The next example id this writer expects."""
        return self.resume_from + self._written

    def shard_bounds(self, index: int) -> tuple[int, int]:
        """Example ids ``[lo, hi)`` of shard ``index``."""
        lo = self.example_range[0] + (index - self.first_shard) * self.examples_per_shard
        return lo, min(lo + self.examples_per_shard, self.example_range[1])

    def _shard_size(self, index: int) -> int:
        lo, hi = self.shard_bounds(index)
        return hi - lo

    def elapsed(self) -> float:
        """Seconds spent writing this store, over every attempt."""
        return self._elapsed_before + time.perf_counter() - self._t0

    def _journal_head(self) -> dict[str, Any]:
        return {
            "record": self.record,
            "store_id": self.store_id,
            "init": self._init_names,
            "started": self.started,
            "elapsed": self.elapsed(),
        }

    def _save_progress(self, directory: Path | None = None) -> None:
        """Write the whole journal anew (atomically): its head and every kept shard."""
        entries = [{**e.to_doc(), "elapsed": self.elapsed()} for e in self._shards]
        write_journal(directory or self.partial, self._journal_head(), entries)

    def _append_journal(self, entry: ShardRecord) -> None:
        """Record one durable shard: one line appended to the journal (O(1))."""
        append_journal(self.partial, {**entry.to_doc(), "elapsed": self.elapsed()})

    def statistics(self) -> dict[Site, RunningStats]:
        """Per-site statistics of every finished shard, merged in shard order."""
        return {site: merge_all([e.site_stats(site) for e in self._shards]) for site in self.sites}

    @staticmethod
    def _rows(stats: dict[Site, RunningStats]) -> int:
        return next(iter(stats.values())).count if stats else 0

    def _release(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    @abc.abstractmethod
    def _begin(self) -> None:
        """Create the partial directory on the first write (the write loop)."""

    @abc.abstractmethod
    def _finish_shard(self, index: int) -> None:
        """Hand the shard being written to the commit stage (the write loop)."""

    @abc.abstractmethod
    def _drain_commits(self) -> None:
        """Wait for every shard handed to the commit stage (the write loop)."""

    @abc.abstractmethod
    def _shutdown_pools(self) -> None:
        """Stop the writer's threads (the write loop)."""

    @abc.abstractmethod
    def _finish_publication(self) -> None:
        """Rename the partial directory into place (publication)."""

    @abc.abstractmethod
    def _write_manifest(
        self, directory: Path, shards: Sequence[ShardRecord], summary: dict[str, Any]
    ) -> None:
        """Write the root manifest of ``directory`` (publication)."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Stop without publishing (the write loop)."""


def files_below(directory: Path, exclude: Sequence[str] = ()) -> list[str]:
    """Every file below ``directory`` as a ``/``-separated relative name, leaving out the
    top-level entries named in ``exclude``."""
    out = []
    for dirpath, dirnames, names in os.walk(directory):
        if Path(dirpath) == directory:
            dirnames[:] = [d for d in dirnames if d not in exclude]
        for n in names:
            rel = (Path(dirpath) / n).relative_to(directory).as_posix()
            if rel not in exclude:
                out.append(rel)
    return sorted(out)
