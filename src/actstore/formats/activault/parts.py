"""Activault in parts: each machine writes an Activault run of its own at
``<parent>/.<run>.parts/part-A-B`` (local or ``s3://``); the merge copies the files
(server-side on S3, hard links locally) into ``<run>`` with one group numbering, merged
statistics and ``cfg.json`` last, then deletes the parts."""

from __future__ import annotations

import dataclasses
import math
import uuid
from typing import Any

import numpy as np

from ...batch import Batch
from ...errors import ConfigError, CorruptStoreError
from ...stats import merge_all
from ...storage.manifest import rekey
from ...storage.object import base_name, join_key, open_location, parent_key
from ..parts import PartFormat, PartInfo, aligned_slices
from ..writerbase import WriterBase
from .layout import CFG, METADATA, STATISTICS, data_file_name, group_uuid
from .metadata import (
    HookMetadata,
    RunRecord,
    run_cfg,
    statistics_from_dict,
    statistics_to_dict,
)
from .positions import POSITIONS, decode, encode
from .run import file_shape, write_run_manifest
from .writer import ActivaultWriter


def _store_id(store: Any, run: str) -> str:
    """The store id of a part's run (its root manifest says it)."""
    from ...storage.manifest import MANIFEST, RootManifest

    key = join_key(run, MANIFEST)
    return RootManifest.from_bytes(store.get(key), store.url(key)).store_id


def _check_parts(
    store: Any, runs: list[str], records: list[RunRecord], part_ids: list[str], final: str
) -> dict[str, Any]:
    """Refuse parts a merge cannot join, before it writes anything: every part is a run of
    the same capture (store id, hooks), records a digest for each committed file of each
    hook, and holds the same ``metadata.json`` per hook. Returns that metadata per hook."""
    for run, rec, part_id in zip(runs, records, part_ids):
        where = store.url(join_key(run, CFG))
        if part_id != part_ids[0] or rec.hooks != records[0].hooks:
            raise CorruptStoreError(
                f"{where} belongs to another capture than the first part of {final} (its store "
                "id or hooks differ); capture the parts again with the same plan and options"
            )
        for hook in rec.hooks:
            digests = rec.digests.get(hook, [])
            if len(digests) != rec.groups or not all(_is_digest(d) for d in digests):
                raise CorruptStoreError(
                    f"{where} records {len(digests)} file digests of {hook} for {rec.groups} "
                    "committed files, or malformed ones; capture this part again"
                )
    metas = {}
    for hook in records[0].hooks:
        found = [store.get_json(join_key(r, hook, METADATA)) for r in runs]
        if any(m != found[0] for m in found):
            raise ConfigError(f"the parts of {final} disagree on {hook}/metadata.json")
        HookMetadata.from_dict(found[0], source=store.url(join_key(runs[0], hook, METADATA)))
        metas[hook] = found[0]
    return metas


def _is_digest(text: str) -> bool:
    """``text`` is a keyed file digest as cfg.json records it (16 hex digits)."""
    return len(text) == 16 and all(c in "0123456789abcdef" for c in text)


class _Rebased(WriterBase):
    """Writer adapter for one slice of an Activault part: the part is a run of its own, so
    example ids are shifted to start at 0 (the runner sends global ids)."""

    def __init__(self, inner: Any, start: int, stop: int) -> None:
        self.inner = inner
        self.example_range: tuple[int, int] = (start, stop)
        self.wants_texts = inner.wants_texts

    # complete and resume_from are read-through views of the inner writer's state (format
    # writers assign them as plain attributes, hence WriterBase declares them writable).
    @property
    def complete(self) -> bool:  # type: ignore[override]
        return self.inner.complete

    @property
    def resume_from(self) -> int:  # type: ignore[override]
        start, stop = self.example_range
        return stop if self.inner.complete else start + self.inner.resume_from

    def write(self, batch: Batch) -> None:
        self.inner.write(
            dataclasses.replace(batch, example_ids=batch.example_ids - self.example_range[0])
        )

    def close(self) -> Any:
        return self.inner.close()

    def abort(self) -> None:
        self.inner.abort()


def _merge_positions(
    store: Any, runs: list[str], records: list[RunRecord], prefix: str, tokens: int
) -> None:
    """The parts' positions files joined in part order, each part's stream rows shifted
    past the files of the parts before it (every part dropped its own tail); none when a
    part has none (captured by an older actstore)."""
    tables, offset = [], 0
    for run, rec in zip(runs, records):
        key = join_key(run, POSITIONS)
        if store.size(key) is None:
            return
        table = decode(store.get(key), tokens, store.url(key))
        table["first"] += offset
        tables.append(table)
        offset += rec.groups * rec.tokens_per_file
    if tables:
        store.put(join_key(prefix, POSITIONS), encode(np.concatenate(tables)))


def part_format() -> PartFormat:
    """How this format captures in parts and merges them."""

    def root_of(prefix: str) -> str:
        return join_key(parent_key(prefix), f".{base_name(prefix)}.parts")

    def examples_per_file(plan, options):
        rows, seq = file_shape(plan, options)  # the writer's own choice, default included
        return math.lcm(rows * seq, plan.tokens_per_example) // plan.tokens_per_example

    def final_location(plan, out, options):
        store, prefix = open_location(out, options.storage_options(str(out)))
        return store.url(prefix)

    def part_writer(plan, final, options, sl):
        store, prefix = open_location(final, options.storage_options(str(final)))
        url = store.url(join_key(root_of(prefix), f"part-{sl.start:010d}-{sl.stop:010d}"))
        return _Rebased(ActivaultWriter(plan, url, options), sl.start, sl.stop)

    def read_record(store, run_prefix):
        source = store.url(join_key(run_prefix, CFG))
        doc = store.get_json(join_key(run_prefix, CFG))
        if not isinstance(doc, dict) or "actstore" not in doc:
            raise CorruptStoreError(
                f"{source} has no 'actstore' section (not written by actstore); capture this "
                "part again"
            )
        return RunRecord.from_dict(doc["actstore"], source=source)

    def list_parts(final):
        store, prefix = open_location(final)
        root, out = root_of(prefix), []
        for name in store.list_dirs(root):
            if not name.startswith("part-") or store.size(join_key(root, name, CFG)) is None:
                continue
            record = read_record(store, join_key(root, name))
            if not record.complete:
                continue
            _, start, stop = name.split("-")
            identity = {
                k: v
                for k, v in record.to_dict().items()
                if k in ("hooks", "rows_per_file", "sequence_length", "dtype", "plan", "token_mask")
            }
            out.append(
                PartInfo(
                    path=store.url(join_key(root, name)),
                    start=int(start),
                    stop=int(stop),
                    n_examples=int(record.plan["n_examples"]),
                    identity=identity,
                )
            )
        return out

    def merge(parts: list[PartInfo], final: str) -> str:
        store, prefix = open_location(final)
        runs = [join_key(root_of(prefix), base_name(str(p.path))) for p in parts]
        records = [read_record(store, r) for r in runs]
        merged_id = str(uuid.uuid5(uuid.NAMESPACE_URL, "|".join(r.run_id for r in records)))
        first = records[0]
        record = dataclasses.replace(
            first,
            run_id=merged_id,
            groups=sum(r.groups for r in records),
            next_example=parts[0].n_examples,
            next_skip=0,
            complete=False,
            dropped_tokens=sum(r.dropped_tokens for r in records),
            num_runs=1,  # one logical run, as a one-process capture records
            digests={},
        )
        plan = first.plan
        bucket = store.bucket_name
        rows_per_batch = max(1, first.rows_per_file // max(int(plan.get("batch_size", 1)), 1))

        def write_cfg(rec: RunRecord) -> None:
            store.put_json(
                join_key(prefix, CFG),
                run_cfg(
                    rec,
                    run_name=base_name(prefix),
                    bucket=bucket,
                    batch_size=int(plan.get("batch_size", 1)),
                    batches_per_file=rows_per_batch,
                ),
                indent=2,
            )

        part_ids = [_store_id(store, r) for r in runs]
        merged_store_id = part_ids[0]  # the capture's: every part has it
        metas = _check_parts(store, runs, records, part_ids, final)
        write_cfg(record)  # incomplete: readers refuse the run until the end
        digests: dict[str, list[str]] = {h: [] for h in first.hooks}
        for hook in first.hooks:
            group = 0
            for run, rec, part_id in zip(runs, records, part_ids):
                for g in range(rec.groups):
                    old = data_file_name(group_uuid(rec.run_id, g), g + 1)
                    new = data_file_name(group_uuid(merged_id, group), group + 1)
                    store.copy(join_key(run, hook, old), join_key(prefix, hook, new))
                    # the same bytes at a new place: re-keyed, not read again
                    value = np.array([int(rec.digests[hook][g], 16)], dtype="<u8")
                    moved = rekey(
                        value, (part_id, f"{hook}/{old}"), (merged_store_id, f"{hook}/{new}")
                    )
                    digests[hook].append(f"{int(moved[0]):016x}")
                    group += 1
            stats = [
                statistics_from_dict(
                    store.get_json(join_key(r, hook, STATISTICS)),
                    source=store.url(join_key(r, hook, STATISTICS)),
                )
                for r in runs
            ]
            store.put_json(join_key(prefix, hook, METADATA), metas[hook])
            known = [s for s in stats if s is not None]
            if len(known) == len(stats):
                store.put_json(
                    join_key(prefix, hook, STATISTICS), statistics_to_dict(merge_all(known))
                )
        _merge_positions(store, runs, records, prefix, int(plan.get("tokens_per_example", 0)))
        done = dataclasses.replace(record, complete=True, digests=digests)
        write_cfg(done)
        write_run_manifest(store, prefix, done, merged_store_id, int(plan.get("d_model", 0)))
        store.delete_tree(root_of(prefix))
        return final

    def pending(out):
        store, prefix = open_location(out)
        root = root_of(prefix)
        waiting = any(store.size(join_key(root, d, CFG)) is not None for d in store.list_dirs(root))
        return [store.url(prefix)] if waiting else []

    return PartFormat(
        name="activault",
        slices=aligned_slices(examples_per_file),
        final_location=final_location,
        part_writer=part_writer,
        list_parts=list_parts,
        merge=merge,
        pending=pending,
        remote=True,
    )
