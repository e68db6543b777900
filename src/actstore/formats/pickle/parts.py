"""pkl.gz in parts: each machine writes a pkl.gz store of its own (the spec's sample ids)
under ``<dir>/.<out>.parts/part-A-B/``; the merge links the shards into ``<out>`` under one
merged ``metadata.json`` (the spec's "merge metadata files")."""

from __future__ import annotations

import shutil
from pathlib import Path

from ..parts import PartFormat, PartInfo, aligned_slices, dir_parts, part_dir, parts_root
from .layout import METADATA, samples_per_shard_for
from .reader import PickleReader
from .writer import PickleWriter, merge_stores


def part_format() -> PartFormat:
    """How this format captures in parts and merges them."""

    def per_shard(plan, options):
        return options.samples_per_shard or samples_per_shard_for(plan, options.shard_mb)

    def part_writer(plan, final, options, sl):
        return PickleWriter(
            plan,
            part_dir(final, sl),
            options,
            example_range=(sl.start, sl.stop),
            machine_id=sl.machine_id,
            total_machines=sl.n_machines,
            samples_per_machine=sl.per_machine,
        )

    def info(path):
        md = PickleReader(path).metadata
        start, stop = md.distributed_config["example_range"]
        return PartInfo(
            path=path,
            start=start,
            stop=stop,
            n_examples=md.actstore.get("n_examples", stop),
            identity=md.extraction_config,
        )

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
        slices=aligned_slices(per_shard),
        final_location=lambda plan, out, options: Path(out).expanduser().resolve(),
        part_writer=part_writer,
        list_parts=lambda final: dir_parts(final, lambda p: (p / METADATA).is_file(), info),
        merge=merge,
        pending=pending,
    )
