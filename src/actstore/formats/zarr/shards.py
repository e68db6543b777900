"""Sharded runs: parallel writer processes, the manifest, and the optional merge.

Layout of a run (the spec's "sharded write layout")::

    run_YYYYmmdd_HHMMSS/
      shards/shard-0000.zarr/   a complete, published store of samples [start_0, start_1)
      shards/shard-0001.zarr/   ...
      manifest.json             global index -> (shard, local index)
      merged/activations.zarr/  optional: all shards in one store (merge_run)

Shard ``k`` holds a contiguous range of global sample ids, so the manifest maps global index
``g`` to the shard with ``start <= g < start + n_samples`` and local index ``g - start``.
Every shard is written by exactly one process (its own :class:`ZarrWriter`, published
atomically); ``write_manifest`` only runs once every shard is published, and refuses a run
with a missing or overlapping range. ``ZarrReader(run_dir)`` reads the shards in place.

Example:
    >>> shard_ranges(10, 3)
    [(0, 4), (4, 7), (7, 10)]
    >>> write_shards("runs/run_x", layout, producer, n_writers=2, attrs=attrs)  # doctest: +SKIP
    >>> merge_run("runs/run_x")  # doctest: +SKIP
    PosixPath('runs/run_x/merged/activations.zarr')
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import multiprocessing
import os
import shutil
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from ...batch import Batch
from ...errors import CaptureError, ConfigError, CorruptStoreError, StoreExistsError
from ...progress import bar_switch
from ...storage import atomic_write_json
from ...storage.local import atomic_write
from .layout import (
    ACTIVATIONS,
    CHUNKSUMS,
    CONFIG_FILE,
    PARTS,
    RUN_FORMAT_TAG,
    SCHEMA_VERSION,
    STATISTICS_FILE,
    STORE_NAME,
    TEXT_FILES,
    ZarrLayout,
    chunk_key,
    parse_chunk_key,
)
from .reader import MANIFEST, ZarrReader, open_store_info
from .store import RowAppender, create_arrays, new_partial_dir, publish, sample_arrays
from .writer import ZarrWriter, layout_attrs, truncation_attrs_from_counts

log = logging.getLogger(__name__)

SHARDS_DIR = "shards"
MERGED_DIR = "merged"

#: ``producer(start, stop)`` yields the batches of global samples ``start..stop-1`` in order.
Producer = Callable[[int, int], Iterable[Batch]]


def shard_ranges(n_samples: int, n_shards: int) -> list[tuple[int, int]]:
    """Split ``0..n_samples`` into ``n_shards`` contiguous ranges differing by at most one."""
    if n_shards < 1 or n_samples < n_shards:
        raise ConfigError(f"cannot split {n_samples} samples into {n_shards} non-empty shards")
    base, extra = divmod(n_samples, n_shards)
    out, start = [], 0
    for k in range(n_shards):
        stop = start + base + (1 if k < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def shard_path(run_dir: str | Path, index: int) -> Path:
    """``run_dir/shards/shard-XXXX.zarr``."""
    return Path(run_dir) / SHARDS_DIR / f"shard-{index:04d}.zarr"


def new_run_dir(root: str | Path) -> Path:
    """A new ``root/run_YYYYmmdd_HHMMSS`` directory (suffixed if that second is taken)."""
    root = Path(root).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("run_%Y%m%d_%H%M%S")
    for n in range(1000):
        path = root / (stamp if n == 0 else f"{stamp}_{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise StoreExistsError(f"could not create a fresh run directory under {root}")


def shard_writer(
    layout: ZarrLayout,
    run_dir: str | Path,
    index: int,
    n_shards: int,
    *,
    attrs: dict[str, Any],
    config: dict[str, Any] | None = None,
    token_ids: bool = False,
    optional: tuple[str, ...] = (),
) -> ZarrWriter:
    """The writer of shard ``index`` of ``n_shards`` for a run of ``layout.n_samples`` samples
    (the layout of the whole run). Batches carry global sample ids."""
    start, stop = shard_ranges(layout.n_samples, n_shards)[index]
    shard_attrs = {
        **attrs,
        "shard": {"index": index, "n_shards": n_shards, "start": start, "stop": stop},
    }
    return ZarrWriter(
        layout.with_samples(stop - start),
        shard_path(run_dir, index),
        attrs=shard_attrs,
        config=config,
        id_offset=start,
        token_ids=token_ids,
        optional=optional,
    )


@dataclass(frozen=True, kw_only=True)
class ShardJob:
    """Everything one writer process needs (pickled to it)."""

    layout: ZarrLayout
    run_dir: str
    index: int
    n_shards: int
    producer: Producer
    attrs: dict[str, Any]
    config: dict[str, Any] = field(default_factory=dict)
    token_ids: bool = False
    optional: tuple[str, ...] = ()


def run_shard_job(job: ShardJob) -> dict[str, Any]:
    """Write one shard from its producer; returns its path, sample count and write time.

    Runs in a writer process with one torch thread: the parallelism is the processes."""
    torch.set_num_threads(1)
    writer = shard_writer(
        job.layout,
        job.run_dir,
        job.index,
        job.n_shards,
        attrs=job.attrs,
        config=job.config,
        token_ids=job.token_ids,
        optional=job.optional,
    )
    start = writer.id_offset
    t0 = time.perf_counter()
    if not writer.complete:
        try:
            for batch in job.producer(start, start + writer.layout.n_samples):
                writer.write(batch)
            writer.close()
        except BaseException:
            writer.abort()
            raise
    return {
        "index": job.index,
        "path": str(writer.final_path),
        "pid": os.getpid(),
        "n_samples": writer.layout.n_samples,
        "seconds": time.perf_counter() - t0,
    }


def write_shards(
    run_dir: str | Path,
    layout: ZarrLayout,
    producer: Producer,
    *,
    n_writers: int,
    attrs: dict[str, Any],
    config: dict[str, Any] | None = None,
    token_ids: bool = False,
    optional: tuple[str, ...] = (),
    progress: bool = True,
) -> dict[str, Any]:
    """Write a run with ``n_writers`` processes, one shard each, then its manifest.

    ``producer`` must be picklable (processes are spawned); it runs in each writer process
    for that shard's range. Returns the manifest, with per-shard write times under
    ``"timings"`` (not stored).

    Example:
        >>> write_shards(run, layout, SyntheticBatches(...), n_writers=2, attrs=attrs)  # doctest: +SKIP
    """
    run_dir = Path(run_dir).expanduser()
    ranges = shard_ranges(layout.n_samples, n_writers)
    jobs = [
        ShardJob(
            layout=layout,
            run_dir=str(run_dir),
            index=k,
            n_shards=len(ranges),
            producer=producer,
            attrs=attrs,
            config=config or {},
            token_ids=token_ids,
            optional=optional,
        )
        for k in range(len(ranges))
    ]
    results = []
    context = multiprocessing.get_context("spawn")
    with (
        ProcessPoolExecutor(max_workers=n_writers, mp_context=context) as pool,
        tqdm(total=len(jobs), desc="shards", unit="shard", **bar_switch(progress)) as bar,
    ):
        futures = [pool.submit(run_shard_job, job) for job in jobs]
        for future in as_completed(futures):
            results.append(future.result())
            bar.update(1)
    manifest = write_manifest(run_dir)
    return {**manifest, "timings": sorted(results, key=lambda r: r["index"])}


def write_manifest(run_dir: str | Path) -> dict[str, Any]:
    """Check that the published shards of ``run_dir`` tile ``0..N`` and write manifest.json."""
    run_dir = Path(run_dir).expanduser()
    paths = sorted(p for p in (run_dir / SHARDS_DIR).glob("shard-*.zarr") if p.is_dir())
    if not paths:
        raise CaptureError(f"{run_dir / SHARDS_DIR} holds no published shard")
    infos = [open_store_info(p) for p in paths]
    declared = {info.attrs.get("shard", {}).get("n_shards") for info in infos}
    if len(declared) != 1 or None in declared:
        raise CorruptStoreError(f"shards of {run_dir} disagree on (or lack) their shard count")
    n_shards = declared.pop()
    by_index = {info.attrs["shard"]["index"]: info for info in infos}
    missing = [k for k in range(n_shards) if k not in by_index]
    if missing:
        raise CaptureError(
            f"{run_dir}: shards {missing} of {n_shards} are not published; rerun "
            "their writers, then write the manifest"
        )
    entries, start = [], 0
    first = by_index[0]
    for k in range(n_shards):
        info = by_index[k]
        if info.attrs["shard"]["start"] != start:
            raise CorruptStoreError(
                f"{info.path} starts at {info.attrs['shard']['start']}, "
                f"expected {start} (overlapping or missing samples)"
            )
        if not info.layout.same_bytes_as(first.layout):
            raise CorruptStoreError(f"{info.path} has another layout than {first.path}")
        entries.append(
            {
                "index": k,
                "path": str(info.path.relative_to(run_dir)),
                "start": start,
                "n_samples": info.n_samples,
            }
        )
        start += info.n_samples
    manifest = {
        "format": RUN_FORMAT_TAG,
        "schema_version": SCHEMA_VERSION,
        "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "n_samples": start,
        "model_id": first.attrs.get("model_id"),
        "sites": list(first.layout.sites),
        "layout": first.layout.with_samples(start).to_dict(),
        "mapping": "global index g is in the shard with start <= g < start + n_samples, at "
        "local index g - start",
        "shards": entries,
        "merged": None,
    }
    atomic_write_json(run_dir / MANIFEST, manifest)
    log.info("wrote %s: %d shards, %d samples", run_dir / MANIFEST, n_shards, start)
    return manifest


def merge_run(
    run_dir: str | Path, dest: str | Path | None = None, *, progress: bool = True
) -> Path:
    """Merge the shards of a run into one store (default ``run_dir/merged/activations.zarr``).

    Chunking is preserved: activation chunk files are copied byte for byte under their new
    sample index; per-sample arrays, text and statistics are concatenated (statistics with
    the exact parallel merge); metadata is consolidated and the store published atomically.
    The manifest then names the merged store.
    """
    run_dir = Path(run_dir).expanduser()
    reader = ZarrReader(run_dir)
    if reader.manifest is None:
        raise ConfigError(f"{run_dir} is not a sharded run (no {MANIFEST})")
    dest = Path(dest).expanduser() if dest is not None else run_dir / MERGED_DIR / STORE_NAME
    if dest.exists():
        raise StoreExistsError(f"{dest} already exists; remove it to merge again")
    lay, stores = reader.layout, reader.stores
    first_group = reader.group(0)
    token_ids = "arrays/prompt_token_ids" in first_group
    optional = tuple(stores[0].attrs.get("optional_arrays", []))
    tmp = new_partial_dir(dest)
    try:
        root = create_arrays(tmp, lay, token_ids=token_ids, optional=optional)
        total = sum(_count_chunks(s) for s in stores)
        with tqdm(total=total, desc="merge", unit="chunk", **bar_switch(progress)) as bar:
            for store in stores:
                _copy_chunks(store, tmp, bar)
        for path in sample_arrays(lay, token_ids=token_ids, optional=optional):
            appender = RowAppender(root[path])
            for k, store in enumerate(stores):
                source = reader.group(k)[path]
                step = max(appender.rows, 1)
                for lo in range(0, store.n_samples, step):
                    appender.append(np.asarray(source[lo : lo + step]))
            appender.close()
        _merge_texts(stores, tmp)
        (tmp / "meta").mkdir(exist_ok=True)
        atomic_write_json(
            tmp / STATISTICS_FILE,
            {"sites": {site: reader.statistics(site).to_dict() for site in lay.sites}},
            indent=None,
        )
        if all(s.chunksums is not None for s in stores):
            for part in PARTS:
                with atomic_write(tmp / CHUNKSUMS[part]) as f:
                    np.save(f, np.concatenate([s.chunksums[part] for s in stores]))
        config_path = stores[0].path / CONFIG_FILE
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}
        config["merged_from"] = [str(s.path) for s in stores]
        atomic_write_json(tmp / CONFIG_FILE, config)
        attrs = {k: v for k, v in stores[0].attrs.items() if k != "shard"}
        counts = {
            p: sum(int(s.attrs.get(f"{p}_truncated_count", 0)) for s in stores) for p in PARTS
        }
        attrs.update(truncation_attrs_from_counts(counts, lay.n_samples))
        attrs.update(layout_attrs(lay))
        attrs.update(
            merged_from=str(run_dir),
            created_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        )
        root.attrs.update(attrs)
        publish(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    manifest = dict(reader.manifest)
    try:
        manifest["merged"] = str(dest.relative_to(run_dir))
    except ValueError:
        manifest["merged"] = str(dest)
    atomic_write_json(run_dir / MANIFEST, manifest)
    log.info("merged %d shards of %s into %s", len(stores), run_dir, dest)
    return dest


def _chunk_files(store: Any, part: str) -> Iterable[tuple[tuple[int, ...], str]]:
    directory = store.path / ACTIVATIONS[part]
    separator = store.separators[part]
    for dirpath, _, names in os.walk(directory):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), directory).replace(os.sep, "/")
            key = parse_chunk_key(rel, separator)
            if key is not None:
                yield key, os.path.join(dirpath, name)


def _count_chunks(store: Any) -> int:
    return sum(1 for part in PARTS for _ in _chunk_files(store, part))


def _copy_chunks(store: Any, tmp: Path, bar: Any) -> None:
    for part in PARTS:
        target = tmp / ACTIVATIONS[part]
        for (i, layer, c, h), source in _chunk_files(store, part):
            shutil.copyfile(source, target / chunk_key((store.offset + i, layer, c, h)))
            bar.update(1)


def _merge_texts(stores: list[Any], tmp: Path) -> None:
    for part in PARTS:
        sources = [s.path / TEXT_FILES[part] for s in stores]
        present = [p.exists() for p in sources]
        if not any(present):
            continue
        if not all(present):
            raise CorruptStoreError(f"only some shards have {TEXT_FILES[part]}; cannot merge")
        target = tmp / TEXT_FILES[part]
        target.parent.mkdir(exist_ok=True)
        with target.open("w", encoding="utf-8") as out:
            for store, source in zip(stores, sources):
                with source.open(encoding="utf-8") as f:
                    for line in f:
                        if line.strip():
                            record = json.loads(line)
                            record["i"] = store.offset + int(record["i"])
                            out.write(json.dumps(record, ensure_ascii=False) + "\n")
