"""saev protocol 2.1 shards (raw memmappable float32), in the document's or saev's dialect."""

from ..registry import FormatSpec
from .layout import SAEV_FAMILIES, SaevMetadata, shard_name
from .options import SaevOptions
from .parts import part_format
from .reader import SaevReader, detect
from .writer import SaevWriter, saev_metadata, store_dir

FORMAT = FormatSpec(
    name="saev",
    summary="saev protocol 2.1: raw memmappable float32 shards (S, L, T, D) + JSON metadata",
    options=SaevOptions,
    detect=detect,
    reader=SaevReader,
    writer=SaevWriter,
    parts=part_format,
    manifests=("shards.json", "metadata.json"),
)

__all__ = [
    "FORMAT",
    "SAEV_FAMILIES",
    "SaevMetadata",
    "SaevOptions",
    "SaevReader",
    "SaevWriter",
    "saev_metadata",
    "shard_name",
    "store_dir",
]
