"""Azure Blob Storage (``az://container/prefix``) as an :class:`~.base.ObjectStore`,
through obstore (Rust's ``object_store``; the ``azure`` extra), and the reads of Google
Cloud Storage (:class:`GCSReads`, which :class:`~.gcs_store.GCSStore` reads through).
docs/s3.md has the measurements behind the choice.

:class:`ObstoreStore` holds what does not depend on the service (a third obstore-backed
service is a subclass): objects are published atomically (a single PUT, or a block list
committed only at the end), created conditionally (``If-None-Match: *``: what the write
lock needs) and read by byte range. Transient faults are retried by obstore's own policy
(capped exponential backoff, ``max_attempts`` tries); what is left is mapped onto
:mod:`actstore.errors`.
"""

from __future__ import annotations

import builtins
import datetime as dt
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from ...errors import (
    ActstoreError,
    ConfigError,
    CorruptStoreError,
    StorageError,
    StoreNotFoundError,
    UnsupportedError,
    require,
)
from .base import Capabilities, ClientSlot, ObjectInfo, ObjectStore
from .config import AzureConfig, GCSConfig
from .s3lock import S3Lock

T = TypeVar("T")


class ObstoreStore(ObjectStore):
    """One bucket (container) through an obstore client, created lazily per process (so
    the store pickles and forked workers get their own connections)."""

    capabilities = Capabilities(
        ranged_reads=True, listing=True, conditional_create=True, multipart=False
    )
    extra = ""
    #: Environment variables that hold the credentials, for error messages.
    credential_vars = ""
    config: AzureConfig | GCSConfig

    def __init__(self, bucket: str) -> None:
        self.bucket = bucket
        self.root_url = f"{self.scheme}://{bucket}"
        self._clients = ClientSlot()

    @property
    def bucket_name(self) -> str:  # type: ignore[override]
        return self.bucket

    @property
    def client(self) -> Any:
        """The obstore store (created on first use in each process)."""
        return self._clients.get(lambda: self._make_client(require("obstore.store", self.extra)))

    def _make_client(self, stores: Any) -> Any:
        raise NotImplementedError

    def _common(self, endpoint: str | None) -> dict[str, Any]:
        """Client and retry options shared by both services."""
        cfg = self.config
        client: dict[str, Any] = {
            "connect_timeout": dt.timedelta(seconds=cfg.connect_timeout_s),
            # a stall: no byte for read_timeout_s (obstore's default caps each whole
            # request at 30 s instead, too short for a large object on a slow link)
            "read_timeout": dt.timedelta(seconds=cfg.read_timeout_s),
            "timeout": dt.timedelta(hours=6),
        }
        if endpoint is not None and endpoint.startswith("http://"):
            client["allow_http"] = True
        retry = {
            "max_retries": cfg.max_attempts - 1,
            "backoff": {
                "init_backoff": dt.timedelta(seconds=cfg.backoff_s),
                "max_backoff": dt.timedelta(seconds=cfg.backoff_max_s),
                "base": 2,
            },
            "retry_timeout": dt.timedelta(seconds=cfg.read_timeout_s * cfg.max_attempts),
        }
        return {"client_options": client, "retry_config": retry}

    def clone(self) -> ObstoreStore:
        return type(self)(self.bucket, self.config)  # type: ignore[call-arg]

    def url(self, key: str) -> str:
        return f"{self.root_url}/{key}"

    def acquire_lock(self, prefix: str, *, break_lock: bool = False) -> Any:
        return S3Lock.acquire(self, prefix, break_lock=break_lock)

    # -------------------------------------------------------------- error mapping

    def _call(self, what: str, key: str | None, fn: Callable[[], T]) -> T:
        """Run ``fn``, mapping obstore's errors onto actstore's."""
        exc = require("obstore.exceptions", self.extra)
        where = self.url(key) if key is not None else self.root_url
        try:
            return fn()
        except ActstoreError:
            raise
        except (exc.NotFoundError, FileNotFoundError) as err:
            if key is None:
                raise self._no_bucket(where) from err
            raise StoreNotFoundError(f"{where} does not exist") from err
        except (exc.PermissionDeniedError, exc.UnauthenticatedError) as err:
            raise StorageError(
                f"{self._endpoint_name()} refused access to {where} ({_first_line(err)}): "
                f"check {self.credential_vars} and the {self._word()}'s permissions"
            ) from err
        except exc.BaseError as err:
            if key is None and " 404 " in str(err):  # the container itself is missing
                raise self._no_bucket(where) from err
            raise StorageError(
                f"{what} {where} failed ({_first_line(err)}); check the network, "
                f"{self.config.endpoint_setting()} and that the service is up"
            ) from err

    def _word(self) -> str:
        return "bucket"

    def _endpoint_name(self) -> str:
        raise NotImplementedError

    def _no_bucket(self, where: str) -> StoreNotFoundError:
        return StoreNotFoundError(
            f"{self._word()} {self.bucket!r} does not exist at {self._endpoint_name()}; "
            f"create it or fix the URL ({where})"
        )

    # -------------------------------------------------------------- reads

    def get(self, key: str) -> bytes:
        obs = require("obstore", self.extra)
        return self._call("GET", key, lambda: bytes(obs.get(self.client, key).bytes()))

    def get_range(self, key: str, start: int, end: int) -> bytes:
        out = bytearray(end - start)
        self.get_range_into(key, out, start)
        return bytes(out)

    def get_range_into(
        self, key: str, out: bytearray | memoryview, start: int, *, total: int | None = None
    ) -> None:
        """One ranged GET into ``out``; checks the object's total size when given."""
        view = memoryview(out).cast("B")
        if not len(view):
            return
        obs = require("obstore", self.extra)
        exc = require("obstore.exceptions", self.extra)
        end = start + len(view)

        def fetch() -> tuple[Any, int]:
            try:
                result = obs.get(self.client, key, options={"range": (start, end)})
            except (exc.NotFoundError, FileNotFoundError):
                raise
            except exc.BaseError as err:
                size = self.size(key)  # a range starting past the end is refused
                if size is not None and start >= size:
                    raise CorruptStoreError(
                        f"{self.url(key)} is {size} bytes, a read from byte {start} is past its "
                        "end: the object is truncated; re-create it"
                    ) from err
                raise
            return result.bytes(), int(result.meta["size"])

        body, size = self._call("GET range", key, fetch)
        if total is not None and size != total:
            raise CorruptStoreError(
                f"{self.url(key)} is {size} bytes, expected {total}: the object was truncated "
                "or replaced; re-create it"
            )
        data = memoryview(body)
        if len(data) != len(view):
            raise CorruptStoreError(
                f"{self.url(key)} ended at byte {start + len(data)}, expected {end}: the object "
                "is truncated; re-create it"
            )
        view[:] = data

    def size(self, key: str) -> int | None:
        obs = require("obstore", self.extra)
        try:
            meta = self._call("HEAD", key, lambda: obs.head(self.client, key))
        except StoreNotFoundError:
            return None
        return int(meta["size"])

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Keys starting with ``prefix`` (a string prefix, as on S3: obstore lists by path
        segment, so the folder holding ``prefix`` is listed and filtered)."""
        obs = require("obstore", self.extra)
        folder = prefix if prefix.endswith("/") else prefix.rpartition("/")[0]
        stream = self._call(
            "LIST", folder, lambda: obs.list(self.client, folder or None, chunk_size=1000)
        )
        while True:
            chunk = self._call("LIST", folder, lambda: next(stream, None))
            if chunk is None:
                return
            for meta in chunk:
                if meta["path"].startswith(prefix):
                    yield ObjectInfo(meta["path"], int(meta["size"]), self._version(meta))

    def list_dirs(self, prefix: str) -> builtins.list[str]:
        obs = require("obstore", self.extra)
        base = prefix.strip("/")
        found = self._call("LIST", base, lambda: obs.list_with_delimiter(self.client, base or None))
        cut = len(base) + 1 if base else 0
        return sorted(p[cut:].rstrip("/") for p in found["common_prefixes"])

    # -------------------------------------------------------------- writes

    def check_bucket(self) -> None:
        """Raise a clear error now if the bucket is missing or the credentials are wrong."""
        obs = require("obstore", self.extra)
        self._call("LIST", None, lambda: next(obs.list(self.client, None, chunk_size=1), None))

    def put(self, key: str, data: bytes | bytearray | memoryview) -> str:
        """Publish ``data`` at ``key``; returns the new object's ETag."""
        obs = require("obstore", self.extra)
        view = memoryview(data).cast("B")
        multipart = len(view) > self.config.multipart_threshold
        result = self._call(
            "PUT",
            key,
            lambda: obs.put(
                self.client,
                key,
                view,
                use_multipart=multipart,
                chunk_size=self.config.part_size,
            ),
        )
        return self._version(result)

    def put_chunks(self, key: str, chunks: Iterable[bytes | bytearray | memoryview]) -> str:
        """Streamed in parts (at most a few parts in memory), completed at the end; returns
        the new object's ETag."""
        obs = require("obstore", self.extra)
        parts = (bytes(c) if not isinstance(c, bytes) else c for c in chunks)
        result = self._call(
            "PUT",
            key,
            lambda: obs.put(
                self.client, key, parts, use_multipart=True, chunk_size=self.config.part_size
            ),
        )
        return self._version(result)

    def delete(self, key: str) -> None:
        obs = require("obstore", self.extra)
        try:
            self._call("DELETE", key, lambda: obs.delete(self.client, key))
        except StoreNotFoundError:
            pass

    def copy(self, src: str, dst: str) -> None:
        """A server-side copy."""
        obs = require("obstore", self.extra)
        self._call("COPY", dst, lambda: obs.copy(self.client, src, dst))

    def abort_incomplete(self, prefix: str) -> int:
        """Nothing to do: obstore aborts its own unfinished uploads, and unfinished parts
        expire on the service (GCS, Azure) without becoming objects."""
        return 0

    # -------------------------------------------------------------- conditional requests

    def _version(self, meta: Any) -> str:
        """The version token of an object (what ``put_if`` takes back)."""
        return str(meta.get("e_tag") or "").strip('"')

    def _update_mode(self, token: str) -> dict[str, str]:
        return {"e_tag": token}

    def put_if(self, key: str, data: bytes, *, etag: str | None) -> str | None:
        """Create ``key`` only if absent (``etag=None``), or replace it only while it has
        version ``etag``; the new version, or None when the condition does not hold."""
        obs = require("obstore", self.extra)
        exc = require("obstore.exceptions", self.extra)
        mode: Any = "create" if etag is None else self._update_mode(etag)

        def put() -> Any:
            try:
                return obs.put(self.client, key, data, mode=mode, use_multipart=False)
            except (exc.AlreadyExistsError, exc.PreconditionError):
                return None
            except exc.NotSupportedError as err:
                raise UnsupportedError(
                    f"{self.root_url} does not support conditional writes"
                ) from err

        try:
            result = self._call("conditional PUT", key, put)
        except StoreNotFoundError:
            return None  # an update of a key that is gone
        return None if result is None else self._version(result)

    def get_with_age(self, key: str) -> tuple[bytes, str, float] | None:
        """``(body, version, age_s)``; the age by this machine's clock against the
        object's Last-Modified (obstore gives no response Date): keep clocks synchronised."""
        obs = require("obstore", self.extra)

        def get() -> tuple[bytes, Any]:
            result = obs.get(self.client, key)
            return bytes(result.bytes()), result.meta

        try:
            body, meta = self._call("GET", key, get)
        except StoreNotFoundError:
            return None
        modified = meta.get("last_modified")
        age = 0.0
        if modified is not None:
            age = max(0.0, (dt.datetime.now(dt.UTC) - modified).total_seconds())
        return body, self._version(meta), age

    def delete_if(self, key: str, etag: str) -> bool:
        """Delete ``key`` if its version is still ``etag`` (a read, then a delete: obstore
        has no conditional delete; the lock only deletes what it holds)."""
        found = self.get_with_age(key)
        if found is None or found[1] != etag:
            return False
        self.delete(key)
        return True


class AzureStore(ObstoreStore):
    """One Azure Blob Storage container (``az://container``)."""

    scheme = "az"
    extra = "azure"
    credential_vars = "AZURE_STORAGE_CONNECTION_STRING (or AZURE_STORAGE_ACCOUNT_NAME/_KEY)"

    def __init__(self, bucket: str, config: AzureConfig | None = None) -> None:
        super().__init__(bucket)
        self.config: AzureConfig = config or AzureConfig()

    def _word(self) -> str:
        return "container"

    def _endpoint_name(self) -> str:
        found = self.config.resolved()
        if "endpoint" in found:
            return found["endpoint"]
        return f"Azure account {found.get('account_name', '(none set)')}"

    def _make_client(self, stores: Any) -> Any:
        found = self.config.resolved()
        if "account_name" not in found:
            raise ConfigError(
                f"no Azure account for {self.root_url}: set AZURE_STORAGE_CONNECTION_STRING, or "
                "AZURE_STORAGE_ACCOUNT_NAME and AZURE_STORAGE_ACCOUNT_KEY"
            )
        endpoint = found.get("endpoint")
        options: dict[str, Any] = {"account_name": found["account_name"]}
        if "account_key" in found:
            options["account_key"] = found["account_key"]
        if endpoint is not None:
            options["endpoint"] = endpoint
        return stores.AzureStore(self.bucket, config=options, **self._common(endpoint))


class GCSReads(ObstoreStore):
    """The reads of a Google Cloud Storage bucket through obstore (six times the
    throughput of google-cloud-storage's ranged downloads on the same emulator, see
    docs/s3.md); :class:`~.gcs_store.GCSStore` writes through the SDK."""

    scheme = "gs"
    extra = "gcs"
    credential_vars = "GOOGLE_APPLICATION_CREDENTIALS"

    def __init__(self, bucket: str, config: GCSConfig | None = None) -> None:
        super().__init__(bucket)
        self.config: GCSConfig = config or GCSConfig()

    def _endpoint_name(self) -> str:
        return self.config.resolved_endpoint() or "Google Cloud Storage"

    def _make_client(self, stores: Any) -> Any:
        cfg = self.config
        endpoint = cfg.resolved_endpoint()
        options: dict[str, Any] = {}
        if endpoint is not None:
            options["base_url"] = endpoint
        credentials = cfg.credentials_path or os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
        if credentials:
            options["application_credentials"] = credentials
        elif endpoint is not None:
            options["skip_signature"] = True  # an emulator: no credentials
        return stores.GCSStore(self.bucket, config=options, **self._common(endpoint))


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:300] if text else type(err).__name__
