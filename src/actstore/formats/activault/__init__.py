"""Activault's S3 layout: torch.save megabatches per hook, written by background uploaders
and streamed back with prefetching (see ``docs/activault.md``).

Example:
    >>> reader = open_store("s3://bucket/run")  # doctest: +SKIP
    >>> stream = ActivaultStream("s3://bucket/run/models.layers.6.post", batch_size=4096)  # doctest: +SKIP
"""

from __future__ import annotations

from ..registry import FormatSpec
from .layout import CFG, METADATA, check_hook_prefixes, hook_name, hook_site
from .metadata import HookMetadata
from .options import ActivaultOptions
from .parts import part_format
from .reader import ActivaultReader, detect
from .stream import ActivaultStream
from .writer import ActivaultWriter

FORMAT = FormatSpec(
    name="activault",
    summary="Activault's S3 layout: torch.save megabatches per hook, s3://bucket/run or a directory",
    options=ActivaultOptions,
    detect=detect,
    reader=ActivaultReader,
    writer=ActivaultWriter,
    stored_dtype="bfloat16",
    parts=part_format,
    manifests=(CFG, METADATA),
    clean_tokens=True,
    writes_remote=True,
)

__all__ = [
    "CFG",
    "FORMAT",
    "METADATA",
    "ActivaultOptions",
    "ActivaultReader",
    "ActivaultStream",
    "ActivaultWriter",
    "HookMetadata",
    "check_hook_prefixes",
    "hook_name",
    "hook_site",
]
