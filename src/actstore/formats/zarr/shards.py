"""Sharded runs: parallel writer processes, the manifest, and the optional merge.

Layout of a run (the spec's "sharded write layout")::

    run_YYYYmmdd_HHMMSS/
      shards/shard-0000.zarr/   a complete, published store of samples [start_0, start_1)
      shards/shard-0001.zarr/   ...
      manifest.json             global index -> (shard, local index)
      actstore-manifest.json    the run's root manifest (manifest.json's digest)
      merged/activations.zarr/  optional: all shards in one store (merge_run)

Shard ``k`` holds a contiguous range of global sample ids, so the manifest maps global index
``g`` to the shard with ``start <= g < start + n_samples`` and local index ``g - start``.
Every shard is written by exactly one process (its own :class:`ZarrWriter`, published
atomically with its own root manifest); ``write_manifest`` only runs once every shard is
published, and refuses a run with a missing or overlapping range. ``ZarrReader(run_dir)``
reads the shards in place.

Example:
    >>> shard_ranges(10, 3)
    [(0, 4), (4, 7), (7, 10)]
    >>> write_shards("runs/run_x", plan, producer, n_writers=2)  # doctest: +SKIP
    >>> merge_run("runs/run_x")  # doctest: +SKIP
    PosixPath('runs/run_x/merged/activations.zarr')
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from ...batch import Batch, CapturePlan
from ...errors import CaptureError, ConfigError, CorruptStoreError
from ...progress import bar_switch
from ...storage import atomic_write_json
from ...storage.location import Location
from ...storage.manifest import ManifestBuilder
from .layout import (  # noqa: F401 - SHARDS_DIR, shard_ranges, shard_path re-exported
    RUN_FORMAT_TAG,
    SCHEMA_VERSION,
    SHARDS_DIR,
    STORE_NAME,
    shard_path,
    shard_ranges,
)
from .options import ZarrOptions
from .writer import ZarrWriter

if TYPE_CHECKING:
    import torch
else:
    from ..._lazy import torch

log = logging.getLogger(__name__)

MERGED_DIR = "merged"
MANIFEST = "manifest.json"

#: ``producer(start, stop)`` yields the batches of global samples ``start..stop-1`` in order.
Producer = Callable[[int, int], Iterable[Batch]]


@dataclass(frozen=True, kw_only=True)
class ShardJob:
    """Everything one writer process needs (pickled to it)."""

    plan: CapturePlan
    options: ZarrOptions
    run_dir: str
    index: int
    n_shards: int
    producer: Producer


def run_shard_job(job: ShardJob) -> dict[str, Any]:
    """Write one shard from its producer; returns its path, sample count and write time.

    Runs in a writer process with one torch thread: the parallelism is the processes."""
    torch.set_num_threads(1)
    writer = ZarrWriter.for_shard(job.plan, job.run_dir, job.index, job.n_shards, job.options)
    start, stop = writer.example_range
    t0 = time.perf_counter()
    if not writer.complete:
        try:
            for batch in job.producer(start, stop):
                writer.write(batch)
            writer.close()
        except BaseException:
            writer.abort()
            raise
    return {
        "index": job.index,
        "path": str(writer.final),
        "pid": os.getpid(),
        "n_samples": stop - start,
        "seconds": time.perf_counter() - t0,
    }


def write_shards(
    run_dir: str | os.PathLike,
    plan: CapturePlan,
    producer: Producer,
    *,
    n_writers: int,
    options: ZarrOptions | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Write a run of ``plan`` with ``n_writers`` processes, one shard each, then its
    manifest. ``producer`` must be picklable (processes are spawned); it runs in each writer
    process for that shard's range. Returns the manifest, with per-shard write times under
    ``"timings"`` (not stored).

    Example:
        >>> write_shards(run_dir, plan, producer, n_writers=2)  # doctest: +SKIP
    """
    run_dir = Path(run_dir).expanduser()
    ranges = shard_ranges(plan.n_examples, n_writers)
    jobs = [
        ShardJob(
            plan=plan,
            options=options or ZarrOptions(),
            run_dir=str(run_dir),
            index=k,
            n_shards=len(ranges),
            producer=producer,
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


def write_manifest(run_dir: str | os.PathLike) -> dict[str, Any]:
    """Check that the published shards of ``run_dir`` tile ``0..N`` and write manifest.json
    and the run's root manifest."""
    from .reader import ZarrReader

    run_dir = Path(run_dir).expanduser()
    paths = sorted(p for p in (run_dir / SHARDS_DIR).glob("shard-*.zarr") if p.is_dir())
    if not paths:
        raise CaptureError(f"{run_dir / SHARDS_DIR} holds no published shard")
    readers = [ZarrReader(p) for p in paths]
    declared = {r.attrs.get("shard", {}).get("n_shards") for r in readers}
    if len(declared) != 1 or None in declared:
        raise CorruptStoreError(f"shards of {run_dir} disagree on (or lack) their shard count")
    n_shards = declared.pop()
    try:
        by_index = {int(r.attrs["shard"]["index"]): r for r in readers}
        starts = {k: int(r.attrs["shard"]["start"]) for k, r in by_index.items()}
    except (KeyError, TypeError, ValueError) as err:
        raise CorruptStoreError(
            f"a shard of {run_dir} has a malformed shard record ({err!r}); re-capture it"
        ) from None
    missing = [k for k in range(n_shards) if k not in by_index]
    if missing:
        raise CaptureError(
            f"{run_dir}: shards {missing} of {n_shards} are not published; rerun "
            "their writers, then write the manifest"
        )
    entries, start = [], 0
    first = by_index[0]
    for k in range(n_shards):
        reader = by_index[k]
        if starts[k] != start:
            raise CorruptStoreError(
                f"{reader.url} starts at {starts[k]}, "
                f"expected {start} (overlapping or missing samples)"
            )
        if not reader.layout.same_bytes_as(first.layout):
            raise CorruptStoreError(f"{reader.url} has another layout than {first.url}")
        entries.append(
            {
                "index": k,
                "path": f"{SHARDS_DIR}/{Path(reader.url).name}",
                "start": start,
                "n_samples": reader.n_samples,
            }
        )
        start += reader.n_samples
    manifest = {
        "format": RUN_FORMAT_TAG,
        "schema_version": SCHEMA_VERSION,
        "created_at": first.attrs.get("created_at"),
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
    _write_run_manifest(run_dir, first)
    log.info("wrote %s: %d shards, %d samples", run_dir / MANIFEST, n_shards, start)
    return manifest


def _write_run_manifest(run_dir: Path, first: Any) -> None:
    """The run's root manifest: ``manifest.json`` (each shard has its own)."""
    record = {"run": first.attrs.get("fingerprint")}
    builder = ManifestBuilder(format="zarr", store_id=first.checks.manifest.store_id, record=record)
    builder.add_file(run_dir, MANIFEST)
    builder.nested = [f"{SHARDS_DIR}/", f"{MERGED_DIR}/"]
    builder.write(run_dir, summary={"run": True})


def merge_run(
    run_dir: str | os.PathLike, dest: str | os.PathLike | None = None, *, progress: bool = True
) -> Path:
    """Merge the shards of a run into one store (default ``run_dir/merged/activations.zarr``),
    written as one capture of every sample would be: each sample re-encoded through a
    :class:`ZarrWriter` (float16 values exact), its statistics folded by that writer from
    the same rows, so they are bit-identical to a one-process capture's (and ``verify``
    recomputes them exactly). The manifest then names the merged store.

    A merge cut short is finished by running it again: a merged store already published
    for this run is kept (its writer recognises its own capture record) and only the
    manifest is updated; ``dest`` holding anything else is refused."""
    from .reader import ZarrReader

    run_dir = Path(run_dir).expanduser()
    reader = ZarrReader(run_dir)
    if reader.manifest is None:
        raise ConfigError(f"{run_dir} is not a sharded run (no {MANIFEST})")
    dest = Path(dest).expanduser() if dest is not None else run_dir / MERGED_DIR / STORE_NAME
    plan = reader.capture_plan()
    options = ZarrOptions(**reader.config.get("options", {}))
    store = Location.parse(dest)
    writer = ZarrWriter(plan, store.parent, options, store=store)
    n = reader.n_samples
    if writer.complete:  # published by an earlier merge cut short before the manifest
        log.info("%s is already merged; updating %s", dest, run_dir / MANIFEST)
    else:
        with tqdm(total=n, desc="merge", unit="sample", **bar_switch(progress)) as bar:
            try:
                for batch in reader.example_batches(plan.batch_size):
                    writer.write(batch)
                    bar.update(batch.n_examples)
                writer.close()
            except BaseException:
                writer.abort()
                raise
    manifest = dict(reader.manifest)
    try:
        manifest["merged"] = str(dest.relative_to(run_dir))
    except ValueError:
        manifest["merged"] = str(dest)
    atomic_write_json(run_dir / MANIFEST, manifest)
    _write_run_manifest(run_dir, reader.stores[0])
    log.info("merged %d shards of %s into %s", len(reader.stores_paths), run_dir, dest)
    return dest
