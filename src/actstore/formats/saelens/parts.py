"""Distributed capture of the saelens format: parts of whole files, merged by linking.

Machine ``i`` writes its slice (aligned on ``examples_per_shard``, files numbered as in
the whole store) to ``<dir>/.<name>.parts/part-A-B/`` with a ``part.json``; the merge
hard-links every part's files into ``<dir>/<name>`` under one index and merged
statistics, byte-identical to a one-process capture, then removes the parts.

Example:
    >>> fmt = part_format()  # doctest: +SKIP
    >>> fmt.slices(plan, SaelensOptions(), 4)  # doctest: +SKIP
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ..parts import PartFormat, PartInfo, part_dir, parts_root, split_examples
from .layout import SIDECAR
from .writer import PART, SaelensWriter, layout_for, merge_parts, plan_record, read_part


def part_format() -> PartFormat:
    """The :class:`~actstore.formats.parts.PartFormat` of the saelens format."""

    def slices(plan, options, n_machines):
        per = layout_for(plan, options).examples_per_shard
        return split_examples(plan.n_examples, n_machines, align=per)

    def part_writer(plan, final, options, sl):
        return SaelensWriter(
            layout_for(plan, options),
            part_dir(final, sl),
            plan=plan_record(plan),
            example_range=(sl.start, sl.stop),
        )

    def info(path: Path) -> PartInfo:
        record, manifest = read_part(path)
        start, stop = manifest["example_range"]
        return PartInfo(
            path=path,
            start=start,
            stop=stop,
            n_examples=record["layout"]["n_examples"],
            identity=record,
        )

    def list_parts(final: Path) -> list[PartInfo]:
        root = parts_root(final)
        if not root.is_dir():
            return []
        return [
            info(p)
            for p in sorted(root.iterdir())
            if p.is_dir() and p.name.startswith("part-") and (p / PART).is_file()
        ]

    def merge(parts, final):
        location = merge_parts([p.path for p in parts], final)
        shutil.rmtree(parts_root(final))
        return location

    def pending(out: Path) -> list[Path]:
        root = parts_root(out)
        waiting = root.is_dir() and any(
            (p / PART).is_file() and (p / SIDECAR).is_file() for p in root.iterdir()
        )
        return [out] if waiting else []

    return PartFormat(
        name="saelens",
        slices=slices,
        final_location=lambda plan, out, options: Path(out).expanduser().resolve(),
        part_writer=part_writer,
        list_parts=list_parts,
        merge=merge,
        pending=pending,
    )
