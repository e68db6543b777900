"""How a format captures in parts and merges them: the contract each format implements in
its own ``parts.py`` (``FormatSpec.parts``); :mod:`actstore.dist` drives any format
through it.

Splitting:
Deterministic, contiguous split of a dataset's examples across machines.

Machine ``i`` of ``n`` captures examples ``[i * per, min((i + 1) * per, N))`` where
``per = align * ceil(N / (align * n))``: every machine but the last gets the same number of
examples, a multiple of ``align`` (a format's shard size, so parts are whole shards), and
the last takes the rest (possibly nothing, for tiny datasets). Because every slice starts at
``machine_id * per``, the pkl.gz spec's global sample id ``machine_id * samples_per_machine
+ local_idx`` is exactly the example's index in the dataset.

Capture computes batches at multiples of ``batch_size`` whatever the slice, so a slice
whose edges fall inside a batch recomputes that batch and keeps only its own rows: the
activations are bitwise those of a single-process capture.

Example:
    >>> [(s.start, s.stop) for s in split_examples(10, 3)]
    [(0, 4), (4, 8), (8, 10)]
    >>> [(s.start, s.stop) for s in split_examples(10, 3, align=4)]
    [(0, 4), (4, 8), (8, 10)]
    >>> [(s.start, s.stop) for s in split_examples(10, 4, align=4)]
    [(0, 4), (4, 8), (8, 10), (10, 10)]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..batch import CapturePlan
from ..errors import ConfigError

if TYPE_CHECKING:
    from .writer import ShardedWriter


@dataclass(frozen=True, kw_only=True)
class Slice:
    """The examples ``[start, stop)`` machine ``machine_id`` of ``n_machines`` captures."""

    machine_id: int
    n_machines: int
    start: int
    stop: int
    per_machine: int
    """The stride: examples per machine (all but the last hold exactly this many)."""

    @property
    def n_examples(self) -> int:
        return self.stop - self.start

    @property
    def empty(self) -> bool:
        return self.stop <= self.start

    def batches(self, batch_size: int) -> tuple[int, int]:
        """(first batch index, number of batches) this slice runs: the blog's "exact batch
        distribution" (a batch straddling an edge is run by both neighbours)."""
        if self.empty:
            return (self.start // batch_size, 0)
        first = self.start // batch_size
        return (first, math.ceil(self.stop / batch_size) - first)

    def __str__(self) -> str:
        return (
            f"machine {self.machine_id} of {self.n_machines}: examples [{self.start}, {self.stop})"
        )


def split_examples(n_examples: int, n_machines: int, *, align: int = 1) -> list[Slice]:
    """Split ``n_examples`` into ``n_machines`` contiguous slices (see the module docstring)."""
    if n_machines < 1:
        raise ConfigError(f"the number of machines must be >= 1, not {n_machines}")
    if align < 1:
        raise ConfigError(f"align must be >= 1, not {align}")
    if n_examples < 0:
        raise ConfigError(f"n_examples must be >= 0, not {n_examples}")
    per = align * max(1, math.ceil(n_examples / (align * n_machines)))
    return [
        Slice(
            machine_id=i,
            n_machines=n_machines,
            start=min(i * per, n_examples),
            stop=min((i + 1) * per, n_examples),
            per_machine=per,
        )
        for i in range(n_machines)
    ]


@dataclass(frozen=True, kw_only=True)
class PartInfo:
    """What a published part says about itself."""

    path: Path | str
    """Its directory, or its URL for object storage."""
    start: int
    stop: int
    n_examples: int
    """Examples in the whole store."""
    identity: Any
    """The capture configuration it belongs to (parts of one store compare equal)."""


@dataclass(frozen=True, kw_only=True)
class PartFormat:
    """How one storage format captures and merges in parts."""

    name: str
    slices: Callable[[CapturePlan, Any, int], list[Slice]]
    """The slices of ``(plan, options, n_machines)``, one per machine."""
    final_location: Callable[[CapturePlan, str, Any], Path | str]
    """Where the published store goes for ``(plan, out, options)`` (a path, or a URL)."""
    part_writer: Callable[[CapturePlan, Path, Any, Slice], Any]
    """A writer of one slice of the store at ``final`` (it knows where its part goes)."""
    list_parts: Callable[[Any], list[PartInfo]]
    """The published parts of the store at ``final`` (a ``Path``; a URL if ``remote``)."""
    merge: Callable[[list[PartInfo], Any], Path | str]
    """Publish the store at ``final`` from its parts (in example order, tiling it) and
    remove what is no longer needed; returns the store's location."""
    pending: Callable[[Any], Sequence[Path | str]]
    """Final locations under an output directory (a ``Path``; a URL if ``remote``) whose
    parts are waiting for a merge."""
    remote: bool = False
    """Whether finals may be object-storage URLs (merged without a local lock)."""


def parts_root(final: Path) -> Path:
    """``<dir>/.<name>.parts``: where the parts of the store ``final`` live (saev, pickle)."""
    return final.parent / f".{final.name}.parts"


def part_dir(final: Path, sl: Slice) -> Path:
    """The part directory of slice ``sl`` (named by its example range)."""
    return parts_root(final) / f"part-{sl.start:010d}-{sl.stop:010d}"


def dir_parts(
    final: Path, is_part: Callable[[Path], bool], read: Callable[[Path], PartInfo]
) -> list[PartInfo]:
    """The parts under :func:`parts_root` of ``final`` that ``is_part`` accepts, read."""
    root = parts_root(final)
    if not root.is_dir():
        return []
    return [
        read(p)
        for p in sorted(root.iterdir())
        if p.is_dir() and p.name.startswith("part-") and is_part(p)
    ]


def aligned_slices(
    alignment: Callable[[CapturePlan, Any], int],
) -> Callable[[CapturePlan, Any, int], list[Slice]]:
    """A ``slices`` function that aligns slices on ``alignment(plan, options)`` examples."""

    def slices(plan: CapturePlan, options: Any, n_machines: int) -> list[Slice]:
        return split_examples(plan.n_examples, n_machines, align=alignment(plan, options))

    return slices


def sharded_part_format(name: str, writer: type[ShardedWriter]) -> PartFormat:
    """The :class:`PartFormat` of a :class:`~actstore.formats.writer.ShardedWriter` format:
    slices of whole shards, each written by ``writer.for_slice`` into
    ``<dir>/.<name>.parts/part-A-B/`` with a ``part.json``; the merge links every part's
    shard files into the store under one index and merged statistics, byte-identical to a
    one-process capture, then removes the parts."""
    import shutil

    from ..storage.location import Location
    from .journal import PART, read_part

    def final_location(plan: CapturePlan, out: str, options: Any) -> Path:
        return writer.store_location(plan, Location.parse(out), options).path()

    def part_writer(plan: CapturePlan, final: Path, options: Any, sl: Slice) -> Any:
        return writer.for_slice(plan, Location.parse(part_dir(final, sl)), options, sl)

    def info(path: Path) -> PartInfo:
        doc = read_part(path)
        start, stop = doc["example_range"]
        return PartInfo(
            path=path,
            start=start,
            stop=stop,
            n_examples=doc["plan"]["n_examples"],
            identity=doc["record"],
        )

    def merge(parts: list[PartInfo], final: Path) -> Path:
        doc = read_part(parts[0].path)
        plan = CapturePlan.from_json_dict(doc["plan"])
        options = writer.options_type(**doc["options"])
        store = Location.parse(final)
        # Concrete writers take (plan, output, options, *, store), not the base's __init__.
        make: Callable[..., ShardedWriter] = writer
        target = make(plan, store.parent, options, store=store)
        location = target.merge([p.path for p in parts])
        shutil.rmtree(parts_root(final))
        return location

    def pending(out: Path) -> list[Path]:
        # parts live beside their store: in --out (saev), in --out/saev/shards (its saev
        # dialect), or beside --out itself (pkl.gz publishes at --out); never a deep walk
        out = Path(out)
        places = (out, out / "saev" / "shards", out.parent)
        found = {r for place in places for r in place.glob(".*.parts") if r.is_dir()}
        roots = [r for r in found if r.parent != out.parent or r.name == f".{out.name}.parts"]
        return [
            r.parent / r.name[1 : -len(".parts")]
            for r in sorted(roots)
            if any((p / PART).is_file() for p in r.iterdir())
        ]

    return PartFormat(
        name=name,
        slices=aligned_slices(writer.shard_examples),
        final_location=final_location,
        part_writer=part_writer,
        list_parts=lambda final: dir_parts(final, lambda p: (p / PART).is_file(), info),
        merge=merge,
        pending=pending,
    )
