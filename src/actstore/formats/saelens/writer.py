"""Write a SAELens activation cache, crash-safely and resumably.

Examples stream into ``<parent>/.<name>.partial/``: ``datasets``' ``ArrowWriter`` writes
each file (``data-{i:05d}-of-{n:05d}.arrow``) as record batches of exactly
``examples_per_block`` examples (so the bytes never depend on how capture batched them),
hashing the bytes as they pass. A full file is fsynced and recorded, with its sha256, the
xxh3-64 of every block of every column, where each block's values start in the file and its
per-site statistics, in ``progress.json``; from then on it is sealed (:meth:`sealed_files`:
an uploader may send it while the capture goes on).
A capture killed at any point and rerun with the same configuration keeps the recorded
files whose sha256 still matches, deletes the rest and resumes after them: the published
store is byte-identical to an uninterrupted one. ``close()`` writes ``state.json`` and
``dataset_info.json`` (what ``Dataset.save_to_disk`` writes), the sidecars, then renames
the directory to its final name and makes its files read-only.

Example:
    >>> writer = SaelensWriter.from_plan(plan, "acts-saelens")  # doctest: +SKIP
    >>> for batch in batches: writer.write(batch)  # doctest: +SKIP
    >>> writer.close()  # doctest: +SKIP
    PosixPath('/abs/acts-saelens')
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from ...batch import Batch, CapturePlan
from ...errors import CaptureError, ConfigError, CorruptStoreError, StoreExistsError
from ...stats import RunningStats, merge_all
from ...storage import (
    FileHasher,
    atomic_write_bytes,
    atomic_write_json,
    fsync_dir,
    hash_file,
    make_read_only,
    publish_dir,
    read_json,
)
from ..base import WriterBase
from .layout import (
    CHECKSUMS,
    FORMAT_TAG,
    INFO,
    PROGRESS,
    SIDECAR,
    STATE,
    STATISTICS,
    TOKENS,
    VERSION,
    SaelensLayout,
    choose_layout,
    values_offsets,
)
from .options import SaelensOptions

log = logging.getLogger(__name__)

PART = "part.json"


def plan_record(plan: CapturePlan) -> dict[str, Any]:
    """The JSON record of a capture plan kept in ``actstore.json`` (extras left out)."""
    doc = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan) if f.name != "extras"}
    doc["sites"] = [str(s) for s in plan.sites]
    return json.loads(json.dumps(doc, default=str))


def store_record(layout: SaelensLayout, plan: dict[str, Any]) -> dict[str, Any]:
    """What identifies a capture (a rerun with an equal record resumes or is a no-op)."""
    return {"format": FORMAT_TAG, "version": VERSION, "layout": layout.to_dict(), "plan": plan}


class _HashingSink:
    """The file ``ArrowWriter`` streams into: hashes bytes as they pass, fsyncs on close."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = open(path, "wb")  # noqa: SIM115 - closed by ArrowWriter through close()
        self.hasher = FileHasher("sha256")
        self.size = 0
        self.closed = False

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.hasher.update(view)
        self.size += view.nbytes
        return self.file.write(view)

    def flush(self) -> None:
        self.file.flush()

    def tell(self) -> int:
        return self.size

    def close(self) -> None:
        if not self.closed:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            self.closed = True


class SaelensWriter(WriterBase):
    """Writer of one store (or, with ``example_range``, of one part of a distributed
    capture: examples ``[start, stop)`` starting on a file boundary, files numbered as in
    the whole store, published with a ``part.json`` for :func:`merge_parts`)."""

    def __init__(
        self,
        layout: SaelensLayout,
        out: str | os.PathLike,
        *,
        plan: dict[str, Any] | None = None,
        example_range: tuple[int, int] | None = None,
    ) -> None:
        self.layout = layout
        self.record = store_record(layout, plan or {})
        self.is_part = example_range is not None
        self.example_range = _check_range(layout, example_range)
        self.final_dir = Path(out).expanduser().resolve()
        self.partial_dir = self.final_dir.parent / f".{self.final_dir.name}.partial"
        self.complete = False
        self.resume_from = self.example_range[0]
        self._features = layout.features()
        self._shards: list[dict[str, Any]] = []
        self._pending: list[tuple[list[np.ndarray], np.ndarray | None]] = []
        self._pending_n = 0
        self._written = 0
        self._arrow: Any = None
        self._sink: _HashingSink | None = None
        self._in_shard = 0
        self._blocks: list[list[str]] = []
        self._stats: list[RunningStats] = []
        self._open()

    @classmethod
    def from_plan(
        cls, plan: CapturePlan, out: str | os.PathLike, options: SaelensOptions | None = None
    ) -> SaelensWriter:
        """The writer of a capture plan: the store directory is ``out`` itself."""
        return cls(layout_for(plan, options), out, plan=plan_record(plan))

    # ------------------------------------------------------------------ open / resume

    def _open(self) -> None:
        final = self.final_dir
        if final.is_dir() and not any(final.iterdir()):
            final.rmdir()  # an empty directory made for the output
        if final.exists():
            self._check_existing(final)
            self.complete = True
            self.resume_from = self.example_range[1]
            log.info("%s is already published; nothing to write", final)
            return
        final.parent.mkdir(parents=True, exist_ok=True)
        if self.partial_dir.exists():
            self._check_existing(self.partial_dir)
            self._resume()
        else:
            self.partial_dir.mkdir()
            atomic_write_json(self.partial_dir / SIDECAR, self.record)
            atomic_write_json(self.partial_dir / PROGRESS, {"shards": []}, indent=None)

    def _check_existing(self, directory: Path) -> None:
        sidecar = directory / SIDECAR
        found = read_json(sidecar) if sidecar.is_file() else None
        if (
            found is None
            or found.get("layout") != self.record["layout"]
            or (found.get("plan") != self.record["plan"])
        ):
            raise StoreExistsError(
                f"{directory} already holds something else (another capture, or files not "
                "written by actstore); choose another output directory or move it away"
            )

    def _resume(self) -> None:
        """Keep recorded files whose checksum still matches; delete everything else."""
        progress = read_json(self.partial_dir / PROGRESS)
        first = self.example_range[0] // self.layout.examples_per_shard
        kept: list[dict[str, Any]] = []
        for entry in progress.get("shards", []):
            index = first + len(kept)
            start, stop = self.layout.shard_range(index)
            path = self.partial_dir / self.layout.file_name(index)
            if entry.get("name") != path.name or entry.get("n_examples") != stop - start:
                break
            if not path.is_file() or hash_file(path) != entry.get("sha256"):
                log.warning("%s is missing or fails its checksum; rewriting from there", path)
                break
            if "values_at" not in entry:  # recorded by an older actstore
                entry["values_at"] = _file_offsets(path, self.layout)
            kept.append(entry)
        keep = {e["name"] for e in kept} | {SIDECAR, PROGRESS}
        for child in self.partial_dir.iterdir():
            if child.name not in keep:
                child.unlink()
        self._shards = kept
        self.resume_from = self.example_range[0] + sum(e["n_examples"] for e in kept)
        atomic_write_json(self.partial_dir / PROGRESS, {"shards": kept}, indent=None)
        log.info(
            "resuming %s: %d finished files (%d examples) kept",
            self.partial_dir,
            len(kept),
            self.resume_from - self.example_range[0],
        )

    # ------------------------------------------------------------------ writing

    def write(self, batch: Batch) -> None:
        """Append ``batch``'s examples (those not already stored), in example order."""
        if self.complete:
            raise CaptureError(f"{self.final_dir} is already published")
        start = self.resume_from + self._written
        keep = batch.example_ids >= start
        if not keep.all():
            batch = batch.select(keep)
        n = batch.n_examples
        if n == 0:
            return
        if not np.array_equal(batch.example_ids, np.arange(start, start + n)):
            raise CaptureError(
                f"batches must arrive in example order: expected ids from {start}, "
                f"got {batch.example_ids[:4].tolist()}..."
            )
        if start + n > self.example_range[1]:
            raise CaptureError(
                f"examples beyond {self.example_range[1]}, the end of what this writer holds"
            )
        lay = self.layout
        columns = []
        for site in lay.sites:
            tensor = batch.acts.get(site)
            if tensor is None:
                raise CaptureError(f"batch lacks site {site}; it has {sorted(batch.acts)}")
            if tuple(tensor.shape) != (n, lay.context_size, lay.d_in):
                raise CaptureError(
                    f"site {site} has shape {tuple(tensor.shape)}; this store holds "
                    f"({n}, {lay.context_size}, {lay.d_in})"
                )
            columns.append(_as_numpy(tensor, lay.dtype))
        if lay.dtype != "float32":  # statistics are of the values as captured, as in zarr
            columns += [_as_numpy(batch.acts[site], "float32") for site in lay.sites]
        tokens = None
        if lay.has_tokens:
            if batch.token_ids is None:
                raise CaptureError("this store keeps token ids but the batch has none")
            tokens = np.ascontiguousarray(batch.token_ids, dtype=np.int32)
        self._pending.append((columns, tokens))
        self._pending_n += n
        self._written += n
        self._drain(final=False)

    def _drain(self, *, final: bool) -> None:
        """Write every whole block buffered (and, at the end, the last short one)."""
        lay = self.layout
        while self._pending_n:
            index = self.example_range[0] // lay.examples_per_shard + len(self._shards)
            start, stop = lay.shard_range(index)
            left_in_shard = stop - start - self._in_shard
            want = min(lay.examples_per_block, left_in_shard)
            if self._pending_n < want:
                if not final:
                    return
                raise CaptureError("internal: a short block before the end of a file")
            columns, tokens = self._take(want)
            if self._arrow is None:
                self._start_shard(index)
            self._write_block(columns, tokens)
            if self._in_shard == stop - start:
                self._finish_shard(index)

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

    def _start_shard(self, index: int) -> None:
        from datasets.arrow_writer import ArrowWriter

        self._sink = _HashingSink(self.partial_dir / self.layout.file_name(index))
        self._arrow = ArrowWriter(features=self._features, stream=self._sink)
        self._in_shard = 0
        self._blocks = []
        self._stats = [RunningStats(self.layout.d_in) for _ in self.layout.sites]

    def _write_block(self, columns: list[np.ndarray], tokens: np.ndarray | None) -> None:
        n_sites = len(self.layout.sites)
        columns, exact = columns[:n_sites], columns[n_sites:] or columns[:n_sites]
        row: dict[str, Any] = dict(zip(self.layout.columns, columns))
        digests = [xxhash.xxh3_64_hexdigest(memoryview(c).cast("B")) for c in columns]
        if tokens is not None:
            row[TOKENS] = tokens
            digests.append(xxhash.xxh3_64_hexdigest(memoryview(tokens).cast("B")))
        self._arrow.write_batch(row)
        for stats, values in zip(self._stats, exact):
            stats.update(values)
        self._blocks.append(digests)
        self._in_shard += columns[0].shape[0]

    def _finish_shard(self, index: int) -> None:
        self._arrow.finalize()
        self._arrow.close()  # closes the sink: flush + fsync
        fsync_dir(self.partial_dir)
        self._shards.append(
            {
                "name": self.layout.file_name(index),
                "n_examples": self._in_shard,
                "sha256": self._sink.hasher.hexdigest(),
                "bytes": self._sink.size,
                "blocks": self._blocks,
                "values_at": _file_offsets(self._sink.path, self.layout),
                "stats": [s.to_dict() for s in self._stats],
            }
        )
        self._arrow = self._sink = None
        self._in_shard = 0
        atomic_write_json(self.partial_dir / PROGRESS, {"shards": self._shards}, indent=None)

    # ------------------------------------------------------------------ publish

    def close(self) -> Path:
        """Write the last file and the index files, then publish the directory."""
        if self.complete:
            return self.final_dir
        self._drain(final=True)
        start, stop = self.example_range
        total = sum(e["n_examples"] for e in self._shards)
        if total != stop - start:
            self.abort()
            raise CaptureError(
                f"only {total} of {stop - start} examples were written; rerun the same "
                f"capture to resume from {self.partial_dir}"
            )
        d = self.partial_dir
        if self.is_part:
            atomic_write_json(d / PART, {"example_range": [start, stop], "shards": self._shards})
        else:
            write_index(d, self.layout, self._shards)
        (d / PROGRESS).unlink()
        fsync_dir(d)
        publish_dir(d, self.final_dir)
        make_read_only(self.final_dir)
        self.complete = True
        log.info("published %s (%d files, %d examples)", self.final_dir, len(self._shards), total)
        return self.final_dir

    def sealed_files(self) -> list[tuple[str, Path]]:
        """The Arrow files finished so far (fsynced, recorded, never written again)."""
        where = self.final_dir if self.complete else self.partial_dir
        if self.complete and not self._shards:  # published before this writer opened
            return [(p.name, p) for p in sorted(where.glob("data-*.arrow"))]
        return [(e["name"], where / e["name"]) for e in self._shards]

    def abort(self) -> None:
        """Stop without publishing; finished files stay for a resume."""
        if self._sink is not None:
            self._sink.close()
        self._arrow = self._sink = None
        self._pending, self._pending_n = [], 0


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


def _file_offsets(path: Path, layout: SaelensLayout) -> list[list[int]]:
    """Where each block column's values start in each record batch of the file at ``path``."""
    import pyarrow as pa

    columns = [*layout.columns, *([TOKENS] if layout.has_tokens else [])]
    with pa.memory_map(str(path)) as mapped:
        return values_offsets(mapped.read_buffer(), columns)


def _as_numpy(tensor: torch.Tensor, dtype: str) -> np.ndarray:
    want = torch.float32 if dtype == "float32" else torch.float16
    return np.ascontiguousarray(tensor.detach().to(want).numpy())


def _check_range(layout: SaelensLayout, example_range: tuple[int, int] | None) -> tuple[int, int]:
    if example_range is None:
        return (0, layout.n_examples)
    start, stop = (int(x) for x in example_range)
    per = layout.examples_per_shard
    if not 0 <= start < stop <= layout.n_examples:
        raise ConfigError(
            f"example range [{start}, {stop}) is empty or outside [0, {layout.n_examples})"
        )
    if start % per or (stop != layout.n_examples and stop % per):
        raise ConfigError(
            f"a saelens part must cover whole files of {per} examples; [{start}, {stop}) "
            "does not (split the dataset with actstore.dist.split_examples)"
        )
    return (start, stop)


def write_index(directory: Path, layout: SaelensLayout, shards: Sequence[dict[str, Any]]) -> None:
    """``state.json`` and ``dataset_info.json`` (as ``save_to_disk`` writes them) and the
    sidecars of a finished store, from the file records in file order."""
    from datasets.info import DatasetInfo
    from datasets.utils.py_utils import asdict

    d = directory
    sha = [e["sha256"] for e in shards]
    state = {
        "_data_files": [{"filename": e["name"]} for e in shards],
        # datasets' fingerprint only keys its cache; this one is a pure function of the data
        "_fingerprint": xxhash.xxh3_64_hexdigest("".join(sha).encode()),
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    atomic_write_bytes(d / STATE, json.dumps(state, indent=2, sort_keys=True).encode())
    info = asdict(DatasetInfo(features=layout.features()))
    info = {key: info[key] for key in sorted(info)}
    atomic_write_bytes(d / INFO, json.dumps(info, indent=2).encode())
    statistics = {
        "sites": {
            site: merge_all([RunningStats.from_dict(e["stats"][i]) for e in shards]).to_dict()
            for i, site in enumerate(layout.sites)
        }
    }
    atomic_write_json(d / STATISTICS, statistics, indent=None)
    sidecar = read_json(d / SIDECAR)
    sidecar["files"] = [
        {
            "name": e["name"],
            "n_examples": e["n_examples"],
            "bytes": e["bytes"],
            "values_at": e["values_at"],
        }
        for e in shards
    ]
    atomic_write_json(d / SIDECAR, sidecar)
    files = {e["name"]: e["sha256"] for e in shards}
    for name in (STATE, INFO, SIDECAR, STATISTICS):
        files[name] = hash_file(d / name)
    block_columns = [*layout.columns, *([TOKENS] if layout.has_tokens else [])]
    checksums = {
        "files": files,
        "blocks": {"xxh3_64 of": block_columns, **{e["name"]: e["blocks"] for e in shards}},
    }
    atomic_write_json(d / CHECKSUMS, checksums, indent=None)


# ---------------------------------------------------------------------- distributed parts


def read_part(part_dir: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``actstore.json`` record and ``part.json`` manifest of a published part."""
    part_dir = Path(part_dir)
    record = read_json(part_dir / SIDECAR)
    manifest = read_json(part_dir / PART)
    try:
        start, stop = (int(x) for x in manifest["example_range"])
        held = sum(int(e["n_examples"]) for e in manifest["shards"])
    except (KeyError, TypeError, ValueError) as err:
        raise CorruptStoreError(f"{part_dir / PART} is malformed ({err!r}); re-capture it") from err
    if held != stop - start:
        raise CorruptStoreError(
            f"{part_dir / PART} lists {held} examples for [{start}, {stop}); re-capture it"
        )
    return record, manifest


def merge_parts(part_dirs: Sequence[str | os.PathLike], final_dir: str | os.PathLike) -> Path:
    """Join published parts (in example order, tiling every example) into the store
    ``final_dir``: files hard-linked (copied across file systems), index and sidecars
    written from the parts' records; byte-identical to a one-process capture."""
    final_dir = Path(final_dir)
    if final_dir.exists():
        raise StoreExistsError(f"{final_dir} already exists; refusing to overwrite it")
    parts = [Path(p) for p in part_dirs]
    if not parts:
        raise ConfigError("merge_parts needs at least one part")
    record, _ = read_part(parts[0])
    layout = SaelensLayout.from_dict(record["layout"], source=str(parts[0] / SIDECAR))
    shards: list[dict[str, Any]] = []
    at = 0
    for part in parts:
        part_record, manifest = read_part(part)
        if part_record != record:
            raise ConfigError(f"{part} belongs to a different capture than {parts[0]}")
        start, stop = manifest["example_range"]
        if start != at:
            raise ConfigError(f"{part} starts at example {start}, expected {at}")
        at = stop
        shards += [{**e, "_from": str(part)} for e in manifest["shards"]]
    if at != layout.n_examples:
        raise ConfigError(f"the parts end at example {at} of {layout.n_examples}")
    work = final_dir.parent / f".{final_dir.name}.merging"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    atomic_write_json(work / SIDECAR, record)
    for entry in shards:
        src, dst = Path(entry.pop("_from")) / entry["name"], work / entry["name"]
        try:
            os.link(src, dst)
        except OSError:
            shutil.copyfile(src, dst)
    write_index(work, layout, shards)
    publish_dir(work, final_dir)
    make_read_only(final_dir)
    log.info("merged %d parts into %s (%d files)", len(parts), final_dir, len(shards))
    return final_dir
