"""Where a store lives: one :class:`Location` type for a local path, a ``file://`` URL and
``s3://bucket/prefix``, in the spirit of zarr-python's ``StorePath`` (a store plus a path).

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from ..errors import ConfigError, CorruptStoreError

if TYPE_CHECKING:
    from .files import StoreFiles
    from .object import ObjectStore, S3Config

#: Suffix of the directory a store is written in before it is published.
PARTIAL_SUFFIX = ".partial"


@dataclass(frozen=True)
class Location:
    """A store's place: ``url`` is an absolute local path or ``s3://bucket/prefix``."""

    url: str
    s3: S3Config | None = field(default=None, compare=False, repr=False)
    """S3 settings for an ``s3://`` location (None: from the environment)."""

    @classmethod
    def parse(
        cls, location: str | os.PathLike | Location, *, s3: S3Config | None = None
    ) -> Location:
        """The location a user wrote: a path, ``file:///path`` or ``s3://bucket/prefix``."""
        if isinstance(location, Location):
            return location if s3 is None else cls(location.url, s3)
        text = os.fspath(location)
        if text.startswith("s3://"):
            parsed = urlparse(text)
            if not parsed.netloc:
                raise ConfigError(f"{text!r} names no bucket; write s3://BUCKET/prefix")
            prefix = parsed.path.strip("/")
            return cls(f"s3://{parsed.netloc}/{prefix}".rstrip("/"), s3)
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
        return cls(os.path.abspath(os.path.expanduser(text)), s3)

    # ------------------------------------------------------------------ parts

    @property
    def is_local(self) -> bool:
        return not self.url.startswith("s3://")

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
            return Location(str(Path(self.url).parent), self.s3)
        bucket, _, prefix = self.url.removeprefix("s3://").partition("/")
        if not prefix:
            raise ConfigError(f"{self.url} is a bucket; it has no parent")
        return Location(f"s3://{bucket}/{prefix.rpartition('/')[0]}".rstrip("/"), self.s3)

    def child(self, *names: str) -> Location:
        """The location ``names`` below this one (``/``-separated parts)."""
        parts = [p.strip("/") for p in names if p and p.strip("/")]
        if not parts:
            return self
        return Location(self.url.rstrip("/") + "/" + "/".join(parts), self.s3)

    def __str__(self) -> str:
        return self.url

    def __fspath__(self) -> str:
        return str(self.path())

    # ------------------------------------------------------------------ access

    def object_store(self) -> tuple[ObjectStore, str]:
        """The object store holding this location and its key prefix inside it."""
        from .object import open_location

        return open_location(self.url, self.s3)

    def files(
        self,
        *,
        cache_dir: str | os.PathLike | None = None,
        cache_bytes: int | str | None = None,
        cache: bool = True,
        threads: int = 16,
    ) -> StoreFiles:
        """The files below this location, read by byte range (see
        :func:`actstore.storage.files.open_files`)."""
        from .files import open_files

        return open_files(
            self,
            cache_dir=cache_dir,
            cache_bytes=cache_bytes,
            s3=self.s3,
            threads=threads,
            cache=cache,
        )

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
