"""The abstract object store and key helpers shared by every backend."""

from __future__ import annotations

import abc
import builtins
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from ...errors import ConfigError
from .config import MiB


@dataclass(frozen=True)
class ObjectInfo:
    """One listed object: its full key and size in bytes."""

    key: str
    size: int
    version: str = ""
    """Changes when the object is replaced: the ETag on S3 ("" where unknown)."""


class ObjectStore(abc.ABC):
    """Bytes by key. Subclasses: :class:`S3Store` and :class:`LocalStore`."""

    #: Human-readable root, e.g. ``s3://bucket`` or ``/data``.
    root_url: str
    #: The bucket's name ("" for a local directory).
    bucket_name: str = ""

    @abc.abstractmethod
    def url(self, key: str) -> str:
        """The location of ``key`` as a user would write it."""

    @abc.abstractmethod
    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Publish ``data`` under ``key`` atomically (whole object or nothing)."""

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """The whole object."""

    @abc.abstractmethod
    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object."""

    def get_range_into(
        self, key: str, out: bytearray | memoryview, start: int, *, total: int | None = None
    ) -> None:
        """Fill ``out`` with bytes ``[start, start + len(out))`` of the object; ``total``: the
        object's expected size, checked where the backend can."""
        view = memoryview(out).cast("B")
        view[:] = self.get_range(key, start, start + len(view))

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
        view = memoryview(out).cast("B")
        total = len(view)
        starts = range(0, total, chunk_size)
        if pool is None or len(starts) <= 1:
            for s in starts:
                self.get_range_into(key, view[s : s + chunk_size], s, total=total)
            return
        futures = [
            pool.submit(self.get_range_into, key, view[s : s + chunk_size], s, total=total)
            for s in starts
        ]
        errors = [f.exception() for f in futures]  # every chunk done before raising
        for err in errors:
            if err is not None:
                raise err

    @abc.abstractmethod
    def size(self, key: str) -> int | None:
        """Size of the object, or None if it does not exist."""

    @abc.abstractmethod
    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (string prefix, S3 semantics)."""

    @abc.abstractmethod
    def list_dirs(self, prefix: str) -> builtins.list[str]:
        """Names of the immediate "sub-directories" of ``prefix`` (``prefix/NAME/...``)."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key`` (no error if it is absent)."""

    @abc.abstractmethod
    def abort_incomplete(self, prefix: str) -> int:
        """Drop unfinished uploads under ``prefix`` (S3 multipart, local temp files)."""

    def check_bucket(self) -> None:
        """Fail early, in one line, when the bucket cannot be used (no-op locally)."""

    def clone(self) -> ObjectStore:
        """Another handle on the same store with its own connections (for a thread pool of
        its own, e.g. one uploader per hook)."""
        return self

    def copy(self, src: str, dst: str) -> None:
        """Make ``dst`` a copy of ``src`` without sending the bytes through this process
        where the backend can (a hard link locally, a server-side copy on S3)."""
        self.put(dst, self.get(src))

    def delete_tree(self, prefix: str) -> None:
        """Remove every object under ``prefix`` (and, locally, the empty folders)."""
        for obj in list(self.list(prefix.rstrip("/") + "/")):
            self.delete(obj.key)

    @abc.abstractmethod
    def acquire_lock(self, prefix: str, *, break_lock: bool = False) -> Any:
        """The write lock of the store at ``prefix`` (a lock file beside a local store, a
        lease object on S3): an object with ``release()``."""

    def get_json(self, key: str) -> Any:
        """Parse the object as UTF-8 JSON (:class:`CorruptStoreError` if it is not, read
        twice: a body mangled in transit, seen under injected resets, is fetched again)."""
        from ...errors import CorruptStoreError
        from ..local import load_json

        for attempt in range(2):
            data = self.get(key)
            try:
                return load_json(data)
            except ValueError as err:
                if attempt == 0:
                    continue
                raise CorruptStoreError(
                    f"{self.url(key)} is not valid JSON ({err}); the store is damaged: restore "
                    "or re-create this file"
                ) from err
        raise AssertionError("unreachable")

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


#: Base name of the write lock object a capture keeps in the prefix of the store it writes
#: (:mod:`actstore.storage.object.s3lock`): never part of the store.
LOCK_NAME = ".actstore-lock.json"


def is_internal(name: str) -> bool:
    """Whether ``name`` (a key or a store-relative name) is actstore's bookkeeping beside a
    store's files (the S3 write lock), which listings of the store leave out.

    Example:
        >>> is_internal("acts/3f1c/.actstore-lock.json"), is_internal("acts000000.bin")
        (True, False)
    """
    return base_name(name) == LOCK_NAME


def is_remote(location: str) -> bool:
    """True for ``s3://`` URLs."""
    return str(location).startswith("s3://")


def split_location(location: str | os.PathLike) -> tuple[str | None, str]:
    """The one parser of a location as a user writes it (:meth:`Location.parse
    <actstore.storage.location.Location.parse>` and :func:`open_location
    <actstore.storage.object.open_location>` both call it): ``(bucket, prefix)`` for
    ``s3://bucket/prefix`` (the prefix without surrounding ``/``), ``(None, path)`` for a
    plain path or ``file:///path``: ``~`` expanded, made absolute and normalised, but not
    resolved (a symlinked directory keeps the name it was given). A
    :class:`~actstore.errors.ConfigError` for a URL without a bucket, another scheme, an
    empty location or the file system root (a store lives in a directory under it).

    Example:
        >>> split_location("s3://bucket/runs/a/"), split_location("file:///tmp/x/../acts")
        (('bucket', 'runs/a'), (None, '/tmp/acts'))
    """
    text = os.fspath(location)
    if text.startswith("s3://"):
        parsed = urlparse(text)
        if not parsed.netloc:
            raise ConfigError(f"{text!r} names no bucket; write s3://BUCKET/prefix")
        return parsed.netloc, parsed.path.strip("/")
    if "://" in text:
        parsed = urlparse(text)
        if parsed.scheme != "file":
            raise ConfigError(
                f"unsupported URL scheme {parsed.scheme!r} in {text!r}; use "
                "s3://bucket/prefix, file:///path or a plain path"
            )
        text = parsed.path
    if not text:
        raise ConfigError("an empty location; give a directory or an s3:// URL")
    path = os.path.abspath(os.path.expanduser(text))
    if os.path.dirname(path) == path:
        raise ConfigError(f"{text!r} is the file system root; give a directory under it")
    return None, path
