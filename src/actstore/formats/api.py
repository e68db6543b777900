"""Everything a storage format needs, in one import (docs/design.md, "Adding a format").

A sharded format (a directory of shards of consecutive examples) supplies a
:class:`ShardedWriter` subclass whose :class:`ShardSink` only encodes, writing through the
:class:`ShardOutput` it is handed, and a :class:`ReaderBase` subclass; a
:class:`FormatSpec` ties them together and registers them (an entry point, or
:func:`register_format`). A format that writes whole files of its own instead subclasses
:class:`FormatWriter` and writes through :class:`StagedFile` and :func:`commit_files`.
The write pipeline casts, writes, digests, folds the statistics, makes files durable,
records progress, resumes and publishes; a format never does any of that itself.

Example:
    >>> import dataclasses
    >>> from actstore.formats.api import ShardedWriter, ShardRecord, ShardSink
    >>> [f.name for f in dataclasses.fields(ShardRecord)][:4]  # what write_index receives
    ['index', 'n_examples', 'files', 'info']
"""

from __future__ import annotations

from ..batch import Batch, CapturePlan
from ..errors import CaptureError, ConfigError, CorruptStoreError, StoreNotFoundError
from ..sites import Site
from ..stats import RunningStats
from ..storage import atomic_write_bytes, atomic_write_json
from ..storage.files import StoreFiles
from ..storage.location import Location
from ..storage.manifest import FileEntry
from .base import ReaderBase
from .blocks import Block
from .parts import sharded_part_format
from .pipeline import ShardOutput
from .registry import FormatSpec, register_format
from .shard import ShardRecord, ShardSink
from .threads import StageClock
from .wholefiles import StagedFile, commit_files, fold_statistics
from .writer import ShardedWriter
from .writerbase import FormatWriter

__all__ = [
    "Batch",
    "Block",
    "CaptureError",
    "CapturePlan",
    "ConfigError",
    "CorruptStoreError",
    "FileEntry",
    "FormatSpec",
    "FormatWriter",
    "Location",
    "ReaderBase",
    "RunningStats",
    "ShardOutput",
    "ShardRecord",
    "ShardSink",
    "ShardedWriter",
    "Site",
    "StageClock",
    "StagedFile",
    "StoreFiles",
    "StoreNotFoundError",
    "atomic_write_bytes",
    "atomic_write_json",
    "commit_files",
    "fold_statistics",
    "register_format",
    "sharded_part_format",
]
