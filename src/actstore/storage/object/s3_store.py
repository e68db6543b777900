"""An S3-compatible bucket as an :class:`~.base.ObjectStore`, through boto3."""

from __future__ import annotations

import builtins
import functools
import logging
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar
from urllib.parse import urlparse

from ...errors import ConfigError, StorageError, StoreNotFoundError, UnsupportedError, require
from ...forksafe import ForkSafeLock
from .base import Capabilities, ClientSlot, ObjectInfo, ObjectStore
from .body import ViewBody
from .config import S3Config, env
from .retry import AUTH_CODES, MISSING_CODES, Retrier, describe_error
from .s3lock import S3Lock

log = logging.getLogger(__name__)

T = TypeVar("T")

#: What a conditional request returns inside the retrier when the service lacks the feature.
_UNSUPPORTED = object()

_SESSION_LOCK = ForkSafeLock()
_SESSION: tuple[int, Any] | None = None


def _session(boto3: Any) -> Any:
    """One boto3 session per process: it caches the service model, so each new client
    costs milliseconds instead of a fresh session's ~150 ms. Call under ``_SESSION_LOCK``."""
    global _SESSION
    if _SESSION is None or _SESSION[0] != os.getpid():
        _SESSION = (os.getpid(), boto3.session.Session())
    return _SESSION[1]


class S3Store(ObjectStore):
    """One bucket of an S3-compatible service, through boto3.

    Each instance creates its own boto3 client lazily (and again after a fork), so stores are
    picklable and each uploader thread group or worker process gets its own connection pool.
    Retries are done here (botocore's own are turned off) so that every transient fault,
    including a body cut short mid-download, follows one documented policy.
    """

    scheme = "s3"
    capabilities = Capabilities(
        ranged_reads=True, listing=True, conditional_create=True, multipart=True, md5_etags=True
    )

    def __init__(self, bucket: str, config: S3Config | None = None) -> None:
        self.bucket = bucket
        self.config = config or S3Config()
        self.root_url = f"s3://{bucket}"
        self._retry = Retrier(self.config)
        self._clients = ClientSlot()

    @property
    def bucket_name(self) -> str:  # type: ignore[override]
        return self.bucket

    def clone(self) -> S3Store:
        return S3Store(self.bucket, self.config)

    def copy(self, src: str, dst: str) -> None:
        """A server-side copy (multipart for large objects)."""
        self._call(
            "copy",
            dst,
            lambda: self.client.copy({"Bucket": self.bucket, "Key": src}, self.bucket, dst),
        )

    def acquire_lock(self, prefix: str, *, break_lock: bool = False) -> Any:
        return S3Lock.acquire(self, prefix, break_lock=break_lock)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_retry"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._retry = Retrier(self.config)

    @property
    def retries(self) -> int:
        """Transient faults retried by this store so far."""
        return self._retry.retries

    @property
    def client(self) -> Any:
        """The boto3 S3 client (created on first use in each process)."""
        return self._clients.get(self._make_client)

    def _make_client(self) -> Any:
        boto3 = require("boto3", "s3")
        from botocore.config import Config

        cfg = self.config
        endpoint = cfg.resolved_endpoint()
        if endpoint is not None and urlparse(endpoint).scheme not in ("http", "https"):
            raise ConfigError(
                f"S3 endpoint {endpoint!r} (from {cfg.endpoint_setting()}) is not an http:// or "
                f"https:// URL; set it to e.g. https://{endpoint.partition('://')[2] or endpoint}"
            )
        key_id = cfg.access_key_id or env("AWS_ACCESS_KEY_ID")
        secret = cfg.secret_access_key or env("AWS_SECRET_ACCESS_KEY")
        kwargs: dict[str, Any] = {}
        if key_id and secret:
            kwargs.update(
                aws_access_key_id=key_id,
                aws_secret_access_key=secret,
                aws_session_token=env("AWS_SESSION_TOKEN"),
            )
        botocore_config = Config(
            signature_version="s3v4",
            s3={"addressing_style": "path"},
            retries={"total_max_attempts": 1, "mode": "standard"},
            connect_timeout=cfg.connect_timeout_s,
            read_timeout=cfg.read_timeout_s,
            max_pool_connections=cfg.max_pool_connections,
            # S3-compatible services (Nebius, older MinIO, Ceph) often reject the streaming
            # trailing checksums newer botocore sends by default; send them only if required.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            tcp_keepalive=True,
        )
        with _SESSION_LOCK:  # clients are thread-safe; creating them from a session is not
            return _session(boto3).client(
                "s3",
                endpoint_url=endpoint,
                region_name=cfg.region or env("AWS_REGION", "AWS_DEFAULT_REGION") or "us-east-1",
                config=botocore_config,
                **kwargs,
            )

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    # -------------------------------------------------------------- error mapping

    def _classify(self, key: str | None) -> Callable[[BaseException], Any]:
        """Map permanent errors to actstore errors (None: let the retrier decide)."""

        def classify(err: BaseException) -> Any:
            botocore_exc = require("botocore.exceptions", "s3")
            where = self.url(key) if key is not None else self.root_url
            endpoint = self.config.resolved_endpoint() or "AWS S3"
            if isinstance(err, botocore_exc.NoCredentialsError):
                return ConfigError(
                    f"no S3 credentials for {where}: set AWS_ACCESS_KEY_ID and "
                    "AWS_SECRET_ACCESS_KEY (and S3_ENDPOINT_URL for a non-AWS service)"
                )
            if not isinstance(err, botocore_exc.ClientError):
                return None
            code = str(err.response.get("Error", {}).get("Code", ""))
            status = int(err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            if code == "NoSuchBucket" or (key is None and status == 404):
                return StoreNotFoundError(
                    f"bucket {self.bucket!r} does not exist at {endpoint}; create it or fix the "
                    f"URL ({where})"
                )
            if code in MISSING_CODES or (status == 404 and code != "NoSuchUpload"):
                return StoreNotFoundError(f"{where} does not exist")
            if code in AUTH_CODES or status == 403:
                return StorageError(
                    f"{endpoint} refused access to {where} ({describe_error(err)}): check "
                    "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and the bucket's permissions"
                )
            if code == "InvalidRange" or status == 416:
                from ...errors import CorruptStoreError

                return CorruptStoreError(
                    f"{where} is shorter than expected (HTTP 416 for a byte range): the object "
                    "is truncated; re-create it"
                )
            return None

        return classify

    def _call(self, what: str, key: str | None, fn: Callable[[], T]) -> T:
        return self._retry(
            f"{what} {self.url(key) if key is not None else self.root_url}", fn, self._classify(key)
        )

    # -------------------------------------------------------------- reads

    def get(self, key: str) -> bytes:
        def attempt() -> bytes:
            response = self.client.get_object(Bucket=self.bucket, Key=key)
            body = response["Body"].read()
            expected = response.get("ContentLength", len(body))
            if len(body) != expected:  # a body cut short: retried like a reset
                from botocore.exceptions import IncompleteReadError

                raise IncompleteReadError(actual_bytes=len(body), expected_bytes=expected)
            return body

        return self._call("GET", key, attempt)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        out = bytearray(end - start)
        self._get_range_into(key, memoryview(out), start, None)
        return bytes(out)

    def get_range_into(
        self, key: str, out: bytearray | memoryview, start: int, *, total: int | None = None
    ) -> None:
        """One ranged GET into ``out``; checks the object's total size when given."""
        self._get_range_into(key, memoryview(out).cast("B"), start, total)

    def _get_range_into(self, key: str, view: memoryview, start: int, total: int | None) -> None:
        from ...errors import CorruptStoreError

        end = start + len(view) - 1

        def attempt() -> None:
            response = self.client.get_object(
                Bucket=self.bucket, Key=key, Range=f"bytes={start}-{end}"
            )
            if total is not None:
                content_range = response.get("ContentRange") or ""
                size = content_range.rpartition("/")[2]
                if size.isdigit() and int(size) != total:
                    response["Body"].close()
                    raise CorruptStoreError(
                        f"{self.url(key)} is {size} bytes, expected {total}: the object was "
                        "truncated or replaced; re-create it"
                    )
            body, done = response["Body"], 0
            while done < len(view):
                n = body.readinto(view[done:])
                if n == 0:
                    break
                done += n
            if done != len(view):
                if total is not None and start + done < total:
                    # The connection ended early: a transient fault, retry the range.
                    raise ConnectionError(f"response ended after {done} of {len(view)} bytes")
                raise CorruptStoreError(
                    f"{self.url(key)} ended at byte {start + done}, expected {start + len(view)}: "
                    "the object is truncated; re-create it"
                )

        self._call("GET range", key, attempt)

    def size(self, key: str) -> int | None:
        botocore_exc = require("botocore.exceptions", "s3")

        def attempt() -> Any:
            try:
                return self.client.head_object(Bucket=self.bucket, Key=key)
            except botocore_exc.ClientError as err:
                if err.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                    return None  # HEAD has no body: a missing key and bucket look alike
                raise

        head = self._call("HEAD", key, attempt)
        return None if head is None else int(head["ContentLength"])

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {
                "Bucket": self.bucket,
                "Prefix": prefix,
                "MaxKeys": self.config.list_page_size,
            }
            if token:
                kwargs["ContinuationToken"] = token
            page = self._call(
                "LIST", prefix, functools.partial(self.client.list_objects_v2, **kwargs)
            )
            for item in page.get("Contents", []):
                yield ObjectInfo(item["Key"], int(item["Size"]), item.get("ETag", "").strip('"'))
            if not page.get("IsTruncated"):
                return
            token = page["NextContinuationToken"]

    def list_dirs(self, prefix: str) -> builtins.list[str]:
        base = prefix.rstrip("/") + "/" if prefix.strip("/") else ""
        names: list[str] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {
                "Bucket": self.bucket,
                "Prefix": base,
                "Delimiter": "/",
                "MaxKeys": self.config.list_page_size,
            }
            if token:
                kwargs["ContinuationToken"] = token
            page = self._call(
                "LIST", base, functools.partial(self.client.list_objects_v2, **kwargs)
            )
            for item in page.get("CommonPrefixes", []):
                names.append(item["Prefix"][len(base) :].rstrip("/"))
            if not page.get("IsTruncated"):
                return names
            token = page["NextContinuationToken"]

    def presigned_url(self, key: str, expires_s: int = 3600) -> str:
        """A plain-HTTP GET URL for ``key`` (what Activault's reader downloads from)."""
        return self.client.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": key}, ExpiresIn=expires_s
        )

    # -------------------------------------------------------------- writes

    def check_bucket(self) -> None:
        """Raise a clear error now if the bucket is missing or the credentials are wrong."""
        self._call("HEAD bucket", None, lambda: self.client.head_bucket(Bucket=self.bucket))

    def put(self, key: str, data: bytes | bytearray | memoryview) -> str:
        """Publish ``data`` at ``key``; it is sent from the caller's buffer (no copy), which
        must not change until this returns. Returns its ETag."""
        view = memoryview(data).cast("B")
        if len(view) <= self.config.multipart_threshold:
            response = self._call(
                "PUT",
                key,
                lambda: self.client.put_object(
                    Bucket=self.bucket,
                    Key=key,
                    Body=ViewBody(view),  # a fresh stream per attempt
                    ContentType="application/octet-stream",
                ),
            )
            return str(response.get("ETag", "")).strip('"')
        return self._put_multipart(key, view)

    def _put_multipart(self, key: str, view: memoryview) -> str:
        """Multipart upload: the object appears only when complete; aborted on failure."""
        upload_id = self.create_upload(key)
        size = self.config.part_size
        offsets = list(range(0, len(view), size))

        def send(number: int, offset: int) -> dict[str, Any]:
            etag = self.upload_part(
                key, upload_id, number, view[offset : offset + size], of=len(offsets)
            )
            return {"PartNumber": number, "ETag": etag}

        try:
            workers = min(self.config.part_concurrency, len(offsets))
            with ThreadPoolExecutor(workers, thread_name_prefix="actstore-part") as pool:
                parts = list(pool.map(lambda a: send(*a), enumerate(offsets, start=1)))
            return self._complete(key, upload_id, parts, len(view))
        except BaseException:
            self.abort_upload(key, upload_id)
            raise

    # Multipart primitives, for callers that stream parts themselves (``actstore cp``).

    def create_upload(self, key: str) -> str:
        """Start a multipart upload of ``key``; returns its upload id."""
        upload = self._call(
            "CREATE multipart",
            key,
            lambda: self.client.create_multipart_upload(
                Bucket=self.bucket, Key=key, ContentType="application/octet-stream"
            ),
        )
        return upload["UploadId"]

    def upload_part(
        self, key: str, upload_id: str, number: int, data: Any, *, of: int | None = None
    ) -> str:
        """Send part ``number`` (1-based) of an upload from ``data`` (any buffer, not copied,
        unchanged until this returns); returns its ETag."""
        view = memoryview(data).cast("B")
        part = self._call(
            f"PUT part {number}{f'/{of}' if of else ''} of",
            key,
            lambda: self.client.upload_part(
                Bucket=self.bucket,
                Key=key,
                UploadId=upload_id,
                PartNumber=number,
                Body=ViewBody(view),
            ),
        )
        return part["ETag"]

    def complete_upload(
        self, key: str, upload_id: str, etags: builtins.list[str], size: int
    ) -> None:
        """Publish ``key`` from its parts (ETags in part order); ``size``: the total bytes."""
        parts = [{"PartNumber": i, "ETag": e} for i, e in enumerate(etags, start=1)]
        self._complete(key, upload_id, parts, size)

    def abort_upload(self, key: str, upload_id: str) -> None:
        """Drop an unfinished upload (logged, not raised, if that fails)."""
        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
        except Exception as err:  # noqa: BLE001 - the original error matters more
            log.warning("could not abort multipart upload of %s: %s", self.url(key), err)

    def _complete(
        self, key: str, upload_id: str, parts: builtins.list[dict[str, Any]], size: int
    ) -> str:
        """Complete an upload; the object's ETag ("" when a retry found it done)."""
        botocore_exc = require("botocore.exceptions", "s3")

        def attempt() -> str:
            try:
                response = self.client.complete_multipart_upload(
                    Bucket=self.bucket,
                    Key=key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                )
            except botocore_exc.ClientError as err:
                # A retried complete whose first try succeeded (response lost) finds no upload.
                code = err.response.get("Error", {}).get("Code")
                if code == "NoSuchUpload" and self.size(key) == size:
                    return ""
                raise
            return str(response.get("ETag", "")).strip('"')

        return self._call("COMPLETE multipart", key, attempt)

    def pending_upload(self, key: str) -> tuple[str, dict[int, tuple[str, int]]] | None:
        """The newest unfinished multipart upload of ``key`` and its parts (number ->
        (ETag, size)), for resuming it; None when there is none."""
        response = self._call(
            "LIST uploads",
            key,
            lambda: self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=key),
        )
        uploads = [u for u in response.get("Uploads", []) if u["Key"] == key]
        if not uploads:
            return None
        upload_id = max(uploads, key=lambda u: u["Initiated"])["UploadId"]
        parts: dict[int, tuple[str, int]] = {}
        marker = 0
        while True:
            try:
                page = self._call(
                    "LIST parts",
                    key,
                    functools.partial(
                        self.client.list_parts,
                        Bucket=self.bucket,
                        Key=key,
                        UploadId=upload_id,
                        PartNumberMarker=marker,
                    ),
                )
            except StoreNotFoundError:
                return None  # completed or aborted meanwhile
            for p in page.get("Parts", []):
                parts[int(p["PartNumber"])] = (p["ETag"], int(p["Size"]))
            if not page.get("IsTruncated"):
                return upload_id, parts
            marker = int(page["NextPartNumberMarker"])

    # Conditional writes (If-None-Match / If-Match), for the write lock.

    def _precondition_failed(self, err: BaseException) -> bool:
        botocore_exc = require("botocore.exceptions", "s3")
        if not isinstance(err, botocore_exc.ClientError):
            return False
        code = str(err.response.get("Error", {}).get("Code", ""))
        status = int(err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        # 412: the condition does not hold; 409: a concurrent conditional write won.
        return status in (409, 412) or code in ("PreconditionFailed", "ConditionalRequestConflict")

    def _unsupported(self, err: BaseException) -> bool:
        botocore_exc = require("botocore.exceptions", "s3")
        if not isinstance(err, botocore_exc.ClientError):
            return False
        code = str(err.response.get("Error", {}).get("Code", ""))
        status = int(err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        return status == 501 or code == "NotImplemented"

    def put_if(self, key: str, data: bytes, *, etag: str | None) -> str | None:
        """PUT ``data`` only if ``key`` does not exist (``etag=None``: ``If-None-Match: *``)
        or still has ETag ``etag`` (``If-Match``). Returns the new ETag, or None when the
        condition does not hold. Raises :class:`~actstore.errors.UnsupportedError` (a
        ``NotImplementedError``) when the service does not support conditional writes (the
        caller falls back)."""
        condition = {"IfNoneMatch": "*"} if etag is None else {"IfMatch": etag}

        def put() -> str:
            response = self.client.put_object(
                Bucket=self.bucket, Key=key, Body=data, ContentType="application/json", **condition
            )
            return str(response["ETag"]).strip('"')

        done = self._conditional("conditional PUT", key, put)
        if done is _UNSUPPORTED:
            raise UnsupportedError(f"{self.root_url} does not support conditional writes")
        return done

    def _conditional(self, what: str, key: str, request: Callable[[], Any]) -> Any:
        """Run a conditional ``request`` (with retries): its result, None when its condition
        does not hold (or the key is gone), ``_UNSUPPORTED`` when the service has no
        conditional requests."""

        def attempt() -> Any:
            try:
                return request()
            except Exception as err:
                if self._precondition_failed(err):
                    return None
                if self._unsupported(err):
                    return _UNSUPPORTED
                raise

        try:
            return self._call(what, key, attempt)
        except StoreNotFoundError:
            return None  # If-Match on a key that is gone

    def get_with_age(self, key: str) -> tuple[bytes, str, float] | None:
        """``(body, ETag, age_s)`` of ``key``, or None if it does not exist. ``age_s`` is the
        time since the object was last written, by the server's clock (its ``Date``
        header minus ``Last-Modified``), so clients' clock skew does not matter."""
        import email.utils

        def attempt() -> tuple[bytes, str, float]:
            response = self.client.get_object(Bucket=self.bucket, Key=key)
            body = response["Body"].read()
            headers = response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
            modified = response.get("LastModified")
            age = 0.0
            if headers.get("date") and modified is not None:
                now = email.utils.parsedate_to_datetime(headers["date"])
                age = max(0.0, (now - modified).total_seconds())
            return body, str(response.get("ETag", "")).strip('"'), age

        try:
            return self._call("GET", key, attempt)
        except StoreNotFoundError:
            return None

    def delete_if(self, key: str, etag: str) -> bool:
        """Delete ``key`` only if its ETag is still ``etag``; False if it changed or is
        gone. Services without conditional deletes get a plain DELETE after a check."""

        def delete() -> bool:
            self.client.delete_object(Bucket=self.bucket, Key=key, IfMatch=etag)
            return True

        done = self._conditional("conditional DELETE", key, delete)
        if done is not _UNSUPPORTED:
            return bool(done)
        found = self.get_with_age(key)
        if found is None or found[1] != etag:
            return False
        self.delete(key)
        return True

    def delete(self, key: str) -> None:
        self._call("DELETE", key, lambda: self.client.delete_object(Bucket=self.bucket, Key=key))

    def abort_incomplete(self, prefix: str) -> int:
        response = self._call(
            "LIST uploads",
            prefix,
            lambda: self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=prefix),
        )
        uploads = response.get("Uploads", [])
        for up in uploads:
            self._call(
                "ABORT multipart",
                up["Key"],
                functools.partial(
                    self.client.abort_multipart_upload,
                    Bucket=self.bucket,
                    Key=up["Key"],
                    UploadId=up["UploadId"],
                ),
            )
        return len(uploads)
