"""The crash protocol, written once: :class:`ShardedWriter` is the base of every writer whose
store is a directory of shards of consecutive examples (saev, SAELens, pkl.gz, zarr).

A format's writer only encodes: :meth:`ShardedWriter.open_shard` returns a
:class:`ShardSink` that writes one shard's files, and :meth:`ShardedWriter.write_index`
writes the format's index and metadata at publication. Everything else lives here:

* **where**: the store is published at :meth:`~ShardedWriter.store_location` (a local
  directory; ``s3://`` outputs are staged locally and uploaded by
  :class:`~actstore.formats.s3_staged.StagedS3Writer`), written before that in
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
    >>> from actstore.formats.saev import SaevOptions, SaevWriter
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

import abc
import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from ..batch import Batch, CapturePlan
from ..errors import (
    CaptureError,
    ConfigError,
    CorruptStoreError,
    OtherCaptureError,
    StoreExistsError,
)
from ..faults import point
from ..sites import Site
from ..stats import RunningStats, merge_all
from ..storage import (
    atomic_write_json,
    fsync_dir,
    link_or_copy,
    make_tree_read_only,
    remove_tree,
)
from ..storage.location import Location, partial_of
from ..storage.lock import StoreLock
from ..storage.manifest import (
    MANIFEST,
    FileEntry,
    ManifestBuilder,
    RootManifest,
    hash_file_blocks,
    hash_ranges,
    store_id_of,
)
from ..storage.writeback import direct_alignment_in
from .base import FormatWriter, summary_of
from .journal import (
    BOOKKEEPING,
    PART,
    PROGRESS,
    append_journal,
    part_checks,
    read_journal,
    read_part,
    recorded_shards,
    stats_doc,
    write_journal,
)
from .pipeline import (
    HUGE_FROM,
    Pools,
    ShardOutput,
    StageClock,
    check_settings,
    copy_rows,
    empty_tensor,
    put_intact,
)
from .shard import ShardSink, ShardStats, WrittenFile

if TYPE_CHECKING:
    import torch

    from ..storage.integrity import Integrity
else:
    from .._lazy import torch

log = logging.getLogger(__name__)


class ShardedWriter(FormatWriter):
    """Base of shard-directory writers; see the module docstring for the protocol.

    Subclasses call ``super().__init__`` from their constructor with the published
    location, the capture record (what a rerun must match to resume), the shard size and
    the example range, after setting what :meth:`open_shard` needs.
    """

    #: Registry name of the format (the manifest and fault points carry it).
    format_name: ClassVar[str] = ""
    #: The format's options dataclass.
    options_type: ClassVar[type] = type(None)

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
        self._shards: list[dict[str, Any]] = []
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
    @abc.abstractmethod
    def shard_examples(cls, plan: CapturePlan, options: Any) -> int:
        """Examples per shard for ``plan`` (distributed slices are aligned on it)."""

    @classmethod
    def for_slice(cls, plan: CapturePlan, store: Location, options: Any, sl: Any) -> ShardedWriter:
        """The writer of one slice of a distributed capture (published at ``store``)."""
        make: Callable[..., ShardedWriter] = cls  # the subclass's signature, not __init__'s
        return make(plan, store.parent, options, example_range=(sl.start, sl.stop), store=store)

    # ------------------------------------------------------------------ the format's part

    @abc.abstractmethod
    def open_shard(self, index: int, directory: Path) -> ShardSink:
        """A sink writing shard ``index`` (global numbering) into ``directory``."""

    @abc.abstractmethod
    def write_index(
        self, directory: Path, shards: Sequence[dict[str, Any]], stats: dict[Site, RunningStats]
    ) -> None:
        """The format's index and metadata files of a finished store (every shard recorded
        in order: ``index``, ``n_examples``, ``files``), written at publication."""

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

    def summary(self, rows: int) -> dict[str, Any]:
        """What the root manifest records of the metadata (checked by readers on open)."""
        return summary_of(
            sites=self.sites, d_model=self.plan.d_model, dtype=self.stored_dtype, rows=rows
        )

    #: Name of the stored dtype (the manifest summary carries it).
    stored_dtype: str = "float32"

    def manifest_skip(self) -> tuple[str, ...]:
        """Folders whose chunk files (names not starting with ``.``) the manifest leaves to a
        digest file of the format's own (zarr's activation chunks: millions of files)."""
        return ()

    def discard_after(self, directory: Path, position: int) -> None:
        """On resume: remove what an earlier attempt wrote in :meth:`manifest_skip` folders
        for examples from ``position`` on (the resumed capture writes them again)."""

    # ------------------------------------------------------------------ open / resume

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

    def _open(self) -> None:
        if self.final.exists() and not (self.final.is_dir() and not any(self.final.iterdir())):
            self._check_published()
            return
        if self.partial.exists():
            if (self.partial / MANIFEST).is_file():  # crashed between manifest and rename
                self._check_record(self.partial)
                self._finish_publication()
                return
            self._resume()

    def _check_record(self, directory: Path) -> None:
        """``directory``'s root manifest was written for this capture record, or refuse."""
        try:
            manifest = RootManifest.from_bytes(
                (directory / MANIFEST).read_bytes(), str(directory / MANIFEST)
            )
        except (OSError, CorruptStoreError) as err:
            raise StoreExistsError(
                f"{directory} holds a publication cut short with an unreadable manifest "
                f"({err}); delete it to start this capture over"
            ) from err
        if manifest.record != self.store_id:
            raise StoreExistsError(
                f"{directory} holds another capture, cut short while publishing; rerun that "
                "capture to finish it, or delete the directory to start this one"
            )

    def _check_published(self) -> None:
        """``final`` holds a store: ours with this record (complete), or refuse."""
        from ..storage.files import LocalFiles
        from ..storage.integrity import Integrity

        try:
            checks = Integrity.open(LocalFiles(self.final))
            damaged = checks.small_file_faults()
            manifest = checks.manifest
        except CorruptStoreError as err:
            manifest, damaged = None, [str(err)]
        if damaged and manifest is not None and manifest.record == store_id_of(self.record):
            raise StoreExistsError(
                f"{self.final} holds this capture, damaged ({damaged[0]}); run actstore verify "
                "on it, then move it away or restore it"
            )
        if manifest is not None and manifest.record != store_id_of(self.record):
            raise OtherCaptureError(
                f"{self.final} holds another capture (its record is not this one's); "
                "choose another output or move it away",
                location=str(self.final),
            )
        if manifest is None:
            raise StoreExistsError(
                f"{self.final} already holds something else (another capture, a damaged store "
                "or files not written by actstore); choose another output or move it away"
            )
        self.complete = True
        self.resume_from = self.example_range[1]
        self._release()
        log.info("%s is already published; nothing to write", self.final)

    def _resume(self) -> None:
        """Keep recorded shards whose files still hash to their digests; drop the rest."""
        try:
            progress, entries = read_journal(self.partial)
            recorded = progress["record"]
            self._init_names = [str(n) for n in progress["init"]]
            if not self.reproducible:
                self.started = float(progress["started"])
            self._elapsed_before = float(entries[-1]["elapsed"] if entries else progress["elapsed"])
        except (CorruptStoreError, KeyError, TypeError, ValueError, OSError) as err:
            log.warning("%s is unreadable (%s); starting this capture over", self.partial, err)
            remove_tree(self.partial)
            return
        if recorded != json.loads(json.dumps(self.record, default=str)):
            raise StoreExistsError(
                f"{self.partial} holds an unfinished capture with another configuration; "
                "rerun that capture to finish it, or delete the directory to start this one"
            )
        kept: list[dict[str, Any]] = []
        for entry in entries:
            index = self.first_shard + len(kept)
            if entry.get("index") != index or entry.get("n_examples") != self._shard_size(index):
                break
            if not self.shard_intact(entry):
                log.warning(
                    "shard %d of %s fails its checksums; rewriting from there", index, self.partial
                )
                break
            entry.pop("elapsed", None)
            kept.append(entry)
        keep = {name for e in kept for name in e["files"]}
        sides = kept[-1]["sides"] if kept else {}
        skip = tuple(f.strip("/") + "/" for f in self.manifest_skip())
        for name in _files_below(self.partial, exclude=BOOKKEEPING):
            if name in keep or name in sides or name in self._init_names:
                continue
            if any(name.startswith(f) for f in skip):
                continue  # the format's own chunk folders: discard_after decides
            (self.partial / name).unlink()
        for name, size in sides.items():
            path = self.partial / name
            if not path.is_file() or path.stat().st_size < size:
                log.warning("%s is shorter than its finished shards; starting over", path)
                remove_tree(self.partial)
                return
            os.truncate(path, size)
        self._shards = kept
        self._created = True
        self.resume_from = self.example_range[0] + sum(e["n_examples"] for e in kept)
        self.discard_after(self.partial, self.resume_from)
        self._save_progress()
        point(f"{self.format_name}.resumed")
        log.info(
            "resuming %s: %d finished shards (%d examples) kept",
            self.partial,
            len(kept),
            self.resume_from - self.example_range[0],
        )

    def shard_intact(self, entry: dict[str, Any]) -> bool:
        """On resume: whether recorded shard ``entry``'s files still hash to their digests,
        and the files it put whole (:meth:`put_files`: zarr's chunks) to theirs."""
        try:
            for name, doc in entry["files"].items():
                want = FileEntry.from_dict(doc, f"{self.partial / PROGRESS} ({name})")
                path = self.partial / name
                if not path.is_file() or path.stat().st_size != want.size:
                    return False
                if want.ranges is not None:
                    got, digests = hash_ranges(self.store_id, name, path.read_bytes(), want.ranges)
                else:
                    got, digests = hash_file_blocks(self.store_id, path, name, want.unit)
                if got.digest != want.digest:
                    return False
                self._digests[name] = digests
            puts = self.put_files(entry)
        except (CorruptStoreError, KeyError, TypeError, ValueError, AttributeError):
            return False
        if puts is None:
            return False
        return all(put_intact(self.partial / n, self.store_id, i, d) for n, i, d in puts)

    def put_files(self, entry: dict[str, Any]) -> Iterable[tuple[str, str, int]] | None:
        """On resume: every file recorded shard ``entry`` put whole
        (:meth:`ShardOutput.put`), as ``(name, ident, digest)`` read from the format's own
        index of them, 0 for a file that must be absent (its fill value); None when that
        index cannot be read (the shard is written again). The pipeline checks each.
        Default: none."""
        return ()

    def shard_bounds(self, index: int) -> tuple[int, int]:
        """Example ids ``[lo, hi)`` of shard ``index``."""
        lo = self.example_range[0] + (index - self.first_shard) * self.examples_per_shard
        return lo, min(lo + self.examples_per_shard, self.example_range[1])

    def _shard_size(self, index: int) -> int:
        lo, hi = self.shard_bounds(index)
        return hi - lo

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
        self._init_names = _files_below(init)
        self._save_progress(init)
        point(f"{self.format_name}.init_filled")
        os.rename(init, self.partial)
        fsync_dir(self.partial.parent)
        self._created = True
        point(f"{self.format_name}.partial_created")

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
        entries = [{**e, "elapsed": self.elapsed()} for e in self._shards]
        write_journal(directory or self.partial, self._journal_head(), entries)

    def _append_journal(self, entry: dict[str, Any]) -> None:
        """Record one durable shard: one line appended to the journal, fsynced (O(1))."""
        append_journal(self.partial, {**entry, "elapsed": self.elapsed()})

    # ------------------------------------------------------------------ writing

    @property
    def position(self) -> int:
        """The next example id this writer expects."""
        return self.resume_from + self._written

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

    #: Batches may carry any number of tokens (prompt/response stores pad per batch).
    ragged_tokens: ClassVar[bool] = False
    #: A part is a store of its slice too (its index is written beside ``part.json``): the
    #: pkl.gz spec's machines each write a readable store.
    parts_are_stores: ClassVar[bool] = False
    #: The shard sink writes the cast tensors' own memory (saev's slabs), so a large batch
    #: that direct writes cannot read where it lies is first copied into the aligned cast
    #: buffer (formats that encode or stage every byte anyway leave it where it is).
    writes_batch_memory: ClassVar[bool] = False

    def _append(self, index: int, batch: Batch) -> None:
        sink, out, stats = self._sink, self._out, self._stats
        if sink is None or out is None or stats is None:  # a new shard (all are set together)
            self._raise_failed_commit()
            pools = self._pools = self._pools or Pools(clock=self.clock)
            if self._direct_align is None:
                self._direct_align = direct_alignment_in(self.partial)
            sink = self._sink = self.open_shard(index, self.partial)
            out = self._out = ShardOutput(self.partial, self.store_id, pools)
            stats = self._stats = ShardStats(self.sites, self.plan.d_model, pools.cpu, self.clock)
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
        entry = {
            "index": index,
            "n_examples": n_examples,
            "files": {f.name: f.entry.to_dict() for f in files},
            "chunks": chunks,
            "info": {f.name: f.info for f in files},
            "sides": sides,
            "stats": {str(s): stats_doc(st) for s, st in stats.items()},
        }
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

    def sealed_files(self) -> list[tuple[str, os.PathLike]]:
        """Every finished shard's files, named as published (relative to the output)."""
        if self.complete:
            return []
        rel = self.final.relative_to(self.output).as_posix()
        prefix = "" if rel == "." else rel + "/"
        return [
            (prefix + name, self.partial / name)
            for e in self._shards
            for name in [*e["files"], *e.get("chunks", ())]
        ]

    # ------------------------------------------------------------------ publish

    def statistics(self) -> dict[Site, RunningStats]:
        """Per-site statistics of every finished shard, merged in shard order."""
        return {
            site: merge_all([RunningStats.from_dict(e["stats"][str(site)]) for e in self._shards])
            for site in self.sites
        }

    def close(self) -> Path:
        """Finish the last shard, write the index and the root manifest, publish; returns
        the store's directory."""
        if self.complete:
            return self.final
        if self._lock is None:
            raise CaptureError(f"the writer of {self.final} was aborted; nothing to publish")
        start, stop = self.example_range
        if self._sink is not None and self.position == stop:
            self._finish_shard(self._shard_index)
        try:
            self._drain_commits()
        except BaseException:
            self.abort()
            raise
        self._shutdown_pools()
        total = sum(e["n_examples"] for e in self._shards)
        if total != stop - start:
            self.abort()
            where = (
                f"rerun the same capture to resume from {self.partial}"
                if self.partial.exists()
                else "no shard was finished, so nothing was kept"
            )
            raise CaptureError(
                f"only {self.position - start} of {stop - start} examples were written; {where}"
            )
        try:
            self._close_sides()
            stats = self.statistics()
            if self.is_part:
                atomic_write_json(self.partial / PART, self._part_doc(), indent=None)
            if not self.is_part or self.parts_are_stores:
                self.write_index(self.partial, self._shards, stats)
            point(f"{self.format_name}.index_written")
            self._write_manifest(self.partial, self._shards, self.summary(self._rows(stats)))
            point(f"{self.format_name}.manifest_written")
            self._finish_publication()
        except BaseException:
            self.abort()  # the finished shards stay: a rerun publishes them
            raise
        log.info("published %s (%d shards, %d examples)", self.final, len(self._shards), total)
        return self.final

    @staticmethod
    def _rows(stats: dict[Site, RunningStats]) -> int:
        return next(iter(stats.values())).count if stats else 0

    def _part_doc(self) -> dict[str, Any]:
        return {
            "example_range": list(self.example_range),
            "record": self.record,
            "plan": self.plan.to_json_dict(),
            "options": dataclasses.asdict(self.options),
            "shards": self._shards,
        }

    def _write_manifest(
        self, directory: Path, shards: Sequence[dict[str, Any]], summary: dict[str, Any]
    ) -> None:
        builder = ManifestBuilder(
            format=self.format_name, store_id=self.store_id, record=self.record
        )
        for entry in shards:
            for name, doc in entry["files"].items():
                builder.add(name, FileEntry.from_dict(doc, name), self._digests[name])
        for name in self._side_names(directory, shards):
            builder.add_file(directory, name, unit=self.side_unit(name))
        builder.add_tree(directory, skip=self.manifest_skip(), exclude=BOOKKEEPING)
        builder.write(directory, summary=summary)

    def _side_names(self, directory: Path, shards: Sequence[dict[str, Any]]) -> list[str]:
        names = set(shards[-1]["sides"]) if shards else set()
        return sorted(n for n in names if (directory / n).is_file())

    def _finish_publication(self) -> None:
        """Drop the bookkeeping, make the files read-only, rename the partial directory
        into place, release the lock (also finishes a publication a crash cut short)."""
        for name in BOOKKEEPING:
            _remove(self.partial / name)
        point(f"{self.format_name}.bookkeeping_removed")
        make_tree_read_only(self.partial)
        if self.final.is_dir() and not any(self.final.iterdir()):
            self.final.rmdir()  # an empty directory made for the output
        self.final.parent.mkdir(parents=True, exist_ok=True)
        fsync_dir(self.partial)
        os.rename(self.partial, self.final)
        fsync_dir(self.final.parent)
        point(f"{self.format_name}.published")
        self.complete = True
        self.resume_from = self.example_range[1]
        self._release()

    def _close_sides(self) -> None:
        for handle in self._sides.values():
            handle.flush()
            os.fsync(handle.fileno())
            handle.close()
        self._sides.clear()

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

    def _release(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    def merge(self, part_dirs: Sequence[str | os.PathLike]) -> Path:
        """Publish this writer's store (opened for the whole capture, nothing written) from
        published parts in example order that together cover every example: shard files are
        hard-linked (copied across file systems), side files concatenated, statistics merged
        shard by shard in order, the index and manifest written as one process would.

        Example:
            >>> SaevWriter.from_plan(plan, out, options).merge(parts)  # doctest: +SKIP
        """
        if self.complete:
            return self.final
        parts = [Path(p) for p in part_dirs]
        if not parts:
            raise ConfigError("merging needs at least one part")
        shards: list[dict[str, Any]] = []
        at = 0
        record = json.loads(json.dumps(self.record, default=str))
        checks = {part: part_checks(part) for part in parts}
        for part in parts:
            doc = read_part(part, checks[part])
            if doc["record"] != record:
                raise ConfigError(f"{part} belongs to a different capture than {self.final}")
            start, stop = doc["example_range"]
            if start != at:
                raise ConfigError(f"{part} starts at example {start}, expected {at}")
            at = stop
            shards += [{**e, "_from": str(part)} for e in doc["shards"]]
        if at != self.plan.n_examples:
            raise ConfigError(f"the parts end at example {at} of {self.plan.n_examples}")
        self._begin()
        try:
            self._merge_into(self.partial, parts, shards, checks)
        except BaseException:
            self.abort()
            raise
        log.info("merged %d parts into %s (%d shards)", len(parts), self.final, len(shards))
        return self.final

    def _merge_into(
        self,
        work: Path,
        parts: list[Path],
        shards: list[dict[str, Any]],
        checks: dict[Path, Integrity],
    ) -> None:
        side_names = sorted(shards[-1]["sides"]) if shards else []
        sides = {n: open(work / n, "wb") for n in side_names}  # noqa: SIM115 - closed below
        try:
            for part in parts:
                for name, handle in sides.items():
                    for piece in checks[part].read_pieces(name):
                        handle.write(piece)
            for entry in shards:
                source = Path(entry.pop("_from"))
                for name in entry["files"]:
                    link_or_copy(source / name, work / name)
                    self._digests[name] = checks[source].digests(name)
                for name in entry.get("chunks", ()):
                    link_or_copy(source / name, work / name)
            sizes = {n: h.tell() for n, h in sides.items()}
        finally:
            for handle in sides.values():
                handle.flush()
                os.fsync(handle.fileno())
                handle.close()
        for entry in shards:
            entry["sides"] = sizes
        self._shards = shards
        stats = self.statistics()
        self.write_index(work, shards, stats)
        self._write_manifest(work, shards, self.summary(self._rows(stats)))
        self._finish_publication()


def _files_below(directory: Path, exclude: Sequence[str] = ()) -> list[str]:
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


def _mask(n: int, start: int, count: int) -> np.ndarray:
    keep = np.zeros(n, dtype=bool)
    keep[start : start + count] = True
    return keep


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        remove_tree(path)
    else:
        path.unlink(missing_ok=True)


__all__ = ["PART", "PROGRESS", "ShardedWriter", "read_part", "recorded_shards"]
