"""docs/design.md's recipe for a new format, followed by a throwaway one defined entirely in
this file and registered with one line: one ``.npy`` file per site per shard plus a JSON
index. It passes the whole conformance kit (``actstore.testing``) and works with
``open_store``, the loader, ``convert`` and the CLI, without touching actstore's code."""

from __future__ import annotations

import dataclasses
import io
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from actstore.batch import Batch, CapturePlan
from actstore.errors import StoreNotFoundError
from actstore.formats import open_store
from actstore.formats.base import Block, ReaderBase
from actstore.formats.parts import sharded_part_format
from actstore.formats.registry import FormatSpec, register_format, unregister_format
from actstore.formats.shard import ShardSink, WrittenFile, as_float32
from actstore.formats.writer import ShardedWriter
from actstore.sites import Site
from actstore.stats import RunningStats
from actstore.storage import atomic_write_json
from actstore.storage.location import Location
from actstore.storage.manifest import hash_file_blocks
from actstore.testing import ConformanceSuite, FormatCase, make_acts, make_plan

INDEX = "index.json"


@dataclasses.dataclass(frozen=True)
class NpyOptions:
    examples_per_shard: int = dataclasses.field(
        default=8, metadata={"help": "Examples per shard file."}
    )


def _name(shard: int, site: Site) -> str:
    return f"shard-{shard:05d}.{site}.npy"


class _NpySink(ShardSink):
    def __init__(self, writer: NpyWriter, index: int, directory: Path) -> None:
        self.writer, self.index, self.directory = writer, index, directory
        self.rows: dict[Site, list[np.ndarray]] = {s: [] for s in writer.sites}

    def append(self, batch: Batch) -> None:
        for site in self.rows:
            rows = as_float32(batch.acts[str(site)]).reshape(-1, self.writer.plan.d_model)
            self.rows[site].append(rows.copy())

    def finish(self) -> list[WrittenFile]:
        out = []
        for site, parts in self.rows.items():
            name = _name(self.index, site)
            with open(self.directory / name, "wb") as f:
                np.save(f, np.concatenate(parts), allow_pickle=False)
                f.flush()
                os.fsync(f.fileno())
            entry, digests = hash_file_blocks(self.writer.store_id, self.directory / name, name)
            out.append(WrittenFile(name, entry, digests))
        return out


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
        return _NpySink(self, index, directory)

    def side_rows(self, batch: Batch) -> dict[str, bytes]:
        if not self.plan.has_tokens or batch.token_ids is None:
            return {}
        return {"tokens.bin": np.ascontiguousarray(batch.token_ids, dtype="<i4").tobytes()}

    def write_index(
        self, directory: Path, shards: Sequence[dict[str, Any]], stats: dict[Site, RunningStats]
    ) -> None:
        atomic_write_json(
            directory / INDEX,
            {
                "format": "npyshards",
                "plan": self.plan.to_json_dict(),
                "shards": [e["n_examples"] for e in shards],
                "statistics": {str(s): st.to_dict() for s, st in stats.items()},
            },
        )


class NpyReader(ReaderBase):
    format_name = "npyshards"

    def __init__(
        self,
        location: str | os.PathLike | Location,
        *,
        verify_reads: bool = True,
        cache_dir: str | os.PathLike | None = None,
        cache_bytes: int | str | None = None,
        s3: Any = None,
    ) -> None:
        self._open_location(
            location, verify_reads=verify_reads, cache_dir=cache_dir, cache_bytes=cache_bytes, s3=s3
        )
        if not self.files.exists(INDEX):
            raise StoreNotFoundError(f"{self.url} holds no npyshards store (no {INDEX})")
        self._open_checks(ours=True)
        self.index = self.checks.read_json(INDEX)
        self.plan = CapturePlan.from_json_dict(self.index["plan"])
        self._check_summary()

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


def _detect(files: Any) -> bool:
    return files.exists(INDEX) and b'"npyshards"' in files.read_bytes(INDEX)


SPEC = FormatSpec(
    name="npyshards",
    summary="one .npy per site per shard, plus a JSON index (a test's throwaway format)",
    options=NpyOptions,
    detect=_detect,
    reader=NpyReader,
    writer=NpyWriter,
    parts=lambda: sharded_part_format("npyshards", NpyWriter),
    manifests=(INDEX,),
)


@pytest.fixture(autouse=True, scope="module")
def _registered():
    register_format(SPEC)  # the one line a new format adds outside its own code
    yield
    unregister_format("npyshards")


class TestNpyShardsConformance(ConformanceSuite):
    case = FormatCase("npyshards", NpyOptions(examples_per_shard=5))


def test_the_cli_and_the_loader_take_the_new_format(tmp_path):
    from actstore.loader import ActivationLoader
    from actstore.testing import make_batches

    plan = make_plan()
    acts = make_acts(plan)
    location = FormatCase("npyshards", NpyOptions(5)).write(
        tmp_path / "store", plan, make_batches(plan, acts)
    )
    reader = open_store(location)
    assert isinstance(reader, NpyReader)
    loader = ActivationLoader(location, site="resid.3", batch_size=16, return_index=True)
    rows = np.concatenate([b.rows.numpy() for b in loader])
    assert sorted(rows.tolist()) == list(range(plan.n_examples * plan.tokens_per_example))
    runner = CliRunner()
    from actstore.cli import app

    result = runner.invoke(app, ["verify", location, "--no-progress"])
    assert result.exit_code == 0 and "OK:" in result.output, result.output
    result = runner.invoke(app, ["inspect", location])
    assert result.exit_code == 0 and "npy shards" in result.output, result.output
    out = tmp_path / "as-saev"
    result = runner.invoke(app, ["convert", location, str(out), "--to", "saev", "--no-progress"])
    assert result.exit_code == 0, result.output
