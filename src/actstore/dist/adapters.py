"""How each storage format captures in parts and merges them (see :mod:`.parts`).

Each factory returns the :class:`~actstore.dist.parts.PartFormat` of one format; the
registry :data:`FACTORIES` maps format names to them. A new format joins distributed
capture by adding a factory here.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..batch import Batch, CapturePlan
from ..errors import ConfigError
from .parts import PartFormat, PartInfo, part_dir, parts_root
from .split import Slice, split_examples


def _dir_parts(final: Path, is_part: Callable[[Path], bool],
               read: Callable[[Path], PartInfo]) -> list[PartInfo]:
    root = parts_root(final)
    if not root.is_dir():
        return []
    return [read(p) for p in sorted(root.iterdir())
            if p.is_dir() and p.name.startswith("part-") and is_part(p)]


def _aligned_slices(alignment: Callable[[CapturePlan, Any], int]):
    def slices(plan: CapturePlan, options: Any, n_machines: int) -> list[Slice]:
        return split_examples(plan.n_examples, n_machines, align=alignment(plan, options))

    return slices


# ---------------------------------------------------------------------- saev


def _saev() -> PartFormat:
    from ..formats.saev import SaevWriter, saev_metadata, store_dir
    from ..formats.saev.writer import PART, merge_parts, read_part

    def metadata(plan, options):
        return saev_metadata(plan, dialect=options.dialect,
                             patches_per_shard=options.patches_per_shard)

    def part_writer(plan, final, options, sl):
        return SaevWriter(metadata(plan, options), part_dir(final, sl),
                          has_tokens=plan.has_tokens, classes=plan.classes,
                          has_labels=plan.has_labels, example_range=(sl.start, sl.stop))

    def info(path):
        md, manifest = read_part(path)
        start, stop = manifest["example_range"]
        return PartInfo(path=path, start=start, stop=stop, n_examples=md.n_examples,
                        identity=md.to_json_dict())

    def merge(parts, final):
        location = merge_parts([p.path for p in parts], final)
        shutil.rmtree(parts_root(final))
        return location

    def pending(out):
        roots = list(out.glob(".*.parts")) + list((out / "saev" / "shards").glob(".*.parts"))
        return [r.parent / r.name[1 : -len(".parts")] for r in sorted(roots)
                if any((p / PART).is_file() for p in r.iterdir())]

    return PartFormat(
        name="saev",
        slices=_aligned_slices(lambda plan, options: metadata(plan, options).examples_per_shard),
        final_location=lambda plan, out, options: store_dir(metadata(plan, options), out),
        part_writer=part_writer,
        list_parts=lambda final: _dir_parts(final, lambda p: (p / PART).is_file(), info),
        merge=merge,
        pending=pending,
    )


# ---------------------------------------------------------------------- pkl.gz


def _pickle() -> PartFormat:
    from ..formats.pickle import PickleReader, PickleWriter, merge_stores
    from ..formats.pickle.layout import METADATA, samples_per_shard_for

    def per_shard(plan, options):
        return options.samples_per_shard or samples_per_shard_for(plan, options.shard_mb)

    def part_writer(plan, final, options, sl):
        return PickleWriter(plan, part_dir(final, sl), options,
                            example_range=(sl.start, sl.stop), machine_id=sl.machine_id,
                            total_machines=sl.n_machines, samples_per_machine=sl.per_machine)

    def info(path):
        md = PickleReader(path).metadata
        start, stop = md.distributed_config["example_range"]
        return PartInfo(path=path, start=start, stop=stop,
                        n_examples=md.actstore.get("n_examples", stop),
                        identity=md.extraction_config)

    def merge(parts, final):
        location = merge_stores([p.path for p in parts], final)
        shutil.rmtree(parts_root(final))
        return location

    def pending(out):
        root = parts_root(out)
        waiting = root.is_dir() and any((p / METADATA).is_file() for p in root.iterdir())
        return [out] if waiting else []

    return PartFormat(
        name="pickle",
        slices=_aligned_slices(per_shard),
        final_location=lambda plan, out, options: Path(out).expanduser().resolve(),
        part_writer=part_writer,
        list_parts=lambda final: _dir_parts(final, lambda p: (p / METADATA).is_file(), info),
        merge=merge,
        pending=pending,
    )


# ---------------------------------------------------------------------- zarr


def _zarr() -> PartFormat:
    from ..formats.zarr import ZarrWriter, shard_ranges, write_manifest
    from ..formats.zarr.layout import CONFIG_FILE
    from ..formats.zarr.reader import MANIFEST, open_store_info
    from ..formats.zarr.shards import SHARDS_DIR
    from ..storage import read_json

    def slices(plan, options, n_machines):
        # the format's own split (sizes differing by at most one); machines beyond the
        # number of samples get nothing
        used = min(n_machines, plan.n_examples)
        ranges = shard_ranges(plan.n_examples, used) if used else []
        ranges += [(plan.n_examples, plan.n_examples)] * (n_machines - used)
        per = max((b - a for a, b in ranges), default=0)
        return [Slice(machine_id=i, n_machines=n_machines, start=a, stop=b, per_machine=per)
                for i, (a, b) in enumerate(ranges)]

    def part_writer(plan, final, options, sl):
        used = min(sl.n_machines, plan.n_examples)
        return ZarrWriter.for_shard(plan, final, sl.machine_id, used, options)

    def info(path):
        store = open_store_info(path)
        shard = store.attrs.get("shard") or {}
        total = read_json(path / CONFIG_FILE)["layout"]["n_samples"]
        return PartInfo(path=path, start=shard["start"], stop=shard["stop"], n_examples=total,
                        identity=store.attrs.get("fingerprint"))

    def list_parts(final):
        shards = final / SHARDS_DIR
        if not shards.is_dir():
            return []
        return [info(p) for p in sorted(shards.glob("shard-*.zarr")) if p.is_dir()]

    def merge(parts, final):
        write_manifest(final)
        return final

    def pending(out):
        return [out] if (out / SHARDS_DIR).is_dir() and not (out / MANIFEST).exists() else []

    return PartFormat(name="zarr", slices=slices,
                      final_location=lambda plan, out, options: Path(out).expanduser().resolve(),
                      part_writer=part_writer, list_parts=list_parts, merge=merge,
                      pending=pending)


# ---------------------------------------------------------------------- activault


class _Rebased:
    """Writer adapter for one slice of an Activault part: the part is a run of its own, so
    example ids are shifted to start at 0 (the runner sends global ids)."""

    def __init__(self, inner: Any, start: int, stop: int) -> None:
        self.inner, self.example_range = inner, (start, stop)
        self.wants_texts = getattr(inner, "wants_texts", False)

    @property
    def complete(self) -> bool:
        return self.inner.complete

    @property
    def resume_from(self) -> int:
        start, stop = self.example_range
        return stop if self.inner.complete else start + self.inner.resume_from

    def write(self, batch: Batch) -> None:
        self.inner.write(dataclasses.replace(batch, example_ids=batch.example_ids
                                             - self.example_range[0]))

    def close(self) -> Any:
        return self.inner.close()

    def abort(self) -> None:
        self.inner.abort()


def _activault() -> PartFormat:
    from ..formats.activault import ActivaultWriter
    from ..formats.activault.layout import CFG, METADATA, STATISTICS, data_file_name, group_uuid
    from ..formats.activault.writer import file_shape
    from ..formats.activault.metadata import (
        HookMetadata,
        RunRecord,
        run_cfg,
        statistics_from_dict,
        statistics_to_dict,
    )
    from ..stats import merge_all
    from ..storage.object import LocalStore, S3Store, base_name, join_key, open_location, parent_key

    def root_of(prefix: str) -> str:
        return join_key(parent_key(prefix), f".{base_name(prefix)}.parts")

    def examples_per_file(plan, options):
        rows, seq = file_shape(plan, options)  # the writer's own choice, default included
        return math.lcm(rows * seq, plan.tokens_per_example) // plan.tokens_per_example

    def final_location(plan, out, options):
        store, prefix = open_location(out, options.s3_config())
        return store.url(prefix)

    def part_writer(plan, final, options, sl):
        store, prefix = open_location(final, options.s3_config())
        url = store.url(join_key(root_of(prefix), f"part-{sl.start:010d}-{sl.stop:010d}"))
        return _Rebased(ActivaultWriter(plan, url, options), sl.start, sl.stop)

    def read_record(store, run_prefix):
        doc = store.get_json(join_key(run_prefix, CFG))
        return RunRecord.from_dict(doc["actstore"], source=store.url(join_key(run_prefix, CFG)))

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
            identity = {k: v for k, v in record.to_dict().items() if k in (
                "hooks", "rows_per_file", "sequence_length", "dtype", "plan", "token_mask")}
            out.append(PartInfo(path=store.url(join_key(root, name)), start=int(start),
                                stop=int(stop), n_examples=int(record.plan["n_examples"]),
                                identity=identity))
        return out

    def copy(store, src: str, dst: str) -> None:
        if isinstance(store, LocalStore):
            target = Path(store.url(dst))
            target.parent.mkdir(parents=True, exist_ok=True)
            target.unlink(missing_ok=True)
            try:
                os.link(store.url(src), target)
            except OSError:
                shutil.copyfile(store.url(src), target)
        elif isinstance(store, S3Store):  # server-side copy (multipart for large objects)
            store.client.copy({"Bucket": store.bucket, "Key": src}, store.bucket, dst)
        else:
            store.put(dst, store.get(src))

    def merge(parts, final):
        store, prefix = open_location(final)
        runs = [join_key(root_of(prefix), base_name(str(p.path))) for p in parts]
        records = [read_record(store, r) for r in runs]
        merged_id = str(uuid.uuid5(uuid.NAMESPACE_URL, "|".join(r.run_id for r in records)))
        first = records[0]
        record = dataclasses.replace(
            first, run_id=merged_id, groups=sum(r.groups for r in records),
            next_example=parts[0].n_examples, next_skip=0, complete=False,
            dropped_tokens=sum(r.dropped_tokens for r in records),
            num_runs=sum(r.num_runs for r in records))
        plan = first.plan
        bucket = store.bucket if isinstance(store, S3Store) else ""
        rows_per_batch = max(1, first.rows_per_file // max(int(plan.get("batch_size", 1)), 1))

        def write_cfg(rec):
            store.put_json(join_key(prefix, CFG), run_cfg(
                rec, run_name=base_name(prefix), bucket=bucket,
                batch_size=int(plan.get("batch_size", 1)), batches_per_file=rows_per_batch),
                indent=2)

        write_cfg(record)  # incomplete: readers refuse the run until the end
        for hook in first.hooks:
            metas = [store.get_json(join_key(r, hook, METADATA)) for r in runs]
            if any(m != metas[0] for m in metas):
                raise ConfigError(f"the parts of {final} disagree on {hook}/metadata.json")
            HookMetadata.from_dict(metas[0], source=store.url(join_key(runs[0], hook, METADATA)))
            group = 0
            for run, rec in zip(runs, records):
                for g in range(rec.groups):
                    copy(store, join_key(run, hook, data_file_name(group_uuid(rec.run_id, g), g + 1)),
                         join_key(prefix, hook, data_file_name(group_uuid(merged_id, group),
                                                               group + 1)))
                    group += 1
            stats = [statistics_from_dict(store.get_json(join_key(r, hook, STATISTICS)),
                                          source=store.url(join_key(r, hook, STATISTICS)))
                     for r in runs]
            store.put_json(join_key(prefix, hook, METADATA), metas[0])
            if None not in stats:
                store.put_json(join_key(prefix, hook, STATISTICS),
                               statistics_to_dict(merge_all(stats)))
        write_cfg(dataclasses.replace(record, complete=True))  # publishes the run
        for obj in list(store.list(root_of(prefix) + "/")):
            store.delete(obj.key)
        if isinstance(store, LocalStore):
            shutil.rmtree(store.url(root_of(prefix)), ignore_errors=True)
        return final

    def pending(out):
        store, prefix = open_location(out)
        root = root_of(prefix)
        waiting = any(store.size(join_key(root, d, CFG)) is not None for d in store.list_dirs(root))
        return [store.url(prefix)] if waiting else []

    return PartFormat(name="activault", slices=_aligned_slices(examples_per_file),
                      final_location=final_location, part_writer=part_writer,
                      list_parts=list_parts, merge=merge, pending=pending, remote=True)


def _saelens() -> PartFormat:
    from ..formats.saelens.parts import part_format

    return part_format()


FACTORIES: dict[str, Callable[[], PartFormat]] = {
    "saev": _saev, "pickle": _pickle, "zarr": _zarr, "activault": _activault,
    "saelens": _saelens}


