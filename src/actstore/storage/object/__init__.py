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

import os
from pathlib import Path

from .base import (
    LOCK_NAME,
    ObjectInfo,
    ObjectStore,
    base_name,
    is_internal,
    is_remote,
    join_key,
    parent_key,
    split_location,
)
from .config import MiB, S3Config
from .local_store import LocalStore
from .retry import Retrier
from .s3_store import S3Store

__all__ = [
    "LOCK_NAME",
    "LocalStore",
    "MiB",
    "ObjectInfo",
    "ObjectStore",
    "Retrier",
    "S3Config",
    "S3Store",
    "base_name",
    "is_internal",
    "is_remote",
    "join_key",
    "open_location",
    "parent_key",
    "split_location",
]


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
    bucket, rest = split_location(str(location))
    if bucket is not None:
        return S3Store(bucket, s3 or S3Config()), rest
    path = Path(rest)
    return LocalStore(path.parent), path.name
