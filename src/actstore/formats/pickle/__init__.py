"""pkl.gz activation shards (the generic format): metadata.json plus gzipped pickle shards
of per-sample ``[seq_len, hidden]`` float32 arrays, read through a restricted unpickler."""

from __future__ import annotations

import json
from pathlib import Path

from ..base import WriterBase
from ..registry import FormatSpec
from .dataset import ActivationDataset
from .layout import VERSION, PickleMetadata, ShardInfo, layer_key, shard_filename
from .options import PickleOptions
from .parts import part_format
from .reader import PickleReader, detect_remote
from .writer import PickleWriter, merge_stores


def _detect(location: str) -> bool:
    if location.startswith("s3://"):
        return detect_remote(location)
    p = Path(location).expanduser()
    meta = p / "metadata.json"
    if not meta.is_file():
        return False
    try:
        doc = json.loads(meta.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and "shards" in doc and "extraction_config" in doc


def _writer_for_plan(plan, out: str, options: PickleOptions) -> WriterBase:
    if str(out).startswith("s3://"):
        from ..s3_staged import StagedS3Writer

        return StagedS3Writer(out, lambda staging: PickleWriter(plan, staging, options))
    return PickleWriter(plan, out, options)


FORMAT = FormatSpec(
    name="pickle",
    summary="pkl.gz shards: metadata.json + gzipped pickles of per-sample float32 [seq, hidden] "
    "arrays (read safely, without running code); OUT is the store directory",
    options=PickleOptions,
    detect=_detect,
    open_reader=PickleReader,
    writer_for_plan=_writer_for_plan,
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
