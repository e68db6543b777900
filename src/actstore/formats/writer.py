"""The crash protocol, written once: :class:`ShardedWriter` is the base of every writer whose
store is a directory of shards of consecutive examples (saev, SAELens, pkl.gz, zarr).

A format's writer only encodes: :meth:`ShardedWriter.open_shard` returns a
:class:`ShardSink` that writes one shard's files, and :meth:`ShardedWriter.write_index`
writes the format's index and metadata at publication (what a format implements:
:class:`~actstore.formats.sharded.ShardedBase`). Everything else is the writer's, one
module per job: this one (construction, the write loop, the commit stage),
:mod:`~actstore.formats.resume`, :mod:`~actstore.formats.publish` and
:mod:`~actstore.formats.merge`:

* **where**: the store is published at :meth:`~ShardedWriter.store_location` (a local
  directory; object storage outputs are staged locally and uploaded by
  :class:`~actstore.formats.staged.StagedWriter`), written before that in
  ``.<name>.partial/`` beside it (:func:`~actstore.storage.location.partial_of`);
* **the lock** (:class:`~actstore.storage.lock.StoreLock`) from open to publish or abort;
* **nothing on disk** until the first :meth:`~ShardedWriter.write` (a refused capture
  leaves no ``.partial``), except the lock file while the writer lives;
* **the write pipeline** (:mod:`actstore.formats.pipeline`): each batch is cast once to
  the stored dtype; the sink's buffers are written by positional writes on several I/O
  streams with rolling writeback and digested as they are written, while the statistics
  are folded on a thread pool; a shard's commit (fsync, then its journal line) runs on its
  own thread while the next shard is written;
* **progress**: when a shard's files are fsynced, the shard is recorded, with its files'
  block digests and its per-site statistics, by one line appended to the journal
  ``.partial/progress.jsonl`` (O(1) per shard; a torn last line is a shard not recorded);
* **verified resume**: a rerun with the same capture record re-hashes the recorded shards,
  keeps the ones that still match, deletes everything after them, truncates the per-example
  side files (``tokens.bin``...) to match, and resumes at the next shard; the result is
  byte-identical to an uninterrupted capture;
* **statistics**: exact per-site running statistics, folded per shard in runs of rows
  counted from the shard's start (so batching and resumes do not change a bit), merged in
  shard order;
* **publication**: the format's index, then the root manifest (every file's size and keyed
  block digests, :mod:`actstore.storage.manifest`) last; then the bookkeeping is removed,
  the files made read-only and the directory renamed into place. A crash after the
  manifest is written is finished by the next open of the same capture; every step calls
  :func:`actstore.faults.point` (``<format>.<step>``) for the crash tests;
* **parts**: with ``example_range`` the writer captures one slice of a distributed capture
  (whole shards, numbered as in the whole store) and publishes it with ``part.json``;
  :meth:`ShardedWriter.merge` joins parts into the store, byte-identical to a one-process capture.

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> from actstore.formats.saev import SaevOptions, SaevWriter
    >>> from actstore.storage.location import Location
    >>> from actstore.testing import make_acts, make_batches, make_plan
    >>> plan, out = make_plan(), tempfile.TemporaryDirectory()
    >>> writer = SaevWriter.from_plan(plan, Location.parse(out.name), SaevOptions())
    >>> for batch in make_batches(plan, make_acts(plan)):
    ...     writer.write(batch)
    >>> store = writer.close()  # published: <out>/<store id>/
    >>> store.parent == Path(out.name), (store / "actstore-manifest.json").is_file()
    (True, True)
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from ..batch import Batch, CapturePlan
from ..errors import (
    CaptureError,
    ConfigError,
)
from ..faults import point
from ..sites import Site
from ..storage import (
    fsync_dir,
    remove_tree,
)
from ..storage.location import Location, partial_of
from ..storage.lock import StoreLock
from ..storage.manifest import (
    store_id_of,
)
from ..storage.writeback import direct_alignment_in
from .journal import (
    PART,
    PROGRESS,
    read_part,
    recorded_shards,
    stats_doc,
)
from .merge import PartMerge
from .pipeline import ShardOutput
from .publish import Publication
from .resume import Resume
from .shard import ShardRecord, ShardSink, ShardStats, WrittenFile
from .sharded import files_below
from .threads import HUGE_FROM, Pools, StageClock, check_settings, copy_rows, empty_tensor

if TYPE_CHECKING:
    import torch

else:
    from .._lazy import torch

log = logging.getLogger(__name__)


class ShardedWriter(Resume, Publication, PartMerge):
    """Base of shard-directory writers; see the module docstring for the protocol.

    Subclasses call ``super().__init__`` from their constructor with the published
    location, the capture record (what a rerun must match to resume), the shard size and
    the example range, after setting what :meth:`open_shard` needs.
    """

    def __init__(
        self,
        *,
        plan: CapturePlan,
        store: Location,
        output: Location,
        options: Any,
        record: dict[str, Any],
        examples_per_shard: int,
        example_range: tuple[int, int] | None = None,
        part: bool | None = None,
        break_lock: bool = False,
    ) -> None:
        store, output = Location.parse(store), Location.parse(output)
        if not store.is_local:
            raise ConfigError(
                f"{store} is on object storage; open writers there with "
                "actstore.formats.open_writer (it stages and uploads)"
            )
        self.plan, self.options = plan, options
        self.sites: tuple[Site, ...] = tuple(plan.sites)
        self.final = store.path()
        self.output = output.path()
        self.partial = partial_of(store).path()
        self.record = record
        self.store_id = store_id_of(record)
        check_settings()  # a bad setting, before anything is made
        self.examples_per_shard = int(examples_per_shard)
        if self.examples_per_shard < 1:
            raise ConfigError(f"a shard must hold at least one example, not {examples_per_shard}")
        #: Publish a part of a distributed capture (``part.json``, merged later) rather
        #: than a complete store of ``example_range`` (zarr's run shards are the latter).
        self.is_part = example_range is not None if part is None else part
        self.example_range: tuple[int, int] = self._check_range(example_range)
        #: Shards are numbered as in the whole store: a part's first shard is not 0.
        self.first_shard = self.example_range[0] // self.examples_per_shard if self.is_part else 0
        self.complete = False
        self.resume_from = self.example_range[0]
        self._shards: list[ShardRecord] = []
        self._digests: dict[str, np.ndarray] = {}
        self._sink: ShardSink | None = None
        self._out: ShardOutput | None = None
        self._stats: ShardStats | None = None
        self._pools: Pools | None = None
        #: CPU seconds per pipeline stage, over the writer's life (:meth:`stage_seconds`)
        self.clock = StageClock()
        #: the commit stage: one thread, so shards are recorded in order
        self._commits: ThreadPoolExecutor | None = None
        self._committing: list[Future] = []
        self._shard_index = -1
        self._cast_buffers: dict[Site, torch.Tensor] = {}
        self._direct_align: int | None = None  # of the store's directory, found at the first shard
        self._in_shard = 0
        self._written = 0
        self._sides: dict[str, Any] = {}
        self._init_names: list[str] = []
        self._created = False
        epoch = os.environ.get("SOURCE_DATE_EPOCH")
        #: The capture's times are fixed (``SOURCE_DATE_EPOCH``): reruns are byte-identical.
        self.reproducible = epoch is not None
        #: When the capture's first attempt started (seconds since the epoch, UTC).
        self.started = float(epoch) if epoch is not None else time.time()
        self._elapsed_before = 0.0
        self._t0 = time.perf_counter()
        self._lock: StoreLock | None = StoreLock.acquire(self.final, break_lock=break_lock)
        try:
            self._open()
        except BaseException:
            self._release()
            raise

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_plan(
        cls,
        plan: CapturePlan,
        location: Location | str | os.PathLike,
        options: Any = None,
        **fields: Any,
    ) -> ShardedWriter:
        """The writer of ``plan`` for output ``location`` with the format's ``options``
        (``fields`` set single options: ``from_plan(plan, out, dialect="saev")``).
        Subclasses take ``(plan, output, options, *, example_range=None, store=None)``."""
        options = options or cls.options_type()
        if fields:
            options = dataclasses.replace(options, **fields)
        make: Callable[..., ShardedWriter] = cls  # the subclass's signature, not __init__'s
        return make(plan, Location.parse(location), options)

    @classmethod
    def for_slice(cls, plan: CapturePlan, store: Location, options: Any, sl: Any) -> ShardedWriter:
        """The writer of one slice of a distributed capture (published at ``store``)."""
        make: Callable[..., ShardedWriter] = cls  # the subclass's signature, not __init__'s
        return make(plan, store.parent, options, example_range=(sl.start, sl.stop), store=store)

    def _check_range(self, example_range: tuple[int, int] | None) -> tuple[int, int]:
        n, per = self.plan.n_examples, self.examples_per_shard
        if example_range is None:
            return (0, n)
        start, stop = (int(x) for x in example_range)
        if not 0 <= start < stop <= n:
            raise ConfigError(f"example range [{start}, {stop}) is empty or outside [0, {n})")
        if self.is_part and (start % per or (stop != n and stop % per)):
            raise ConfigError(
                f"a {self.format_name} part must cover whole shards of {per} examples; "
                f"[{start}, {stop}) does not (split the dataset with actstore.dist.split_examples)"
            )
        return (start, stop)

    def _begin(self) -> None:
        """Create the partial directory (complete, under a temporary name, then renamed:
        a crash leaves none or a resumable one) on the first write."""
        if self._created:
            return
        self.final.parent.mkdir(parents=True, exist_ok=True)
        init = self.partial.with_name(self.partial.name + "-init")
        if init.exists():
            remove_tree(init)  # a crash while creating it (we hold the lock)
        init.mkdir()
        point(f"{self.format_name}.init_created")
        try:
            self.init_files(init)
        except BaseException:
            remove_tree(init)  # nothing was durable: leave nothing behind
            raise
        self._init_names = files_below(init)
        self._save_progress(init)
        point(f"{self.format_name}.init_filled")
        os.rename(init, self.partial)
        fsync_dir(self.partial.parent)
        self._created = True
        point(f"{self.format_name}.partial_created")

    def cast(self, batch: Batch, pool: Executor) -> dict[Site, torch.Tensor]:
        """Each site of ``batch`` in the :attr:`stored_dtype`, C-contiguous on the CPU: the
        one cast of the pipeline, on the writer's ``pool`` (a view when the capture already
        hands that dtype, as a capture that casts on the GPU does)."""
        dtype = getattr(torch, self.stored_dtype)
        out, copies = {}, []
        for site in self.sites:
            t = batch.acts[str(site)].detach()
            if t.device.type != "cpu":
                t = t.to(device="cpu", dtype=dtype)
            if t.dtype != dtype or not t.is_contiguous() or self._unaligned(t):
                # the same buffer every batch, grown to the largest batch (free again once
                # write() returns: fresh memory would cost a page fault per 4 KiB, ~0.7 CPU
                # s/GB, and batches of a prompt/response capture vary in length); large
                # ones are page-aligned, so direct writes read them where they are
                held = self._cast_buffers.get(site)
                if held is None or held.numel() < t.numel() or held.dtype != dtype:
                    held = self._cast_buffers[site] = empty_tensor((t.numel(),), dtype)
                dest = held[: t.numel()].view(t.shape)
                copies.append((dest, t, None))
                t = dest
            out[site] = t
        if copies:
            copy_rows(pool, copies, self.clock)
        return out

    def _unaligned(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is large but not aligned for the store's direct writes: copied
        into the (page-aligned) cast buffer on the CPU pool, in parallel, rather than into
        a bounce buffer by the I/O thread that then waits for the disk."""
        align = self._direct_align or 0
        return (
            self.writes_batch_memory
            and align > 0
            and t.nbytes >= HUGE_FROM
            and t.data_ptr() % align != 0
        )

    # ------------------------------------------------------------------ writing

    def write(self, batch: Batch) -> None:
        """Append ``batch``'s examples not already stored; they must continue in order."""
        if self.complete:
            raise CaptureError(f"{self.final} is already published")
        if self._lock is None:
            raise CaptureError(f"the writer of {self.final} was closed or aborted")
        start = self.position
        keep = batch.example_ids >= start
        if not keep.all():
            batch = batch.select(keep)
        n = batch.n_examples
        if n == 0:
            return
        if not np.array_equal(batch.example_ids, np.arange(start, start + n)):
            raise CaptureError(
                f"batches must arrive in example order: expected ids from {start}, "
                f"got {batch.example_ids[:4].tolist()}..."
            )
        if start + n > self.example_range[1]:
            raise CaptureError(
                f"examples beyond {self.example_range[1]}, the end of what this writer holds"
            )
        self._check_batch(batch)
        self._begin()
        done = 0
        while done < n:
            index = (
                self.first_shard + (start + done - self.example_range[0]) // self.examples_per_shard
            )
            room = self._shard_size(index) - self._in_shard
            take = min(room, n - done)
            part = batch if take == n else batch.select(_mask(n, done, take))
            self._append(index, part)
            done += take
            if self._in_shard == self._shard_size(index):
                self._finish_shard(index)

    def _check_batch(self, batch: Batch) -> None:
        """Every site the store holds is in the batch with the plan's shape."""
        want = (batch.n_examples, self.plan.tokens_per_example, self.plan.d_model)
        for site in self.sites:
            tensor = batch.acts.get(str(site))
            if tensor is None:
                raise CaptureError(f"batch lacks site {site}; it has {sorted(batch.acts)}")
            if tuple(tensor.shape) != want and not self.ragged_tokens:
                raise CaptureError(
                    f"site {site} has shape {tuple(tensor.shape)}; this store holds {want}"
                )

    def _append(self, index: int, batch: Batch) -> None:
        sink, out, stats = self._sink, self._out, self._stats
        if sink is None or out is None or stats is None:  # a new shard (all are set together)
            self._raise_failed_commit()
            pools = self._pools = self._pools or Pools(clock=self.clock)
            if self._direct_align is None:
                self._direct_align = direct_alignment_in(self.partial)
            sink = self._sink = self.open_shard(index, self.partial)
            out = self._out = ShardOutput(self.partial, self.store_id, pools)
            stats = self._stats = ShardStats(
                self.sites, self.plan.d_model, pools.cpu, self.clock, tasks=pools.threads
            )
            sink.open(out)
            self._in_shard, self._shard_index = 0, index
        assert self._pools is not None
        acts = self.cast(batch, self._pools.cpu)
        try:
            self.clock.timed(
                "encode", sink.append, batch, acts, out
            )  # writes go out on the I/O streams
            stats.update(self.stat_rows(batch, acts))  # folded on the CPU pool meanwhile
            for name, data in self.side_rows(batch).items():
                f = self._sides.get(name)
                if f is None:
                    (self.partial / name).parent.mkdir(parents=True, exist_ok=True)
                    f = self._sides[name] = open(self.partial / name, "ab")  # noqa: SIM115
                f.write(data)
        finally:
            try:
                out.settle()  # the batch's memory is the caller's again once write() returns
            finally:
                stats.settle()
        self._in_shard += batch.n_examples
        self._written += batch.n_examples
        point(f"{self.format_name}.written")

    def _finish_shard(self, index: int) -> None:
        """Hand the shard to the commit stage (its own thread): the next shard is written
        while this one is made durable and recorded."""
        sink, out, shard_stats = self._sink, self._out, self._stats
        assert sink is not None and out is not None and shard_stats is not None
        sink.finish(out)
        sides = {}
        for name, handle in self._sides.items():
            handle.flush()
            sides[name] = handle.tell()
        side_fds = [h.fileno() for h in self._sides.values()]
        self._sink = self._out = self._stats = None
        n_examples, self._in_shard = self._in_shard, 0
        if self._commits is None:
            self._commits = ThreadPoolExecutor(1, thread_name_prefix="actstore-commit")
        self._committing.append(
            self._commits.submit(
                self._commit, index, n_examples, sink, out, shard_stats, sides, side_fds
            )
        )
        point(f"{self.format_name}.shard_finished")

    def _commit(
        self,
        index: int,
        n_examples: int,
        sink: ShardSink,
        out: ShardOutput,
        shard_stats: ShardStats,
        sides: dict[str, int],
        side_fds: list[int],
    ) -> None:
        try:
            entries = out.close_files(also=side_fds)
        except BaseException:
            out.abort()
            raise
        info = sink.info()
        files = [WrittenFile(n, e, d, info.get(n, {})) for n, (e, d) in entries.items()]
        chunks = sink.chunk_files()
        point(f"{self.format_name}.shard_synced")
        for f in files:
            self._digests[f.name] = f.digests
        stats = shard_stats.finish()
        entry = ShardRecord(
            index=index,
            n_examples=n_examples,
            files={f.name: f.entry for f in files},
            info={f.name: f.info for f in files},
            chunks=tuple(chunks),
            sides=sides,
            stats={str(s): stats_doc(st) for s, st in stats.items()},
            folded={str(s): st for s, st in stats.items()},
        )
        self._append_journal(entry)
        self._shards.append(entry)
        point(f"{self.format_name}.shard_recorded")

    def sync(self) -> None:
        """Wait until every finished shard is durable and recorded in the journal (the
        commit stage otherwise records them in the background)."""
        self._drain_commits()

    def stage_seconds(self) -> dict[str, float]:
        """CPU seconds each pipeline stage took so far, summed over its threads."""
        return dict(self.clock.seconds)

    def _raise_failed_commit(self) -> None:
        """Re-raise a commit's failure on the writer's thread (finished ones are dropped)."""
        done = [f for f in self._committing if f.done()]
        self._committing = [f for f in self._committing if not f.done()]
        for fut in done:
            fut.result()

    def _drain_commits(self) -> None:
        """Wait for every shard handed to the commit stage (re-raising the first error)."""
        pending, self._committing = self._committing, []
        error: BaseException | None = None
        for fut in pending:
            try:
                fut.result()
            except BaseException as err:  # noqa: BLE001 - wait for all, raise the first
                error = error or err
        if error is not None:
            raise error

    def abort(self) -> None:
        """Stop without publishing; finished shards stay for a resume (a partial directory
        holding none is removed: there is nothing to resume)."""
        if self._sink is not None:
            self._sink.abort()
            self._sink = None
        if self._out is not None:
            self._out.abort()
            self._out = self._stats = None
        try:
            self._drain_commits()  # a shard already handed over is kept if it commits
        except BaseException as err:  # noqa: BLE001 - the caller's error is the one raised
            log.debug("a shard's commit failed while aborting: %s", err)
        self._shutdown_pools()
        for handle in self._sides.values():
            handle.close()
        self._sides.clear()
        if self._lock is not None and self._created and not self._shards and self.partial.exists():
            remove_tree(self.partial)
            self._created = False
        self._release()

    def _shutdown_pools(self) -> None:
        if self._commits is not None:
            self._commits.shutdown(wait=True)
            self._commits = None
        if self._pools is not None:
            self._pools.shutdown()
            self._pools = None


def _mask(n: int, start: int, count: int) -> np.ndarray:
    keep = np.zeros(n, dtype=bool)
    keep[start : start + count] = True
    return keep


__all__ = ["PART", "PROGRESS", "ShardRecord", "ShardedWriter", "read_part", "recorded_shards"]
