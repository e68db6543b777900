"""The moving parts of :class:`~actstore.formats.activault.writer.ActivaultWriter`: one
background uploader per hook (``torch.save`` straight into the file or the upload buffer,
statistics folded on a thread pool meanwhile), the packer that fills megabatch files (the
one cast to the stored dtype), and the position (example, tokens to skip) a resume starts
from."""

from __future__ import annotations

import io
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import CaptureError
from ...stats import RunningStats
from ...storage.manifest import keyed_digest
from ...storage.object import (
    ObjectStore,
    join_key,
)
from ..threads import StageClock, copy_rows, empty_bytes, empty_tensor
from ..wholefiles import StagedFile, fold_statistics
from .layout import (
    data_file_name,
    tensor_bytes,
    write_megabatch,
)

if TYPE_CHECKING:
    import torch
else:
    from ..._lazy import torch

log = logging.getLogger(__name__)


@dataclass
class UploadJob:
    group: int
    uuid: str
    states: torch.Tensor
    input_ids: torch.Tensor
    #: called once the file is stored and nothing reads ``states`` any more (the packer
    #: reuses the buffer)
    release: Callable[[], None] | None = None


@dataclass
class Stored:
    """One hook's file of a group, written (not yet committed): its size, keyed digest,
    statistics, and on a local disk the temporary file the commit makes durable and renames
    (None on object storage: the upload itself published it whole)."""

    group: int
    hook: str
    nbytes: int
    stats: RunningStats
    digest: str
    staged: StagedFile | None = None


class HookUploader:
    """Serialises and stores one hook's megabatches on its own threads and client.

    ``submit`` blocks only while ``queue_files`` megabatches already wait. Per file: the
    statistics are folded on ``pool`` (chunks of the file in a fixed order) while
    ``torch.save`` writes the file, straight from the megabatch's storage, either
    positionally into a temporary file beside its final name (``directory`` given: a
    local run; digested as written, with rolling writeback; made durable and renamed by
    the writer's commit stage) or into one buffer that is uploaded (object storage).
    Results go to ``on_done`` as :class:`Stored`; errors through ``on_error``, and stop
    further uploads of this hook.
    """

    def __init__(
        self,
        hook: str,
        prefix: str,
        store: ObjectStore,
        *,
        threads: int,
        queue_files: int,
        expected_bytes: int | None,
        on_done: Callable[[Stored], None],
        on_error: Callable[[BaseException], None],
        store_id: str,
        directory: Path | None = None,
        pool: Executor | None = None,
        clock: StageClock | None = None,
    ) -> None:
        self.hook, self.prefix, self.store, self.store_id = hook, prefix, store, store_id
        self.expected_bytes = expected_bytes
        self.on_done, self.on_error = on_done, on_error
        self.directory, self.pool = directory, pool
        self.clock = clock or StageClock()
        self.files = 0
        self.bytes = 0
        self.busy_s = 0.0
        self._lock = threading.Lock()
        self._buffers = threading.local()
        self._queue: queue.Queue[UploadJob | None] = queue.Queue(maxsize=queue_files)
        self._stop = threading.Event()
        self._closed = False
        self._stops_sent = 0
        self._threads = [
            threading.Thread(target=self._run, name=f"actstore-upload-{hook}-{i}", daemon=True)
            for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    def submit(self, job: UploadJob) -> float:
        """Queue ``job``; returns the seconds spent waiting for room."""
        if self._closed:
            raise CaptureError(f"the uploader of {self.hook} is closed; no more files can be sent")
        start = time.perf_counter()
        self._queue.put(job)
        return time.perf_counter() - start

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if self._stop.is_set():
                continue
            try:
                self._upload(job)
            except BaseException as err:  # noqa: BLE001 - reported to the writer
                self._stop.set()
                self.on_error(err)

    def _check_size(self, key: str, size: int) -> int:
        with self._lock:
            if self.expected_bytes is None:
                self.expected_bytes = size
            expected = self.expected_bytes
        if size != expected:
            raise CaptureError(
                f"torch.save produced {size} bytes for {key}, but this hook's files are "
                f"{expected} bytes (bytes_per_file); Activault's reader needs every file of a "
                "hook to be exactly the same size"
            )
        return expected

    def _upload(self, job: UploadJob) -> None:
        start = time.perf_counter()
        # folded on the pool while the file is written: in parallel across hooks and chunks
        stats = fold_statistics(job.states, self.pool, self.clock)
        file = data_file_name(job.uuid, job.group + 1)
        key = join_key(self.prefix, file)
        name = f"{self.hook}/{file}"
        staged = None
        if self.directory is not None:
            staged, digest, size = self._write_local(job, file, name)
        else:
            digest, size = self._put(job, key, name)
        try:
            expected = self._check_size(key, size)
            result = Stored(job.group, self.hook, expected, stats(), digest, staged)
        except BaseException:
            if staged is not None:
                staged.discard()
            raise
        if job.release is not None:
            job.release()
        del job
        with self._lock:
            self.files += 1
            self.bytes += expected
            self.busy_s += time.perf_counter() - start
        self.on_done(result)

    def _write_local(self, job: UploadJob, file: str, name: str) -> tuple[StagedFile, str, int]:
        """torch.save into a staged file beside ``file`` (committed later)."""
        assert self.directory is not None
        self.directory.mkdir(parents=True, exist_ok=True)
        stream = StagedFile(self.directory / file, self.store_id, name, self.clock)
        try:
            self.clock.timed("encode", write_megabatch, job.states, job.input_ids, stream)
            stream.finish()
        except BaseException:
            stream.discard()  # the encoder's error is the one raised
            raise
        return stream, f"{stream.digest():016x}", stream.size

    def _put(self, job: UploadJob, key: str, name: str) -> tuple[str, int]:
        """torch.save into one buffer (no copy beyond the tensors'), then one upload."""
        with self._lock:
            guess = self.expected_bytes
        if guess is None:
            guess = tensor_bytes(job.states, job.input_ids) + (1 << 20)
        # one buffer per upload thread, reused (fresh memory costs a page fault per 4 KiB);
        # the put below has sent it before the thread's next file
        buffer = getattr(self._buffers, "stream", None)
        if buffer is None or buffer.capacity < guess:
            buffer = self._buffers.stream = _MemoryStream(guess)
        buffer.size = 0
        self.clock.timed("encode", write_megabatch, job.states, job.input_ids, buffer)
        data = buffer.view()
        digest = self.clock.timed("hash", keyed_digest, self.store_id, name, data)
        self.store.put(key, data)
        return f"{digest:016x}", len(data)

    def close(self, *, abort: bool = False) -> None:
        """Finish queued uploads (or skip them with ``abort``) and stop the threads.

        Idempotent: a second call (``abort`` after a ``close`` that raised) sends no more
        stop markers (the threads that took theirs have exited: nothing would take another
        off the bounded queue, and the put would block for ever).
        """
        if abort:
            self._stop.set()
        self._closed = True
        while self._stops_sent < len(self._threads):
            self._queue.put(None)
            self._stops_sent += 1
        for t in self._threads:
            t.join()


class _MemoryStream(io.RawIOBase):
    """An in-memory file of one preallocated, uninitialised buffer (grown only if
    ``capacity`` was too small): ``torch.save`` copies each record into it once."""

    def __init__(self, capacity: int) -> None:
        self._buf = empty_bytes(max(capacity, 1 << 16))
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:  # type: ignore[override]
        view = np.frombuffer(memoryview(data).cast("B"), np.uint8)
        end = self.size + len(view)
        if end > len(self._buf):
            grown = empty_bytes(max(end, 2 * len(self._buf)))
            grown[: self.size] = self._buf[: self.size]
            self._buf = grown
        self._buf[self.size : end] = view
        self.size = end
        return len(view)

    @property
    def capacity(self) -> int:
        return len(self._buf)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        pass

    def view(self) -> memoryview:
        # numpy's stubs declare ndarray.__buffer__ (PEP 688) only for Python >= 3.12
        return memoryview(self._buf[: self.size]).cast("B")  # type: ignore[arg-type]


class Position:
    """Where the head of the token stream is: an example and how many of its kept tokens
    lie before the head. Entries are ``[example id, kept tokens left, kept tokens before]``."""

    def __init__(self, example: int, skip: int) -> None:
        self.example, self.skip = example, skip
        self._pending: deque[list[int]] = deque()

    def add(self, example_ids: np.ndarray, kept: np.ndarray) -> None:
        for eid, n in zip(example_ids.tolist(), kept.tolist()):
            before = self.skip if not self._pending and eid == self.example else 0
            self._pending.append([eid, n, before])

    def advance(self, n_tokens: int) -> tuple[int, int]:
        """Consume ``n_tokens`` from the head; return the new head position."""
        while self._pending and (n_tokens > 0 or self._pending[0][1] == 0):
            entry = self._pending[0]
            take = min(entry[1], n_tokens)
            n_tokens -= take
            if take == entry[1]:
                self._pending.popleft()
                self.example, self.skip = entry[0] + 1, 0
            else:
                entry[1] -= take
                entry[2] += take
                self.example, self.skip = entry[0], entry[2]
        assert n_tokens == 0, "advanced past the buffered tokens"
        return self.example, self.skip


class Packer:
    """Packs kept token rows of every hook into preallocated megabatch buffers.

    Rows are cast to the stored dtype as they are copied in (one pass, no concatenation;
    token cleaning's gather included), on ``pool``'s threads
    (:func:`~actstore.formats.threads.copy_rows`); a full buffer is handed out as is (it
    owns exactly its storage, as torch.save needs).
    """

    def __init__(
        self,
        hooks: list[str],
        n: int,
        d: int,
        dtype: torch.dtype,
        clock: StageClock,
        keep: int = 2,
    ) -> None:
        self.hooks, self.n, self.d, self.dtype, self.clock = hooks, n, d, dtype, clock
        self.keep = keep  # buffers kept per hook for reuse: as many as can be in flight
        self.fill = 0
        self._states: dict[str, torch.Tensor] = {}
        self._ids = torch.empty(0, dtype=torch.int64)
        self._free: dict[str, list[torch.Tensor]] = {h: [] for h in hooks}
        self._lock = threading.Lock()

    def _new(self) -> None:
        with self._lock:
            self._states = {
                h: self._free[h].pop()
                if self._free[h]
                else empty_tensor((self.n, self.d), self.dtype)
                for h in self.hooks
            }
        self._ids = torch.empty(self.n, dtype=torch.int64)
        self.fill = 0

    def recycle(self, hook: str, states: torch.Tensor) -> None:
        """Take back ``hook``'s megabatch buffer once its file is stored: the next group
        fills it again (fresh memory would cost a page fault per 4 KiB, ~0.7 CPU s/GB)."""
        with self._lock:
            if len(self._free[hook]) < self.keep:
                self._free[hook].append(states)

    def add(
        self,
        rows: dict[str, torch.Tensor],
        ids: torch.Tensor,
        index: torch.Tensor | None,
        pool: Executor,
    ) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        """Append ``rows[hook]`` ([k, d], or its rows ``index`` when given) and ``ids``
        (already selected); return the groups filled. Returns once every copy is done."""
        full, pos, k = [], 0, ids.shape[0]
        while pos < k:
            if self.fill == 0:
                self._new()
            take = min(self.n - self.fill, k - pos)
            at = slice(self.fill, self.fill + take)
            copies = [
                (
                    self._states[hook][at],
                    rows[hook] if index is not None else rows[hook][pos : pos + take],
                    None if index is None else index[pos : pos + take],
                )
                for hook in self.hooks
            ]
            copy_rows(pool, copies, self.clock)
            self._ids[at].copy_(ids[pos : pos + take])
            self.fill += take
            pos += take
            if self.fill == self.n:
                full.append((self._states, self._ids))
                self.fill = 0
        return full
