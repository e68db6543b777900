"""Write a pkl.gz store, crash-safely and resumably; merge the stores of several machines.

Shards are pickled (protocol 5) through gzip into hidden temporary files, fsynced and
renamed to ``shard_{id:04d}.pkl.gz``; each finished shard is recorded, with the running
statistics so far, in a hidden progress file. ``metadata.json`` is written last, so a
reader never sees a store before every shard it lists is complete; the hidden
``.actstore-manifest.xxh128`` (digest of metadata.json) is written just before it. A
crashed capture rerun with the same configuration keeps the finished shards (re-checked
against their checksums) and resumes after them; a crash after publication leaves nothing
but the published store once rerun. The writer holds the store's lock
(:mod:`actstore.storage.lock`) from open to close; every step calls
:func:`actstore.faults.point` (crash tests).

Shard ``k`` (id ``k + 1``) always holds samples ``[k * S, (k + 1) * S)`` with ``S`` samples
per shard, so one machine's part of a distributed capture (``example_range``, starting
on a shard boundary) has the shards a single-machine capture would have;
:func:`merge_stores` links them into one directory under one merged ``metadata.json``.

Example:
    >>> w = PickleWriter(plan, "acts-pkl")  # doctest: +SKIP
    >>> for batch in batches: w.write(batch)  # doctest: +SKIP
    >>> w.close()  # doctest: +SKIP
    PosixPath('/abs/acts-pkl')
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import pickle
import shutil
import time
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from ...batch import Batch, CapturePlan
from ...errors import CaptureError, ConfigError, StoreExistsError
from ...faults import point
from ...stats import RunningStats, merge_all
from ...storage import (
    FileHasher,
    atomic_write_bytes,
    atomic_write_json,
    fsync_dir,
    hash_file,
    make_read_only,
    read_json,
)
from ...storage.lock import StoreLock
from ..base import WriterBase
from .layout import (
    MANIFEST,
    MAX_SHARD_BYTES,
    METADATA,
    MIN_SHARD_BYTES,
    PROGRESS,
    TEXT_PREVIEW_CHARS,
    VERSION,
    PickleMetadata,
    ShardInfo,
    distributed_config,
    extraction_config,
    is_shard_filename,
    layer_key,
    samples_per_shard_for,
    shard_filename,
    utc_now,
)
from .options import PickleOptions

log = logging.getLogger(__name__)

#: Pickle protocol of shards: 5 writes array buffers in one piece (Python >= 3.8 reads it).
PICKLE_PROTOCOL = 5


class _HashingWriter:
    """Write-only file wrapper that hashes what passes through (gzip writes into it)."""

    def __init__(self, raw) -> None:
        self.raw, self.hasher, self.size = raw, FileHasher("sha256"), 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.hasher.update(view)
        self.size += len(view)
        return self.raw.write(view)

    def flush(self) -> None:
        self.raw.flush()


class PickleWriter(WriterBase):
    """Writer of one pkl.gz store (or one machine's part: see the module docstring)."""

    #: Ask capture for each example's decoded text (the items' ``text_preview``).
    wants_texts = True

    def __init__(
        self,
        plan: CapturePlan,
        out: str | os.PathLike,
        options: PickleOptions | None = None,
        *,
        example_range: tuple[int, int] | None = None,
        machine_id: int = 0,
        total_machines: int = 1,
        samples_per_machine: int | None = None,
        break_lock: bool = False,
    ) -> None:
        options = options or PickleOptions()
        self.plan, self.options = plan, options
        self.out = Path(out).expanduser().resolve()
        self.samples_per_shard = options.samples_per_shard or samples_per_shard_for(
            plan, options.shard_mb
        )
        self.config = extraction_config(plan, self.samples_per_shard)
        start, stop = example_range if example_range is not None else (0, plan.n_examples)
        per_machine = samples_per_machine if samples_per_machine is not None else stop - start
        self._check_range(start, stop, machine_id, per_machine)
        self.example_range = (start, stop)
        self.machine_id = machine_id
        self.distributed = distributed_config(
            machine_id=machine_id,
            total_machines=total_machines,
            samples_per_machine=per_machine,
            example_range=(start, stop),
        )
        shard_bytes = (
            self.samples_per_shard * plan.tokens_per_example * plan.d_model * 4 * len(plan.sites)
        )
        if shard_bytes > MAX_SHARD_BYTES:
            raise ConfigError(
                f"{self.samples_per_shard} samples per shard make {shard_bytes / 1e9:.1f} GB "
                "shards; the spec caps shards at 2 GB: lower samples_per_shard or shard_mb"
            )
        if shard_bytes < MIN_SHARD_BYTES and plan.n_examples > self.samples_per_shard:
            log.info("shards of %.1f MB are below the spec's 10 MB minimum", shard_bytes / 1e6)
        self.complete = False
        self.resume_from = start
        self._shards: list[ShardInfo] = []
        self._stats = {layer: RunningStats(plan.d_model) for layer in plan.layers}
        self._elapsed = 0.0
        self._t0 = time.perf_counter()
        self._items: dict[str, list[dict[str, Any]]] = {}
        self._buffered = 0
        self._written = 0
        self._lock = StoreLock.acquire(self.out, break_lock=break_lock)
        try:
            self._open()
        except BaseException:
            self._lock.release()
            raise

    # ------------------------------------------------------------------ open / resume

    def _check_range(self, start: int, stop: int, machine_id: int, per_machine: int) -> None:
        n, per_shard = self.plan.n_examples, self.samples_per_shard
        if not 0 <= start < stop <= n:
            raise ConfigError(f"example range [{start}, {stop}) is empty or outside [0, {n})")
        if start % per_shard:
            raise ConfigError(
                f"a part must start on a shard boundary ({per_shard} samples per "
                f"shard); {start} is not one"
            )
        if machine_id * per_machine != start:
            raise ConfigError(
                f"machine {machine_id} with {per_machine} samples per machine starts at sample "
                f"{machine_id * per_machine}, not {start}: sample ids would not be unique"
            )

    def _open(self) -> None:
        meta = self.out / METADATA
        if meta.exists():
            if read_json(meta).get("extraction_config") != self.config:
                raise StoreExistsError(
                    f"{self.out} already holds a different pkl.gz store; move it away or "
                    "choose another output directory"
                )
            self._clean_after_publish()
            self.complete = True
            self.resume_from = self.example_range[1]
            self._lock.release()
            log.info("%s is already published; nothing to write", self.out)
            return
        self.out.mkdir(parents=True, exist_ok=True)
        progress = self.out / PROGRESS
        if progress.exists():
            self._resume(read_json(progress))
        elif any(not p.name.startswith(".") for p in self.out.iterdir()):
            raise ConfigError(
                f"{self.out} is not empty and holds no pkl.gz capture; give a new or empty "
                "output directory"
            )
        self._clean_unlisted()
        self._save_progress()
        point("pickle.opened")

    def _resume(self, progress: dict[str, Any]) -> None:
        if (
            progress.get("extraction_config") != self.config
            or progress.get("distributed_config") != self.distributed
        ):
            raise StoreExistsError(
                f"{self.out} holds an unfinished capture with another configuration; delete "
                "it or choose another output directory"
            )
        shards = [ShardInfo.from_dict(s) for s in progress.get("shards", [])]
        for info in shards:
            path = self.out / info.filename
            if (
                not path.exists()
                or path.stat().st_size != info.size_bytes
                or (hash_file(path) != info.sha256)
            ):
                log.warning("%s is missing or damaged; restarting this capture from scratch", path)
                return
        self._shards = shards
        self._stats = {
            int(k): RunningStats.from_dict(v) for k, v in progress.get("stats", {}).items()
        }
        self._elapsed = float(progress.get("elapsed_s", 0.0))
        self.resume_from = self.example_range[0] + sum(s.num_samples for s in shards)
        log.info(
            "resuming %s: %d finished shards (%d samples) kept",
            self.out,
            len(shards),
            self.resume_from - self.example_range[0],
        )

    def _clean_unlisted(self) -> None:
        """Remove shard files and temporaries the progress record does not list."""
        keep = {s.filename for s in self._shards}
        for child in self.out.iterdir():
            ours = is_shard_filename(child.name) or _is_temporary(child.name)
            if ours and child.name not in keep:
                child.unlink()

    def _clean_after_publish(self) -> None:
        """Remove what a crash between publishing and cleaning up left (we hold the lock)."""
        for child in self.out.iterdir():
            if child.name == PROGRESS or _is_temporary(child.name):
                child.unlink()

    def _save_progress(self) -> None:
        atomic_write_json(
            self.out / PROGRESS,
            {
                "extraction_config": self.config,
                "distributed_config": self.distributed,
                "shards": [s.to_dict() for s in self._shards],
                "stats": {str(k): v.to_dict() for k, v in self._stats.items()},
                "elapsed_s": self._elapsed + time.perf_counter() - self._t0,
            },
            indent=None,
        )

    # ------------------------------------------------------------------ writing

    def write(self, batch: Batch) -> None:
        """Append ``batch``'s examples (those not already stored) in order."""
        if self.complete:
            raise CaptureError(f"{self.out} is already published")
        start = self.resume_from + self._written
        keep = batch.example_ids >= start
        if not keep.all():
            batch = batch.select(keep)
        if batch.n_examples == 0:
            return
        ids = batch.example_ids
        if not np.array_equal(ids, np.arange(start, start + len(ids))):
            raise CaptureError(
                f"batches must arrive in example order: expected ids from "
                f"{start}, got {ids[:4].tolist()}..."
            )
        if ids[-1] >= self.example_range[1]:
            raise CaptureError(
                f"example {ids[-1]} is beyond {self.example_range[1]}, the end of "
                "what this writer holds"
            )
        acts = {}
        for layer in self.plan.layers:
            tensor = batch.acts.get(f"resid.{layer}")
            if tensor is None:
                raise CaptureError(f"batch lacks site resid.{layer}; it has {sorted(batch.acts)}")
            acts[layer] = np.ascontiguousarray(tensor.to(torch.float32).numpy())
        per_machine = self.distributed["samples_per_machine"]
        for i, example in enumerate(ids.tolist()):
            meta: dict[str, Any] = {
                "token_count": int(batch.token_mask[i].sum())
                if batch.token_mask is not None
                else int(acts[self.plan.layers[0]].shape[1]),
                "dataset_idx": example,
                "machine_id": self.machine_id,
            }
            if batch.token_ids is not None:
                meta["token_ids"] = np.ascontiguousarray(batch.token_ids[i], dtype=np.int32)
            if batch.labels is not None:
                meta["label"] = int(batch.labels[i])
            text = batch.texts[i][:TEXT_PREVIEW_CHARS] if batch.texts is not None else ""
            local = example - self.example_range[0]
            for layer, array in acts.items():
                self._items.setdefault(layer_key(layer), []).append(
                    {
                        "sample_idx": self.machine_id * per_machine + local,
                        "activation": array[i],
                        "shape": tuple(array[i].shape),
                        "text_preview": text,
                        "metadata": meta,
                    }
                )
            self._buffered += 1
            if (example + 1) % self.samples_per_shard == 0:
                self._flush()
        self._written += len(ids)

    def _flush(self) -> None:
        """Pickle the buffered samples as the next shard; record it with the statistics."""
        items = self._items
        first = items[layer_key(self.plan.layers[0])][0]["sample_idx"]
        last = items[layer_key(self.plan.layers[0])][-1]["sample_idx"]
        shard_id = first // self.samples_per_shard + 1
        name = shard_filename(shard_id, self.options.compress)
        tmp = self.out / f".{name}.tmp"
        with open(tmp, "wb") as raw:
            sink = _HashingWriter(raw)
            if self.options.compress:
                with gzip.GzipFile(
                    filename="",
                    mode="wb",
                    fileobj=sink,
                    compresslevel=self.options.compresslevel,
                    mtime=0,
                ) as gz:
                    pickle.dump(items, gz, protocol=PICKLE_PROTOCOL)
            else:
                pickle.dump(items, sink, protocol=PICKLE_PROTOCOL)
            raw.flush()
            point("pickle.shard_written")
            os.fsync(raw.fileno())
        os.replace(tmp, self.out / name)
        fsync_dir(self.out)
        point("pickle.shard_renamed")
        n_tokens = 0
        for layer in self.plan.layers:
            rows = [item["activation"] for item in items[layer_key(layer)]]
            self._stats[layer].update(np.concatenate(rows))
            n_tokens = sum(r.shape[0] for r in rows)
        self._shards.append(
            ShardInfo(
                shard_id=shard_id,
                filename=name,
                size_bytes=sink.size,
                num_samples=self._buffered,
                layers=tuple(self.plan.layers),
                sample_id_range=(first, last),
                compressed=self.options.compress,
                checksum=f"sha256:{sink.hasher.hexdigest()}",
                num_tokens=n_tokens,
            )
        )
        self._items, self._buffered = {}, 0
        self._save_progress()
        point("pickle.shard_recorded")

    def sealed_files(self) -> list[tuple[str, Path]]:
        """Every finished shard (recorded in the progress file, never rewritten)."""
        if self.complete:
            return []
        return [(s.filename, self.out / s.filename) for s in self._shards]

    # ------------------------------------------------------------------ publish

    def metadata(self) -> PickleMetadata:
        """The ``metadata.json`` the finished shards make."""
        return PickleMetadata(
            version=VERSION,
            created_at=utc_now(),
            extraction_config=self.config,
            distributed_config=self.distributed,
            shards=tuple(self._shards),
            statistics=_statistics(
                self._shards,
                self.plan.layers,
                self._stats,
                self._elapsed + time.perf_counter() - self._t0,
            ),
        )

    def close(self) -> Path:
        """Write the last shard, then ``metadata.json`` (which publishes the store)."""
        if self.complete:
            return self.out
        if self._buffered:
            self._flush()
        total = sum(s.num_samples for s in self._shards)
        start, stop = self.example_range
        if total != stop - start:
            raise CaptureError(
                f"only {total} of {stop - start} samples were written; rerun the "
                f"same capture to resume in {self.out}"
            )
        _publish_metadata(self.out, self.metadata().to_json_dict())
        point("pickle.published")
        (self.out / PROGRESS).unlink()
        fsync_dir(self.out)
        point("pickle.progress_removed")
        make_read_only(self.out)
        self._lock.release()
        self.complete = True
        log.info("published %s (%d shards, %d samples)", self.out, len(self._shards), total)
        return self.out

    def abort(self) -> None:
        """Drop the unfinished shard; finished shards stay for a resume."""
        self._items, self._buffered = {}, 0
        self._lock.release()


def _is_temporary(name: str) -> bool:
    """A temporary file of this writer or of :func:`atomic_write` (hidden, ``.tmp``)."""
    return name.startswith(".") and name.endswith(".tmp")


def _publish_metadata(out: Path, doc: dict[str, Any]) -> None:
    """Write the manifest (digest of the metadata), then metadata.json: the publication."""
    data = (json.dumps(doc, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    digest = xxhash.xxh3_128_hexdigest(data)
    atomic_write_bytes(out / MANIFEST, f"{digest}  {METADATA}\n".encode())
    point("pickle.manifest_written")
    atomic_write_bytes(out / METADATA, data)


def _statistics(
    shards: Sequence[ShardInfo],
    layers: Sequence[int],
    stats: dict[int, RunningStats],
    seconds: float,
) -> dict[str, Any]:
    return {
        "total_shards": len(shards),
        "total_samples": sum(s.num_samples for s in shards),
        "total_size_bytes": sum(s.size_bytes for s in shards),
        "layers_extracted": list(layers),
        "extraction_duration_seconds": round(seconds, 3),
        "activation_statistics": {layer_key(k): stats[k].to_dict() for k in layers if k in stats},
    }


# ---------------------------------------------------------------------- merging machines


def merge_stores(stores: Sequence[str | os.PathLike], out: str | os.PathLike) -> Path:
    """Merge the pkl.gz stores several machines wrote into one store at ``out``.

    The machines' metadata files are merged into one ``metadata.json`` (shards renumbered
    ``1..n`` in sample id order, statistics merged exactly, ``distributed_config`` listing
    every machine); shard files are hard-linked (copied across file systems), never
    rewritten. Sample ids must be unique across machines, and the stores must come from the
    same extraction (same ``extraction_config``).

    Example:
        >>> merge_stores(["run/machine_0", "run/machine_1"], "run/merged")  # doctest: +SKIP
    """
    from .reader import PickleReader

    readers = [PickleReader(s) for s in stores]
    if not readers:
        raise ConfigError("merge_stores needs at least one store")
    config = readers[0].metadata.extraction_config
    for r in readers[1:]:
        if r.metadata.extraction_config != config:
            raise ConfigError(
                f"{r.path} comes from a different extraction than "
                f"{readers[0].path} (extraction_config differs)"
            )
    entries = sorted(
        ((s, r) for r in readers for s in r.metadata.shards),
        key=lambda pair: pair[0].sample_id_range,
    )
    for (a, ra), (b, rb) in pairwise(entries):
        if b.sample_id_range[0] <= a.sample_id_range[1]:
            raise ConfigError(
                f"{ra.path / a.filename} and {rb.path / b.filename} hold overlapping sample ids "
                f"({list(a.sample_id_range)}, {list(b.sample_id_range)}): these machines did "
                "not use distinct machine ids, or a slice was captured twice"
            )
    out = Path(out).expanduser().resolve()
    if (out / METADATA).exists():
        raise StoreExistsError(f"{out} already holds a store; refusing to overwrite it")
    out.mkdir(parents=True, exist_ok=True)
    if any(not p.name.startswith(".") and not is_shard_filename(p.name) for p in out.iterdir()):
        raise ConfigError(f"{out} holds other files; merge into a new or empty directory")
    shards = []
    for new_id, (info, reader) in enumerate(entries, start=1):
        name = shard_filename(new_id, info.compressed)
        target = out / name
        if target.exists():
            target.unlink()
        try:
            os.link(reader.path / info.filename, target)
        except OSError:
            shutil.copyfile(reader.path / info.filename, target)
        shards.append(ShardInfo(**{**info.__dict__, "shard_id": new_id, "filename": name}))
    listed = {s.filename for s in shards}
    for child in out.iterdir():  # left by an interrupted merge of other stores
        if is_shard_filename(child.name) and child.name not in listed:
            child.unlink()
    layers = readers[0].metadata.layers
    by_start = sorted(
        readers, key=lambda r: min((s.sample_id_range[0] for s in r.metadata.shards), default=0)
    )
    parts = {layer: [r.statistics(layer) for r in by_start] for layer in layers}
    stats = {layer: merge_all(p) for layer, p in parts.items() if None not in p}
    seconds = max(
        float(r.metadata.statistics.get("extraction_duration_seconds", 0.0)) for r in readers
    )
    first = by_start[0].metadata.distributed_config
    merged = PickleMetadata(
        version=VERSION,
        created_at=utc_now(),
        extraction_config=config,
        distributed_config={
            "machine_id": None,
            "total_machines": first.get("total_machines", len(readers)),
            "multihost": False,
            "num_hosts": len(readers),
            "mesh_type": first.get("mesh_type", "1d"),
            "samples_per_machine": first.get("samples_per_machine"),
            "machines": [
                {
                    "machine_id": r.metadata.distributed_config.get("machine_id"),
                    "example_range": r.metadata.distributed_config.get("example_range"),
                    "num_samples": r.metadata.n_samples,
                    "created_at": r.metadata.created_at,
                }
                for r in by_start
            ],
        },
        shards=tuple(shards),
        statistics=_statistics(shards, layers, stats, seconds),
    )
    _publish_metadata(out, merged.to_json_dict())
    make_read_only(out)
    log.info("merged %d machines' stores into %s (%d shards)", len(readers), out, len(shards))
    return out
