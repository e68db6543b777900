"""What ``verify`` checks of an Activault run beyond its files' bytes: ``cfg.json``
against its commit record and its files, and each hook's statistics recomputed from its
megabatch files the writer's way.

A run actstore wrote is named by its capture record: the store id is the digest of the
record's identity (hooks, shapes, dtype, capture plan), the run id derives from the store
id, and ``cfg.json`` records the keyed digest of every committed file. So a ``cfg.json``
whose record was edited (hooks remapped or reordered, digests removed or changed) no
longer gives the manifest's store id or the files' digests, and hook folders swapped
give files whose digests are not the ones recorded for their hook, even when the root
manifest was rewritten over the edit (without ``ACTSTORE_MANIFEST_KEY``).

:class:`ActivaultVerify` is the reader's ``verify``: every file against the root manifest,
each megabatch decoded as it is read, then these checks.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from ...errors import ConfigError, CorruptStoreError
from ...sites import Site
from ...stats import RunningStats, merge_all
from ...storage.manifest import store_id_of
from ...storage.object import base_name
from ..recompute import compare_statistics
from ..report import VerifyReport
from ..wholefiles import statistics_of
from .examples import ActivaultExamples
from .fetch import check_megabatch
from .layout import (
    STATISTICS,
    data_file_name,
    group_uuid,
    hook_site,
    load_megabatch,
    parse_data_file,
)
from .metadata import DIGESTS_SINCE, RunRecord, run_cfg, statistics_to_dict
from .positions import POSITIONS

if TYPE_CHECKING:
    import torch

    from ...storage.manifest import RootManifest
else:
    from ..._lazy import torch


def one_process_run_id(store_id: str) -> str:
    """The run id an uninterrupted capture with ``store_id`` gives (a run merged from
    parts has another: :mod:`.parts`)."""
    return str(uuid.UUID(hex=xxhash.xxh3_128_hexdigest(store_id.encode())))


def file_statistics(states: torch.Tensor) -> RunningStats:
    """One megabatch file's statistics, as the writer folds them (merged in group order)."""
    return statistics_of(states)


def merged_statistics(per_file: dict[int, RunningStats], n_files: int) -> RunningStats | None:
    """The files' statistics merged in group order, as the writer stores them; None when a
    file could not be decoded (its fault is listed)."""
    if n_files == 0 or any(i not in per_file for i in range(n_files)):
        return None
    return merge_all([per_file[i] for i in range(n_files)])


def check_statistics(
    faults: list[str],
    where: str,
    hook: str,
    stored: RunningStats | None,
    recomputed: RunningStats,
    *,
    merged: bool,
    record: Any = None,
) -> None:
    """Bit for bit for a run captured in one process (the whole ``statistics.json``
    ``record``, its ``std`` and ``norm`` included); a run merged from parts merged its
    parts' totals, whose bounds it does not keep: compared up to
    :data:`~actstore.formats.recompute.MERGE_ORDER_RTOL`."""
    compare_statistics(
        faults,
        where,
        hook,
        stored,
        recomputed,
        exact=not merged,
        record=record,
        to_record=statistics_to_dict,
    )


def record_faults(
    cfg: dict[str, Any], record: RunRecord, manifest: RootManifest, hooks: list[str]
) -> list[str]:
    """Every way ``cfg.json`` (``cfg``, with its commit ``record``) disagrees with the run's
    root manifest (its store id and each file's keyed digest) and with itself."""
    faults: list[str] = []
    identity = {
        "hooks": record.hooks,
        "rows_per_file": record.rows_per_file,
        "sequence_length": record.sequence_length,
        "dtype": record.dtype,
        "plan": record.plan,
    }
    if store_id_of(identity) != manifest.store_id:
        faults.append(
            "cfg.json: its commit record (hooks, shapes, dtype, capture plan) is not the one "
            f"the run was published with (store id {store_id_of(identity)}, the manifest's "
            f"{manifest.store_id}): cfg.json was edited; restore it or capture again"
        )
    faults += _site_faults(record)
    if record.complete and record.version >= DIGESTS_SINCE:
        faults += _digest_faults(record, manifest, hooks)
    faults += _cfg_faults(cfg, record)
    return faults


def _site_faults(record: RunRecord) -> list[str]:
    """Each hook folder's site (its name says it) against the site the record maps it to,
    and the record's sites against the capture plan's, in order."""
    faults = []
    try:
        mapped = {h: Site.parse(s) for h, s in record.hooks.items()}
        planned = [Site.parse(s) for s in record.plan.get("sites", [])]
    except (ConfigError, TypeError, ValueError) as err:
        return [f"cfg.json: the commit record's sites are malformed ({err})"]
    for hook, site in mapped.items():
        named = hook_site(hook)
        if named is not None and named != site:
            faults.append(
                f"cfg.json maps hook folder {hook} to {site}, but the folder holds {named}: "
                "cfg.json was edited; restore it or capture again"
            )
    if planned and planned != list(mapped.values()):
        faults.append(
            f"cfg.json's hooks store {', '.join(map(str, mapped.values()))}, but its capture "
            f"plan captured {', '.join(map(str, planned))}: cfg.json was edited"
        )
    return faults


def _digest_faults(record: RunRecord, manifest: RootManifest, hooks: list[str]) -> list[str]:
    """Each committed file's keyed digest in the record against the file's (the manifest's
    entry, itself checked against the bytes)."""
    faults = []
    for hook in hooks:
        recorded = record.digests.get(hook)
        if recorded is None or len(recorded) != record.groups:
            faults.append(
                f"cfg.json records {0 if recorded is None else len(recorded)} file digests of "
                f"{hook} for its {record.groups} committed files: the commit record was "
                "edited; restore cfg.json or capture again"
            )
            continue
        wrong = []
        for g, text in enumerate(recorded):
            name = f"{hook}/{data_file_name(group_uuid(record.run_id, g), g + 1)}"
            entry = manifest.files.get(name)
            if entry is None or entry.single != text:
                wrong.append(name)
        if wrong:
            faults.append(
                f"{wrong[0]}: not the file cfg.json's commit record holds for {hook} "
                f"({len(wrong)} of {record.groups} files differ): hook folders or files were "
                "swapped or replaced; restore them or capture again"
            )
    return faults


def _cfg_faults(cfg: dict[str, Any], record: RunRecord) -> list[str]:
    """cfg.json against what the writer writes for its commit record: every key of
    Activault's (totals, hook list, shapes, batches per file, cleaning flags) and the
    ``actstore`` section itself, field for field. Only the run's name and bucket depend on
    where the run lies now (a copy keeps them): they must be strings."""
    try:
        batch_size = int(record.plan["batch_size"])
        want = run_cfg(
            record,
            run_name=cfg["run_name"],
            bucket=cfg["data_config"]["bucket_name"],
            batch_size=batch_size,
            batches_per_file=max(1, record.rows_per_file // max(batch_size, 1)),
        )
    except (KeyError, TypeError, ValueError) as err:
        return [f"cfg.json is malformed: {err!r} is missing or not a number"]
    faults = []
    if not isinstance(cfg["run_name"], str) or not isinstance(
        want["data_config"]["bucket_name"], str
    ):
        faults.append("cfg.json: run_name and data_config.bucket_name must be strings")
    differ = sorted(k for k in {*want, *cfg} if k != "actstore" and cfg.get(k) != want.get(k))
    if differ:
        faults.append(
            f"cfg.json's {', '.join(differ)} disagree{'s' * (len(differ) == 1)} with its commit "
            "record: cfg.json was edited; restore it or capture again"
        )
    section = cfg.get("actstore")
    if section != record.to_dict():
        keys = (
            sorted(
                k
                for k in {*section, *record.to_dict()}
                if section.get(k) != record.to_dict().get(k)
            )
            if isinstance(section, dict)
            else ["actstore"]
        )
        faults.append(
            f"cfg.json's actstore section holds {', '.join(keys)} other than its commit record "
            "reads them: cfg.json was edited; restore it or capture again"
        )
    if not record.complete:
        faults.append(
            "cfg.json says the run is unfinished, but it was published (its root manifest is "
            "written when the run completes): cfg.json was edited; restore it or capture again"
        )
    return faults


class ActivaultVerify(ActivaultExamples):
    """``verify`` of a run: its files against the root manifest, each megabatch decoded."""

    def verify(self, *, progress: Callable[[int], None] | None = None) -> VerifyReport:
        """Every file of the run against its root manifest (one download each), then each
        megabatch decoded: shapes, dtypes, NaN/Inf, each hook's statistics recomputed from
        its files the writer's way (bit for bit), stray objects, group alignment across
        hooks, and cfg.json against its commit record and its files
        (:mod:`.verify`). A run without a manifest (Activault's own) is decoded file by
        file and reported as unverifiable."""
        report = VerifyReport(self.url)
        report.notes.extend(self.notes)
        self._scan: dict[str, Any] = {
            h: {
                "stats": {},
                "non_finite": 0,
                "bufs": {},
                "index": {base_name(f.key): i for i, f in enumerate(lst.files)},
            }
            for h, lst in self.listings.items()
        }
        try:
            positions = self.positions
        except CorruptStoreError as err:
            report.faults.append(str(err))
            positions = None
        for scan in self._scan.values():
            scan["positions"] = positions
        n_files, n_bytes = self.checks.verify(
            report.faults, progress=progress, on_chunk=self.scan_chunk
        )
        report.files_checked, report.bytes_checked = n_files, n_bytes
        if self.checks.manifest is None:  # decode what there is, unverified
            for hook, listing in self.listings.items():
                for i, f in enumerate(listing.files):
                    data = self.fetch(hook, i)
                    self._decoded(hook, i, bytes(data))
                    report.files_checked += 1
                    report.bytes_checked += f.size
                    if progress is not None:
                        progress(f.size)
        self.verify_content(report)
        return report

    def scan_chunk(self, name: str, offset: int, data: memoryview) -> None:
        """Gather each megabatch file as verify reads it (files are read several at a
        time: one buffer each); decode it when whole."""
        hook, _, base = name.rpartition("/")
        scan = getattr(self, "_scan", {}).get(hook)
        if scan is None or parse_data_file(base) is None:
            return
        index = scan["index"].get(base)
        if index is None:
            return
        buf = scan["bufs"].setdefault(base, bytearray())
        buf += data
        if len(buf) == self.listings[hook].metadata.bytes_per_file:
            del scan["bufs"][base]
            self._decoded(hook, index, bytes(buf))

    def _decoded(self, hook: str, index: int, data: bytes) -> None:
        scan = self._scan[hook]
        listing = self.listings[hook]
        try:
            mb = check_megabatch(load_megabatch(data, source=hook), listing.metadata, hook)
        except CorruptStoreError as err:
            scan.setdefault("faults", []).append(str(err))
            return
        positions = scan.get("positions")
        if positions is not None and mb["input_ids"] is not None:
            per = listing.metadata.tokens_per_file
            want = positions.ids_of_rows(index * per, (index + 1) * per)
            if not np.array_equal(mb["input_ids"].reshape(-1).numpy(), want):
                scan.setdefault("faults", []).append(
                    f"{hook}/{base_name(listing.files[index].key)}: its tokens are not the ones "
                    f"{POSITIONS} places there: the positions "
                    "were edited; restore them or capture again"
                )
        states = mb["states"]
        scan["non_finite"] += int((~torch.isfinite(states.to(torch.float32))).sum())
        scan["stats"][index] = file_statistics(states)

    def verify_content(self, report: VerifyReport) -> None:
        merged = (
            self.record is not None
            and self.checks.manifest is not None
            and (self.record.run_id != one_process_run_id(self.checks.manifest.store_id))
        )
        for hook, listing in self.listings.items():
            scan = self._scan[hook]
            report.faults.extend(scan.get("faults", []))
            for name in listing.strays:
                report.faults.append(
                    f"{hook}/{name} is not a megabatch file; Activault's reader would read it "
                    "as one: remove it"
                )
            for name in listing.uncommitted:
                report.faults.append(
                    f"{hook}/{name} belongs to no committed group (left by an interrupted "
                    "capture); rerun that capture to clean it up, or delete it"
                )
            if scan["non_finite"]:
                report.notes.append(
                    f"{hook}: {scan['non_finite']} activation values are NaN or infinite"
                )
            try:
                stored = self.site_statistics(self._hook_site(hook))
            except CorruptStoreError as err:  # reported with the rest, not raised
                report.faults.append(str(err))
                continue
            if stored is None:
                report.notes.append(f"{hook}: no exact statistics.json (count missing) to check")
                continue
            recomputed = merged_statistics(scan["stats"], len(listing.files))
            if recomputed is not None:
                check_statistics(
                    report.faults,
                    f"{hook}/{STATISTICS}",
                    hook,
                    stored,
                    recomputed,
                    merged=merged,
                    record=self._json(f"{hook}/{STATISTICS}"),
                )
        if self.record is not None and self.checks.manifest is not None:
            found = record_faults(self.cfg, self.record, self.checks.manifest, self.hooks)
            positions = self.__dict__.get("_positions")
            if positions is not None:
                rec = self.record
                found += [
                    f"cfg.json's {fault} ({POSITIONS} says otherwise): cfg.json or the positions "
                    "were edited; restore them or capture again"
                    for fault in positions.record_faults(
                        rec.groups * rec.tokens_per_file,
                        rec.next_example,
                        rec.next_skip,
                        rec.dropped_tokens,
                        rec.token_mask,
                        merged=merged,
                    )
                ]
            for fault in found:
                if fault not in report.faults:
                    report.faults.append(fault)


__all__ = [
    "ActivaultVerify",
    "check_statistics",
    "file_statistics",
    "merged_statistics",
    "one_process_run_id",
    "record_faults",
]
