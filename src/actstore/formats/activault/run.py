"""An Activault run's shape and its root manifest: how many rows and tokens each
megabatch file holds for a capture plan, and the manifest put last once a run is
complete (from the keyed digest each commit recorded in ``cfg.json``)."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ...batch import CapturePlan
from ...errors import (
    ConfigError,
    CorruptStoreError,
)
from ...sites import Site
from ...storage.manifest import (
    BLOCKS,
    MANIFEST,
    FileEntry,
    ManifestBuilder,
    file_digest,
)
from ...storage.object import (
    ObjectStore,
    join_key,
)
from ..report import summary_of
from .layout import (
    CFG,
    METADATA,
    STATISTICS,
    data_file_name,
    group_uuid,
    parse_dtype,
)
from .metadata import (
    HookMetadata,
    RunRecord,
)
from .options import ActivaultOptions
from .positions import (
    POSITIONS,
)

if TYPE_CHECKING:
    import torch
else:
    from ..._lazy import torch

log = logging.getLogger(__name__)


def write_run_manifest(
    store: ObjectStore, run_prefix: str, record: RunRecord, store_id: str, d_model: int
) -> None:
    """Put the root manifest of the complete run ``record`` describes (its last object)."""
    builder = ManifestBuilder(format="activault", store_id=store_id, record=store_id)
    for hook in record.hooks:
        md = HookMetadata.from_dict(
            store.get_json(join_key(run_prefix, hook, METADATA)),
            source=store.url(join_key(run_prefix, hook, METADATA)),
        )
        digests = record.digests.get(hook, [])
        if len(digests) != record.groups:
            raise CorruptStoreError(
                f"{store.url(run_prefix)}: cfg.json records {len(digests)} file digests of "
                f"{hook} for {record.groups} committed files; capture the run again"
            )
        for g, text in enumerate(digests):
            name = f"{hook}/{data_file_name(group_uuid(record.run_id, g), g + 1)}"
            value = np.array([int(text, 16)], dtype="<u8")
            builder.add(
                name,
                FileEntry(size=md.file_bytes, digest=file_digest(value), single=text),
                value,
            )
        for name in (METADATA, STATISTICS):
            key = join_key(run_prefix, hook, name)
            if store.size(key) is not None:
                builder.add_bytes(f"{hook}/{name}", store.get(key))
    builder.add_bytes(CFG, store.get(join_key(run_prefix, CFG)))
    if store.size(join_key(run_prefix, POSITIONS)) is not None:
        builder.add_bytes(POSITIONS, store.get(join_key(run_prefix, POSITIONS)))
    rows = record.groups * record.tokens_per_file
    summary = summary_of(
        sites=[Site.parse(s) for s in record.hooks.values()],
        d_model=d_model,
        dtype=record.dtype,
        rows=rows,
    )
    manifest, blocks = builder.build(summary=summary)
    if blocks is not None:
        store.put(join_key(run_prefix, BLOCKS), blocks)
    store.put(join_key(run_prefix, MANIFEST), manifest)


#: Largest default megabatch file (Activault's 70B configs write 4 GiB files; smaller files
#: keep the reader's prefetch memory and the dropped tail small).
DEFAULT_FILE_BYTES = 256 << 20


def file_shape(plan: CapturePlan, options: ActivaultOptions) -> tuple[int, int]:
    """(rows, tokens per row) of every megabatch file a capture ``plan`` writes.

    Example:
        >>> from actstore.testing import make_plan
        >>> file_shape(make_plan(tokens_per_example=128), ActivaultOptions(rows_per_file=4))
        (4, 128)
    """
    seq = options.sequence_length or plan.tokens_per_example
    rows = options.rows_per_file or default_rows_per_file(
        plan.batch_size,
        seq,
        plan.d_model,
        parse_dtype(options.dtype),
        total_tokens=plan.n_examples * plan.tokens_per_example,
    )
    return rows, seq


def default_rows_per_file(
    batch_size: int, seq: int, d: int, dtype: torch.dtype, *, total_tokens: int | None = None
) -> int:
    """8 capture batches of rows, but at most 256 MiB per file and, for small captures, at
    most a sixteenth of the data (so the dropped tail, under one file, stays small).

    Example:
        >>> default_rows_per_file(32, 128, 384, torch.bfloat16)
        256
        >>> default_rows_per_file(4, 2048, 8192, torch.bfloat16)
        8
        >>> default_rows_per_file(32, 128, 384, torch.bfloat16, total_tokens=1000 * 128)
        62
    """
    row_bytes = seq * d * torch.empty(0, dtype=dtype).element_size()
    rows = min(8 * batch_size, DEFAULT_FILE_BYTES // row_bytes)
    if total_tokens is not None:
        rows = min(rows, total_tokens // (16 * seq))
    return max(1, rows)


def conversion_options(plan: CapturePlan, options: Any) -> ActivaultOptions:
    """Files of whole examples that hold every converted row: every Activault file is
    the same size and the writer drops a tail under one file, so a conversion picks
    ``rows_per_file`` dividing the examples (the largest at most the default) and
    refuses, in one line, a ``rows_per_file`` or ``sequence_length`` given that would
    drop rows (a conversion is of every row or of none)."""
    options = options or ActivaultOptions()
    rows, seq = file_shape(plan, options)
    tokens, n = plan.tokens_per_example, plan.n_examples
    if (n * tokens) % (rows * seq) == 0:
        return options
    fits = max(k for k in range(1, min(rows, n) + 1) if n % k == 0)
    if not options.rows_per_file and seq == tokens:
        return replace(options, rows_per_file=fits)
    hint = (
        f"give --opt rows_per_file={fits} (it divides the {n} examples)"
        if seq == tokens
        else f"leave sequence_length at the store's {tokens} tokens per example"
    )
    raise ConfigError(
        f"Activault files of {rows} rows x {seq} tokens would leave the last "
        f"{(n * tokens) % (rows * seq)} of the store's {n * tokens} rows out (every file "
        f"is the same size); a conversion keeps every row: {hint}"
    )
