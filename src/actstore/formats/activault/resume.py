"""Resume, one job of :class:`~actstore.formats.activault.writer.ActivaultWriter`: a
run of this capture found at open is complete, or resumed after its last committed group
(files of uncommitted groups deleted, committed ones checked against their recorded
digests, statistics caught up); a run of another capture is refused, saying what differs."""

from __future__ import annotations

import abc
import logging
from typing import TYPE_CHECKING, Any

from ...batch import CapturePlan
from ...errors import (
    ActstoreError,
    CorruptStoreError,
    OtherCaptureError,
    StoreExistsError,
)
from ...stats import RunningStats
from ...storage.manifest import (
    MANIFEST,
    keyed_digest,
)
from ...storage.object import (
    ObjectStore,
    join_key,
)
from ..wholefiles import statistics_of
from .layout import (
    METADATA,
    STATISTICS,
    data_file_name,
    group_uuid,
    load_megabatch,
    parse_data_file,
)
from .metadata import (
    DIGESTS_SINCE,
    RUN_RECORD_VERSION,
    HookMetadata,
    RunRecord,
    statistics_from_dict,
)
from .positions import (
    PIECES,
    piece_start,
)

if TYPE_CHECKING:
    pass
else:
    pass

log = logging.getLogger(__name__)


class RunResume(abc.ABC):
    """How an Activault writer opens over a run an earlier attempt left (declared here:
    what it uses of the writer)."""

    plan: CapturePlan
    store: ObjectStore
    run_prefix: str
    location: str
    hooks: dict[str, str]
    store_id: str
    tokens_per_file: int
    record: RunRecord
    complete: bool
    resume_from: int
    _write_lock: Any
    _stats: dict[str, RunningStats]
    _metadata_bytes: dict[str, int]

    @abc.abstractmethod
    def _key(self, *parts: str) -> str:
        """A key below the run."""

    @abc.abstractmethod
    def _hook_prefix(self, hook: str) -> str:
        """The prefix of ``hook``'s files."""

    @abc.abstractmethod
    def _new_record(self) -> RunRecord:
        """The run record of this capture, before any group."""

    @abc.abstractmethod
    def _write_manifest(self) -> None:
        """Put the root manifest of the complete run."""

    @abc.abstractmethod
    def _write_cfg(self, record: RunRecord | None = None) -> None:
        """Put ``cfg.json``."""

    def _resume(self, cfg_key: str) -> None:
        doc = self.store.get_json(cfg_key)
        if not isinstance(doc, dict) or "actstore" not in doc:
            raise StoreExistsError(
                f"{self.location} is an Activault run not written by actstore; it cannot be "
                "resumed or extended: choose a new run name"
            )
        record = RunRecord.from_dict(doc["actstore"], source=self.store.url(cfg_key))
        if record.version < RUN_RECORD_VERSION:
            lacks = "file digests" if record.version < DIGESTS_SINCE else "token positions"
            raise StoreExistsError(
                f"{self.location} was written by an older actstore (run record version "
                f"{record.version}, without {lacks}) and cannot be resumed or completed "
                "here; capture into a new run"
            )
        expected = self._new_record()
        differ = [
            name
            for name in ("hooks", "rows_per_file", "sequence_length", "dtype", "plan")
            if getattr(record, name) != getattr(expected, name)
        ]
        if differ:
            words = [f"a different {name} (--opt {name})" for name in differ if name != "plan"]
            if "plan" in differ:
                words += _plan_words(record.plan, expected.plan)
            if record.complete:
                then = (
                    "it is finished and left as it is: choose a new run name, or move it "
                    "away to capture anew"
                )
            else:
                then = (
                    "it is unfinished: rerun that capture (same model, weights, dataset, "
                    "dtype, sites and options) to resume it, or choose a new run name"
                )
            raise OtherCaptureError(
                f"{self.location} holds another capture: {'; '.join(words)}; {then}",
                location=str(self.location),
            )
        self.record = record
        if record.complete:
            if self.store.size(self._key(MANIFEST)) is None:  # a crash before the manifest
                self._write_manifest()
            self.complete = True
            self.resume_from = self.plan.n_examples
            self._write_lock.release()
            log.info("%s is already complete; nothing to write", self.location)
            return
        aborted = self.store.abort_incomplete(self.run_prefix + "/")
        for obj in self.store.list(self._key(PIECES) + "/"):  # of uncommitted groups
            start = piece_start(obj.key)
            if start is None or start >= record.next_example:
                self.store.delete(obj.key)
        self._stats = {h: self._recover_hook(h, record) for h in self.hooks}
        self.record = record  # as the first attempt wrote it: a resumed run is byte-identical
        self._write_cfg()
        self.resume_from = record.next_example
        log.info(
            "resuming %s after %d committed files per hook (example %d, %d tokens into it; "
            "%d unfinished uploads aborted)",
            self.location,
            record.groups,
            record.next_example,
            record.next_skip,
            aborted,
        )

    def _recover_hook(self, hook: str, record: RunRecord) -> RunningStats:
        """Delete files of uncommitted groups; check committed ones; catch statistics up."""
        prefix = self._hook_prefix(hook)
        keep = {
            data_file_name(group_uuid(record.run_id, g), g + 1): g for g in range(record.groups)
        }
        sizes: dict[str, int] = {}
        for obj in self.store.list(prefix + "/"):
            name = obj.key[len(prefix) + 1 :]
            if name in keep:
                sizes[name] = obj.size
            elif parse_data_file(name) is not None:
                log.info("deleting %s (uploaded after the last commit)", self.store.url(obj.key))
                self.store.delete(obj.key)
        if record.groups == 0:
            return RunningStats(self.plan.d_model)
        md = HookMetadata.from_dict(
            self.store.get_json(join_key(prefix, METADATA)),
            source=self.store.url(join_key(prefix, METADATA)),
        )
        self._metadata_bytes[hook] = md.file_bytes
        for name, g in keep.items():
            if sizes.get(name) != md.bytes_per_file:
                raise CorruptStoreError(
                    f"{self.store.url(join_key(prefix, name))} (committed group {g}) is "
                    f"{'missing' if name not in sizes else f'{sizes[name]} bytes'}, expected "
                    f"{md.bytes_per_file} bytes; the run is damaged: capture into a new run"
                )
        stats_key = join_key(prefix, STATISTICS)
        stats = None
        if self.store.size(stats_key) is not None:
            stats = statistics_from_dict(
                self.store.get_json(stats_key), source=self.store.url(stats_key)
            )
        stats = stats or RunningStats(self.plan.d_model)
        done, rest = divmod(stats.count, self.tokens_per_file)
        if rest or done > record.groups:
            raise CorruptStoreError(
                f"{self.store.url(stats_key)} counts {stats.count} tokens, which is not the "
                f"{record.groups} committed files of {self.tokens_per_file} tokens; the run is "
                "damaged: capture into a new run"
            )
        digests = record.digests.get(hook, [])
        for g in range(done, record.groups):  # statistics lag the commit by at most a group
            name = data_file_name(group_uuid(record.run_id, g), g + 1)
            key = join_key(prefix, name)
            data = self.store.get(key)
            keyed = keyed_digest(self.store_id, f"{hook}/{name}", data)
            if g < len(digests) and keyed != int(digests[g], 16):
                raise CorruptStoreError(
                    f"{self.store.url(key)} (committed group {g}) is not the file that was "
                    "committed (changed or damaged since); capture into a new run"
                )
            states = load_megabatch(data, source=self.store.url(key))["states"]
            stats = stats.merge(statistics_of(states))
        return stats

    # ------------------------------------------------------------------ writing


def _plan_words(held: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """What differs between two capture plans kept in run records, in words."""
    from ...batch import plan_differences

    try:
        words = plan_differences(
            CapturePlan.from_json_dict(held), CapturePlan.from_json_dict(wanted)
        )
    except (KeyError, TypeError, ValueError, ActstoreError):
        words = []
    if words:
        return words
    keys = [k for k in wanted if held.get(k) != wanted.get(k)]
    return [f"another capture plan ({', '.join(keys)})"]
