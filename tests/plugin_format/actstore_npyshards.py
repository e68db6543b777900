"""npyshards: a sixth actstore storage format, packaged on its own as a third-party project
would (docs/design.md, "Adding a format"): one ``.npy`` file per site per shard, token ids
in ``tokens.bin``, a JSON index. Installing this package makes the format known to every
actstore command through its entry point (``pyproject.toml``); nothing in actstore names
it. ``tests/test_new_format.py`` installs it with pip and runs its own conformance suite
(``test_npyshards.py``)."""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from actstore.formats.api import (
    Batch,
    Block,
    CapturePlan,
    CorruptStoreError,
    FormatSpec,
    Location,
    ReaderBase,
    RunningStats,
    ShardedWriter,
    ShardOutput,
    ShardRecord,
    ShardSink,
    Site,
    StoreNotFoundError,
    atomic_write_json,
    sharded_part_format,
)

INDEX = "index.json"


@dataclasses.dataclass(frozen=True)
class NpyOptions:
    examples_per_shard: int = dataclasses.field(
        default=8, metadata={"help": "Examples per shard file."}
    )


def _name(shard: int, site: Site) -> str:
    return f"shard-{shard:05d}.{site}.npy"


class _NpySink(ShardSink):
    """One shard: each site's rows gathered (copied: a sink keeps no reference to a batch
    after ``append``), written as one ``.npy`` file per site when the shard ends."""

    def __init__(self, writer: NpyWriter, index: int) -> None:
        self.writer, self.index = writer, index
        self.rows: dict[Site, list[np.ndarray]] = {s: [] for s in writer.sites}

    def open(self, out: ShardOutput) -> None:
        for site in self.rows:
            out.declare(_name(self.index, site))

    def append(self, batch: Batch, acts: Mapping[Site, torch.Tensor], out: ShardOutput) -> None:
        for site, parts in self.rows.items():
            parts.append(acts[site].numpy().reshape(-1, self.writer.plan.d_model).copy())

    def finish(self, out: ShardOutput) -> None:
        for site, parts in self.rows.items():
            buf = io.BytesIO()
            np.save(buf, np.concatenate(parts), allow_pickle=False)
            out.write(_name(self.index, site), buf.getvalue())


class NpyWriter(ShardedWriter):
    format_name = "npyshards"
    options_type = NpyOptions

    def __init__(
        self,
        plan: CapturePlan,
        output: Location,
        options: NpyOptions | None = None,
        *,
        example_range: tuple[int, int] | None = None,
        store: Location | None = None,
    ) -> None:
        options = options or NpyOptions()
        super().__init__(
            plan=plan,
            store=store or self.store_location(plan, output, options),
            output=output,
            options=options,
            record={"plan": plan.to_json_dict(), "per_shard": options.examples_per_shard},
            examples_per_shard=options.examples_per_shard,
            example_range=example_range,
        )

    @classmethod
    def shard_examples(cls, plan: CapturePlan, options: Any) -> int:
        return (options or NpyOptions()).examples_per_shard

    def open_shard(self, index: int, directory: Path) -> ShardSink:
        return _NpySink(self, index)

    def side_rows(self, batch: Batch) -> dict[str, bytes]:
        out = {}
        if self.plan.has_tokens and batch.token_ids is not None:
            out["tokens.bin"] = np.ascontiguousarray(batch.token_ids, dtype="<i4").tobytes()
        if self.plan.has_labels and batch.labels is not None:
            out["labels.bin"] = np.ascontiguousarray(batch.labels, dtype="<i8").tobytes()
        return out

    def write_index(
        self, directory: Path, shards: Sequence[ShardRecord], stats: dict[Site, RunningStats]
    ) -> None:
        atomic_write_json(
            directory / INDEX,
            {
                "format": "npyshards",
                "plan": self.plan.to_json_dict(),
                "shards": [e.n_examples for e in shards],
                "statistics": {str(s): st.to_dict() for s, st in stats.items()},
            },
        )


class NpyReader(ReaderBase):
    format_name = "npyshards"

    def open_index(self) -> None:
        if not self.files.exists(INDEX):
            raise StoreNotFoundError(f"{self.url} holds no npyshards store (no {INDEX})")
        self.open_checks(ours=True)
        self.index = self.checks.read_json(INDEX)
        self.plan = CapturePlan.from_json_dict(self.index["plan"])

    @property
    def sites(self) -> tuple[Site, ...]:
        return tuple(self.plan.sites)

    @property
    def d_model(self) -> int:
        return self.plan.d_model

    @property
    def dtype(self) -> np.dtype:
        return np.dtype("float32")

    def n_rows(self, site: Any) -> int:
        self.site(site)
        return sum(self.index["shards"]) * self.plan.tokens_per_example

    def site_blocks(self, site: Site) -> list[Block]:
        t = self.plan.tokens_per_example
        return [Block(site, n * t, (k,)) for k, n in enumerate(self.index["shards"])]

    def read_block(self, block: Block, out: np.ndarray | None = None) -> np.ndarray:
        data = self.checks.read_bytes(_name(block.loc[0], block.site))  # checked whole
        rows = np.load(io.BytesIO(data), allow_pickle=False)
        if out is None:
            return rows
        out[: len(rows)] = rows
        return out[: len(rows)]

    def site_statistics(self, site: Site) -> RunningStats | None:
        return RunningStats.from_dict(self.index["statistics"][str(site)])

    def describe_format(self) -> dict[str, Any]:
        return {"format": "npy shards", "shape": f"{sum(self.index['shards'])} examples"}

    def capture_plan(self) -> CapturePlan:
        return self.plan

    @property
    def tokens(self) -> np.ndarray | None:  # type: ignore[override]
        if not self.plan.has_tokens:
            return None
        data = self.checks.read_bytes("tokens.bin")
        return np.frombuffer(data, "<i4").reshape(self.plan.n_examples, -1)

    @property
    def labels(self) -> np.ndarray | None:  # type: ignore[override]
        if not self.plan.has_labels:
            return None
        return np.frombuffer(self.checks.read_bytes("labels.bin"), "<i8")

    @property
    def classes(self) -> list[str] | None:
        return self.plan.classes


def _detect(files: Any) -> bool:
    """An index.json of this format, or a damaged one (claimed, so the reader names the
    fault: a kit rule)."""
    if not files.exists(INDEX):
        return False
    try:
        doc = files.read_json(INDEX)
    except CorruptStoreError:
        return True
    return isinstance(doc, dict) and doc.get("format") == "npyshards"


FORMAT = FormatSpec(
    name="npyshards",
    summary="one .npy per site per shard, plus a JSON index (a test's throwaway format)",
    options=NpyOptions,
    detect=_detect,
    reader=NpyReader,
    writer=NpyWriter,
    parts=lambda: sharded_part_format("npyshards", NpyWriter),
    manifests=(INDEX,),
)
