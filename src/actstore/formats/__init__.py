"""Storage formats. Each package ``actstore.formats.<name>`` owns one on-disk layout (its
constants, writer and reader) and registers itself as ``FORMAT`` (see :mod:`.registry`).

Example:
    >>> import tempfile
    >>> from actstore.testing import FormatCase, make_acts, make_batches, make_plan
    >>> plan, out = make_plan(), tempfile.TemporaryDirectory()
    >>> store = FormatCase("pickle").write(out.name, plan, make_batches(plan, make_acts(plan)))
    >>> reader = open_store(store)  # whichever format the files hold
    >>> type(reader).__name__, reader.sites
    ('PickleReader', (Site(kind='resid', layer=1), Site(kind='resid', layer=3)))
"""

from __future__ import annotations

import os
from typing import Any

from ..storage.location import Location
from .base import ReaderBase
from .blocks import Block
from .reading import SiteLike
from .registry import FormatSpec, available_formats, detect_format, get_format
from .writerbase import FormatWriter, WriterBase


def open_store(location: str | os.PathLike | Location, **kwargs: Any) -> ReaderBase:
    """Open the store at ``location`` (a path, ``file://`` or ``s3://`` URL) with the reader
    of its format. ``kwargs``: ``verify_reads``, ``cache_dir``, ``cache_bytes``, ``s3``."""
    location = Location.parse(location, storage=kwargs.get("storage"))
    return detect_format(location).open_reader(location, **kwargs)


def verify_store(location: str | os.PathLike | Location, *, foreign_ok: bool = False) -> str:
    """Open the store at ``location`` and run its full ``verify()``; raise
    :class:`~actstore.errors.CorruptStoreError` listing the faults, else say what was
    checked (what ``actstore cp`` runs on a copy). ``foreign_ok``: a store another tool
    wrote (no root manifest) passes on its format's own checks, and the report says so."""
    from ..errors import CorruptStoreError

    reader = open_store(location)
    try:
        report = reader.verify()
    finally:
        reader.close()
    foreign = reader.checks.manifest is None
    if foreign and foreign_ok:
        report.faults[:] = [f for f in report.faults if not f.startswith("no root manifest")]
    if report.faults:
        raise CorruptStoreError(
            f"{location} fails verification: {'; '.join(report.faults[:5])}"
            + (f" (and {len(report.faults) - 5} more)" if len(report.faults) > 5 else "")
        )
    return (
        f"{type(reader).__name__}.verify() of {location}: {report.files_checked} files, "
        f"{report.bytes_checked} bytes checked"
        + (" (written by another tool: no root manifest, its format's checks only)" * foreign)
    )


__all__ = [
    "Block",
    "FormatSpec",
    "FormatWriter",
    "ReaderBase",
    "SiteLike",
    "WriterBase",
    "available_formats",
    "detect_format",
    "get_format",
    "open_store",
    "verify_store",
]
