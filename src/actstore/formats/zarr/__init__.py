"""Zarr v2 prompt/response activation store (the zarr-logger spec): float16, uncompressed,
chunks ``(1, 1, T_chunk, H)`` so one ``(sample, layer)`` read touches only its own chunks;
sharded parallel writers with a manifest, a multi-shard reader and an optional merge.
Stores and runs may live at ``s3://bucket/prefix`` (read with ranged GETs; captured there
through a staging directory by the registry's ``open_writer``).

Example:
    >>> from actstore.formats.zarr import ZarrReader
    >>> r = ZarrReader("out/activations.zarr")  # doctest: +SKIP
    >>> r.read(0, "resid.3", "prompt").shape  # doctest: +SKIP
    (57, 4096)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..registry import FormatSpec
from .layout import ZarrLayout, choose_layout
from .options import ZarrOptions
from .parts import part_format
from .plan import plan_store
from .reader import ZarrReader, detect
from .shards import merge_run, shard_ranges, write_manifest, write_shards
from .writer import ZarrWriter

if TYPE_CHECKING:
    from .dataset import ZarrPairDataset


def __getattr__(name: str) -> Any:  # the torch Dataset loads torch: only when asked for
    if name == "ZarrPairDataset":
        from .dataset import ZarrPairDataset

        return ZarrPairDataset
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


FORMAT = FormatSpec(
    name="zarr",
    summary="Zarr v2 prompt/response store: float16 (N, L, P_max|R_max, H), chunks (1, 1, T, H)",
    options=ZarrOptions,
    detect=detect,
    reader=ZarrReader,
    writer=ZarrWriter,
    stored_dtype="float16",
    parts=part_format,
    manifests=(".zmetadata", "manifest.json"),
    markers=(".zmetadata", "manifest.json", ".zgroup", ".zattrs", "zarr.json"),
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
    "write_manifest",
    "write_shards",
]
