"""Google Cloud Storage (``gs://bucket/prefix``) as an :class:`~.base.ObjectStore`: reads
(whole objects and byte ranges) through obstore, everything else through the official
SDK, google-cloud-storage (both in the ``gcs`` extra). docs/s3.md has the measurements
behind the split: obstore's ranged GETs ran at six times the SDK's on the same emulator,
but its uploads use GCS's XML API, which fake-gcs-server (the emulator the tests run on)
does not accept, so writes, listings and conditional requests stay with the SDK.

Objects are published atomically (one upload, or a resumable upload finalised only after
its last chunk), created conditionally (``ifGenerationMatch=0``: what the write lock needs,
with conditional updates and deletes by generation) and read by byte range. Object
versions are GCS generations. Transient faults are retried by the SDK's own policy;
what is left is mapped onto :mod:`actstore.errors`.
"""

from __future__ import annotations

import base64
import builtins
import datetime as dt
import io
import os
import random
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from ...errors import (
    ActstoreError,
    ConfigError,
    CorruptStoreError,
    StorageError,
    StoreNotFoundError,
    require,
)
from .base import Capabilities, ClientSlot, ObjectInfo, ObjectStore
from .config import GCSConfig
from .obstore_store import GCSReads
from .s3lock import S3Lock

T = TypeVar("T")


class _ChunkReader(io.RawIOBase):
    """A readable stream over an iterable of buffers (what a resumable upload reads; an
    error raised by the iterable propagates before the upload is finalised)."""

    def __init__(self, chunks: Iterable[bytes | bytearray | memoryview]) -> None:
        self._chunks = iter(chunks)
        self._left = memoryview(b"")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        """``size`` bytes unless the chunks run out first (a short read means the end)."""
        parts, want = [], (1 << 62) if size is None or size < 0 else size
        while want > 0:
            if not len(self._left):
                nxt = next(self._chunks, None)
                if nxt is None:
                    break
                self._left = memoryview(nxt).cast("B")
                continue
            take = self._left[:want]
            parts.append(bytes(take))
            self._left = self._left[len(take) :]
            want -= len(take)
            self._pos += len(take)
        return b"".join(parts)

    def readinto(self, out: Any) -> int:
        while not len(self._left):
            nxt = next(self._chunks, None)
            if nxt is None:
                return 0
            self._left = memoryview(nxt).cast("B")
        n = min(len(out), len(self._left))
        out[:n] = self._left[:n]
        self._left = self._left[n:]
        self._pos += n
        return n


class GCSStore(ObjectStore):
    """One Google Cloud Storage bucket (``gs://bucket``). The SDK client is created lazily
    in each process (the store pickles; forked workers get their own connections)."""

    scheme = "gs"
    capabilities = Capabilities(
        ranged_reads=True,
        listing=True,
        conditional_create=True,
        multipart=False,
        content_md5=True,
    )

    def __init__(self, bucket: str, config: GCSConfig | None = None) -> None:
        self.bucket = bucket
        self.config = config or GCSConfig()
        self.root_url = f"gs://{bucket}"
        self.reads = GCSReads(bucket, self.config)
        self._clients = ClientSlot()

    @property
    def bucket_name(self) -> str:  # type: ignore[override]
        return self.bucket

    def clone(self) -> GCSStore:
        return GCSStore(self.bucket, self.config)

    def url(self, key: str) -> str:
        return f"gs://{self.bucket}/{key}"

    def acquire_lock(self, prefix: str, *, break_lock: bool = False) -> Any:
        return S3Lock.acquire(self, prefix, break_lock=break_lock)

    # -------------------------------------------------------------- client

    @property
    def client(self) -> Any:
        """The SDK's bucket handle (created on first use in each process)."""
        return self._clients.get(self._make_client)

    def _make_client(self) -> Any:
        storage = require("google.cloud.storage", "gcs")
        cfg = self.config
        endpoint = cfg.resolved_endpoint()
        kwargs: dict[str, Any] = {
            "project": os.environ.get("GOOGLE_CLOUD_PROJECT") or "actstore",
        }
        credentials_path = cfg.credentials_path or os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
        if endpoint is not None:
            if not endpoint.startswith(("http://", "https://")):
                raise ConfigError(
                    f"GCS endpoint {endpoint!r} (from {cfg.endpoint_setting()}) is not an http:// "
                    "or https:// URL"
                )
            kwargs["client_options"] = {"api_endpoint": endpoint}
        auth = require("google.auth.exceptions", "gcs")
        if credentials_path:
            from google.oauth2 import service_account

            try:
                kwargs["credentials"] = service_account.Credentials.from_service_account_file(
                    credentials_path
                )
            except (OSError, ValueError, auth.GoogleAuthError) as err:
                raise ConfigError(
                    f"the Google Cloud credentials file {credentials_path} (from "
                    f"{'GCSConfig.credentials_path' if cfg.credentials_path else 'GOOGLE_APPLICATION_CREDENTIALS'}"
                    f") cannot be used for {self.root_url}: {_first_line(err).rstrip('.')}; give a service "
                    "account key file"
                ) from None
        elif endpoint is not None:  # an emulator: no credentials
            from google.auth.credentials import AnonymousCredentials

            kwargs["credentials"] = AnonymousCredentials()
        try:
            client = storage.Client(**kwargs)
        except auth.DefaultCredentialsError:
            raise ConfigError(
                f"no Google Cloud credentials for {self.root_url}: set "
                "GOOGLE_APPLICATION_CREDENTIALS to a service account key file, run `gcloud auth "
                "application-default login`, or set STORAGE_EMULATOR_HOST for an emulator"
            ) from None
        from requests.adapters import HTTPAdapter

        adapter = HTTPAdapter(pool_connections=4, pool_maxsize=64)  # parallel ranged GETs
        client._http.mount("http://", adapter)
        client._http.mount("https://", adapter)
        return client.bucket(self.bucket)

    def _retry(self) -> Any:
        """The SDK's retry policy for a whole-object upload (idempotent here: the same bytes
        again; the SDK retries only conditional uploads by default). A resumable upload
        retries each chunk; a simple one is sent again whole."""
        cfg = self.config
        retry = require("google.cloud.storage.retry", "gcs").DEFAULT_RETRY
        return retry.with_delay(initial=cfg.backoff_s, maximum=cfg.backoff_max_s)

    def _blob(self, key: str) -> Any:
        return self.client.blob(key)

    # -------------------------------------------------------------- error mapping

    def _call(self, what: str, key: str | None, fn: Callable[[], T]) -> T:
        """Run ``fn``, mapping the SDK's errors onto actstore's."""
        exc = require("google.api_core.exceptions", "gcs")
        where = self.url(key) if key is not None else self.root_url
        endpoint = self.config.resolved_endpoint() or "Google Cloud Storage"
        try:
            return self._parsed(fn)
        except ActstoreError:
            raise
        except exc.NotFound as err:
            if key is None or "bucket" in str(err).lower() and "does not exist" in str(err):
                raise StoreNotFoundError(
                    f"bucket {self.bucket!r} does not exist at {endpoint}; create it or fix the "
                    f"URL ({where})"
                ) from err
            raise StoreNotFoundError(f"{where} does not exist") from err
        except (exc.Forbidden, exc.Unauthorized) as err:
            raise StorageError(
                f"{endpoint} refused access to {where} ({_first_line(err)}): check "
                "GOOGLE_APPLICATION_CREDENTIALS and the bucket's permissions"
            ) from err
        except exc.RequestRangeNotSatisfiable as err:
            raise CorruptStoreError(
                f"{where} is shorter than expected (HTTP 416 for a byte range): the object is "
                "truncated; re-create it"
            ) from err
        except (exc.GoogleAPIError, OSError) as err:  # requests' errors are OSErrors
            raise StorageError(
                f"{what} {where} failed ({_first_line(err)}); check the network, "
                f"{self.config.endpoint_setting()} ({endpoint}) and that the service is up"
            ) from err

    def _parsed(self, fn: Callable[[], T]) -> T:
        """``fn()``, run again (with the config's backoff, up to ``max_attempts``) when the
        SDK fails on a response body it could not use: a connection cut right after the
        headers leaves an empty body, which the SDK hands its JSON consumers as ``b""``
        (they then fail with ``AttributeError``/``ValueError``); every other error is the
        caller's."""
        cfg = self.config
        for attempt in range(1, cfg.max_attempts + 1):
            try:
                return fn()
            except ActstoreError:
                raise  # ours, e.g. a ConfigError (a ValueError) naming missing credentials
            except (AttributeError, ValueError) as err:
                if attempt == cfg.max_attempts:
                    raise StorageError(
                        f"{self.root_url} sent {cfg.max_attempts} responses the client could "
                        f"not read ({type(err).__name__}: {err}); check the network"
                    ) from err
                time.sleep(random.uniform(0, min(cfg.backoff_max_s, cfg.backoff_s * 2**attempt)))
        raise AssertionError("unreachable")

    # -------------------------------------------------------------- reads

    def get(self, key: str) -> bytes:
        return self.reads.get(key)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self.reads.get_range(key, start, end)

    def get_range_into(
        self, key: str, out: bytearray | memoryview, start: int, *, total: int | None = None
    ) -> None:
        """One ranged GET into ``out``; checks the object's total size when given."""
        self.reads.get_range_into(key, out, start, total=total)

    def size(self, key: str) -> int | None:
        blob = self._call("HEAD", key, lambda: self.client.get_blob(key))
        return None if blob is None else int(blob.size)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        pages = self._call(
            "LIST",
            prefix,
            lambda: (
                self.client.list_blobs(prefix=prefix, page_size=self.config.list_page_size).pages
            ),
        )
        while True:
            page = self._call("LIST", prefix, lambda: next(pages, None))
            if page is None:
                return
            for blob in page:
                yield ObjectInfo(
                    blob.name, int(blob.size), str(blob.generation), _hex_md5(blob.md5_hash)
                )

    def list_dirs(self, prefix: str) -> builtins.list[str]:
        base = prefix.rstrip("/") + "/" if prefix.strip("/") else ""

        def run() -> builtins.list[str]:
            found = self.client.list_blobs(prefix=base, delimiter="/")
            for _ in found.pages:
                pass
            return sorted(p[len(base) :].rstrip("/") for p in found.prefixes)

        return self._call("LIST", base, run)

    # -------------------------------------------------------------- writes

    def check_bucket(self) -> None:
        """Raise a clear error now if the bucket is missing or the credentials are wrong."""
        self._call("LIST", None, lambda: list(self.client.list_blobs(max_results=1)))

    def put(self, key: str, data: bytes | bytearray | memoryview) -> str:
        """Publish ``data`` at ``key``; returns the new object's generation."""
        view = memoryview(data).cast("B")
        blob = self._blob(key)
        if len(view) > self.config.multipart_threshold:
            blob.chunk_size = self.config.part_size  # a resumable upload, finalised last
        self._call(
            "PUT",
            key,
            lambda: blob.upload_from_file(
                io.BytesIO(view), size=len(view), checksum=None, retry=self._retry()
            ),
        )
        return _generation(blob)

    def put_chunks(self, key: str, chunks: Iterable[bytes | bytearray | memoryview]) -> str:
        """A resumable upload read from ``chunks``, finalised only after the last; returns
        the new object's generation."""
        blob = self._blob(key)
        blob.chunk_size = self.config.part_size
        self._call(
            "PUT",
            key,
            lambda: blob.upload_from_file(_ChunkReader(chunks), checksum=None, retry=self._retry()),
        )
        return _generation(blob)

    def delete(self, key: str) -> None:
        try:
            self._call("DELETE", key, lambda: self._blob(key).delete())
        except StoreNotFoundError:
            pass

    def copy(self, src: str, dst: str) -> None:
        """A server-side copy."""
        self._call("COPY", dst, lambda: self.client.copy_blob(self._blob(src), self.client, dst))

    def abort_incomplete(self, prefix: str) -> int:
        """Nothing to do: an unfinished resumable upload never becomes an object and
        expires on the service."""
        return 0

    # -------------------------------------------------------------- conditional requests

    def _precondition(self, err: BaseException) -> bool:
        exc = require("google.api_core.exceptions", "gcs")
        return isinstance(err, (exc.PreconditionFailed, exc.Conflict))

    def put_if(self, key: str, data: bytes, *, etag: str | None) -> str | None:
        """Create ``key`` only if absent (``etag=None``: generation 0), or replace it only
        at generation ``etag``; the new generation, or None when the condition fails."""
        blob = self._blob(key)
        generation = 0 if etag is None else int(etag)

        def put() -> str | None:
            try:
                blob.upload_from_string(
                    bytes(data), content_type="application/json", if_generation_match=generation
                )
            except Exception as err:
                if self._precondition(err):
                    return None
                raise
            return str(blob.generation)

        try:
            return self._call("conditional PUT", key, put)
        except StoreNotFoundError:
            return None

    def get_with_age(self, key: str) -> tuple[bytes, str, float] | None:
        """``(body, generation, age_s)``; the age by this machine's clock against the
        object's update time (the SDK gives no response Date): keep clocks synchronised."""

        def get() -> tuple[bytes, Any] | None:
            blob = self.client.get_blob(key)
            if blob is None:
                return None
            body = blob.download_as_bytes(if_generation_match=blob.generation, checksum=None)
            return body, blob

        try:
            found = self._call("GET", key, get)
        except StoreNotFoundError:
            return None
        except StorageError as err:
            if self._precondition(err.__cause__ or err):
                return self.get_with_age(key)  # replaced between the two requests
            raise
        if found is None:
            return None
        body, blob = found
        age = 0.0
        if blob.updated is not None:
            age = max(0.0, (dt.datetime.now(dt.UTC) - blob.updated).total_seconds())
        return body, str(blob.generation), age

    def delete_if(self, key: str, etag: str) -> bool:
        """Delete ``key`` only at generation ``etag`` (a conditional delete, after a look at
        the generation: fake-gcs-server ignores the condition on deletes)."""

        def delete() -> bool:
            blob = self.client.get_blob(key)
            if blob is None or str(blob.generation) != etag:
                return False
            try:
                self._blob(key).delete(if_generation_match=int(etag))
            except Exception as err:
                if self._precondition(err):
                    return False
                raise
            return True

        try:
            return self._call("conditional DELETE", key, delete)
        except StoreNotFoundError:
            return False


def _hex_md5(value: str | None) -> str:
    """GCS's ``md5Hash`` (base64; absent for composite objects) as hex, else ""."""
    return base64.b64decode(value).hex() if value else ""


def _generation(blob: Any) -> str:
    """The generation an upload left on ``blob`` (what :meth:`GCSStore.list` reports)."""
    return "" if blob.generation is None else str(blob.generation)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:300] if text else type(err).__name__
