"""Storage formats. Each package ``actstore.formats.<name>`` owns one on-disk layout (its
constants, Writer and Reader) and registers itself as ``FORMAT`` (see :mod:`.registry`).

Example:
    >>> reader = open_store("actstore-data/3f1c...")  # doctest: +SKIP
"""

from __future__ import annotations

import os
from typing import Any

from .base import Block, Reader, Writer
from .registry import FormatSpec, available_formats, detect_format, get_format


def open_store(location: str | os.PathLike, **kwargs: Any) -> Reader:
    """Open the store at ``location`` (a path or URL) with the reader of its format."""
    return detect_format(str(location)).open_reader(str(location), **kwargs)


def verify_store(location: str | os.PathLike) -> str:
    """Run the format's own ``verify()`` on the store at ``location``; raise
    :class:`~actstore.errors.CorruptStoreError` on a fault, else say what was checked
    (``copy_store``'s ``check_store``)."""
    from ..errors import ActstoreError, CorruptStoreError

    try:
        reader = open_store(location)
    except ActstoreError as err:
        return f"{location} is not a readable store ({err})"
    report = reader.verify()
    reader.close()
    if not report.ok:
        raise CorruptStoreError(
            f"{location} fails verification after the copy: {'; '.join(report.faults[:5])}"
        )
    return f"{type(reader).__name__}.verify() of {location}: {report.files_checked} files checked"


__all__ = [
    "Block",
    "FormatSpec",
    "Reader",
    "Writer",
    "available_formats",
    "detect_format",
    "get_format",
    "open_store",
    "verify_store",
]
