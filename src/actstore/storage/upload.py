"""Send finished files to object storage on a background thread while their writer goes on.

:class:`BackgroundUploader` takes ``(name, path)`` pairs (a writer's sealed files, see
``WriterBase.sealed_files``) through :meth:`~BackgroundUploader.offer`, which only queues
them: the caller never waits on the network. Files are started in the order offered,
several at once (up to ``threads``), each in parts that share the uploader's own part pool
of ``threads`` (:class:`~actstore.storage.filecopy.FileCopier`: on S3 an interrupted upload
of a large file resumes part by part), so files smaller than ``threads`` parts still keep
every connection busy, as raw parallel puts would. A file already at the destination with
the same size and the ETag (S3) or listed MD5 (GCS) of the local bytes is not sent again
(a rerun after ``kill -9``; ``az://``, whose listings say nothing of the bytes, sends it
again). Errors are kept for :meth:`~BackgroundUploader.finish` to report; the uploader
starts no file after the first.

Example:
    >>> up = BackgroundUploader(store, "acts/3f1c")  # doctest: +SKIP
    >>> up.offer([("acts000000.bin", Path("/staging/acts000000.bin"))])  # doctest: +SKIP
    >>> up.finish()  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .copy import DEFAULT_PART_BYTES, multipart_etag
from .filecopy import FileCopier
from .files import PathFiles
from .object import ObjectInfo, ObjectStore

log = logging.getLogger(__name__)


class BackgroundUploader:
    """Uploads offered files to ``store`` under ``prefix`` (``prefix/name``)."""

    def __init__(
        self,
        store: ObjectStore,
        prefix: str,
        *,
        threads: int = 8,
        part_bytes: int = DEFAULT_PART_BYTES,
    ) -> None:
        self.store, self.prefix = store, prefix
        self.threads, self.part_bytes = threads, part_bytes
        self.etags: dict[str, str] = {}
        """Name -> version of every file now at the destination (sent or found there): the
        ETag of its bytes on S3, the version the backend gave the upload elsewhere."""
        self.sent: list[str] = []
        self.found: list[str] = []
        """Files found already uploaded (by an earlier, interrupted run)."""
        self.errors: list[tuple[str, BaseException]] = []
        self._stat: dict[str, tuple[Path, tuple[int, int, int]]] = {}
        """Name -> its path and (size, mtime_ns, inode) when it was read to be sent."""
        self._files = PathFiles(f"files queued for {store.url(prefix)}")
        self._queue: queue.Queue[tuple[str, Path] | None] = queue.Queue()
        self._offered: set[str] = set()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    def offer(self, files: Iterable[tuple[str, str | os.PathLike[str]]]) -> None:
        """Queue the files not offered before (returns at once)."""
        for name, path in files:
            if name in self._offered:
                continue
            self._offered.add(name)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="actstore-uploader", daemon=True
                )
                self._thread.start()
            self._queue.put((name, Path(path)))

    def _run(self) -> None:
        copier = FileCopier(self._files, self.store, self.prefix, self.part_bytes, None)
        present: dict[str, ObjectInfo] | None = None
        # parts of every file share one pool; up to ``threads`` files are in flight, so
        # the parts of the next file are queued while the last parts of one are sent
        with (
            ThreadPoolExecutor(self.threads, thread_name_prefix="actstore-upload-part") as pool,
            ThreadPoolExecutor(self.threads, thread_name_prefix="actstore-upload-file") as files,
        ):
            while (item := self._queue.get()) is not None:
                if self.errors or self._stopping.is_set():
                    continue
                name, path = item
                try:
                    if present is None:  # one listing: what an interrupted run sent
                        base = self.prefix.rstrip("/") + "/" if self.prefix else ""
                        present = {o.key[len(base) :]: o for o in self.store.list(base)}
                    # (raises once the interpreter is shutting down: the file stays unsent)
                    files.submit(self._send, copier, pool, name, path, present.get(name))
                except BaseException as err:  # noqa: BLE001 - reported by finish()
                    self.errors.append((name, err))

    def _send(
        self,
        copier: FileCopier,
        pool: ThreadPoolExecutor,
        name: str,
        path: Path,
        have: ObjectInfo | None,
    ) -> None:
        """Send one file (on a file thread; its parts on ``pool``), unless it is there."""
        if self.errors or self._stopping.is_set():
            return
        try:
            st = path.stat()
            size = st.st_size
            if have is not None and have.size == size and self._holds(have, path):
                self.etags[name] = have.version
                self._stat[name] = (path, _signature(st))
                self.found.append(name)
                return
            self._files.add(name, path)
            copier.run(pool, [name], {name: size})
            # the MD5 ETag of the bytes read (S3), else the version the backend gave them
            version = copier.etags.get(name) or copier.versions.get(name)
            if version:
                self.etags[name] = version
            self._stat[name] = (path, _signature(st))
            self.sent.append(name)
            log.debug("uploaded %s", self.store.url(f"{self.prefix}/{name}"))
        except BaseException as err:  # noqa: BLE001 - reported by finish()
            self.errors.append((name, err))

    def _holds(self, found: ObjectInfo, path: Path) -> bool:
        """Whether the object ``found`` holds the bytes of ``path``: its ETag is theirs
        (S3), or the MD5 its listing gives is (GCS); a backend with neither (``az://``)
        says nothing of the bytes, and the file is sent again."""
        caps = self.store.capabilities
        tag = found.version.strip('"') if caps.md5_etags else found.md5 if caps.content_md5 else ""
        return bool(tag) and multipart_etag(path, tag) == tag

    def _join(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def finish(self) -> dict[str, str]:
        """Wait for every queued file; returns :attr:`etags`. Errors stay in :attr:`errors`."""
        self._join()
        return self.etags

    def unchanged(self, root: str | os.PathLike[str] | None = None) -> dict[str, str]:
        """:attr:`etags` of the files whose size, modification time and inode are still
        those they had when they were read to be sent (or checked): the version of the bytes
        now on disk. ``root``: the directory the files are now in as ``root/name`` (a
        writer that published its partial directory by renaming it); default: where they
        were offered. Call after :meth:`finish`."""
        out = {}
        for name, etag in self.etags.items():
            path, then = self._stat[name]
            if root is not None:
                path = Path(root) / name
            try:
                if _signature(path.stat()) == then:
                    out[name] = etag
            except OSError:
                continue
        return out

    def stop(self) -> None:
        """Start no more files; wait for those being sent (their parts stay resumable)."""
        self._stopping.set()
        self._join()


def _signature(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_size, st.st_mtime_ns, st.st_ino
