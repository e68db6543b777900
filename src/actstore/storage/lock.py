"""An exclusive write lock per store: one capture writes a store at a time.

The lock is a file ``.<store name>.lock`` beside the store, held with ``flock`` for as long
as the writer lives and holding ``{"host", "pid", "start"}`` of its holder. A second writer
gets :class:`StoreLockedError` with one line naming the holder. The kernel drops a flock
when its process dies, so a capture killed with ``kill -9`` never blocks the next one; the
next one finds the dead holder's record and says it takes over. ``break_lock=True``
removes a lock that a live process (or a process on another host sharing the file system)
still holds: only for a holder known to be dead.

Object storage has no flock: writers to ``s3://`` hold a lease object there instead
(:mod:`actstore.storage.s3lock`), with the same refusal and the same ``break_lock``.

Example:
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> lock = StoreLock.acquire(d / "store")
    >>> lock.release()
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import logging
import os
import socket
from pathlib import Path
from typing import Self

from ..errors import StoreLockedError
from .local import load_json

log = logging.getLogger(__name__)


def lock_path(store: str | os.PathLike) -> Path:
    """The lock file of the store ``store``: ``.<name>.lock`` in its parent directory."""
    store = Path(store)
    return store.parent / f".{store.name}.lock"


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (a zombie counts as gone)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


#: Environment switch that makes every writer of this process take over held locks.
BREAK_LOCK_ENV = "ACTSTORE_BREAK_LOCK"


class FileLock:
    """An exclusive ``flock``: the one flock mechanism of actstore (store write locks, the
    cache's eviction lock, dist's merge lock, the loader server's ring lock).

    ``target`` is an open descriptor (the caller keeps it; the lock is dropped, not
    closed) or a path: the file is created if missing (its folder too) and opened for the
    time the lock is held. A lock on a path is held on the file that is at the path when
    :meth:`acquire` returns: a holder that removed the file (``release(remove=True)``)
    while this one waited makes it retry on the new file, so two processes never both
    hold "the" lock of a path.

    Example:
        >>> import tempfile, pathlib
        >>> path = pathlib.Path(tempfile.mkdtemp()) / ".lock"
        >>> with FileLock(path):
        ...     FileLock(path).acquire(blocking=False)
        False
    """

    def __init__(self, target: int | str | os.PathLike) -> None:
        self.path: Path | None = None if isinstance(target, int) else Path(target)
        self.fd: int | None = target if isinstance(target, int) else None

    def acquire(self, *, blocking: bool = True) -> bool:
        """Take the lock (waiting for it unless ``blocking=False``); False if another
        holds it and ``blocking`` is False."""
        flags = fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB)
        if self.path is None:
            assert self.fd is not None
            try:
                fcntl.flock(self.fd, flags)
            except BlockingIOError:
                return False
            return True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, flags)
            except BlockingIOError:
                os.close(fd)
                return False
            if _same_file(fd, self.path):
                self.fd = fd
                return True
            os.close(fd)  # removed by its holder while we waited: lock the new file

    def release(self, *, remove: bool = False) -> None:
        """Drop the lock (idempotent); a path's file is closed, and with ``remove`` deleted
        first (if it is still the one locked)."""
        if self.fd is None:
            return
        if self.path is None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            return
        if remove and _same_file(self.fd, self.path):
            self.path.unlink(missing_ok=True)
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> Self:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


class StoreLock:
    """A held write lock; :meth:`release` (or process death) frees it."""

    def __init__(self, store: Path, lock: FileLock) -> None:
        self.store, self._lock = store, lock
        self.path = lock_path(store)

    @classmethod
    def acquire(cls, store: str | os.PathLike, *, break_lock: bool = False) -> StoreLock:
        """Lock ``store`` for writing or raise :class:`StoreLockedError`. ``break_lock`` (or
        ``ACTSTORE_BREAK_LOCK=1``, which ``capture --break-lock`` sets) takes a held lock
        over: only for a capture known to be dead on another host."""
        store = Path(store)
        break_lock = break_lock or os.environ.get(BREAK_LOCK_ENV) == "1"
        path = lock_path(store)
        lock = FileLock(path)
        while not lock.acquire(blocking=False):
            holder = _read_path(path)
            if not break_lock:
                raise StoreLockedError(
                    f"another capture ({describe_holder(holder)}) is writing {store}; wait for "
                    "it or, if it is dead, rerun with --break-lock"
                )
            log.warning("breaking the lock of %s held by %s", store, describe_holder(holder))
            path.unlink(missing_ok=True)
            break_lock = False
        fd = lock.fd
        assert fd is not None
        old = _read(fd)
        if old.get("pid") and old.get("pid") != os.getpid():
            dead = old.get("host") == socket.gethostname() and not pid_alive(int(old["pid"]))
            log.warning(
                "taking over the write lock of %s from %s%s",
                store,
                describe_holder(old),
                " (that process is dead)" if dead else " (it no longer holds it)",
            )
        record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "start": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        os.fsync(fd)
        return cls(store, lock)

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent)."""
        self._lock.release(remove=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read(fd: int) -> dict:
    try:
        doc = load_json(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def _read_path(path: Path) -> dict:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return {}
    try:
        return _read(fd)
    finally:
        os.close(fd)


def describe_holder(holder: dict) -> str:
    """``pid P on host H, started T`` of a lock record (``?`` for what it lacks)."""
    return (
        f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, "
        f"started {holder.get('start', '?')}"
    )
