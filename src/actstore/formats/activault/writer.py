"""Write an Activault run: per-hook background uploaders, exact resume after a crash.

Data flow. ``write(batch)`` casts each site's activations to the stored dtype, drops the
tokens the batch's ``token_mask`` rejects (token cleaning), and appends the kept tokens to
one stream per hook. Every ``rows_per_file x sequence_length`` tokens form a *group*: one
megabatch per hook, all named with the same group uuid (so crosscoders can match tokens
across layers). Each hook's megabatches go through a bounded queue to that hook's
:class:`HookUploader`, which serialises (``torch.save``) and uploads them on its own
threads with its own client; the caller waits only when a queue is full. The caller's
thread only packs (the one cast to the stored dtype); ``torch.save`` writes straight from
the packed megabatch into the file (local: positional writes with rolling writeback,
digested as written, into a temporary file beside the final name) or into one upload
buffer (object storage), while the statistics are folded on a thread pool. A commit
thread makes group k durable (fsync, rename, directory fsync) and records it while group
k+1 is written.

Commit protocol (what makes resume exact). ``cfg.json`` is first written when the first
group is handed to the uploaders, before any data file exists (opening a writer creates
nothing). A group is committed once every hook's file of it is uploaded, in group order:
the first commit writes each hook's ``metadata.json`` (with ``bytes_per_file``), then
``cfg.json`` records ``groups`` and the stream position where the next group starts
(example, kept tokens already stored of that example), then each hook's
``statistics.json`` is updated. Files are whole or absent (single PUT, or a
multipart upload completed only when every part is in; on a local disk a temporary file
renamed into place by the commit). A rerun of the same capture finds
``cfg.json``, deletes files of uncommitted groups and unfinished uploads, folds any
statistics that lag the commit record back in from the committed files, and resumes at
the recorded position: no token is stored twice or missed.

Example:
    >>> import os, tempfile
    >>> from actstore.testing import make_acts, make_batches, make_plan
    >>> plan, out = make_plan(n_examples=24), tempfile.TemporaryDirectory()  # 6 tokens each
    >>> w = ActivaultWriter(plan, f"{out.name}/run", ActivaultOptions(rows_per_file=4))  # or s3://
    >>> for batch in make_batches(plan, make_acts(plan)):
    ...     w.write(batch)
    >>> run = w.close()
    >>> sorted(os.listdir(run))  # doctest: +NORMALIZE_WHITESPACE
    ['actstore-manifest.json', 'actstore-positions.npy', 'cfg.json',
     'models.layers.1.post', 'models.layers.3.post']
    >>> len(os.listdir(run / "models.layers.1.post"))  # 6 files + 2 json
    8
"""

from __future__ import annotations

import functools
import logging
import threading
import uuid as uuid_lib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from ...batch import Batch, CapturePlan
from ...errors import (
    ActstoreError,
    CaptureError,
    StoreExistsError,
)
from ...faults import point
from ...stats import RunningStats
from ...storage.location import Location
from ...storage.manifest import (
    store_id_of,
)
from ...storage.object import (
    ObjectStore,
    StorageOptions,
    base_name,
    is_internal,
    join_key,
    open_location,
)
from ...storage.writeback import pool_size
from ..threads import StageClock, check_settings, cpu_pool
from ..wholefiles import commit_files
from ..writerbase import FormatWriter
from .layout import (
    CFG,
    METADATA,
    STATISTICS,
    check_hook_prefixes,
    dtype_name,
    group_uuid,
    hook_name,
    parse_dtype,
)
from .metadata import (
    HookMetadata,
    RunRecord,
    run_cfg,
    statistics_to_dict,
)
from .options import ActivaultOptions
from .positions import (
    PIECES,
    PositionLog,
    build,
)
from .resume import RunResume
from .run import conversion_options, file_shape, write_run_manifest
from .upload import (
    HookUploader,
    Packer,
    Position,
    Stored,
    UploadJob,
)

if TYPE_CHECKING:
    import torch
else:
    from ..._lazy import torch

log = logging.getLogger(__name__)


class ActivaultWriter(RunResume, FormatWriter):
    """Writer for one Activault run (``s3://bucket/run``, ``file://...`` or a directory).

    Attributes ``resume_from`` (examples whose kept tokens are all stored, or the example a
    committed file ends in) and ``complete`` tell capture where to restart.
    """

    def __init__(
        self,
        plan: CapturePlan,
        out: str | Location,
        options: ActivaultOptions | None = None,
        *,
        storage: StorageOptions | None = None,
    ) -> None:
        options = options or ActivaultOptions()
        check_settings()  # a bad setting, before anything is made
        self.plan, self.options = plan, options
        self._storage = options.storage_options(str(out), storage)
        self.store, self.run_prefix = open_location(str(out), self._storage)
        self.location = self.store.url(self.run_prefix)  # a URL or an absolute path
        self.hooks: dict[str, str] = {hook_name(site): str(site) for site in plan.sites}
        check_hook_prefixes(self.hooks)
        self.dtype = parse_dtype(options.dtype)
        self.rows, self.seq = file_shape(plan, options)
        self.batches_per_file = max(1, self.rows // plan.batch_size)
        self.tokens_per_file = self.rows * self.seq
        self.complete = False
        self.resume_from = 0
        #: Seconds ``write`` waited for room in an uploader queue (back-pressure).
        self.blocked_s = 0.0
        self._error: BaseException | None = None
        self._lock = threading.Lock()  # guards the pending groups and the run record
        self._committed = threading.Condition(self._lock)
        self._cfg_lock = threading.Lock()  # one cfg.json write at a time
        self._uploaders: dict[str, HookUploader] = {}
        self._pending: dict[int, dict[str, Any]] = {}
        #: CPU seconds per stage (cast, encode, statistics, write, hash, commit)
        self.clock = StageClock()
        self._pool: ThreadPoolExecutor | None = None
        self._committer: threading.Thread | None = None
        self._stopping = False
        self._metadata_bytes: dict[str, int] = {}
        self._packer = Packer(
            list(self.hooks),
            self.tokens_per_file,
            plan.d_model,
            self.dtype,
            self.clock,
            keep=options.queue_files + options.upload_threads,
        )
        self._stats: dict[str, RunningStats] = {}  # set here or by _resume
        self._stream = 0  # stream rows of the kept tokens handed to the packer
        self._cfg_written = True  # a new run writes it with its first group
        self.identity = {
            "hooks": self.hooks,
            "rows_per_file": self.rows,
            "sequence_length": self.seq,
            "dtype": options.dtype,
            "plan": plan.to_json_dict(),  # what a resumed capture must match
        }
        self.store_id = store_id_of(self.identity)
        if not self.run_prefix:
            raise CaptureError(f"{self.location}: give a run name, e.g. s3://bucket/my-run")
        self.store.check_bucket()
        self._write_lock: Any = self.store.acquire_lock(self.run_prefix)
        try:
            self._open()
        except BaseException:
            self._write_lock.release()
            raise

    @classmethod
    def from_plan(
        cls, plan: CapturePlan, location: Location, options: Any = None
    ) -> ActivaultWriter:
        """The writer of ``plan`` for the run at ``location`` (a directory or ``s3://``)."""
        location = Location.parse(location)
        return cls(plan, location.url, options or ActivaultOptions(), storage=location.storage)

    @classmethod
    def convert_options(cls, plan: CapturePlan, options: Any) -> ActivaultOptions:
        """:func:`~actstore.formats.activault.run.conversion_options`."""
        return conversion_options(plan, options)

    # ------------------------------------------------------------------ open / resume

    def _hook_prefix(self, hook: str) -> str:
        return join_key(self.run_prefix, hook)

    def _key(self, *parts: str) -> str:
        return join_key(self.run_prefix, *parts)

    def _new_record(self) -> RunRecord:
        return RunRecord(
            # from the capture record: a rerun names every file as the first attempt did
            run_id=str(uuid_lib.UUID(hex=xxhash.xxh3_128_hexdigest(self.store_id.encode()))),
            hooks=self.hooks,
            rows_per_file=self.rows,
            sequence_length=self.seq,
            dtype=self.options.dtype,
            plan=self.plan.to_json_dict(),
        )

    def _open(self) -> None:
        cfg_key = self._key(CFG)
        if self.store.size(cfg_key) is None:
            self._start_new_run()
        else:
            self._resume(cfg_key)
        self._position = Position(self.record.next_example, self.record.next_skip)
        self._positions = PositionLog(
            self.store, self._key, self.plan.tokens_per_example, self.record.next_example
        )
        self._stream = self.record.groups * self.tokens_per_file - self.record.next_skip
        self._next_example = self.record.next_example
        self._skip = self.record.next_skip
        self._emitted = self.record.groups
        if not self._stats:
            self._stats = {h: RunningStats(self.plan.d_model) for h in self.hooks}

    def _start_new_run(self) -> None:
        existing = self.store.list_dirs(self.run_prefix)
        check_hook_prefixes([*existing, *(h for h in self.hooks if h not in existing)])
        if any(not is_internal(o.key) for o in self.store.list(self.run_prefix + "/")):
            raise StoreExistsError(
                f"{self.location} already holds objects but no cfg.json, so it is not a run "
                "actstore can resume; choose a new run name"
            )
        self.record = self._new_record()
        # cfg.json is written with the first group (before any data file: a run holding
        # files but no cfg.json is refused): opening a writer creates nothing
        self._cfg_written = False
        log.info("new Activault run %s (hooks: %s)", self.location, ", ".join(self.hooks))

    def _fail(self, err: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = err
            self._committed.notify_all()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            err = self._error
            if isinstance(err, ActstoreError):
                raise CaptureError(f"uploading to {self.location} failed: {err}") from err
            raise CaptureError(f"uploading to {self.location} failed: {err!r}") from err

    def _make_store(self) -> ObjectStore:
        return self.store.clone()  # its own client and connection pool

    def stage_seconds(self) -> dict[str, float]:
        """CPU seconds spent so far per stage, summed over threads."""
        return dict(self.clock.seconds)

    def _start_uploaders(self) -> None:
        opts = self.options
        if self._pool is None:
            self._pool = cpu_pool(pool_size())
        local = self.store.local_root is not None
        for hook in self.hooks:
            prefix = self._hook_prefix(hook)
            self._uploaders[hook] = HookUploader(
                hook,
                prefix,
                self._make_store(),
                threads=opts.upload_threads,
                queue_files=opts.queue_files,
                expected_bytes=self._metadata_bytes.get(hook),
                on_done=self._uploaded,
                on_error=self._fail,
                store_id=self.store_id,
                directory=Path(self.store.url(prefix)) if local else None,
                pool=self._pool,
                clock=self.clock,
            )
        self._committer = threading.Thread(
            target=self._commit_loop, name="actstore-activault-commit", daemon=True
        )
        self._committer.start()

    def write(self, batch: Batch) -> None:
        """Append the kept tokens of ``batch``'s examples not already stored."""
        if self.complete:
            raise CaptureError(f"{self.location} is already complete")
        self._raise_if_failed()
        ids = batch.example_ids
        keep = ids >= self._next_example
        if not keep.all():
            batch = batch.select(keep)
            ids = batch.example_ids
        if batch.n_examples == 0:
            return
        expected = np.arange(self._next_example, self._next_example + batch.n_examples)
        if not np.array_equal(ids, expected):
            raise CaptureError(
                f"batches must arrive in example order: expected ids from {self._next_example}, "
                f"got {ids[:4].tolist()}..."
            )
        b, t = batch.n_examples, batch.n_tokens
        if batch.d_model != self.plan.d_model or set(batch.acts) != set(self.hooks.values()):
            raise CaptureError(
                f"batch has sites {sorted(batch.acts)} of width {batch.d_model}; this run stores "
                f"{sorted(self.hooks.values())} of width {self.plan.d_model}"
            )
        has_mask = batch.token_mask is not None
        if self.record.token_mask is None:
            with self._lock:
                self.record = replace(self.record, token_mask=has_mask)
        elif self.record.token_mask != has_mask:
            raise CaptureError(
                f"{self.location} was started {'with' if self.record.token_mask else 'without'} "
                "token cleaning; resume it with the same cleaning setting"
            )
        mask = (
            np.ones((b, t), dtype=bool)
            if batch.token_mask is None
            else np.array(batch.token_mask, dtype=bool, copy=True)
        )
        # where each example's kept tokens go (before any skip)
        self._positions.add(build(mask, batch.token_ids, first=self._stream))
        self._stream += int(mask.sum())
        if self._skip:  # the first kept tokens of this example are stored already
            row = mask[0]
            row[np.flatnonzero(row)[: self._skip]] = False
            self._skip = 0
        kept = mask.sum(axis=1)
        self._position.add(ids, kept)
        flat = np.flatnonzero(mask.reshape(-1))
        index = None if flat.size == b * t else torch.from_numpy(flat)
        # gathered and cast to the stored dtype as they are packed, on the CPU pool
        rows = {
            hook: _cpu_rows(batch.acts[site], b * t, self.dtype)
            for hook, site in self.hooks.items()
        }
        if batch.token_ids is not None:
            token_ids = torch.from_numpy(np.asarray(batch.token_ids, dtype=np.int64)).reshape(-1)
        else:
            token_ids = torch.full((b * t,), -1, dtype=torch.int64)
        if self._pool is None:
            self._pool = cpu_pool(pool_size())
        full = self._packer.add(
            rows,
            token_ids if index is None else token_ids.index_select(0, index),
            index,
            self._pool,
        )
        self._next_example += b
        for states, group_ids in full:
            self._emit_group(states, group_ids)
            self._raise_if_failed()

    def _emit_group(self, states: dict[str, torch.Tensor], ids: torch.Tensor) -> None:
        """Hand one full group (a megabatch per hook) to the uploaders."""
        if not self._cfg_written:
            self._write_cfg()
            self._cfg_written = True
        if not self._uploaders:
            self._start_uploaders()
        group = self._emitted
        self._emitted += 1
        name = group_uuid(self.record.run_id, group)
        position = self._position.advance(self.tokens_per_file)
        with self._lock:
            self._pending[group] = {
                "left": set(self.hooks),
                "position": position,
                "stored": {},
            }
        ids = ids.view(self.rows, self.seq)
        for hook in self.hooks:
            job = UploadJob(
                group,
                name,
                states[hook].view(self.rows, self.seq, -1),
                ids,
                functools.partial(self._packer.recycle, hook, states[hook]),
            )
            self.blocked_s += self._uploaders[hook].submit(job)

    def _uploaded(self, stored: Stored) -> None:
        """Called on an uploader thread when a hook's file of a group is written."""
        with self._lock:
            pending = self._pending[stored.group]
            pending["left"].discard(stored.hook)
            pending["stored"][stored.hook] = stored
            self._committed.notify_all()  # the commit stage may take the group

    def _commit_loop(self) -> None:
        """The commit stage: commits groups in order, each once every hook's file of it is
        written, on its own thread (group k is made durable while k+1 is written)."""
        while True:
            with self._lock:
                self._committed.wait_for(self._head_ready)
                if self._error is not None:
                    return
                pending = self._pending.get(self.record.groups)
                if pending is None or pending["left"]:
                    return  # stopping, nothing complete left
            try:
                self.clock.timed("commit", self._commit, pending)
            except BaseException as err:  # noqa: BLE001 - reported to the writer
                self._fail(err)
                return

    def _head_ready(self) -> bool:
        head = self._pending.get(self.record.groups)
        return self._error is not None or self._stopping or (head is not None and not head["left"])

    def _commit(self, pending: dict[str, Any]) -> None:
        """Publish one finished group: its files (durable, then renamed into place on a
        local disk), metadata (first time), cfg.json, statistics."""
        stored: dict[str, Stored] = pending["stored"]
        staged = [s.staged for s in stored.values() if s.staged is not None]
        commit_files(staged)
        group = self.record.groups
        for hook, s in stored.items():
            self._metadata_bytes.setdefault(hook, s.nbytes)
        if group == 0:
            for hook in self.hooks:
                md = HookMetadata.for_shape(
                    rows=self.rows,
                    seq=self.seq,
                    d=self.plan.d_model,
                    dtype=dtype_name(self.dtype),
                    batches_per_file=self.batches_per_file,
                ).with_bytes(self._metadata_bytes[hook])
                self.store.put_json(join_key(self._hook_prefix(hook), METADATA), md.to_dict())
        example, skip = pending["position"]
        self._positions.put_piece(example)  # before cfg.json commits the position past them
        digests = {h: [*self.record.digests.get(h, []), stored[h].digest] for h in self.hooks}
        with self._lock:
            record = replace(
                self.record, groups=group + 1, next_example=example, next_skip=skip, digests=digests
            )
        self._write_cfg(record)
        for hook in self.hooks:  # merged in group order: deterministic
            self._stats[hook] = self._stats[hook].merge(stored[hook].stats)
            self.store.put_json(
                join_key(self._hook_prefix(hook), STATISTICS), statistics_to_dict(self._stats[hook])
            )
        with self._lock:
            self._pending.pop(group)
            self.record = replace(
                self.record, groups=group + 1, next_example=example, next_skip=skip, digests=digests
            )
            self._committed.notify_all()

    def _write_cfg(self, record: RunRecord | None = None) -> None:
        bucket = self.store.bucket_name
        doc = run_cfg(
            record or self.record,
            run_name=base_name(self.run_prefix),
            bucket=bucket,
            batch_size=self.plan.batch_size,
            batches_per_file=self.batches_per_file,
        )
        with self._cfg_lock:
            self.store.put_json(self._key(CFG), doc, indent=2)

    # ------------------------------------------------------------------ finish

    def flush(self) -> None:
        """Wait until every full file handed over so far is uploaded and committed."""
        with self._committed:
            self._committed.wait_for(
                lambda: self.record.groups >= self._emitted or self._error is not None
            )
        self._raise_if_failed()

    def _write_manifest(self) -> None:
        """The root manifest of the complete run, put last: every committed file (its
        keyed digest from the commit record), each hook's metadata and statistics, cfg.json,
        the positions file; the positions pieces removed first."""
        self.store.delete_tree(self._key(PIECES))
        write_run_manifest(
            self.store, self.run_prefix, self.record, self.store_id, self.plan.d_model
        )

    def close(self) -> Path | str:
        """Upload what is queued, mark the run complete, and return its location.

        Kept tokens after the last full file are dropped (every file must be the same
        size, as Activault's reader requires); the count is logged and recorded.
        """
        if self.complete:
            return _published(self.location)
        self._raise_if_failed()
        dropped = self._packer.fill
        for uploader in self._uploaders.values():
            uploader.close()
        self._raise_if_failed()
        self.flush()
        self._stop_committer()
        if self.record.groups == 0:
            raise CaptureError(
                f"the capture kept {dropped} tokens, fewer than one file of "
                f"{self.tokens_per_file} ({self.rows} rows x {self.seq} tokens); lower "
                "--opt rows_per_file or capture more examples"
            )
        if dropped:
            log.warning(
                "dropped the last %d tokens: fewer than one file of %d tokens "
                "(Activault files must all be the same size)",
                dropped,
                self.tokens_per_file,
            )
        self._positions.write_table(self.record.groups * self.tokens_per_file, self._next_example)
        with self._lock:
            self.record = replace(self.record, complete=True, dropped_tokens=dropped)
            self._write_cfg()
        point("activault.completed")
        self._write_manifest()
        self._write_lock.release()
        self.complete = True
        log.info(
            "published %s: %d files per hook, %d tokens each",
            self.location,
            self.record.groups,
            self.tokens_per_file,
        )
        return _published(self.location)

    def abort(self) -> None:
        """Stop without marking the run complete; committed files stay for a resume."""
        for uploader in self._uploaders.values():
            uploader.close(abort=True)
        self._stop_committer()
        with self._lock:  # written, never committed: the temporary files go
            pending, self._pending = self._pending, {}
        for group in pending.values():
            for stored in group["stored"].values():
                if stored.staged is not None:
                    stored.staged.discard()
        self._write_lock.release()

    def _stop_committer(self) -> None:
        """Stop the commit stage once it has committed every complete group."""
        with self._lock:
            self._stopping = True
            self._committed.notify_all()
        if self._committer is not None:
            self._committer.join()
            self._committer = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _cpu_rows(acts: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """A site's activations as ``[rows, d]`` on the CPU: a view when they are there, else
    cast to the stored ``dtype`` on their device and copied over."""
    acts = acts.detach()
    if acts.device.type != "cpu":
        acts = acts.to(dtype=dtype).to("cpu")
    return acts.reshape(rows, -1)


def _published(location: str) -> Path | str:
    """What ``close()`` returns: the run's directory, or its URL on object storage."""
    loc = Location.parse(location)
    return loc.path() if loc.is_local else loc.url
