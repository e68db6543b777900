"""saev in parts: each machine writes whole shards (global numbering) into
``<out>/.<hash>.parts/part-A-B/``; the merge hard-links them into ``<out>/<hash>`` under one
index, byte-identical to a single-process capture."""

from __future__ import annotations

import shutil

from ..parts import PartFormat, PartInfo, aligned_slices, dir_parts, part_dir, parts_root
from .writer import PART, SaevWriter, merge_parts, read_part, saev_metadata, store_dir


def part_format() -> PartFormat:
    """How this format captures in parts and merges them."""

    def metadata(plan, options):
        return saev_metadata(
            plan, dialect=options.dialect, patches_per_shard=options.patches_per_shard
        )

    def part_writer(plan, final, options, sl):
        return SaevWriter(
            metadata(plan, options),
            part_dir(final, sl),
            has_tokens=plan.has_tokens,
            classes=plan.classes,
            has_labels=plan.has_labels,
            example_range=(sl.start, sl.stop),
        )

    def info(path):
        md, manifest = read_part(path)
        start, stop = manifest["example_range"]
        return PartInfo(
            path=path, start=start, stop=stop, n_examples=md.n_examples, identity=md.to_json_dict()
        )

    def merge(parts, final):
        location = merge_parts([p.path for p in parts], final)
        shutil.rmtree(parts_root(final))
        return location

    def pending(out):
        roots = list(out.glob(".*.parts")) + list((out / "saev" / "shards").glob(".*.parts"))
        return [
            r.parent / r.name[1 : -len(".parts")]
            for r in sorted(roots)
            if any((p / PART).is_file() for p in r.iterdir())
        ]

    return PartFormat(
        name="saev",
        slices=aligned_slices(lambda plan, options: metadata(plan, options).examples_per_shard),
        final_location=lambda plan, out, options: store_dir(metadata(plan, options), out),
        part_writer=part_writer,
        list_parts=lambda final: dir_parts(final, lambda p: (p / PART).is_file(), info),
        merge=merge,
        pending=pending,
    )
