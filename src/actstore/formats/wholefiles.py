"""The write pipeline's part for a format that writes whole files of its own rather than
shards of consecutive examples (Activault's megabatch files): the format encodes into a
:class:`StagedFile`, this module writes, digests, folds the statistics and commits.

* :class:`StagedFile`: a new file beside its final name, appended around the page cache
  where the file system allows (:class:`~actstore.storage.writeback.Appender`) and
  digested in order as written (its keyed digest as the root manifest records it);
* :func:`commit_files`: several staged files made durable together (one ``fsync`` per
  file, on the I/O streams the file system can commit at once), renamed into place, and
  their directories made durable;
* :func:`fold_statistics`: a file's statistics folded on the CPU pool while it is written.

No format module fsyncs, hashes or computes statistics itself.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..stats import Moments, RunningStats, moments
from ..storage.local import AtomicFile, fsync_dir
from ..storage.manifest import BlockHasher
from ..storage.writeback import Appender, DirectFile, sync_files
from .threads import StageClock

if TYPE_CHECKING:
    import torch


class StagedFile(io.RawIOBase):
    """A write-only file object for an encoder (``torch.save``) that writes file ``name``
    (``hook/file.pt``) of store ``store_id`` at ``path``: staged under a temporary name
    beside it until :func:`commit_files`. The caller may reuse a buffer once a write
    returns; :meth:`finish` writes what is staged and closes the file for writing."""

    def __init__(self, path: Path, store_id: str, name: str, clock: StageClock) -> None:
        self.staged = AtomicFile(path, durable=False)
        try:
            self._file = DirectFile(self.staged.tmp, self.staged.fd)
            self._appender = Appender(self._file)
        except BaseException:
            self.staged.discard()
            raise
        self._hasher, self._clock = BlockHasher(store_id, name, 0), clock
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:  # type: ignore[override]
        view = memoryview(data).cast("B")
        t0 = time.thread_time()
        self._appender.write(view)
        t1 = time.thread_time()
        self._hasher.update(view)
        self._clock.add("write", t1 - t0)
        self._clock.add("hash", time.thread_time() - t1)
        self.size += len(view)
        return len(view)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        pass

    def finish(self) -> None:
        """Write what is staged (before :func:`commit_files` makes it durable)."""
        t0 = time.thread_time()
        try:
            self._appender.finish()
        finally:
            self._file.close()
            self._clock.add("write", time.thread_time() - t0)

    def digest(self) -> int:
        """The keyed digest of everything written (the file as one block)."""
        return int(self._hasher.digests()[0])

    @property
    def direct_bytes(self) -> int:
        """Bytes written around the page cache."""
        return self._file.direct_bytes

    @property
    def align(self) -> int:
        """The alignment direct writes need (0: no direct I/O on this file system)."""
        return self._file.align

    def discard(self) -> None:
        """Remove the staged file (idempotent)."""
        self._file.close()
        self.staged.discard()


def commit_files(files: Sequence[StagedFile]) -> None:
    """Publish ``files`` (each :meth:`~StagedFile.finish`\\ ed): their bytes made durable
    together, then each renamed into place, then their directories made durable."""
    if not files:
        return
    sync_files([f.staged.fd for f in files])
    for f in files:
        f.staged.commit()  # durable=False: the rename alone, the bytes are synced above
    for directory in sorted({f.staged.path.parent for f in files}):
        fsync_dir(directory)


def fold_statistics(
    states: torch.Tensor, pool: Executor | None, clock: StageClock | None = None
) -> Callable[[], RunningStats]:
    """Start folding the statistics of ``states`` (``[..., d]``, stored dtype): runs of
    :attr:`~actstore.stats.RunningStats.rows_per_chunk` rows from the first, each run's
    :func:`~actstore.stats.moments` on ``pool`` (GIL-free; inline when None), merged in
    run order by the returned function. Equal to ``RunningStats.of`` of the values widened
    to float32, bit for bit, whatever the pool."""
    rows = states.reshape(-1, states.shape[-1])
    d = rows.shape[1]
    per = RunningStats(d).rows_per_chunk
    parts: list[Future | Moments] = []
    for lo in range(0, rows.shape[0], per):
        chunk = rows[lo : lo + per]
        if pool is None:
            parts.append(moments(chunk))
        elif clock is not None:
            parts.append(pool.submit(clock.timed, "statistics", moments, chunk))
        else:
            parts.append(pool.submit(moments, chunk))

    def finish() -> RunningStats:
        stats = RunningStats(d)
        for p in parts:
            stats.add(p.result() if isinstance(p, Future) else p)
        return stats

    return finish


def statistics_of(states: torch.Tensor) -> RunningStats:
    """:func:`fold_statistics` of ``states`` on the caller's thread."""
    return fold_statistics(states, None)()
