"""Write a SAELens activation cache: the format's part of the crash protocol.

:class:`SaelensWriter` is a :class:`~actstore.formats.writer.ShardedWriter` (which owns the
partial directory, progress record, verified resume, statistics, root manifest and
publication). Each shard is one ``data-{i:05d}-of-{n:05d}.arrow`` file that ``datasets``'
``ArrowWriter`` writes as record batches of exactly ``examples_per_block`` examples (so the
bytes never depend on how capture batched them). When a file is finished its manifest blocks
are the values of each column of each record batch (what a block read fetches) and the
bytes between them. At publication the writer adds ``state.json`` and
``dataset_info.json`` (what ``Dataset.save_to_disk`` writes), ``statistics.json`` and
``actstore.json`` (the layout, the capture plan and where each block's values lie).

Example:
    >>> import tempfile
    >>> from actstore.testing import make_acts, make_batches, make_plan
    >>> plan, out = make_plan(), tempfile.TemporaryDirectory()
    >>> writer = SaelensWriter.from_plan(plan, Location.parse(out.name))
    >>> for batch in make_batches(plan, make_acts(plan)):
    ...     writer.write(batch)
    >>> sorted(p.name for p in writer.close().iterdir())  # doctest: +NORMALIZE_WHITESPACE
    ['actstore-blocks.xxh3', 'actstore-manifest.json', 'actstore.json',
     'data-00000-of-00001.arrow', 'dataset_info.json', 'state.json', 'statistics.json']
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ...batch import Batch, CapturePlan
from ...errors import CaptureError, require
from ...sites import Site
from ...stats import RunningStats
from ...storage import atomic_write_bytes, atomic_write_json
from ...storage.location import Location
from ..pipeline import ShardOutput
from ..shard import ShardRecord, ShardSink
from ..writer import ShardedWriter
from .layout import (
    FORMAT_TAG,
    INFO,
    SIDECAR,
    STATE,
    STATISTICS,
    TOKENS,
    VERSION,
    SaelensLayout,
    choose_layout,
    dataset_state,
    values_offsets,
)
from .options import SaelensOptions

if TYPE_CHECKING:
    import torch
else:
    from ..._lazy import torch


def plan_record(plan: CapturePlan) -> dict[str, Any]:
    """The JSON record of a capture plan kept in ``actstore.json`` (extras left out)."""
    doc = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan) if f.name != "extras"}
    doc["sites"] = [str(s) for s in plan.sites]
    return json.loads(json.dumps(doc, default=str))


def store_record(layout: SaelensLayout, plan: dict[str, Any]) -> dict[str, Any]:
    """What identifies a capture (a rerun with an equal record resumes or is a no-op)."""
    return {"format": FORMAT_TAG, "version": VERSION, "layout": layout.to_dict(), "plan": plan}


def layout_for(plan: CapturePlan, options: SaelensOptions | None) -> SaelensLayout:
    """The layout ``options`` give a capture ``plan``."""
    options = options or SaelensOptions()
    return choose_layout(
        plan,
        dtype=options.dtype,
        shard_mb=options.shard_mb,
        examples_per_shard=options.examples_per_shard,
        block_kb=options.block_kb,
    )


class SaelensWriter(ShardedWriter):
    """Writer of one cache (``out`` is the store directory), or one part of one."""

    format_name = "saelens"
    options_type = SaelensOptions

    def __init__(
        self,
        plan: CapturePlan,
        output: Location,
        options: SaelensOptions | None = None,
        *,
        example_range: tuple[int, int] | None = None,
        store: Location | None = None,
    ) -> None:
        require("datasets.arrow_writer", "datasets")  # missing: one line, nothing created
        options = options or SaelensOptions()
        self.layout = layout_for(plan, options)
        self.stored_dtype = self.layout.dtype
        super().__init__(
            plan=plan,
            store=store or output,
            output=output,
            options=options,
            record=store_record(self.layout, plan_record(plan)),
            examples_per_shard=self.layout.examples_per_shard,
            example_range=example_range,
        )

    @classmethod
    def shard_examples(cls, plan: CapturePlan, options: Any) -> int:
        return layout_for(plan, options).examples_per_shard

    # ------------------------------------------------------------------ the format's part

    def init_files(self, directory: Path) -> None:
        atomic_write_json(directory / SIDECAR, self.record)

    def open_shard(self, index: int, directory: Path) -> ShardSink:
        return _ArrowFile(self.layout, self.layout.file_name(index))

    def write_index(
        self, directory: Path, shards: Sequence[ShardRecord], stats: dict[Site, RunningStats]
    ) -> None:
        """``state.json`` and ``dataset_info.json`` (as ``save_to_disk`` writes them),
        ``statistics.json`` and ``actstore.json``."""
        from datasets.info import DatasetInfo
        from datasets.utils.py_utils import asdict

        names = [name for e in shards for name in e.files]
        digests = "".join(f.digest for e in shards for f in e.files.values())
        state = dataset_state(names, digests)
        atomic_write_bytes(directory / STATE, json.dumps(state, indent=2, sort_keys=True).encode())
        info = asdict(DatasetInfo(features=self.layout.features()))
        info = {key: info[key] for key in sorted(info)}
        atomic_write_bytes(directory / INFO, json.dumps(info, indent=2).encode())
        atomic_write_json(
            directory / STATISTICS,
            {"sites": {str(site): st.to_dict() for site, st in stats.items()}},
            indent=None,
        )
        record = dict(self.record)
        record["files"] = [
            {
                "name": name,
                "n_examples": e.n_examples,
                "bytes": f.size,
                "values_at": e.info[name]["values_at"],
            }
            for e in shards
            for name, f in e.files.items()
        ]
        atomic_write_json(directory / SIDECAR, record)


class _ArrowFile(ShardSink):
    """One Arrow file, written as record batches of exactly ``examples_per_block``; its
    manifest blocks are each column's values in each record batch (found at commit)."""

    def __init__(self, layout: SaelensLayout, name: str) -> None:
        self.layout, self.name = layout, name
        self._pending: list[tuple[list[np.ndarray], np.ndarray | None]] = []
        self._pending_n = 0
        self.n = 0
        self.values_at: list[list[int]] = []

    def open(self, out: ShardOutput) -> None:
        from datasets.arrow_writer import ArrowWriter

        stream = out.stream(self.name, ranges=self._ranges)
        self.arrow = ArrowWriter(features=self.layout.features(), stream=stream)

    def append(self, batch: Batch, acts: Mapping[Site, torch.Tensor], out: ShardOutput) -> None:
        lay = self.layout
        columns = [acts[Site.parse(site)].numpy() for site in lay.sites]
        tokens = None
        if lay.has_tokens:
            if batch.token_ids is None:
                raise CaptureError("this store keeps token ids but the batch has none")
            tokens = np.ascontiguousarray(batch.token_ids, dtype=np.int32)
        self._pending.append((columns, tokens))
        self._pending_n += batch.n_examples
        self.n += batch.n_examples
        while self._pending_n >= lay.examples_per_block:
            self._write_block(lay.examples_per_block)
        if self._pending:  # FIFO: what is left of this batch is the last entry; it waits
            cols, toks = self._pending[-1]  # for the next record batch, so it is copied
            self._pending[-1] = ([c.copy() for c in cols], None if toks is None else toks.copy())

    def _write_block(self, n: int) -> None:
        columns, tokens = self._take(n)
        row: dict[str, Any] = dict(zip(self.layout.columns, columns))
        if tokens is not None:
            row[TOKENS] = tokens
        self.arrow.write_batch(row)

    def _take(self, n: int) -> tuple[list[np.ndarray], np.ndarray | None]:
        """The first ``n`` buffered examples, as contiguous arrays."""
        parts, got = [], 0
        while got < n:
            columns, tokens = self._pending[0]
            have = columns[0].shape[0]
            use = min(have, n - got)
            parts.append(([c[:use] for c in columns], None if tokens is None else tokens[:use]))
            if use == have:
                self._pending.pop(0)
            else:
                self._pending[0] = (
                    [c[use:] for c in columns],
                    None if tokens is None else tokens[use:],
                )
            got += use
        self._pending_n -= n
        if len(parts) == 1:
            cols, toks = parts[0]
            return [np.ascontiguousarray(c) for c in cols], toks
        cols = [np.concatenate([p[0][k] for p in parts]) for k in range(len(parts[0][0]))]
        toks = None if parts[0][1] is None else np.concatenate([p[1] for p in parts])
        return cols, toks

    def finish(self, out: ShardOutput) -> None:
        if self._pending_n:  # the file's last, short block
            self._write_block(self._pending_n)
        self.arrow.finalize(close_stream=True)

    def _ranges(self, data: memoryview) -> list[tuple[int, int]]:
        self.values_at = _values_at(data, self.layout)
        return _ranges(self.values_at, self.layout, self.n)

    def info(self) -> dict[str, dict[str, Any]]:
        return {self.name: {"values_at": self.values_at}}


def _values_at(data: bytes | memoryview, layout: SaelensLayout) -> list[list[int]]:
    """Where each block column's values start in each record batch of an Arrow file."""
    import pyarrow as pa

    columns = [*layout.columns, *([TOKENS] if layout.has_tokens else [])]
    return values_offsets(pa.py_buffer(data), columns)


def _ranges(values_at: list[list[int]], layout: SaelensLayout, n: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of every block of a file of ``n`` examples: each column's
    values in each record batch (the last batch may be short)."""
    itemsize = 4 if layout.dtype == "float32" else 2
    column = layout.context_size * layout.d_in * itemsize
    token_row = layout.context_size * 4
    out = []
    for b, offsets in enumerate(values_at):
        rows = min(layout.examples_per_block, n - b * layout.examples_per_block)
        for k, offset in enumerate(offsets):
            width = token_row if k >= len(layout.columns) else column
            out.append((int(offset), rows * width))
    return out
