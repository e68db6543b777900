"""Object storage with one small API for S3-compatible buckets and local directories.

A location is ``s3://bucket/key/prefix``, ``file:///abs/path`` or a plain path.
:func:`open_location` turns it into an :class:`ObjectStore` plus the key prefix inside it,
so format code is written once and works on S3 and on local disk alike:

* ``put`` publishes atomically: a single PUT, a multipart upload completed only when every
  part is in (aborted otherwise), or a local temp file renamed into place. A reader never
  sees a half-written object.
* ``get_into`` fills a buffer with concurrent ranged GETs; ``list`` lists by key prefix
  (S3 semantics: no trailing ``/`` means sibling keys that share the prefix are included).
* Transient faults (HTTP 5xx, ``503 SlowDown``, throttling, connection resets, timeouts,
  a response body cut short) are retried with capped exponential backoff and jitter; after
  ``max_attempts`` a :class:`~actstore.errors.StorageError` names the operation, the object
  and the last error. Missing buckets and keys raise
  :class:`~actstore.errors.StoreNotFoundError`; rejected credentials a ``StorageError``
  that says which environment variables to check.

S3 credentials and endpoint come from :class:`S3Config`, whose defaults read the usual
variables: ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
``S3_ENDPOINT_URL`` (Activault's name) or ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, and
``AWS_REGION`` / ``AWS_DEFAULT_REGION``.

Example:
    >>> store, prefix = open_location("/tmp/actstore-doc/run")
    >>> store.put(f"{prefix}/hello.txt", b"hi")
    >>> store.get(f"{prefix}/hello.txt"), prefix
    (b'hi', 'run')
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlparse

from ..errors import ActstoreError, ConfigError, StorageError, StoreNotFoundError, require
from .local import atomic_write

log = logging.getLogger(__name__)

T = TypeVar("T")

MiB = 1 << 20

#: S3 error codes that mean "try again later" even when the status is not 5xx.
_RETRY_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "InternalError",
        "ServiceUnavailable",
        "RequestLimitExceeded",
        "TooManyRequests",
        "BadDigest",
        "IncompleteBody",
    }
)
_AUTH_CODES = frozenset(
    {
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "AccessDenied",
        "InvalidToken",
        "ExpiredToken",
        "AuthorizationHeaderMalformed",
        "InvalidSecurity",
        "403",
    }
)
_MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})


def _env(*names: str) -> str | None:
    for name in names:
        value = os.environ.get(name)
        if value:
            return value
    return None


@dataclass(frozen=True, kw_only=True)
class S3Config:
    """How to reach an S3-compatible endpoint and how hard to retry.

    Fields left ``None`` are read from the environment when the client is created.

    Example:
        >>> S3Config(endpoint_url="http://127.0.0.1:9000", max_attempts=4).max_attempts
        4
    """

    endpoint_url: str | None = None
    """e.g. ``https://storage.eu-north1.nebius.cloud``; None: $S3_ENDPOINT_URL,
    $AWS_ENDPOINT_URL_S3 or $AWS_ENDPOINT_URL, else AWS."""
    region: str | None = None
    """None: $AWS_REGION or $AWS_DEFAULT_REGION, else us-east-1."""
    access_key_id: str | None = field(default=None, repr=False)
    secret_access_key: str | None = field(default=None, repr=False)
    max_attempts: int = 8
    """Tries per request (and per multipart part) before giving up."""
    backoff_s: float = 0.1
    """First backoff; doubles per retry up to ``backoff_max_s``, with full jitter."""
    backoff_max_s: float = 10.0
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    max_pool_connections: int = 64
    multipart_threshold: int = 64 * MiB
    """Objects larger than this are uploaded as multipart uploads."""
    part_size: int = 32 * MiB
    """Multipart part size (S3 requires >= 5 MiB except for the last part)."""
    part_concurrency: int = 4
    """Parts of one object uploaded at once."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError(f"max_attempts must be >= 1, not {self.max_attempts}")
        if self.part_size < 5 * MiB:
            raise ConfigError(f"part_size must be >= 5 MiB (an S3 limit), not {self.part_size}")
        if self.multipart_threshold < self.part_size:
            raise ConfigError("multipart_threshold must be >= part_size")

    def resolved_endpoint(self) -> str | None:
        return self.endpoint_url or _env(*_ENDPOINT_VARS)

    def endpoint_setting(self) -> str:
        """Where the endpoint comes from, for error messages (what the user should fix).

        Example:
            >>> S3Config(endpoint_url="http://127.0.0.1:9000").endpoint_setting()
            'S3Config.endpoint_url (--endpoint-url)'
        """
        if self.endpoint_url:
            return "S3Config.endpoint_url (--endpoint-url)"
        return next((name for name in _ENDPOINT_VARS if os.environ.get(name)), "S3_ENDPOINT_URL")


#: Environment variables naming the endpoint, first match wins (S3_ENDPOINT_URL: Activault's).
_ENDPOINT_VARS = ("S3_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")


@dataclass(frozen=True)
class ObjectInfo:
    """One listed object: its full key and size in bytes."""

    key: str
    size: int


class ObjectStore:
    """Bytes by key. Subclasses: :class:`S3Store` and :class:`LocalStore`."""

    #: Human-readable root, e.g. ``s3://bucket`` or ``/data``.
    root_url: str

    def url(self, key: str) -> str:
        """The location of ``key`` as a user would write it."""
        raise NotImplementedError

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Publish ``data`` under ``key`` atomically (whole object or nothing)."""
        raise NotImplementedError

    def get(self, key: str) -> bytes:
        """The whole object."""
        raise NotImplementedError

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object."""
        raise NotImplementedError

    def get_into(
        self,
        key: str,
        out: bytearray | memoryview,
        *,
        chunk_size: int = 8 * MiB,
        pool: ThreadPoolExecutor | None = None,
    ) -> None:
        """Fill ``out`` with the first ``len(out)`` bytes of the object, in chunks fetched
        concurrently on ``pool`` (sequentially without one). The object must be exactly
        ``len(out)`` bytes long, else :class:`~actstore.errors.CorruptStoreError`."""
        raise NotImplementedError

    def size(self, key: str) -> int | None:
        """Size of the object, or None if it does not exist."""
        raise NotImplementedError

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (string prefix, S3 semantics)."""
        raise NotImplementedError

    def list_dirs(self, prefix: str) -> list[str]:
        """Names of the immediate "sub-directories" of ``prefix`` (``prefix/NAME/...``)."""
        raise NotImplementedError

    def delete(self, key: str) -> None:
        """Remove ``key`` (no error if it is absent)."""
        raise NotImplementedError

    def abort_incomplete(self, prefix: str) -> int:
        """Drop unfinished uploads under ``prefix`` (S3 multipart, local temp files)."""
        raise NotImplementedError

    def get_json(self, key: str) -> Any:
        """Parse the object as UTF-8 JSON (:class:`CorruptStoreError` if it is not)."""
        import json

        from ..errors import CorruptStoreError

        data = self.get(key)
        try:
            return json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CorruptStoreError(
                f"{self.url(key)} is not valid JSON ({err}); the store is damaged: restore or "
                "re-create this file"
            ) from err

    def put_json(self, key: str, obj: Any, *, indent: int | None = None) -> None:
        """Serialise ``obj`` as JSON and publish it atomically."""
        import json

        self.put(key, json.dumps(obj, indent=indent).encode("utf-8"))


def join_key(*parts: str) -> str:
    """Join key parts with single slashes, skipping empty parts.

    Example:
        >>> join_key("run", "", "models.layers.1.post/", "metadata.json")
        'run/models.layers.1.post/metadata.json'
    """
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


def parent_key(key: str) -> str:
    """``"a/b/c"`` -> ``"a/b"``; ``"c"`` -> ``""``."""
    return key.rstrip("/").rpartition("/")[0]


def base_name(key: str) -> str:
    """``"a/b/c"`` -> ``"c"``."""
    return key.rstrip("/").rpartition("/")[2]


def is_remote(location: str) -> bool:
    """True for ``s3://`` URLs."""
    return str(location).startswith("s3://")


def open_location(
    location: str | os.PathLike, s3: S3Config | None = None
) -> tuple[ObjectStore, str]:
    """The store holding ``location`` and the key prefix of ``location`` inside it.

    ``s3://bucket/a/b`` -> (S3 store of ``bucket``, ``"a/b"``); a local path or ``file://``
    URL -> (store rooted at the parent directory, the last path component).

    Example:
        >>> store, prefix = open_location("file:///tmp/x/run")
        >>> store.root_url, prefix
        ('/tmp/x', 'run')
    """
    text = str(location)
    if text.startswith("s3://"):
        parsed = urlparse(text)
        if not parsed.netloc:
            raise ConfigError(f"{text!r} names no bucket; write s3://BUCKET/run/hook")
        return S3Store(parsed.netloc, s3 or S3Config()), parsed.path.strip("/")
    if "://" in text:
        parsed = urlparse(text)
        if parsed.scheme != "file":
            raise ConfigError(
                f"unsupported URL scheme {parsed.scheme!r} in {text!r}; use s3://bucket/key, "
                "file:///path or a plain path"
            )
        text = parsed.path
    path = Path(text).expanduser().resolve()
    if path.parent == path:
        raise ConfigError(f"{text!r} is the file system root; give a directory under it")
    return LocalStore(path.parent), path.name


# ---------------------------------------------------------------------------- retries


def _transient(err: BaseException) -> bool:
    """Whether ``err`` is worth retrying (network trouble or a server-side 5xx)."""
    botocore_exc = require("botocore.exceptions", "s3")
    if isinstance(err, botocore_exc.ClientError):
        code = str(err.response.get("Error", {}).get("Code", ""))
        status = int(err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        return status >= 500 or status == 429 or code in _RETRY_CODES
    transient_types = (
        botocore_exc.EndpointConnectionError,
        botocore_exc.ConnectionClosedError,
        botocore_exc.ReadTimeoutError,
        botocore_exc.ConnectTimeoutError,
        botocore_exc.ResponseStreamingError,
        botocore_exc.IncompleteReadError,
        botocore_exc.HTTPClientError,
        ConnectionError,
        TimeoutError,
    )
    return isinstance(err, transient_types)


def _unreachable(err: BaseException) -> bool:
    """Whether ``err`` means no connection to the endpoint could be made at all."""
    botocore_exc = require("botocore.exceptions", "s3")
    return isinstance(
        err,
        (
            botocore_exc.EndpointConnectionError,
            botocore_exc.ConnectTimeoutError,
            ConnectionRefusedError,
        ),
    )


def _describe_error(err: BaseException) -> str:
    botocore_exc = require("botocore.exceptions", "s3")
    if isinstance(err, botocore_exc.ClientError):
        e = err.response.get("Error", {})
        status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return f"HTTP {status} {e.get('Code', '')}: {e.get('Message', '')}".strip()
    return f"{type(err).__name__}: {err}"


class _Retrier:
    """Runs a callable, retrying transient errors with capped exponential backoff."""

    def __init__(self, config: S3Config) -> None:
        self.config = config
        self.retries = 0  # total retries so far (read by tests and benchmarks)
        self._lock = threading.Lock()

    def __call__(
        self, what: str, fn: Callable[[], T], classify: Callable[[BaseException], Any]
    ) -> T:
        cfg = self.config
        for attempt in range(1, cfg.max_attempts + 1):
            try:
                return fn()
            except Exception as err:  # classified below
                if isinstance(err, ActstoreError):
                    raise
                mapped = classify(err)
                if mapped is not None:
                    raise mapped from err
                if not _transient(err):
                    raise StorageError(f"{what} failed: {_describe_error(err)}") from err
                if attempt == cfg.max_attempts:
                    if _unreachable(err):
                        endpoint = cfg.resolved_endpoint() or "AWS S3 (no endpoint set)"
                        raise StorageError(
                            f"{what} failed after {attempt} attempts: cannot reach {endpoint} "
                            f"({_describe_error(err)}); check {cfg.endpoint_setting()} and that "
                            "the service is up, or raise max_attempts"
                        ) from err
                    raise StorageError(
                        f"{what} failed after {attempt} attempts ({_describe_error(err)}); the "
                        "endpoint keeps failing: check the network and the S3 service, or raise "
                        "max_attempts"
                    ) from err
                delay = random.uniform(
                    0, min(cfg.backoff_max_s, cfg.backoff_s * 2 ** (attempt - 1))
                )
                with self._lock:
                    self.retries += 1
                log.warning(
                    "%s: %s; retry %d/%d in %.2fs",
                    what,
                    _describe_error(err),
                    attempt,
                    cfg.max_attempts - 1,
                    delay,
                )
                time.sleep(delay)
        raise AssertionError("unreachable")


# ---------------------------------------------------------------------------- S3

_SESSION_LOCK = threading.Lock()
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

    def __init__(self, bucket: str, config: S3Config | None = None) -> None:
        self.bucket = bucket
        self.config = config or S3Config()
        self.root_url = f"s3://{bucket}"
        self._retry = _Retrier(self.config)
        self._client: Any = None
        self._pid = os.getpid()
        self._client_lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = {**self.__dict__, "_client": None}
        del state["_client_lock"], state["_retry"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._client_lock = threading.Lock()
        self._retry = _Retrier(self.config)

    @property
    def retries(self) -> int:
        """Transient faults retried by this store so far."""
        return self._retry.retries

    @property
    def client(self) -> Any:
        """The boto3 S3 client (created on first use in each process)."""
        if self._client is None or self._pid != os.getpid():
            with self._client_lock:
                if self._client is None or self._pid != os.getpid():
                    self._client = self._make_client()
                    self._pid = os.getpid()
        return self._client

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
        key_id = cfg.access_key_id or _env("AWS_ACCESS_KEY_ID")
        secret = cfg.secret_access_key or _env("AWS_SECRET_ACCESS_KEY")
        kwargs: dict[str, Any] = {}
        if key_id and secret:
            kwargs.update(
                aws_access_key_id=key_id,
                aws_secret_access_key=secret,
                aws_session_token=_env("AWS_SESSION_TOKEN"),
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
                region_name=cfg.region or _env("AWS_REGION", "AWS_DEFAULT_REGION") or "us-east-1",
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
            if code in _MISSING_CODES or (status == 404 and code != "NoSuchUpload"):
                return StoreNotFoundError(f"{where} does not exist")
            if code in _AUTH_CODES or status == 403:
                return StorageError(
                    f"{endpoint} refused access to {where} ({_describe_error(err)}): check "
                    "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and the bucket's permissions"
                )
            if code == "InvalidRange" or status == 416:
                from ..errors import CorruptStoreError

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
            return response["Body"].read()

        return self._call("GET", key, attempt)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        out = bytearray(end - start)
        self._get_range_into(key, memoryview(out), start, None)
        return bytes(out)

    def _get_range_into(self, key: str, view: memoryview, start: int, total: int | None) -> None:
        """One ranged GET into ``view``; checks the object's total size when given."""
        from ..errors import CorruptStoreError

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

    def get_into(
        self,
        key: str,
        out: bytearray | memoryview,
        *,
        chunk_size: int = 8 * MiB,
        pool: ThreadPoolExecutor | None = None,
    ) -> None:
        view = memoryview(out).cast("B")
        total = len(view)
        starts = list(range(0, total, chunk_size)) or [0]
        if total == 0:
            return
        if pool is None or len(starts) == 1:
            for s in starts:
                self._get_range_into(key, view[s : s + chunk_size], s, total)
            return
        futures = [
            pool.submit(self._get_range_into, key, view[s : s + chunk_size], s, total)
            for s in starts
        ]
        errors = [f.exception() for f in futures]
        for err in errors:
            if err is not None:
                raise err

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
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
            if token:
                kwargs["ContinuationToken"] = token
            page = self._call("LIST", prefix, lambda kw=kwargs: self.client.list_objects_v2(**kw))
            for item in page.get("Contents", []):
                yield ObjectInfo(item["Key"], int(item["Size"]))
            if not page.get("IsTruncated"):
                return
            token = page["NextContinuationToken"]

    def list_dirs(self, prefix: str) -> list[str]:
        base = prefix.rstrip("/") + "/" if prefix.strip("/") else ""
        names: list[str] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": base, "Delimiter": "/"}
            if token:
                kwargs["ContinuationToken"] = token
            page = self._call("LIST", base, lambda kw=kwargs: self.client.list_objects_v2(**kw))
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

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        if len(view) <= self.config.multipart_threshold:
            self._call(
                "PUT",
                key,
                lambda: self.client.put_object(
                    Bucket=self.bucket,
                    Key=key,
                    Body=bytes(view),
                    ContentType="application/octet-stream",
                ),
            )
            return
        self._put_multipart(key, view)

    def _put_multipart(self, key: str, view: memoryview) -> None:
        """Multipart upload: the object appears only when complete; aborted on failure."""
        client = self.client
        upload = self._call(
            "CREATE multipart",
            key,
            lambda: client.create_multipart_upload(
                Bucket=self.bucket, Key=key, ContentType="application/octet-stream"
            ),
        )
        upload_id = upload["UploadId"]
        size = self.config.part_size
        offsets = list(range(0, len(view), size))

        def send(number: int, offset: int) -> dict[str, Any]:
            body = bytes(view[offset : offset + size])
            part = self._call(
                f"PUT part {number}/{len(offsets)} of",
                key,
                lambda: client.upload_part(
                    Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body
                ),
            )
            return {"PartNumber": number, "ETag": part["ETag"]}

        try:
            workers = min(self.config.part_concurrency, len(offsets))
            with ThreadPoolExecutor(workers, thread_name_prefix="actstore-part") as pool:
                parts = list(pool.map(lambda a: send(*a), enumerate(offsets, start=1)))
            self._complete(key, upload_id, parts, len(view))
        except BaseException:
            try:
                client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            except Exception as err:  # noqa: BLE001 - the original error matters more
                log.warning("could not abort multipart upload of %s: %s", self.url(key), err)
            raise

    def _complete(self, key: str, upload_id: str, parts: list[dict[str, Any]], size: int) -> None:
        botocore_exc = require("botocore.exceptions", "s3")

        def attempt() -> None:
            try:
                self.client.complete_multipart_upload(
                    Bucket=self.bucket,
                    Key=key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                )
            except botocore_exc.ClientError as err:
                # A retried complete whose first try succeeded (response lost) finds no upload.
                code = err.response.get("Error", {}).get("Code")
                if code == "NoSuchUpload" and self.size(key) == size:
                    return
                raise

        self._call("COMPLETE multipart", key, attempt)

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
                lambda up=up: self.client.abort_multipart_upload(
                    Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"]
                ),
            )
        return len(uploads)


# ---------------------------------------------------------------------------- local


class LocalStore(ObjectStore):
    """A directory treated as a bucket: keys are ``/``-separated relative paths.

    ``put`` writes a hidden temp file (``.NAME.*.tmp``) in the target directory, fsyncs and
    renames it into place; listings skip such temp files, like S3 hides unfinished
    multipart uploads, and :meth:`abort_incomplete` removes them.
    """

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.root_url = str(self.root)

    def _path(self, key: str) -> Path:
        return self.root / key if key else self.root

    def url(self, key: str) -> str:
        return str(self._path(key))

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_write(path) as f:
                f.write(data)
        except OSError as err:
            raise StorageError(f"cannot write {path}: {err}") from err

    def _open(self, key: str):
        try:
            return open(self._path(key), "rb", buffering=0)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as err:
            raise StoreNotFoundError(f"{self._path(key)} does not exist") from err

    def get(self, key: str) -> bytes:
        with self._open(key) as f:
            return f.read()

    def get_range(self, key: str, start: int, end: int) -> bytes:
        with self._open(key) as f:
            return os.pread(f.fileno(), end - start, start)

    def get_into(
        self,
        key: str,
        out: bytearray | memoryview,
        *,
        chunk_size: int = 8 * MiB,
        pool: ThreadPoolExecutor | None = None,
    ) -> None:
        from ..errors import CorruptStoreError

        view = memoryview(out).cast("B")
        with self._open(key) as f:
            size = os.fstat(f.fileno()).st_size
            if size != len(view):
                raise CorruptStoreError(
                    f"{self._path(key)} is {size} bytes, expected {len(view)}: the file was "
                    "truncated or replaced; re-create it"
                )
            done = 0
            while done < len(view):
                n = os.preadv(f.fileno(), [view[done : done + chunk_size]], done)
                if n == 0:
                    raise CorruptStoreError(f"{self._path(key)} ended at byte {done}")
                done += n

    def size(self, key: str) -> int | None:
        try:
            st = self._path(key).stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        return st.st_size if self._path(key).is_file() else None

    @staticmethod
    def _is_temp(name: str) -> bool:
        return name.startswith(".") and name.endswith(".tmp")

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        # Only the entries of the prefix's directory that start with its last component are
        # walked (never the whole root), then everything below them.
        top_key, stem = (
            (prefix, "") if prefix.endswith("/") else (parent_key(prefix), base_name(prefix))
        )
        top = self._path(top_key.strip("/"))
        if not top.is_dir():
            return
        out = []
        for entry in top.iterdir():
            if not entry.name.startswith(stem) or self._is_temp(entry.name):
                continue
            if entry.is_file():
                out.append(
                    ObjectInfo(entry.relative_to(self.root).as_posix(), entry.stat().st_size)
                )
                continue
            for dirpath, _, filenames in os.walk(entry):
                for name in filenames:
                    if not self._is_temp(name):
                        path = Path(dirpath) / name
                        out.append(
                            ObjectInfo(path.relative_to(self.root).as_posix(), path.stat().st_size)
                        )
        yield from sorted(out, key=lambda o: o.key)

    def list_dirs(self, prefix: str) -> list[str]:
        directory = self._path(prefix.strip("/"))
        if not directory.is_dir():
            return []
        return sorted(p.name for p in directory.iterdir() if p.is_dir())

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def abort_incomplete(self, prefix: str) -> int:
        directory = self._path(prefix.strip("/"))
        if not directory.is_dir():
            return 0
        n = 0
        for dirpath, _, filenames in os.walk(directory):
            for name in filenames:
                if self._is_temp(name):
                    (Path(dirpath) / name).unlink(missing_ok=True)
                    n += 1
        return n
