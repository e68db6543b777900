"""pkl.gz activation shards (the generic format): metadata.json plus gzipped pickle shards
of per-sample ``[seq_len, hidden]`` float32 arrays, read through a restricted unpickler."""

from __future__ import annotations

from ..registry import FormatSpec
from .dataset import ActivationDataset
from .layout import VERSION, PickleMetadata, ShardInfo, layer_key, shard_filename
from .options import PickleOptions
from .parts import part_format
from .reader import PickleReader, detect
from .writer import PickleWriter, merge_stores

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
