"""The moving parts of :class:`~actstore.formats.activault.writer.ActivaultWriter`: one
background uploader per hook, the packer that fills megabatch files, and the position
(example, tokens to skip) a resume starts from."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from ...errors import CaptureError
from ...stats import RunningStats
from ...storage.manifest import block_keys
from ...storage.object import (
    ObjectStore,
    join_key,
)
from .layout import (
    data_file_name,
    serialize_megabatch,
)

if TYPE_CHECKING:
    import torch
else:
    from ..._lazy import torch

log = logging.getLogger(__name__)


def keyed_digest(store_id: str, name: str, data: Any) -> int:
    """The keyed digest of a one-block file ``name`` (``hook/file.pt``) of run ``store_id``,
    as the root manifest records it."""
    return xxhash.xxh3_64_intdigest(data) ^ int(block_keys(store_id, name, 0, 1)[0])


@dataclass
class UploadJob:
    group: int
    uuid: str
    states: torch.Tensor
    input_ids: torch.Tensor


class HookUploader:
    """Serialises and uploads one hook's megabatches on its own threads and client.

    ``submit`` blocks only while ``queue_files`` megabatches already wait. Errors are
    reported through ``on_error`` and stop further uploads of this hook.
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
        on_done: Callable[[int, str, int, RunningStats, str], None],
        on_error: Callable[[BaseException], None],
        store_id: str,
    ) -> None:
        self.hook, self.prefix, self.store, self.store_id = hook, prefix, store, store_id
        self.expected_bytes = expected_bytes
        self.on_done, self.on_error = on_done, on_error
        self.files = 0
        self.bytes = 0
        self.busy_s = 0.0
        self._lock = threading.Lock()
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

    def _upload(self, job: UploadJob) -> None:
        start = time.perf_counter()
        stats = group_statistics(job.states)  # here: in parallel across hooks, off the capture
        buffer = serialize_megabatch(job.states, job.input_ids)
        data = buffer.getbuffer()
        key = join_key(self.prefix, data_file_name(job.uuid, job.group + 1))
        with self._lock:
            if self.expected_bytes is None:
                self.expected_bytes = len(data)
            expected = self.expected_bytes
        if len(data) != expected:
            raise CaptureError(
                f"torch.save produced {len(data)} bytes for {key}, but this hook's files are "
                f"{expected} bytes (bytes_per_file); Activault's reader needs every file of a "
                "hook to be exactly the same size"
            )
        name = f"{self.hook}/{data_file_name(job.uuid, job.group + 1)}"
        digest = f"{keyed_digest(self.store_id, name, data):016x}"
        self.store.put(key, data)
        del data
        with self._lock:
            self.files += 1
            self.bytes += expected
            self.busy_s += time.perf_counter() - start
        self.on_done(job.group, self.hook, expected, stats, digest)

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

    Rows are cast to the stored dtype as they are copied in (one pass, no concatenation);
    a full buffer is handed out as is (it owns exactly its storage, as torch.save needs).
    """

    def __init__(self, hooks: list[str], n: int, d: int, dtype: torch.dtype) -> None:
        self.hooks, self.n, self.d, self.dtype = hooks, n, d, dtype
        self.fill = 0
        self._states: dict[str, torch.Tensor] = {}
        self._ids = torch.empty(0, dtype=torch.int64)

    def _new(self) -> None:
        self._states = {h: torch.empty(self.n, self.d, dtype=self.dtype) for h in self.hooks}
        self._ids = torch.empty(self.n, dtype=torch.int64)
        self.fill = 0

    def add(
        self, rows: dict[str, torch.Tensor], ids: torch.Tensor
    ) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        """Append ``rows[hook]`` ([k, d]) and ``ids`` ([k]); return the groups filled."""
        full, pos, k = [], 0, ids.shape[0]
        while pos < k:
            if self.fill == 0:
                self._new()
            take = min(self.n - self.fill, k - pos)
            for hook in self.hooks:
                self._states[hook][self.fill : self.fill + take].copy_(rows[hook][pos : pos + take])
            self._ids[self.fill : self.fill + take].copy_(ids[pos : pos + take])
            self.fill += take
            pos += take
            if self.fill == self.n:
                full.append((self._states, self._ids))
                self.fill = 0
        return full


def group_statistics(states: torch.Tensor) -> RunningStats:
    """Statistics of one megabatch's stored values (exactly what a reader sees). A run's
    statistics are these merged in group order, so a resumed run's are bit-identical."""
    return RunningStats.of(states.reshape(-1, states.shape[-1]).to(torch.float32).numpy())
