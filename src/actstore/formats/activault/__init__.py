"""Activault's S3 layout: torch.save megabatches per hook, written by background uploaders
and streamed back with prefetching (see ``docs/activault.md``).

Example:
    >>> import tempfile
    >>> from actstore.testing import FormatCase, make_acts, make_batches, make_plan
    >>> plan, out = make_plan(n_examples=24), tempfile.TemporaryDirectory()  # 6 tokens each
    >>> case = FormatCase("activault", ActivaultOptions(rows_per_file=4))  # 24-token files
    >>> run = case.write(f"{out.name}/run", plan, make_batches(plan, make_acts(plan)))
    >>> from actstore.formats import open_store
    >>> reader = open_store(run)  # a local run here; s3://bucket/run alike
    >>> from actstore.formats.activault import ActivaultStream  # loaded on use (torch)
    >>> stream = ActivaultStream(f"{run}/models.layers.3.post", batch_size=16)
    >>> next(iter(stream)).shape
    torch.Size([16, 8])
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..registry import FormatSpec
from .layout import CFG, METADATA, check_hook_prefixes, hook_name, hook_site
from .metadata import HookMetadata
from .options import ActivaultOptions
from .parts import part_format
from .reader import ActivaultReader, detect
from .writer import ActivaultWriter

if TYPE_CHECKING:
    from .stream import ActivaultStream


def __getattr__(name: str) -> Any:  # the stream is a torch IterableDataset: loaded on use
    if name == "ActivaultStream":
        from .stream import ActivaultStream

        return ActivaultStream
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


FORMAT = FormatSpec(
    name="activault",
    summary="Activault's S3 layout: torch.save megabatches per hook, s3://bucket/run or a directory",
    options=ActivaultOptions,
    detect=detect,
    reader=ActivaultReader,
    writer=ActivaultWriter,
    stored_dtype="bfloat16",
    parts=part_format,
    manifests=(CFG, METADATA),
    clean_tokens=True,
    writes_remote=True,
)

__all__ = [
    "CFG",
    "FORMAT",
    "METADATA",
    "ActivaultOptions",
    "ActivaultReader",
    "ActivaultStream",
    "ActivaultWriter",
    "HookMetadata",
    "check_hook_prefixes",
    "hook_name",
    "hook_site",
]
