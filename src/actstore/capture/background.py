"""Hand batches to a writer on a background thread through a bounded queue.

The forward loop calls :meth:`BackgroundWriter.put`; a full queue blocks it (back-pressure),
so no batch is ever dropped and memory stays bounded at ``queue_size`` batches. A writer
error is re-raised in the forward loop at its next ``put`` or at :meth:`close`.

Example:
    >>> import tempfile
    >>> from actstore.formats.saev import SaevOptions, SaevWriter
    >>> from actstore.storage.location import Location
    >>> from actstore.testing import make_acts, make_batches, make_plan
    >>> plan, out = make_plan(), tempfile.TemporaryDirectory()
    >>> writer = SaevWriter.from_plan(plan, Location.parse(out.name), SaevOptions())
    >>> with BackgroundWriter(writer, queue_size=4) as bg:  # an error aborts the writer
    ...     for batch in make_batches(plan, make_acts(plan)):
    ...         bg.put(batch)
    ...     store = bg.close()  # waits for the queue, then publishes
    >>> (store / "shards.json").is_file()
    True
"""

from __future__ import annotations

import errno
import queue
import threading
import time
from typing import Any, Self

from ..batch import Batch
from ..errors import ActstoreError, CaptureError, ConfigError
from ..formats.writerbase import WriterBase

_DONE = object()


#: Errors of a disk that cannot take more (full, over a quota, past a file-size limit).
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def writer_failed(err: BaseException) -> CaptureError:
    """The one line a capture ends with when its writer failed (on its thread, or as it
    finished): what failed and, for a full disk, what to do.

    Example:
        >>> print(writer_failed(OSError(errno.ENOSPC, "No space left on device")))
        the writer failed: [Errno 28] No space left on device; free space (or choose another --out) and rerun the same command: it resumes from the finished shards
    """
    hint = ""
    if isinstance(err, OSError) and err.errno in _DISK_FULL:
        hint = (
            "; free space (or choose another --out) and rerun the same command: it resumes "
            "from the finished shards"
        )
    return CaptureError(f"the writer failed: {err}{hint}")


class BackgroundWriter:
    """Runs ``writer.write`` on its own thread; ``close()`` returns ``writer.close()``."""

    def __init__(self, writer: WriterBase, *, queue_size: int = 4) -> None:
        if queue_size < 1:
            raise ConfigError("queue_size must be at least 1")
        self.writer = writer
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="actstore-writer", daemon=True)
        self._thread.start()
        #: Seconds the forward loop spent blocked on a full queue (back-pressure).
        self.blocked_s = 0.0

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _DONE:
                return
            try:
                self.writer.write(item)
            except BaseException as err:  # noqa: BLE001 - re-raised in the producer
                self._error = err
                return  # the producer sees the error at its next put/close

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise writer_failed(self._error) from self._error

    def put(self, batch: Batch) -> None:
        """Queue ``batch`` for writing; blocks while the queue is full."""
        start = time.perf_counter()
        self._put(batch)
        self.blocked_s += time.perf_counter() - start

    def _put(self, item: Any) -> None:
        while True:
            self._raise_if_failed()
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _finish(self) -> None:
        if self._thread.is_alive() and self._error is None:
            try:
                self._put(_DONE)
            except CaptureError:
                pass
        self._thread.join()

    def close(self) -> Any:
        """Wait for queued batches, then close the writer (publishing its output). A disk
        error as it finishes (a full disk, a quota or file-size limit: the last shards and
        the index are written here) is one :class:`CaptureError`, as during the capture;
        the shards already finished stay for a rerun to resume."""
        self._finish()
        self._raise_if_failed()
        try:
            return self.writer.close()
        except OSError as err:
            if isinstance(err, ActstoreError):
                raise
            raise writer_failed(err) from err

    def abort(self) -> None:
        """Stop after the batches already queued, without publishing."""
        self._finish()
        self.writer.abort()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
