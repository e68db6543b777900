"""Where a store lives: one :class:`Location` type for a local path, a ``file://`` URL and
``s3://bucket/prefix`` (or ``gs://``, ``az://``: any scheme of
:mod:`~actstore.storage.object.registry`), in the spirit of zarr-python's ``StorePath`` (a store plus a path).

Formats never branch on local versus remote: they read a store's bytes through
:meth:`Location.files` (:mod:`actstore.storage.files`), which serves both, and writers stage
locally and publish through the same type. The names of a store's unfinished write and lock
(``.<name>.partial``, ``.<name>.lock``) are derived here, once.

Example:
    >>> loc = Location.parse("s3://bucket/runs/a")
    >>> loc.is_local, loc.name, str(loc.parent), str(loc.child("x.bin"))
    (False, 'a', 's3://bucket/runs', 's3://bucket/runs/a/x.bin')
    >>> Location.parse("file:///tmp/acts").local_path
    PosixPath('/tmp/acts')
    >>> partial_of(Location.parse("/tmp/acts/3f1c")).name
    '.3f1c.partial'
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import ConfigError, CorruptStoreError
from .cache import BlockCache
from .localfiles import LocalFiles
from .object import ObjectStore, StorageOptions, open_location, split_location
from .s3files import ObjectFiles
from .storefiles import StoreFiles

#: Suffix of the directory a store is written in before it is published.
PARTIAL_SUFFIX = ".partial"


@dataclass(frozen=True)
class Location:
    """A store's place: ``url`` is an absolute local path or ``SCHEME://bucket/prefix``
    (canonical scheme: ``s3``, ``gs``, ``az``)."""

    url: str
    storage: StorageOptions | None = field(default=None, compare=False, repr=False)
    """The backend's settings (``S3Config``, ``GCSConfig``, ``AzureConfig``; None, or
    another backend's: from the environment)."""

    @classmethod
    def parse(
        cls, location: str | os.PathLike | Location, *, storage: StorageOptions | None = None
    ) -> Location:
        """The location a user wrote: a path, ``file:///path`` or ``s3://bucket/prefix``
        (``gs://``, ``az://``...; parsed by :func:`~actstore.storage.object.split_location`,
        as :func:`~actstore.storage.object.open_location` parses it)."""
        if isinstance(location, Location):
            return location if storage is None else cls(location.url, storage)
        scheme, bucket, rest = split_location(location)
        if bucket is None:
            return cls(rest, storage)
        return cls(f"{scheme}://{bucket}/{rest}".rstrip("/"), storage)

    # ------------------------------------------------------------------ parts

    @property
    def scheme(self) -> str:
        """``file`` for local disk, else the object store's (``s3``, ``gs``, ``az``)."""
        scheme, sep, _ = self.url.partition("://")
        return scheme if sep else "file"

    @property
    def is_local(self) -> bool:
        return self.scheme == "file"

    @property
    def local_path(self) -> Path | None:
        """The directory on local disk, or None for object storage."""
        return Path(self.url) if self.is_local else None

    def path(self) -> Path:
        """The local directory; a one-line :class:`ConfigError` for object storage."""
        if not self.is_local:
            raise ConfigError(f"{self.url} is on object storage; this needs a local directory")
        return Path(self.url)

    @property
    def name(self) -> str:
        return self.url.rstrip("/").rpartition("/")[2]

    @property
    def parent(self) -> Location:
        if self.is_local:
            return replace(self, url=str(Path(self.url).parent))
        root = f"{self.scheme}://"
        bucket, _, prefix = self.url.removeprefix(root).partition("/")
        if not prefix:
            raise ConfigError(f"{self.url} is a bucket; it has no parent")
        return replace(self, url=f"{root}{bucket}/{prefix.rpartition('/')[0]}".rstrip("/"))

    def child(self, *names: str) -> Location:
        """The location ``names`` below this one (``/``-separated parts)."""
        parts = [p.strip("/") for p in names if p and p.strip("/")]
        if not parts:
            return self
        return replace(self, url=self.url.rstrip("/") + "/" + "/".join(parts))

    def __str__(self) -> str:
        return self.url

    def __fspath__(self) -> str:
        return str(self.path())

    # ------------------------------------------------------------------ access

    def object_store(self) -> tuple[ObjectStore, str]:
        """The object store holding this location and its key prefix inside it."""
        return open_location(self.url, self.storage)

    def files(
        self,
        *,
        cache_dir: str | os.PathLike | None = None,
        cache_bytes: int | str | None = None,
        cache: bool = True,
        threads: int = 16,
    ) -> StoreFiles:
        """The files below this location, read by byte range: :class:`LocalFiles` or
        :class:`ObjectFiles` (any object store). ``cache_dir`` (default ``$ACTSTORE_CACHE``) turns on the local
        cache tier for remote stores, capped at ``cache_bytes`` (default
        ``$ACTSTORE_CACHE_MAX`` or 10 GiB); ``cache=False``: no cache tier whatever the
        environment says."""
        if self.is_local:
            return LocalFiles(self.url)
        store, prefix = self.object_store()
        tier = BlockCache.open(cache_dir, cache_bytes) if cache else None
        return ObjectFiles(store, prefix, cache=tier, threads=threads)

    def exists(self) -> bool:
        """Whether anything is stored here (a directory, or any object under the prefix)."""
        if self.is_local:
            return Path(self.url).exists()
        store, prefix = self.object_store()
        return next(iter(store.list(prefix + "/")), None) is not None


def partial_of(final: Location | str | os.PathLike) -> Location:
    """Where the store ``final`` is written before it is published: ``.<name>.partial``
    beside it (every writer and ``actstore status`` use this one name)."""
    final = Location.parse(final)
    return final.parent.child(f".{final.name}{PARTIAL_SUFFIX}")


def refuse_unwritable(location: Location) -> None:
    """A one-line :class:`ConfigError` for a store written straight to a backend that
    cannot take writes (its ``capabilities.writes`` is False, e.g. a read-only HTTP
    backend): write it locally, then ``actstore cp`` it somewhere writable."""
    if location.is_local:
        return
    store, _ = location.object_store()
    if not store.capabilities.writes:
        raise ConfigError(
            f"{location.scheme}:// is read-only here: write the store to a local directory "
            "or a writable bucket instead"
        )


def refuse_partial(location: Location) -> None:
    """Raise :class:`CorruptStoreError` if ``location`` is a writer's partial directory
    (an unfinished capture: readers open only published stores)."""
    final = final_of_partial(location.name)
    if final is not None:
        raise CorruptStoreError(
            f"{location} is an unfinished capture of {final} (a partial directory): rerun the "
            "same capture command to resume and publish it"
        )


def final_of_partial(name: str) -> str | None:
    """The store name a partial directory ``name`` belongs to, or None if it is not one.

    Example:
        >>> final_of_partial(".3f1c.partial"), final_of_partial("3f1c")
        ('3f1c', None)
    """
    if name.startswith(".") and name.endswith(PARTIAL_SUFFIX) and len(name) > 9:
        return name[1 : -len(PARTIAL_SUFFIX)]
    return None
