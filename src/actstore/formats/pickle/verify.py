"""``verify`` of a pkl.gz store: every shard decoded and checked, the statistics' totals
against the shards, and, for a store actstore wrote, every field of ``metadata.json`` the
writer derives from the data (:class:`PickleVerify`)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np

from ...errors import CorruptStoreError, UnsafeDataError
from ..report import VerifyReport
from .layout import (
    METADATA,
    VERSION,
    distributed_config,
    is_shard_filename,
    layer_key,
    shard_filename,
)
from .shards import PickleShards


class PickleVerify(PickleShards):
    """``verify`` of a pkl.gz store."""

    def verify(self, *, progress: Callable[[int], None] | None = None) -> VerifyReport:
        """Every file against the root manifest, then every shard decoded: checksum, safe
        unpickling, structure, NaN/Inf values, and the statistics' totals against the
        shards. ``progress(n_bytes)`` as data is read."""
        report = VerifyReport(self.url)
        n_files, n_bytes = self.checks.verify(report.faults, progress=None)
        listed = {s.filename for s in self.shards}
        for name in sorted(self.files.list()):
            if is_shard_filename(name) and name not in listed:
                report.faults.append(f"{name} is not listed in {METADATA}")
        non_finite = 0
        held: dict[int, tuple[list[int], list[Any]]] = {}  # shard -> sample ids, machine ids
        for index, info in enumerate(self.shards):
            self._cache.pop(index, None)
            try:
                data = self.load_shard(index, progress=progress)
            except (CorruptStoreError, UnsafeDataError) as err:
                report.faults.append(str(err))
                continue
            first = data[layer_key(info.layers[0])] if info.layers else []
            held[index] = (
                [int(item["sample_idx"]) for item in first],
                [(item.get("metadata") or {}).get("machine_id") for item in first],
            )
            for layer in info.layers:
                for item in data[layer_key(layer)]:
                    non_finite += int(
                        item["activation"].size - np.count_nonzero(np.isfinite(item["activation"]))
                    )
        report.files_checked, report.bytes_checked = max(n_files, len(self.shards)), n_bytes
        totals = self.metadata.statistics
        if totals.get("total_samples", self.n_examples) != self.n_examples:
            report.faults.append(
                f"statistics.total_samples is {totals['total_samples']} but the "
                f"shards hold {self.n_examples} samples"
            )
        for layer in self.layers:
            stats = self.statistics(layer) if self._has_stats(layer, report) else None
            rows = sum(self.shard_rows(i) for i, s in enumerate(self.shards) if layer in s.layers)
            if stats is not None and (stats.count != rows or stats.d != self.d_model):
                report.faults.append(
                    f"statistics of layer {layer} count {stats.count} rows of width "
                    f"{stats.d}; the shards hold {rows} of {self.d_model}"
                )
        for key, want in (
            ("total_shards", len(self.shards)),
            ("total_size_bytes", sum(s.size_bytes for s in self.shards)),
        ):
            if key in totals and totals[key] != want:
                report.faults.append(f"statistics.{key} is {totals[key]}, the store has {want}")
        if non_finite:
            report.notes.append(f"{non_finite} activation values are NaN or infinite")
        if self.metadata.actstore and len(held) == len(self.shards):
            report.faults += [f"{METADATA}: {f}" for f in self._metadata_faults(held)]
        self.verify_statistics(report)
        self.verify_record(report)
        return report

    def _metadata_faults(self, held: dict[int, tuple[list[int], list[Any]]]) -> list[str]:
        """What ``metadata.json`` says of the shards, against the shards (``held``: each
        shard's sample ids and items' machine ids, as decoded): every field actstore's
        writer derives from the data (shard entries, distributed_config, the statistics'
        totals), for a store actstore wrote. Only the creation time and the extraction
        duration are not derived from the data; they must be a time and a number."""
        md, faults = self.metadata, []
        edited = "the metadata was edited; restore it or re-capture"
        if md.version != VERSION:
            faults.append(f"version is {md.version!r}; actstore writes {VERSION!r}: {edited}")
        if not re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", md.created_at):
            faults.append(f"created_at {md.created_at!r} is not a UTC time: {edited}")
        for index, info in enumerate(self.shards):
            ids = held[index][0]
            if info.filename != shard_filename(info.shard_id, info.compressed):
                faults.append(
                    f"shard entry {info.shard_id} names {info.filename!r}, not "
                    f"{shard_filename(info.shard_id, info.compressed)!r}: {edited}"
                )
            if ids and list(info.sample_id_range) != [min(ids), max(ids)]:
                faults.append(
                    f"shard {info.filename} declares sample ids {list(info.sample_id_range)}; "
                    f"it holds {min(ids)}..{max(ids)}: {edited}"
                )
        faults += self._distributed_faults(held, edited)
        totals = md.statistics
        want = {
            "total_shards": len(self.shards),
            "total_samples": md.n_samples,
            "total_size_bytes": sum(s.size_bytes for s in self.shards),
            "layers_extracted": list(md.layers),
        }
        for key, value in want.items():
            if key not in totals or totals[key] != value:
                faults.append(f"statistics.{key} is {totals.get(key)!r}, the store has {value}")
        seconds = totals.get("extraction_duration_seconds")
        if not (
            isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and 0 <= seconds
        ):
            faults.append(f"statistics.extraction_duration_seconds {seconds!r} is not a duration")
        return list(dict.fromkeys(faults))

    def _distributed_faults(
        self, held: dict[int, tuple[list[int], list[Any]]], edited: str
    ) -> list[str]:
        """``distributed_config`` against the shards: the example range they hold and the
        machine each item says wrote it."""
        dist = self.metadata.distributed_config
        by_machine: dict[Any, list[int]] = {}
        for ids, machines in held.values():
            for i, m in zip(ids, machines):
                by_machine.setdefault(m, []).append(i)
        if "machines" not in dist:
            lo = min((min(ids) for ids, _ in held.values() if ids), default=0)
            hi = max((max(ids) + 1 for ids, _ in held.values() if ids), default=0)
            machine, per = dist.get("machine_id"), dist.get("samples_per_machine")
            want = distributed_config(
                machine_id=machine if isinstance(machine, int) else -1,
                total_machines=dist.get("total_machines"),  # type: ignore[arg-type]
                samples_per_machine=per,  # type: ignore[arg-type]
                example_range=(lo, hi),
            )
            faults = []
            if dist != want or set(by_machine) != {machine}:
                faults.append(
                    f"distributed_config {dist} does not describe the shards (machine "
                    f"{sorted(by_machine, key=str)} wrote samples {lo}..{hi - 1}): {edited}"
                )
            elif not (
                isinstance(per, int)
                and isinstance(machine, int)
                and isinstance(dist.get("total_machines"), int)
                and machine * per == lo
                and hi == min(lo + per, md_examples(self))
                and machine < dist["total_machines"]
                and dist["total_machines"] * per >= md_examples(self)
            ):
                faults.append(
                    f"distributed_config: machine {machine} of {dist['total_machines']} with "
                    f"{per} samples per machine cannot hold samples {lo}..{hi - 1}: {edited}"
                )
            return faults
        want_machines = [
            {
                "machine_id": m,
                "example_range": [min(ids), max(ids) + 1],
                "num_samples": len(ids),
            }
            for m, ids in sorted(by_machine.items(), key=lambda kv: str(kv[0]))
        ]
        expected = {
            "machine_id": None,
            "total_machines": len(by_machine),
            "multihost": False,
            "num_hosts": len(by_machine),
            "mesh_type": "1d",
            "samples_per_machine": dist.get("samples_per_machine"),
            "machines": want_machines,
        }
        if dist != expected:
            return [f"distributed_config does not describe the merged shards: {edited}"]
        return []

    def _has_stats(self, layer: int, report: VerifyReport) -> bool:
        try:
            stats = self.statistics(layer)
        except CorruptStoreError as err:
            report.faults.append(f"statistics of layer {layer}: {err}")
            return False
        if stats is not None and (stats.mean.shape != (stats.d,) or stats.m2.shape != (stats.d,)):
            report.faults.append(f"statistics of layer {layer} have vectors of the wrong length")
            return False
        return stats is not None


def md_examples(reader: PickleShards) -> int:
    """Examples of the whole capture a store (or one machine's part of it) belongs to."""
    return int(reader.metadata.actstore.get("n_examples") or 0)
