"""The retry policy for object storage: which faults are transient, capped backoff."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ...errors import ActstoreError, StorageError, require
from .config import S3Config

log = logging.getLogger(__name__)

T = TypeVar("T")

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
#: Error codes of rejected credentials (no retry: a one-line error naming the variables).
AUTH_CODES = frozenset(
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
#: Error codes of a missing object or bucket.
MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})


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


def describe_error(err: BaseException) -> str:
    """One line of what ``err`` (a botocore error or any other) says: code and message."""
    botocore_exc = require("botocore.exceptions", "s3")
    if isinstance(err, botocore_exc.ClientError):
        e = err.response.get("Error", {})
        status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return f"HTTP {status} {e.get('Code', '')}: {e.get('Message', '')}".strip()
    return f"{type(err).__name__}: {err}"


class Retrier:
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
                    raise StorageError(f"{what} failed: {describe_error(err)}") from err
                if attempt == cfg.max_attempts:
                    if _unreachable(err):
                        endpoint = cfg.resolved_endpoint() or "AWS S3 (no endpoint set)"
                        raise StorageError(
                            f"{what} failed after {attempt} attempts: cannot reach {endpoint} "
                            f"({describe_error(err)}); check {cfg.endpoint_setting()} and that "
                            "the service is up, or raise max_attempts"
                        ) from err
                    raise StorageError(
                        f"{what} failed after {attempt} attempts ({describe_error(err)}); the "
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
                    describe_error(err),
                    attempt,
                    cfg.max_attempts - 1,
                    delay,
                )
                time.sleep(delay)
        raise AssertionError("unreachable")
