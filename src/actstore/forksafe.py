"""Locks that a forked child gets fresh: :class:`ForkSafeLock`.

A DataLoader worker is a ``fork`` of the process that made the loader, and inherits its
readers with every lock in them. A lock that another thread of the parent held at the
moment of the fork (a read-ahead thread checking a block, say) stays held forever in the
child, whose first use of it then hangs. A :class:`ForkSafeLock` is a plain
``threading.Lock`` in the process that made it, and a new, free one in any other.

Example:
    >>> lock = ForkSafeLock()
    >>> with lock:
    ...     lock.locked()
    True
"""

from __future__ import annotations

import os
import threading
from typing import Any


class ForkSafeLock:
    """``threading.Lock`` semantics, made anew (free) the first time it is used in a
    process other than the one that made it. Picklable: an unpickled one is new too."""

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def _current(self) -> threading.Lock:
        if self._pid != os.getpid():  # a forked child: the parent's state is meaningless
            self._pid, self._lock = os.getpid(), threading.Lock()
        return self._lock

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._current().acquire(blocking, timeout)

    def release(self) -> None:
        self._current().release()

    def locked(self) -> bool:
        return self._current().locked()

    def __enter__(self) -> bool:
        return self._current().__enter__()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
