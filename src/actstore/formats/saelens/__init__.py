"""SAELens's cached-activations layout: a ``datasets`` directory ``sae_lens`` trains from
(``ActivationsStore(cached_activations_path=...)``), one column per TransformerLens hook;
local or at ``s3://bucket/prefix`` (read with ranged GETs, written through a staging
directory)."""

from __future__ import annotations

from ..registry import FormatSpec
from .layout import FORMAT_TAG, STATE, ColumnSite, SaelensLayout, hook_name, hook_site
from .options import SaelensOptions
from .parts import part_format
from .reader import SaelensReader, detect
from .writer import SaelensWriter

FORMAT = FormatSpec(
    name="saelens",
    summary="SAELens activation cache: a datasets save_to_disk directory, one Array2D column "
    "per TransformerLens hook (sae_lens trains from it); OUT is the store directory",
    options=SaelensOptions,
    detect=detect,
    reader=SaelensReader,
    writer=SaelensWriter,
    parts=part_format,
    manifests=(STATE,),
    markers=(STATE, "dataset_info.json"),
)

__all__ = [
    "FORMAT",
    "FORMAT_TAG",
    "ColumnSite",
    "SaelensLayout",
    "SaelensOptions",
    "SaelensReader",
    "SaelensWriter",
    "hook_name",
    "hook_site",
]
