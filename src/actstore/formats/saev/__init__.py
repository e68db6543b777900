"""saev protocol 2.1 shards (raw memmappable float32), in the document's or saev's dialect."""

from pathlib import Path

from ..base import VerifyReport, WriterBase
from ..registry import FormatSpec
from .layout import SAEV_FAMILIES, SaevMetadata, shard_name
from .options import SaevOptions
from .parts import part_format
from .reader import SaevReader, detect_remote
from .writer import SaevWriter, saev_metadata, store_dir


def _detect(location: str) -> bool:
    if location.startswith("s3://"):
        return detect_remote(location)
    p = Path(location).expanduser()
    if not (p / "shards.json").is_file() or not (p / "metadata.json").is_file():
        return False
    import json

    try:
        doc = json.loads((p / "metadata.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return True  # let the reader report the damaged file
    return isinstance(doc, dict) and (
        "patches_per_ex" in doc or "content_tokens_per_example" in doc
    )


def _writer_for_plan(plan, out: str, options: SaevOptions) -> WriterBase:
    if str(out).startswith("s3://"):
        from .remote import SaevS3Writer

        return SaevS3Writer.from_plan(
            plan, out, dialect=options.dialect, patches_per_shard=options.patches_per_shard
        )
    return SaevWriter.from_plan(
        plan, out, dialect=options.dialect, patches_per_shard=options.patches_per_shard
    )


FORMAT = FormatSpec(
    name="saev",
    summary="saev protocol 2.1: raw memmappable float32 shards (S, L, T, D) + JSON metadata",
    options=SaevOptions,
    detect=_detect,
    open_reader=SaevReader,
    writer_for_plan=_writer_for_plan,
    parts=part_format,
)

__all__ = [
    "FORMAT",
    "SAEV_FAMILIES",
    "SaevMetadata",
    "SaevOptions",
    "SaevReader",
    "SaevWriter",
    "VerifyReport",
    "saev_metadata",
    "shard_name",
    "store_dir",
]
