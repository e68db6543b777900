"""Copying one store's files, the part of ``actstore cp`` and of background upload that
moves bytes: :class:`FileCopier` sends each file to object storage (multipart for large
ones, resumable by part) or writes it to a local directory (positional writes, a journal
of finished parts), reading from any :class:`~actstore.storage.files.StoreFiles`."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from ..errors import (
    StorageError,
)
from ..faults import point
from .files import StoreFiles
from .local import atomic_write_bytes, fsync_dir
from .object import ObjectStore, join_key

log = logging.getLogger(__name__)

#: Written after every other file by default: the root manifest, without which readers
#: refuse the store (callers that know the format pass its index files first in ``last=``).


def _disk_error(target: Path | str, err: OSError) -> StorageError:
    """A local write of the copy failed: one line naming the file and what to do."""
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageError(
            f"disk full writing {target}; free space and rerun the same copy to resume"
        )
    code = errno.errorcode.get(err.errno or 0, str(err.errno))
    return StorageError(
        f"writing {target} failed ({code}: {err.strerror}); fix the cause and rerun the same "
        "copy to resume"
    )


class FileCopier:
    """Copies files part by part on a shared pool; with ``etags`` it remembers the ETag each
    S3 object should have (an MD5 of every byte sent: CPU a verified copy pays for)."""

    def __init__(
        self,
        source: StoreFiles,
        store: ObjectStore,
        prefix: str,
        part_bytes: int,
        progress: Callable[[int], None] | None,
        *,
        etags: bool = True,
    ) -> None:
        self.source, self.store, self.prefix = source, store, prefix
        self.part_bytes, self.progress = part_bytes, progress
        self.hash = hashlib.md5 if etags and store.capabilities.md5_etags else None
        self.etags: dict[str, str] = {}
        self.versions: dict[str, str] = {}
        """Name -> the version the backend gave each object sent (where it gives one): the
        object at that version holds the bytes read to send it."""
        self.parts_reused = 0
        """Parts of earlier, interrupted copies kept (not sent again)."""
        self._lock = threading.Lock()

    def run(self, pool: ThreadPoolExecutor, names: list[str], sizes: dict[str, int]) -> None:
        jobs = [(name, self._start(pool, name, sizes[name])) for name in names]
        errors: list[BaseException] = []
        for name, (futures, finish, abort) in jobs:
            try:
                results = [f.result() for f in futures]
                if errors:
                    raise errors[0]
                finish(results)
            except BaseException as err:  # noqa: BLE001 - abort this file, report the first
                for f in futures:  # no part may still write once its file is closed
                    f.cancel()
                wait(futures)
                abort()
                if not errors:
                    errors.append(err)
        if errors:
            raise errors[0]

    def _landed(self, name: str, version: str) -> None:
        if version:
            with self._lock:
                self.versions[name] = version

    def _done(self, n: int) -> None:
        if self.progress is not None:
            with self._lock:
                self.progress(n)

    def _start(
        self, pool: ThreadPoolExecutor, name: str, size: int
    ) -> tuple[list[Future], Any, Any]:
        key = join_key(self.prefix, name)
        part = self.part_bytes
        offsets = list(range(0, size, part)) or [0]
        if self.store.local_root is not None:
            return self._start_local(pool, name, key, size, offsets)
        return self._start_remote(pool, name, key, size, offsets)

    def _start_remote(
        self, pool: ThreadPoolExecutor, name: str, key: str, size: int, offsets: list[int]
    ) -> tuple[list[Future], Any, Any]:
        store = self.store
        if len(offsets) > 1 and not store.capabilities.multipart:
            return self._start_streamed(pool, name, key, size, offsets)
        if len(offsets) == 1:  # one PUT

            def put() -> bytes:
                data = self.source.read_range(name, 0, size, cache=False)
                self._landed(name, store.put(key, data))
                self._done(size)
                return self.hash(data).digest() if self.hash else b""

            def finish_put(digests: list[bytes]) -> None:
                if self.hash:
                    self.etags[name] = digests[0].hex()

            return [pool.submit(put)], finish_put, lambda: None

        upload_id, found = self._resumable(key, size, len(offsets))

        def send(number: int, offset: int) -> tuple[str, bytes]:
            data = self.source.read_range(
                name, offset, min(self.part_bytes, size - offset), cache=False
            )
            old = found.get(number)
            digest = hashlib.md5(data).digest() if old or self.hash else b""
            if old is not None and old.strip('"') == digest.hex():
                etag = old  # sent by an interrupted copy: keep it
                with self._lock:
                    self.parts_reused += 1
            else:
                etag = store.upload_part(key, upload_id, number, data, of=len(offsets))
            point("copy.part_sent")
            self._done(len(data))
            return etag, digest

        futures = [pool.submit(send, i, o) for i, o in enumerate(offsets, start=1)]

        def finish(results: list[tuple[str, bytes]]) -> None:
            store.complete_upload(key, upload_id, [e for e, _ in results], size)
            if self.hash:
                joined = self.hash(b"".join(d for _, d in results)).hexdigest()
                self.etags[name] = f"{joined}-{len(results)}"

        def keep() -> None:  # the parts sent stay for the next run to resume
            log.info("upload of %s left unfinished; run the same copy again to resume it", key)

        return futures, finish, keep

    def _start_streamed(
        self, pool: ThreadPoolExecutor, name: str, key: str, size: int, offsets: list[int]
    ) -> tuple[list[Future], Any, Any]:
        """A large file to a backend without resumable parts: read part by part and
        streamed into one upload that the backend completes atomically at the end."""

        def chunks() -> Any:
            for offset in offsets:
                data = self.source.read_range(
                    name, offset, min(self.part_bytes, size - offset), cache=False
                )
                yield data
                point("copy.part_sent")
                self._done(len(data))

        def send() -> None:
            self._landed(name, self.store.put_chunks(key, chunks()))

        return [pool.submit(send)], lambda _: None, lambda: None

    def _resumable(self, key: str, size: int, n_parts: int) -> tuple[str, dict[int, str]]:
        """An unfinished upload of ``key`` to continue, with the ETags of its parts that
        have the size this copy gives them; else a new upload and no parts."""
        store = self.store
        try:
            pending = store.pending_upload(key)
        except StorageError as err:  # e.g. no s3:ListBucketMultipartUploads permission
            log.debug("cannot list unfinished uploads of %s (%s); starting over", key, err)
            pending = None
        if pending is None:
            return store.create_upload(key), {}
        upload_id, parts = pending
        part = self.part_bytes
        keep = {
            n: etag
            for n, (etag, length) in parts.items()
            if 1 <= n <= n_parts and length == min(part, size - (n - 1) * part)
        }
        log.info("resuming the upload of %s: %d of %d parts are there", key, len(keep), n_parts)
        return upload_id, keep

    def _start_local(
        self, pool: ThreadPoolExecutor, name: str, key: str, size: int, offsets: list[int]
    ) -> tuple[list[Future], Any, Any]:
        target = Path(self.store.url(key))
        if len(offsets) > 1:
            return self._start_local_parts(pool, name, target, size, offsets)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        except OSError as err:
            raise _disk_error(target, err) from err
        files = _Open(fd)
        try:
            os.ftruncate(fd, size)
        except OSError as err:
            files.close()
            Path(tmp).unlink(missing_ok=True)
            raise _disk_error(target, err) from err

        def write(offset: int) -> None:
            data = self.source.read_range(
                name, offset, min(self.part_bytes, size - offset), cache=False
            )
            try:
                _pwrite_all(fd, data, offset)
            except OSError as err:
                raise _disk_error(target, err) from err
            self._done(len(data))

        futures = [pool.submit(write, o) for o in offsets] if size else []

        def finish(_: list[Any]) -> None:
            try:
                os.fsync(fd)
                files.close(check=True)
                os.chmod(tmp, 0o644)
                os.replace(tmp, target)
                fsync_dir(target.parent)
            except OSError as err:
                raise _disk_error(target, err) from err

        def abort() -> None:
            files.close()
            Path(tmp).unlink(missing_ok=True)

        return futures, finish, abort

    def _start_local_parts(
        self, pool: ThreadPoolExecutor, name: str, target: Path, size: int, offsets: list[int]
    ) -> tuple[list[Future], Any, Any]:
        """A large file, resumable: parts go into ``.NAME.partial.tmp`` and each finished
        part is appended to the journal ``.NAME.parts.tmp`` (headed by the source's size,
        version and the part size: a changed source or part size starts over)."""
        partial = target.parent / f".{target.name}.partial.tmp"
        journal = target.parent / f".{target.name}.parts.tmp"
        header = json.dumps(
            {"size": size, "version": self.source.version(name), "part": self.part_bytes}
        )
        done = _journaled(journal, header) if partial.exists() else set()
        files = _Open()
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            if not done:
                atomic_write_bytes(journal, (header + "\n").encode())
            fd = files.add(os.open(partial, os.O_RDWR | os.O_CREAT, 0o644))
            os.ftruncate(fd, size)
            jfd = files.add(os.open(journal, os.O_WRONLY | os.O_APPEND))
        except OSError as err:
            files.close()
            raise _disk_error(target, err) from err
        if done:
            log.info(
                "resuming the download of %s: %d of %d parts are there",
                target,
                len(done),
                len(offsets),
            )

        def write(offset: int) -> None:
            length = min(self.part_bytes, size - offset)
            if offset in done:
                with self._lock:
                    self.parts_reused += 1
                self._done(length)
                return
            data = self.source.read_range(name, offset, length, cache=False)
            try:
                _pwrite_all(fd, data, offset)
                os.write(jfd, f"{offset}\n".encode())  # one small append: whole or absent
            except OSError as err:
                raise _disk_error(target, err) from err
            point("copy.part_sent")
            self._done(len(data))

        futures = [pool.submit(write, o) for o in offsets]

        def finish(_: list[Any]) -> None:
            try:
                os.fsync(fd)
                files.close(check=True)
                os.replace(partial, target)
                journal.unlink(missing_ok=True)
                fsync_dir(target.parent)
            except OSError as err:
                raise _disk_error(target, err) from err

        def keep() -> None:  # the partial file and its journal stay for the next run
            files.close()

        return futures, finish, keep


class _Open:
    """File descriptors of one file being copied, each closed once (a second ``close``
    could otherwise close a number another thread has opened since)."""

    def __init__(self, *fds: int) -> None:
        self.fds = list(fds)

    def add(self, fd: int) -> int:
        self.fds.append(fd)
        return fd

    def close(self, *, check: bool = False) -> None:
        """Close them all; ``check``: raise the first error (else ignored)."""
        first: OSError | None = None
        fds, self.fds = self.fds, []
        for fd in fds:
            try:
                os.close(fd)
            except OSError as err:
                first = first or err
        if check and first is not None:
            raise first


def _pwrite_all(fd: int, data: memoryview | bytes, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def _journaled(journal: Path, header: str) -> set[int]:
    """Offsets of the parts a journal lists, if it belongs to this source (else none)."""
    try:
        lines = journal.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return set()
    if not lines or lines[0] != header:
        return set()
    return {int(line) for line in lines[1:] if line.isdigit()}
