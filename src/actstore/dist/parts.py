"""Parts of a distributed capture, per format, and the merge that publishes them.

Every machine writes its slice as a *part*: a directory ``part-<start>-<stop>`` under
``<final>.parts`` (hidden: ``<dir>/.<name>.parts``) next to where the finished store will
be. The merge checks that the published parts tile ``[0, n_examples)`` exactly and come
from one capture configuration, then lets the format join them (saev: shards hard-linked
under one index; pkl.gz: shards linked under one merged metadata.json) and removes the
parts. A missing slice stops it with :class:`MissingPartsError`, naming the machines to
rerun: a store with a hole is never published.

Example:
    >>> merge_store("/scratch/acts/3f1c...")  # doctest: +SKIP
    PosixPath('/scratch/acts/3f1c...')
"""

from __future__ import annotations

import fcntl
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..batch import CapturePlan
from ..errors import CaptureError, ConfigError, StoreNotFoundError
from .split import Slice

log = logging.getLogger(__name__)


class MissingPartsError(CaptureError):
    """A distributed capture cannot be merged: some slices have no published part."""

    def __init__(self, message: str, missing: list[tuple[int, int]] | None = None) -> None:
        super().__init__(message)
        self.missing = missing or []
        """The example ranges ``[start, stop)`` no finished part holds."""


@dataclass(frozen=True, kw_only=True)
class PartInfo:
    """What a published part says about itself."""

    path: Path
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
    alignment: Callable[[CapturePlan, Any], int]
    """Examples per shard: every part but the last holds a multiple of this."""
    final_location: Callable[[CapturePlan, str, Any], Path]
    """Where the merged store goes for ``(plan, out, options)``."""
    part_writer: Callable[[CapturePlan, Path, Any, Slice], Any]
    """A writer of one slice into the part directory it is given."""
    is_part: Callable[[Path], bool]
    read_part: Callable[[Path], PartInfo]
    merge: Callable[[list[Path], Path], Path]
    """Join parts (tiling ``[0, n)`` in order) into the final location; returns it."""


# ---------------------------------------------------------------------- saev


def _saev() -> PartFormat:
    from ..formats.saev import SaevWriter, saev_metadata, store_dir
    from ..formats.saev.writer import PART, merge_parts, read_part

    def metadata(plan, options):
        return saev_metadata(plan, dialect=options.dialect,
                             patches_per_shard=options.patches_per_shard)  # fmt: skip

    def part_writer(plan, part_dir, options, sl):
        return SaevWriter(metadata(plan, options), part_dir, has_tokens=plan.has_tokens,
                          classes=plan.classes, has_labels=plan.has_labels,
                          example_range=(sl.start, sl.stop))  # fmt: skip

    def info(path):
        md, manifest = read_part(path)
        start, stop = manifest["example_range"]
        return PartInfo(path=path, start=start, stop=stop, n_examples=md.n_examples,
                        identity=md.to_json_dict())  # fmt: skip

    return PartFormat(
        name="saev",
        alignment=lambda plan, options: metadata(plan, options).examples_per_shard,
        final_location=lambda plan, out, options: store_dir(metadata(plan, options), out),
        part_writer=part_writer,
        is_part=lambda path: (path / PART).is_file(),
        read_part=info,
        merge=merge_parts,
    )


# ---------------------------------------------------------------------- pkl.gz


def _pickle() -> PartFormat:
    from ..formats.pickle import PickleReader, PickleWriter, merge_stores
    from ..formats.pickle.layout import samples_per_shard_for

    def per_shard(plan, options):
        return options.samples_per_shard or samples_per_shard_for(plan, options.shard_mb)

    def part_writer(plan, part_dir, options, sl):
        return PickleWriter(plan, part_dir, options, example_range=(sl.start, sl.stop),
                            machine_id=sl.machine_id, total_machines=sl.n_machines,
                            samples_per_machine=sl.per_machine)  # fmt: skip

    def is_part(path):
        return (path / "metadata.json").is_file() and path.name.startswith("part-")

    def info(path):
        md = PickleReader(path).metadata
        start, stop = md.distributed_config["example_range"]
        return PartInfo(path=path, start=start, stop=stop,
                        n_examples=md.actstore.get("n_examples", stop),
                        identity=md.extraction_config)  # fmt: skip

    return PartFormat(
        name="pickle",
        alignment=per_shard,
        final_location=lambda plan, out, options: Path(out).expanduser().resolve(),
        part_writer=part_writer,
        is_part=is_part,
        read_part=info,
        merge=lambda parts, final: merge_stores(parts, final),
    )


_FACTORIES: dict[str, Callable[[], PartFormat]] = {"saev": _saev, "pickle": _pickle}


def part_format(name: str) -> PartFormat:
    """The :class:`PartFormat` of storage format ``name``."""
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ConfigError(
            f"distributed capture does not support the {name!r} format yet; "
            f"formats with parts: {', '.join(sorted(_FACTORIES))}"
        )
    return factory()


def part_formats() -> list[PartFormat]:
    """Every format that captures in parts and whose code is importable."""
    out = []
    for name in _FACTORIES:
        try:
            out.append(part_format(name))
        except ImportError:
            continue
    return out


# ---------------------------------------------------------------------- locations


def parts_root(final: Path) -> Path:
    """``<dir>/.<name>.parts``: where the parts of the store ``final`` live."""
    return final.parent / f".{final.name}.parts"


def part_dir(final: Path, sl: Slice) -> Path:
    """The part directory of slice ``sl`` (named by its example range)."""
    return parts_root(final) / f"part-{sl.start:010d}-{sl.stop:010d}"


def published_parts(final: Path, fmt: PartFormat) -> list[PartInfo]:
    """The published parts of ``final``, in example order."""
    root = parts_root(final)
    if not root.is_dir():
        return []
    parts = [fmt.read_part(p) for p in sorted(root.iterdir())
             if p.is_dir() and p.name.startswith("part-") and fmt.is_part(p)]  # fmt: skip
    return sorted(parts, key=lambda p: (p.start, p.stop))


def missing_ranges(parts: list[PartInfo], n_examples: int) -> list[tuple[int, int]]:
    """Example ranges no part covers. Overlapping parts (two splittings mixed) are an error.

    Example:
        >>> p = lambda a, b: PartInfo(path=Path("."), start=a, stop=b, n_examples=9, identity=0)
        >>> missing_ranges([p(0, 3), p(6, 9)], 9)
        [(3, 6)]
    """
    gaps, at = [], 0
    for part in parts:
        if part.start < at:
            raise ConfigError(
                f"parts overlap at example {part.start} ({part.path.name}): they come from "
                "captures with different --num-machines or shard sizes; delete the parts of "
                "one of them"
            )
        if part.start > at:
            gaps.append((at, part.start))
        at = part.stop
    if at < n_examples:
        gaps.append((at, n_examples))
    return gaps


def merge_store(final: str | Path, fmt: str | PartFormat | None = None) -> Path:
    """Merge the parts of the store ``final`` and publish it; returns its location.

    Raises :class:`MissingPartsError` if a slice has no published part (then nothing is
    published). An already merged store is returned as it is. Machines finishing together
    queue on a lock file; the later ones then find the store published.
    """
    final = Path(final).expanduser().resolve()
    spec = _format_of(final, fmt)
    root = parts_root(final)
    try:
        if _published(final, spec):
            return final
        lock = open(root / ".merge.lock", "a")
    except FileNotFoundError:
        if _published(final, spec):  # another machine merged and removed the parts just now
            return final
        raise StoreNotFoundError(f"{final} has no parts to merge (looked for {root})") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _published(final, spec):
            return final
        parts = published_parts(final, spec)
        if not parts:
            raise MissingPartsError(f"no part of {final} is published yet in {root}")
        if len({repr(p.identity) for p in parts}) > 1 or len({p.n_examples for p in parts}) > 1:
            raise ConfigError(f"{root} holds parts of different captures; delete the stale ones")
        gaps = missing_ranges(parts, parts[0].n_examples)
        if gaps:
            raise MissingPartsError(
                f"cannot publish {final}: no finished part holds examples "
                + ", ".join(f"[{a}, {b})" for a, b in gaps)
                + f" of {parts[0].n_examples}. Rerun the machines of those slices (the same "
                "capture command with their --machine-id, or the Ray run again: finished "
                f"slices are kept), then `actstore merge {final}`", gaps
            )
        location = Path(spec.merge([p.path for p in parts], final))
        shutil.rmtree(root)
    log.info("published %s from %d parts", location, len(parts))
    return location


def _published(final: Path, spec: PartFormat) -> bool:
    from ..formats import get_format

    return get_format(spec.name).detect(str(final))


def _format_of(final: Path, fmt: str | PartFormat | None) -> PartFormat:
    if isinstance(fmt, PartFormat):
        return fmt
    if fmt is not None:
        return part_format(fmt)
    root = parts_root(final)
    for spec in part_formats():
        if root.is_dir() and any(spec.is_part(p) for p in root.iterdir() if p.is_dir()):
            return spec
        if _published(final, spec):
            return spec
    raise StoreNotFoundError(f"{final} has no parts of a distributed capture (looked in {root})")


def find_unmerged(out: str | Path) -> list[Path]:
    """Final locations with parts waiting under ``out``: ``out`` itself (pkl.gz) or stores
    inside it (saev: ``out/<hash>``)."""
    out = Path(out).expanduser().resolve()
    found = []
    if parts_root(out).is_dir():
        found.append(out)
    if out.is_dir():
        for root in sorted(out.glob(".*.parts")):
            found.append(out / root.name[1 : -len(".parts")])
        saev_root = out / "saev" / "shards"  # the saev dialect's layout
        if saev_root.is_dir():
            found += [saev_root / r.name[1:-6] for r in sorted(saev_root.glob(".*.parts"))]
    return found
