"""Activault's S3 layout: torch.save megabatches per hook, written by background uploaders
and streamed back with prefetching (see ``docs/activault.md``).

Example:
    >>> reader = open_store("s3://bucket/run")  # doctest: +SKIP
    >>> stream = ActivaultStream("s3://bucket/run/models.layers.6.post", batch_size=4096)  # doctest: +SKIP
"""

from __future__ import annotations

import json
from pathlib import Path

from ...errors import ActstoreError
from ...storage.object import is_remote, join_key, open_location
from ..registry import FormatSpec
from .layout import CFG, METADATA, check_hook_prefixes, hook_name, hook_site
from .metadata import HookMetadata
from .options import ActivaultOptions
from .parts import part_format
from .reader import ActivaultReader
from .stream import ActivaultStream
from .writer import ActivaultWriter

_HOOK_KEYS = {"shape", "dtype", "bytes_per_file"}


def _detect(location: str) -> bool:
    """A hook folder (metadata.json with Activault's keys) or a run (cfg.json, or hook
    folders beneath). Remote locations that cannot be looked at (missing bucket or
    credentials, wrong endpoint) are claimed, so the reader reports the real problem
    instead of "unknown format": no other format reads ``s3://``."""
    text = str(location)
    if not is_remote(text):
        path = Path(text.removeprefix("file://")).expanduser()
        if not path.is_dir():
            return False
        if _is_hook_doc(path / METADATA):
            return True
        if (path / CFG).is_file():
            return True
        return any(_is_hook_doc(child / METADATA) for child in path.iterdir() if child.is_dir())
    try:
        store, prefix = open_location(text)
        if (
            store.size(join_key(prefix, METADATA)) is not None
            or store.size(join_key(prefix, CFG)) is not None
        ):
            return True
        return any(
            store.size(join_key(prefix, d, METADATA)) is not None
            for d in store.list_dirs(prefix)[:8]
        )
    except ActstoreError:
        return True


def _is_hook_doc(path: Path) -> bool:
    if not path.is_file():
        return False
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and _HOOK_KEYS <= set(doc)


def _writer_for_plan(plan, out: str, options: ActivaultOptions) -> ActivaultWriter:
    return ActivaultWriter(plan, out, options)


FORMAT = FormatSpec(
    name="activault",
    summary="Activault's S3 layout: torch.save megabatches per hook, s3://bucket/run or a directory",
    options=ActivaultOptions,
    detect=_detect,
    open_reader=ActivaultReader,
    writer_for_plan=_writer_for_plan,
    stored_dtype="bfloat16",
    parts=part_format,
    manifests=(CFG, METADATA),
    clean_tokens=True,
)

__all__ = [
    "FORMAT",
    "ActivaultOptions",
    "ActivaultReader",
    "ActivaultStream",
    "ActivaultWriter",
    "HookMetadata",
    "check_hook_prefixes",
    "hook_name",
    "hook_site",
]
