"""The files of one store directory, on local disk or under ``s3://bucket/prefix``, read by
byte range. Format readers get their bytes through this layer, so one reader serves both.

* :class:`StoreFiles` (:mod:`~actstore.storage.storefiles`) is the contract;
* :class:`LocalFiles` (:mod:`~actstore.storage.localfiles`) reads with ``pread`` (and
  exposes ``local_path`` so readers keep their memmaps), keeping a bounded set of open
  descriptors;
* :class:`S3Files` (:mod:`~actstore.storage.s3files`) lists the prefix once (names, sizes,
  ETags), then serves ``read_range`` with concurrent ranged GETs straight into the caller's
  buffer, and ``read_ranges`` by coalescing nearby ranges into few GETs. With a
  :class:`BlockCache` (``cache_dir=`` or ``$ACTSTORE_CACHE``) ranges fetched once are kept
  on local disk.

:func:`open_files` picks the backend of a location (:meth:`Location.files
<actstore.storage.location.Location.files>`).

Example:
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()); _ = (d / "a.bin").write_bytes(b"0123456789")
    >>> files = open_files(d)
    >>> files.size("a.bin"), bytes(files.read_range("a.bin", 2, 3)), files.list()
    (10, b'234', {'a.bin': 10})
"""

from __future__ import annotations

import os

from .localfiles import GAP_BYTES, Descriptors, LocalFiles, PathFiles
from .location import Location
from .object import StorageOptions
from .s3files import MERGE_GAP, PART_BYTES, ObjectFiles, S3Files
from .storefiles import StoreFiles

__all__ = [
    "GAP_BYTES",
    "MERGE_GAP",
    "PART_BYTES",
    "Descriptors",
    "LocalFiles",
    "ObjectFiles",
    "PathFiles",
    "S3Files",
    "StoreFiles",
    "open_files",
]


def open_files(
    location: str | os.PathLike | Location,
    *,
    cache_dir: str | os.PathLike | None = None,
    cache_bytes: int | str | None = None,
    storage: StorageOptions | None = None,
    threads: int = 16,
    cache: bool = True,
) -> StoreFiles:
    """The files at ``location``: a local directory, ``file://`` URL or ``s3://bucket/prefix``
    (``gs://``, ``az://``...; ``s3``: that backend's settings).

    ``cache_dir`` (default ``$ACTSTORE_CACHE``) turns on the local cache tier for remote
    stores, capped at ``cache_bytes`` (default ``$ACTSTORE_CACHE_MAX`` or 10 GiB);
    ``cache=False``: no cache tier whatever the environment says.
    """
    return Location.parse(location, storage=storage).files(
        cache_dir=cache_dir, cache_bytes=cache_bytes, cache=cache, threads=threads
    )
