"""Write a saev store straight to ``s3://bucket/prefix``.

:class:`SaevS3Writer` is the local :class:`~.writer.SaevWriter` (its crash protocol
unchanged) writing into a staging directory, plus an uploader thread: each shard is sent
as a multipart upload as soon as it is finished, while the capture goes on. ``close()``
publishes the staged store, sends what is left (the last shard, tokens, the index files)
with :func:`~actstore.storage.copy.copy_store`, which writes ``metadata.json`` last (readers
refuse a prefix without it) and verifies the upload, then removes the staging copy.

After ``kill -9`` the same capture command resumes exactly: the staged partial store
resumes at its next shard as on local disk, and shards already on S3 with the right size are
not sent again. The staging directory is ``$ACTSTORE_CACHE/staging`` or
``~/.cache/actstore/staging``, one sub-directory per destination URL.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import shutil
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ...errors import CaptureError
from ...storage.cache import CACHE_ENV
from ...storage.copy import DEFAULT_PART_BYTES, FileCopier, copy_store
from ...storage.files import open_files
from ...storage.object import S3Config, S3Store, join_key, open_location
from .writer import SaevWriter

log = logging.getLogger(__name__)


def staging_root(url: str) -> Path:
    """Where a capture to ``url`` stages its shards."""
    base = os.environ.get(CACHE_ENV)
    root = Path(base).expanduser() / "staging" if base else Path.home() / ".cache/actstore/staging"
    return root / hashlib.sha1(url.rstrip("/").encode()).hexdigest()[:16]


class SaevS3Writer(SaevWriter):
    """A :class:`SaevWriter` whose store is published at ``s3://``; ``close()`` returns its
    URL. ``keep_local=True`` keeps the staged copy after the upload."""

    def __init__(
        self,
        metadata: Any,
        dump_to: str,
        *,
        s3: S3Config | None = None,
        staging: str | os.PathLike | None = None,
        keep_local: bool = False,
        threads: int = 8,
        **kwargs: Any,
    ) -> None:
        self.s3 = s3
        self.keep_local, self.threads = keep_local, threads
        self.staging = Path(staging or staging_root(dump_to)).expanduser().resolve()
        self.store, self._prefix = open_location(dump_to, s3)
        if not isinstance(self.store, S3Store):
            raise CaptureError(f"{dump_to} is not an s3:// location")
        self.store.check_bucket()
        self._dump_to = dump_to.rstrip("/")
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._errors: list[BaseException] = []
        self._thread: threading.Thread | None = None
        self._closing = False
        super().__init__(metadata, self.staging, **kwargs)

    @property
    def url(self) -> str:
        """Where the store is published."""
        return f"{self._dump_to}/{self.final_dir.relative_to(self.staging).as_posix()}"

    def _remote_key(self, name: str) -> str:
        return join_key(self._prefix, self.final_dir.relative_to(self.staging).as_posix(), name)

    def _open(self) -> None:
        if self.store.size(self._remote_key("metadata.json")) is not None:
            self.complete = True
            self.resume_from = self.example_range[1]
            log.info("%s is already published; nothing to write", self.url)
            return
        super()._open()

    # ------------------------------------------------------------------ background upload

    def _finish_shard(self) -> None:
        super()._finish_shard()
        if self._closing:  # close() sends the last shard with the rest
            return
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._upload_loop, name="actstore-s3-writer", daemon=True
            )
            self._thread.start()
        self._queue.put(self._shards[-1]["name"])

    def _upload_loop(self) -> None:
        files = open_files(self.partial_dir)
        prefix = self._remote_key("")
        copier = FileCopier(files, self.store, prefix, DEFAULT_PART_BYTES, None)
        with ThreadPoolExecutor(self.threads, thread_name_prefix="actstore-s3-part") as pool:
            while (name := self._queue.get()) is not None:
                if self._errors:
                    continue
                try:
                    copier.run(pool, [name], {name: files.require(name)})
                except BaseException as err:  # noqa: BLE001 - reported by close()
                    self._errors.append(err)

    def _drain(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        if self._errors:
            raise CaptureError(
                f"uploading shards to {self.url} failed: {self._errors[0]}; rerun the same "
                "capture to resume"
            ) from self._errors[0]

    # ------------------------------------------------------------------ publish

    def close(self) -> str:  # type: ignore[override]
        """Publish locally, wait for the shard uploads, send the rest (``metadata.json``
        last), verify, and remove the staged copy."""
        if self.complete and not self.final_dir.exists():
            return self.url  # published on S3 before this writer opened
        self._closing = True
        try:
            local = super().close()
        finally:
            self._drain()
        copy_store(local, self.url, s3=self.s3, threads=self.threads)
        if not self.keep_local:
            _remove_tree(self.final_dir)
        log.info("published %s", self.url)
        return self.url

    def abort(self) -> None:
        super().abort()
        try:
            self._drain()
        except CaptureError as err:
            log.warning("%s", err)


def _remove_tree(path: Path) -> None:
    """Delete a published (read-only) staged store."""

    def writable(func: Any, target: str, _: Any) -> None:
        os.chmod(os.path.dirname(target), stat.S_IRWXU)
        os.chmod(target, stat.S_IRUSR | stat.S_IWUSR)
        func(target)

    shutil.rmtree(path, onerror=writable)  # files are read-only once published
