"""pkl.gz activation shards (the generic format): metadata.json plus gzipped pickle shards
of per-sample ``[seq_len, hidden]`` float32 arrays, read through a restricted unpickler."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..registry import FormatSpec
from .layout import VERSION, PickleMetadata, ShardInfo, layer_key, shard_filename
from .options import PickleOptions
from .parts import part_format
from .reader import PickleReader, detect
from .writer import PickleWriter, merge_stores

if TYPE_CHECKING:
    from .dataset import ActivationDataset


def __getattr__(name: str) -> Any:  # the torch Dataset loads torch: only when asked for
    if name == "ActivationDataset":
        from .dataset import ActivationDataset

        return ActivationDataset
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


FORMAT = FormatSpec(
    name="pickle",
    summary="pkl.gz shards: metadata.json + gzipped pickles of per-sample float32 [seq, hidden] "
    "arrays (read safely, without running code); OUT is the store directory",
    options=PickleOptions,
    detect=detect,
    reader=PickleReader,
    writer=PickleWriter,
    parts=part_format,
)

__all__ = [
    "FORMAT",
    "VERSION",
    "ActivationDataset",
    "PickleMetadata",
    "PickleOptions",
    "PickleReader",
    "PickleWriter",
    "ShardInfo",
    "layer_key",
    "merge_stores",
    "shard_filename",
]
