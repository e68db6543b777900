"""Locks that a forked child gets fresh: :class:`ForkSafeLock`.

A DataLoader worker is a ``fork`` of the process that made the loader, and inherits its
readers with every lock in them. A lock that another thread of the parent held at the
moment of the fork (a read-ahead thread checking a block, say) stays held forever in the
child, whose first use of it then hangs. A :class:`ForkSafeLock` is a plain
``threading.Lock`` in the process that made it, and a new, free one in a forked child
(replaced in the child as it starts, before any thread of its own can use it).

Example:
    >>> lock = ForkSafeLock()
    >>> with lock:
    ...     lock.locked()
    True
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any


class ForkSafeLock:
    """``threading.Lock`` semantics, made anew (free) in a forked child. Picklable: an
    unpickled one is new too."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        _ALL.add(self)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self._lock.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]


#: Every live :class:`ForkSafeLock`, given a free lock in a forked child.
_ALL: weakref.WeakSet[ForkSafeLock] = weakref.WeakSet()


def _fresh_after_fork() -> None:
    for lock in list(_ALL):
        lock._lock = threading.Lock()


os.register_at_fork(after_in_child=_fresh_after_fork)
