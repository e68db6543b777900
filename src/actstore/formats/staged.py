"""Any format's local writer, published to object storage (``s3://``, ``gs://``,
``az://``) as it goes.

:class:`StagedWriter` runs the format's own writer (crash protocol unchanged) in a
staging directory (:func:`staging_root`), and:

* **uploads in the background**: after each ``write()`` it asks the writer for its
  :meth:`~.base.WriterBase.sealed_files` and queues the new ones on a
  :class:`~actstore.storage.upload.BackgroundUploader` (its own thread and part pool), so
  the capture never waits on the network;
* **holds the destination's write lock** (:class:`~actstore.storage.s3lock.S3Lock`, a
  lease object in the store's prefix, taken with the backend's conditional create) from
  open to close: a second capture of the same store, on any machine, is refused with one
  line naming the holder;
* **publishes at close()**: waits for the queued uploads, lets the local writer publish,
  and sends the rest with :func:`~actstore.storage.copy.copy_store` (the format's index,
  then the root manifest last: readers refuse a prefix without it; every object checked
  against the version its upload left, or the ETag of its bytes), then drops the staged
  copy.

A rerun after ``kill -9`` resumes the staged writer where it stopped; files already on S3
with the right size and ETag are not sent again, and a large file whose multipart upload
was cut resumes from the parts already there (``gs://`` and ``az://`` send such files
again: their versions say nothing of the bytes).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

from ..batch import Batch
from ..errors import (
    CaptureError,
    ConfigError,
    CorruptStoreError,
    OtherCaptureError,
    StoreExistsError,
)
from ..storage import remove_tree
from ..storage.cache import CACHE_ENV
from ..storage.copy import CopyReport, copy_store
from ..storage.manifest import MANIFEST, RootManifest
from ..storage.object import StorageOptions, join_key, open_location
from ..storage.s3lock import DEFAULT_LEASE_S, S3Lock
from ..storage.upload import BackgroundUploader
from .writerbase import WriterBase

log = logging.getLogger(__name__)


def staging_root(url: str) -> Path:
    """Where a capture to ``url`` stages its files: ``$ACTSTORE_CACHE/staging/<id>``, else
    ``~/.cache/actstore/staging/<id>``, one directory per destination."""
    base = os.environ.get(CACHE_ENV)
    root = Path(base).expanduser() / "staging" if base else Path.home() / ".cache/actstore/staging"
    return root / hashlib.sha1(url.rstrip("/").encode()).hexdigest()[:16]


class StagedWriter(WriterBase):
    """``make_local(staging_dir)`` builds the local writer. The store it publishes at
    ``staging_dir / subdir`` goes to ``url / subdir``; :attr:`url` is that location."""

    def __init__(
        self,
        url: str,
        make_local: Callable[[Path], WriterBase],
        *,
        storage: StorageOptions | None = None,
        staging: str | os.PathLike | None = None,
        keep_local: bool = False,
        last: tuple[str, ...] = (MANIFEST,),
        subdir: str = "",
        threads: int = 8,
        break_lock: bool = False,
        lease_s: float = DEFAULT_LEASE_S,
    ) -> None:
        self.dest, self.storage, self.keep_local = url.rstrip("/"), storage, keep_local
        self.threads = threads
        self.subdir, self.last = subdir.strip("/"), tuple(last)
        store, self._prefix = open_location(url, storage)
        if not store.capabilities.writes:
            raise ConfigError(f"{url} is read-only: stores cannot be written there")
        store.check_bucket()
        self.store = store
        self.staging = Path(staging or staging_root(url)).expanduser().resolve()
        self.inner: WriterBase | None = None
        self.lock: S3Lock | None = None
        self.report: CopyReport | None = None
        """What the copy at :meth:`close` sent and checked (the files the background
        uploads sent are trusted by the version they left, not read back)."""
        self._uploader: BackgroundUploader | None = None
        manifest_key = join_key(self._prefix, self.subdir, MANIFEST)
        self._published = store.size(manifest_key) is not None
        self.complete: bool = self._published
        if self._published:
            self._check_published(manifest_key, make_local)
            log.info("%s is already published; nothing to write", self.url)
            return
        self.lock = S3Lock.acquire(
            store, join_key(self._prefix, self.subdir), break_lock=break_lock, lease_s=lease_s
        )
        try:
            self.staging.parent.mkdir(parents=True, exist_ok=True)
            self.inner = make_local(self.staging)
        except BaseException:
            self.lock.release()
            raise
        self.wants_texts = self.inner.wants_texts
        self.example_range = self.inner.example_range
        self.complete = self.inner.complete
        self.resume_from = self.inner.resume_from
        self._uploader = BackgroundUploader(store, self._prefix, threads=threads)
        self._offer()

    def _check_published(self, key: str, make_local: Callable[[Path], WriterBase]) -> None:
        """The store published at :attr:`url` is this capture (its root manifest names this
        capture's record, as the local writer compares it), else refuse: another model,
        dataset, dtype, sites or options at the same URL is never "already captured"."""
        wanted = _record_id(make_local)
        try:
            found = RootManifest.from_bytes(self.store.get(key), self.store.url(key)).record
        except (CorruptStoreError, OSError) as err:
            raise StoreExistsError(
                f"{self.url} holds a store whose root manifest cannot be read ({err}); "
                "choose another output or remove it"
            ) from None
        if wanted is not None and found != wanted:
            raise OtherCaptureError(
                f"{self.url} holds another capture (its record is not this one's); choose "
                "another output or remove it",
                location=self.url,
            )

    @property
    def url(self) -> str:
        """Where the store is published."""
        return f"{self.dest}/{self.subdir}" if self.subdir else self.dest

    def _offer(self) -> None:
        if self._uploader is not None and self.inner is not None and not self.inner.complete:
            self._uploader.offer(self.inner.sealed_files())

    def write(self, batch: Batch) -> None:
        if self.lock is not None:
            self.lock.check()
        if self.inner is None:
            raise CaptureError(f"{self.url} is already published")
        self.inner.write(batch)
        self._offer()

    def sync(self) -> None:
        """Wait for the staged writer's finished shards, then queue them for upload."""
        if self.inner is not None:
            self.inner.sync()
        self._offer()

    def close(self) -> str:
        """Wait for the background uploads, publish locally, send the rest (the manifest
        last, verified), drop the staged copy and the lock."""
        if self._published or self.inner is None:
            return self.url
        try:
            if self.lock is not None:
                self.lock.check()
            if self._uploader is not None:
                self.sync()  # every shard sealed so far goes up with the others (errors: below)
                self._uploader.finish()
            local = Path(str(self.inner.close()))
            # the versions of files sent that are still the bytes sent (unchanged since)
            sent = self._sent()
            failed = self._uploader.errors if self._uploader is not None else []
            if failed:
                name, err = failed[0]
                raise CaptureError(
                    f"uploading {name} to {self.url} failed: {err}; the store is complete in "
                    f"{local}: rerun the same capture to upload the rest"
                ) from err
            self.report = copy_store(
                local,
                self.url,
                storage=self.storage,
                threads=self.threads,
                sent=sent,
                last=self.last,
            )
            if self.lock is not None:
                self.lock.check()
        finally:
            if self.lock is not None:
                self.lock.release()
        if not self.keep_local:
            remove_tree(self.staging)  # the staged store and the writer's bookkeeping
            with contextlib.suppress(OSError):
                self.staging.parent.rmdir()  # the destination's staging folder, if empty
        log.info("published %s", self.url)
        self._published = True
        return self.url

    def _sent(self) -> dict[str, str]:
        """Name (below :attr:`url`) -> version of every file the uploader sent whose local
        bytes are unchanged since (found where the local writer published them)."""
        if self._uploader is None:
            return {}
        base = f"{self.subdir}/" if self.subdir else ""
        return {
            name[len(base) :]: version
            for name, version in self._uploader.unchanged(self.staging).items()
            if name.startswith(base)
        }

    def abort(self) -> None:
        """Stop uploading (the file in flight finishes, or stays resumable), stop the local
        writer (durable progress kept) and release the lock."""
        try:
            if self._uploader is not None:
                self._uploader.stop()
            if self.inner is not None:
                self.inner.abort()
        finally:
            if self.lock is not None:
                self.lock.release()


def _record_id(make_local: Callable[[Path], WriterBase]) -> str | None:
    """The record id (what a root manifest's ``record`` holds) of the writer
    ``make_local`` builds, opened in a scratch directory and aborted (it creates nothing
    before its first write); None when the writer keeps no record id."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="actstore-record-") as scratch:
        writer = make_local(Path(scratch))
        try:
            return getattr(writer, "store_id", None)
        finally:
            writer.abort()
