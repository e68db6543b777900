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


__all__ = [
    "Block",
    "FormatSpec",
    "Reader",
    "Writer",
    "available_formats",
    "detect_format",
    "get_format",
    "open_store",
]
