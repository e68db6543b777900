"""SAELens's cached-activations layout: a ``datasets`` directory ``sae_lens`` trains from
(``ActivationsStore(cached_activations_path=...)``), one column per TransformerLens hook;
local or at ``s3://bucket/prefix`` (read with ranged GETs, written through a staging
directory)."""

from __future__ import annotations

import json
from pathlib import Path

from ..base import WriterBase
from ..registry import FormatSpec
from .layout import FORMAT_TAG, INFO, SIDECAR, STATE, SaelensLayout, hook_name, hook_site
from .options import SaelensOptions
from .parts import part_format
from .reader import SaelensReader, UnverifiedStoreWarning, detect_remote
from .writer import SaelensWriter, merge_parts


def _detect(location: str) -> bool:
    if location.startswith("s3://"):
        return detect_remote(location)
    p = Path(location).expanduser()
    if (p / SIDECAR).is_file():
        try:
            doc = json.loads((p / SIDECAR).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return True  # let the reader report the damaged file
        return isinstance(doc, dict) and doc.get("format") == FORMAT_TAG
    if not (p / STATE).is_file() or not (p / INFO).is_file():
        return False
    try:
        features = json.loads((p / INFO).read_text(encoding="utf-8")).get("features") or {}
    except (OSError, ValueError, AttributeError):
        return False
    return any(isinstance(f, dict) and f.get("_type") == "Array2D" for f in features.values())


def _writer_for_plan(plan, out: str, options: SaelensOptions) -> WriterBase:
    if str(out).startswith("s3://"):
        from ..s3_staged import StagedS3Writer

        return StagedS3Writer(
            out, lambda staging: SaelensWriter.from_plan(plan, staging, options), manifest=STATE
        )
    return SaelensWriter.from_plan(plan, out, options)


FORMAT = FormatSpec(
    name="saelens",
    summary="SAELens activation cache: a datasets save_to_disk directory, one Array2D column "
    "per TransformerLens hook (sae_lens trains from it); OUT is the store directory",
    options=SaelensOptions,
    detect=_detect,
    open_reader=SaelensReader,
    writer_for_plan=_writer_for_plan,
    parts=part_format,
    manifests=(STATE,),
)

__all__ = [
    "FORMAT",
    "SaelensLayout",
    "SaelensOptions",
    "SaelensReader",
    "SaelensWriter",
    "UnverifiedStoreWarning",
    "hook_name",
    "hook_site",
    "merge_parts",
]
