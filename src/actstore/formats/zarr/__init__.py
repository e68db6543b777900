"""Zarr v2 prompt/response activation store (the zarr-logger spec): float16, uncompressed,
chunks ``(1, 1, T_chunk, H)`` so one ``(sample, layer)`` read touches only its own chunks;
sharded parallel writers with a manifest, a multi-shard reader and an optional merge.
Stores and runs may live at ``s3://bucket/prefix`` (read with ranged GETs; captured there
through a staging directory, see :mod:`.remote`).

Example:
    >>> from actstore.formats.zarr import ZarrReader
    >>> r = ZarrReader("out/activations.zarr")  # doctest: +SKIP
    >>> r.read(0, "resid.3", "prompt").shape  # doctest: +SKIP
    (57, 4096)
"""

from __future__ import annotations

import json
from pathlib import Path

from ..registry import FormatSpec
from .layout import FORMAT_TAG, RUN_FORMAT_TAG, STORE_NAME, ZarrLayout, choose_layout
from .options import ZarrOptions
from .parts import part_format
from .reader import MANIFEST, ZarrPairDataset, ZarrReader
from .shards import merge_run, shard_ranges, write_manifest, write_shards
from .writer import ZarrWriter, plan_store, store_path


def _detect(location: str) -> bool:
    if location.startswith("s3://"):
        from .remote import detect_remote

        return detect_remote(location)
    path = Path(location).expanduser()
    if (path / MANIFEST).is_file():
        try:
            return (
                json.loads((path / MANIFEST).read_text(encoding="utf-8")).get("format")
                == RUN_FORMAT_TAG
            )
        except (OSError, ValueError, AttributeError):
            return False
    if not (path / ".zgroup").exists() and (path / STORE_NAME / ".zgroup").exists():
        path = path / STORE_NAME
    attrs = path / ".zattrs"
    if not attrs.is_file():
        return False
    try:
        return json.loads(attrs.read_text(encoding="utf-8")).get("format") == FORMAT_TAG
    except (OSError, ValueError, AttributeError):
        return True  # ours by location but damaged: let the reader say what is wrong


def _writer_for_plan(plan, out: str, options: ZarrOptions):
    if str(out).startswith("s3://"):
        from .remote import ZarrS3Writer

        return ZarrS3Writer.for_plan(plan, str(out), options)
    return ZarrWriter.from_plan(plan, out, options)


FORMAT = FormatSpec(
    name="zarr",
    summary="Zarr v2 prompt/response store: float16 (N, L, P_max|R_max, H), chunks (1, 1, T, H)",
    options=ZarrOptions,
    detect=_detect,
    open_reader=ZarrReader,
    writer_for_plan=_writer_for_plan,
    stored_dtype="float16",
    parts=part_format,
    manifests=(".zmetadata", "manifest.json"),
)

__all__ = [
    "FORMAT",
    "ZarrLayout",
    "ZarrOptions",
    "ZarrPairDataset",
    "ZarrReader",
    "ZarrWriter",
    "choose_layout",
    "merge_run",
    "plan_store",
    "shard_ranges",
    "store_path",
    "write_manifest",
    "write_shards",
]
