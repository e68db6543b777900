"""One flock mechanism (``storage.lock.FileLock``) under every lock on local disk: store
write locks (``StoreLock``), the cache's eviction lock, dist's merge lock and the loader
server's ring lock. Real files and threads of this process: two opens of one file are
two flock holders, as two processes would be."""

from __future__ import annotations

import os
import threading

import pytest

from actstore.errors import StoreLockedError
from actstore.storage.lock import FileLock, StoreLock, lock_path


def test_a_path_lock_is_exclusive_and_released(tmp_path):
    path = tmp_path / "sub" / ".lock"  # the folder is made
    with FileLock(path) as held:
        assert held.fd is not None
        assert FileLock(path).acquire(blocking=False) is False
    other = FileLock(path)
    assert other.acquire(blocking=False) is True
    other.release()
    assert other.fd is None and path.exists()


def test_a_waiter_on_a_removed_lock_file_locks_the_new_file(tmp_path):
    """The holder removes the lock file as it releases (dist's merge lock, StoreLock): the
    process that waited on the old file must not believe it holds the lock while a third
    one locks the new file at the same path."""
    path = tmp_path / ".merge.lock"
    first = FileLock(path)
    first.acquire()
    waiter = FileLock(path)
    got = threading.Event()

    def wait() -> None:
        waiter.acquire()
        got.set()

    thread = threading.Thread(target=wait)
    thread.start()
    assert not got.wait(0.2)  # blocked behind the holder
    first.release(remove=True)
    thread.join(10)
    assert got.is_set()
    assert waiter.fd is not None
    assert os.fstat(waiter.fd).st_ino == os.stat(path).st_ino  # the file at the path
    assert FileLock(path).acquire(blocking=False) is False  # so a third one waits
    waiter.release(remove=True)
    assert not path.exists()


def test_a_descriptor_lock_keeps_its_descriptor(tmp_path):
    """The loader server's ring lock: flock on a descriptor its owner keeps open."""
    path = tmp_path / "ring"
    path.write_bytes(b"\0" * 8)
    fd, other = os.open(path, os.O_RDWR), os.open(path, os.O_RDWR)
    try:
        with FileLock(fd):
            assert FileLock(other).acquire(blocking=False) is False
        assert os.fstat(fd).st_size == 8  # still open
        lock = FileLock(other)
        assert lock.acquire(blocking=False) is True
        lock.release()
    finally:
        os.close(fd)
        os.close(other)


def test_store_lock_refuses_a_second_writer_and_is_removed_on_release(tmp_path):
    store = tmp_path / "store"
    held = StoreLock.acquire(store)
    with pytest.raises(StoreLockedError, match=rf"pid {os.getpid()} on host .*--break-lock"):
        StoreLock.acquire(store)
    held.release()
    assert not lock_path(store).exists()
    with StoreLock.acquire(store):
        assert lock_path(store).exists()
    assert not lock_path(store).exists()


def test_break_lock_takes_a_held_store_lock_over(tmp_path, caplog):
    store = tmp_path / "store"
    held = StoreLock.acquire(store)
    taken = StoreLock.acquire(store, break_lock=True)
    assert "breaking the lock" in caplog.text
    with pytest.raises(StoreLockedError):
        StoreLock.acquire(store)
    held.release()  # the old holder's release leaves the new holder's file alone
    assert lock_path(store).exists()
    taken.release()
    assert not lock_path(store).exists()
