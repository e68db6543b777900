"""URL scheme -> backend: the one table that says which :class:`~.base.ObjectStore` serves
``s3://``, ``gs://`` and ``az://`` locations, and the one parser of a location as a user
writes it. A new backend is one module and one :func:`register_backend` call (plus a run of
:class:`actstore.testing.BackendSuite`).

Example:
    >>> split_location("gs://bucket/runs/a/"), split_location("abfs://box/x")
    (('gs', 'bucket', 'runs/a'), ('az', 'box', 'x'))
    >>> backend("gcs").scheme, remote_schemes()
    ('gs', ('s3', 'gs', 'az'))
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from ...errors import ConfigError
from .base import ObjectStore
from .config import AzureConfig, GCSConfig, S3Config, StorageOptions


@dataclass(frozen=True)
class Backend:
    """One remote backend: its scheme (and other spellings of it), its settings type and
    how to open one bucket of it."""

    scheme: str
    name: str
    """What the service is called, for messages."""
    options_type: type[StorageOptions]
    open: Callable[[str, Any], ObjectStore]
    """``open(bucket, options)`` -> the store (options of :attr:`options_type`)."""
    aliases: tuple[str, ...] = ()
    bucket_word: str = "bucket"

    def options(self, given: StorageOptions | None) -> StorageOptions:
        """``given`` when it is this backend's type, else this backend's defaults."""
        return given if isinstance(given, self.options_type) else self.options_type()


_BACKENDS: dict[str, Backend] = {}
_SPELLINGS: dict[str, str] = {}


def register_backend(entry: Backend) -> None:
    """Serve locations of ``entry.scheme`` (and its aliases) with ``entry``."""
    _BACKENDS[entry.scheme] = entry
    for spelling in (entry.scheme, *entry.aliases):
        _SPELLINGS[spelling] = entry.scheme


def backend(scheme: str) -> Backend:
    """The backend of ``scheme`` (any of its spellings); :class:`ConfigError` if none."""
    canonical = _SPELLINGS.get(scheme)
    if canonical is None:
        raise ConfigError(
            f"unsupported URL scheme {scheme!r}; use {', '.join(_examples())}, file:///path "
            "or a plain path"
        )
    return _BACKENDS[canonical]


def remote_schemes() -> tuple[str, ...]:
    """The schemes of object storage, canonical spellings."""
    return tuple(_BACKENDS)


def _examples() -> list[str]:
    return [f"{b.scheme}://{b.bucket_word.upper()}/prefix" for b in _BACKENDS.values()]


def is_remote(location: str | os.PathLike) -> bool:
    """True for a URL of object storage (``s3://``, ``gs://``, ``az://``...)."""
    scheme, sep, _ = os.fspath(location).partition("://")
    return bool(sep) and scheme in _SPELLINGS


def split_location(location: str | os.PathLike) -> tuple[str, str | None, str]:
    """The one parser of a location as a user writes it (:meth:`Location.parse
    <actstore.storage.location.Location.parse>` and :func:`open_location
    <actstore.storage.object.open_location>` both call it): ``(scheme, bucket, prefix)``
    for ``s3://bucket/prefix`` and the other object stores (canonical scheme, prefix
    without surrounding ``/``), ``("file", None, path)`` for a plain path or
    ``file:///path``: ``~`` expanded, made absolute and normalised, but not resolved (a
    symlinked directory keeps the name it was given). A :class:`ConfigError` for a URL
    without a bucket, an unknown scheme, an empty location or the file system root.

    Example:
        >>> split_location("s3://bucket/runs/a/"), split_location("file:///tmp/x/../acts")
        (('s3', 'bucket', 'runs/a'), ('file', None, '/tmp/acts'))
    """
    text = os.fspath(location)
    if "://" in text:
        parsed = urlparse(text)
        if parsed.scheme != "file":
            entry = backend(parsed.scheme)
            word = entry.bucket_word.upper()
            if not parsed.netloc:
                raise ConfigError(
                    f"{text!r} names no {entry.bucket_word}; write {entry.scheme}://{word}/prefix"
                )
            if "@" in parsed.netloc or ":" in parsed.netloc:
                raise ConfigError(
                    f"{text!r}: give the {entry.bucket_word} alone, {entry.scheme}://{word}/prefix "
                    f"(the account or endpoint goes in {entry.options_type().endpoint_setting()})"
                )
            return entry.scheme, parsed.netloc, parsed.path.strip("/")
        text = parsed.path
    if not text:
        raise ConfigError("an empty location; give a directory or an s3:// URL")
    path = os.path.abspath(os.path.expanduser(text))
    if os.path.dirname(path) == path:
        raise ConfigError(f"{text!r} is the file system root; give a directory under it")
    return "file", None, path


def open_bucket(scheme: str, bucket: str, options: StorageOptions | None = None) -> ObjectStore:
    """The store of ``bucket`` on the backend of ``scheme``, with ``options`` when they are
    that backend's (else its defaults, read from the environment)."""
    entry = backend(scheme)
    return entry.open(bucket, entry.options(options))


def _open_s3(bucket: str, options: S3Config) -> ObjectStore:
    from .s3_store import S3Store

    return S3Store(bucket, options)


def _open_gs(bucket: str, options: GCSConfig) -> ObjectStore:
    from .gcs_store import GCSStore

    return GCSStore(bucket, options)


def _open_az(bucket: str, options: AzureConfig) -> ObjectStore:
    from .obstore_store import AzureStore

    return AzureStore(bucket, options)


register_backend(Backend("s3", "S3", S3Config, _open_s3))
register_backend(Backend("gs", "Google Cloud Storage", GCSConfig, _open_gs, aliases=("gcs",)))
register_backend(
    Backend(
        "az",
        "Azure Blob Storage",
        AzureConfig,
        _open_az,
        aliases=("abfs",),
        bucket_word="container",
    )
)
