"""Storage formats. Each module owns one on-disk layout: its constants, Writer and Reader.

:func:`open_store` finds the format of a path and returns its reader.

Example:
    >>> reader = open_store("actstore-data/3f1c...")  # doctest: +SKIP
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import StoreNotFoundError
from .base import Block, Reader, Writer


def detect_format(path: str | os.PathLike) -> str:
    """Name of the format stored at ``path`` (``"saev"``, ...)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise StoreNotFoundError(f"{p} does not exist")
    if (p / "metadata.json").is_file() and (p / "shards.json").is_file():
        return "saev"
    raise StoreNotFoundError(
        f"{p} is not an actstore-readable store (a saev directory holds metadata.json "
        "and shards.json)"
    )


def open_store(path: str | os.PathLike, **kwargs: Any) -> Reader:
    """Open the store at ``path`` with the reader of its format."""
    fmt = detect_format(path)
    if fmt == "saev":
        from .saev import SaevReader

        return SaevReader(path, **kwargs)
    raise AssertionError(fmt)


__all__ = ["Block", "Reader", "Writer", "detect_format", "open_store"]
