"""Object storage with one small API for S3-compatible buckets, Google Cloud Storage, Azure
Blob Storage and local directories.

A location is ``s3://bucket/key/prefix``, ``gs://bucket/prefix``, ``az://container/prefix``
(also spelt ``gcs://``, ``abfs://``), ``file:///abs/path`` or a plain path; the scheme picks
the backend from one table (:mod:`.registry`), and what each backend can do beyond the
basics is in its :class:`Capabilities`.
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
``AWS_REGION`` / ``AWS_DEFAULT_REGION``; ``gs://`` from :class:`GCSConfig`
(``GOOGLE_APPLICATION_CREDENTIALS``, ``STORAGE_EMULATOR_HOST``), ``az://`` from
:class:`AzureConfig` (``AZURE_STORAGE_CONNECTION_STRING``, or ``AZURE_STORAGE_ACCOUNT_NAME``
and ``AZURE_STORAGE_ACCOUNT_KEY``).

Example:
    >>> store, prefix = open_location("/tmp/actstore-doc/run")
    >>> store.put(f"{prefix}/hello.txt", b"hi")  # its version: "" on a local disk
    ''
    >>> store.get(f"{prefix}/hello.txt"), prefix
    (b'hi', 'run')
"""

from __future__ import annotations

import os
from pathlib import Path

from .base import (
    LOCK_NAME,
    Capabilities,
    ObjectInfo,
    ObjectStore,
    base_name,
    is_internal,
    join_key,
    parent_key,
)
from .config import AzureConfig, GCSConfig, MiB, S3Config, StorageOptions
from .local_store import LocalStore
from .registry import (
    Backend,
    backend,
    is_remote,
    open_bucket,
    register_backend,
    remote_schemes,
    split_location,
)
from .retry import Retrier
from .s3_store import S3Store

__all__ = [
    "LOCK_NAME",
    "AzureConfig",
    "Backend",
    "Capabilities",
    "GCSConfig",
    "LocalStore",
    "MiB",
    "ObjectInfo",
    "ObjectStore",
    "Retrier",
    "S3Config",
    "S3Store",
    "StorageOptions",
    "backend",
    "base_name",
    "is_internal",
    "is_remote",
    "join_key",
    "open_bucket",
    "open_location",
    "parent_key",
    "register_backend",
    "remote_schemes",
    "split_location",
]


def open_location(
    location: str | os.PathLike, storage: StorageOptions | None = None
) -> tuple[ObjectStore, str]:
    """The store holding ``location`` and the key prefix of ``location`` inside it.

    ``s3://bucket/a/b`` -> (S3 store of ``bucket``, ``"a/b"``), likewise ``gs://`` and
    ``az://``; a local path or ``file://`` URL -> (store rooted at the parent directory,
    the last path component). ``storage``: the backend's settings (:class:`S3Config`,
    :class:`GCSConfig`, :class:`AzureConfig`; settings of another backend's type are
    ignored, that backend's defaults read from the environment).

    Example:
        >>> store, prefix = open_location("file:///tmp/x/run")
        >>> store.root_url, prefix
        ('/tmp/x', 'run')
    """
    scheme, bucket, rest = split_location(str(location))
    if bucket is not None:
        return open_bucket(scheme, bucket, storage), rest
    path = Path(rest)
    return LocalStore(path.parent), path.name
