"""saev protocol 2.1 shards (raw memmappable float32), in the document's or saev's dialect."""

from .layout import SAEV_FAMILIES, SaevMetadata, shard_name
from .reader import SaevReader, VerifyReport
from .writer import SaevWriter, saev_metadata, store_dir

__all__ = [
    "SAEV_FAMILIES",
    "SaevMetadata",
    "SaevReader",
    "SaevWriter",
    "VerifyReport",
    "saev_metadata",
    "shard_name",
    "store_dir",
]
