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


class StoreLock:
    """A held write lock; :meth:`release` (or process death) frees it."""

    def __init__(self, store: Path, path: Path, fd: int) -> None:
        self.store, self.path = store, path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, store: str | os.PathLike, *, break_lock: bool = False) -> StoreLock:
        """Lock ``store`` for writing or raise :class:`StoreLockedError`. ``break_lock`` (or
        ``ACTSTORE_BREAK_LOCK=1``, which ``capture --break-lock`` sets) takes a held lock
        over: only for a capture known to be dead on another host."""
        store = Path(store)
        break_lock = break_lock or os.environ.get(BREAK_LOCK_ENV) == "1"
        path = lock_path(store)
        path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read(fd)
                os.close(fd)
                if not break_lock:
                    raise StoreLockedError(
                        f"another capture ({_who(holder)}) is writing {store}; wait for it "
                        "or, if it is dead, rerun with --break-lock"
                    ) from None
                log.warning("breaking the lock of %s held by %s", store, _who(holder))
                path.unlink(missing_ok=True)
                break_lock = False
                continue
            try:  # the file may have been removed by its last holder in the meantime
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            break
        old = _read(fd)
        if old.get("pid") and old.get("pid") != os.getpid():
            dead = old.get("host") == socket.gethostname() and not pid_alive(int(old["pid"]))
            log.warning(
                "taking over the write lock of %s from %s%s",
                store,
                _who(old),
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
        return cls(store, path, fd)

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent)."""
        if self._fd is None:
            return
        try:
            if os.fstat(self._fd).st_ino == os.stat(self.path).st_ino:
                self.path.unlink()
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read(fd: int) -> dict:
    try:
        doc = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def _who(holder: dict) -> str:
    return (
        f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, "
        f"started {holder.get('start', '?')}"
    )
