"""Parts of a distributed capture, per format, and the merge that publishes them.

Every machine writes its slice as a *part* next to where the finished store will be, and
the merge publishes the store once the published parts tile ``[0, n_examples)`` exactly
and come from one capture configuration. A missing slice stops it with
:class:`MissingPartsError`, naming the examples to rerun: a store with a hole is never
published. Per format:

========  ==================================  ==========================================
format    parts                               merge
========  ==================================  ==========================================
saev      ``<out>/.<hash>.parts/part-A-B/``   shards hard-linked into ``<out>/<hash>``
          (whole shards, global numbering)    under one index: byte-identical to a
                                              single-process capture
pickle    ``<dir>/.<out>.parts/part-A-B/``    shards linked into ``<out>`` under one
          (each a pkl.gz store, one per       merged ``metadata.json`` (the spec's
          machine, spec sample ids)           "merge metadata files")
zarr      ``<out>/shards/shard-K.zarr``       ``<out>/manifest.json`` over the shards,
          (the format's sharded run)          read in place (no copy; ``merge_run``
                                              consolidates into one store if wanted)
activault ``<parent>/.<run>.parts/part-A-B``  files copied (server-side on S3, hard links
          (each an Activault run, local or    locally) into ``<run>`` with one group
          ``s3://``)                          numbering, merged statistics, ``cfg.json``
                                              last; parts deleted
========  ==================================  ==========================================

Parts of the saev, pickle and activault formats are whole shards/files (slices aligned
on them), so the merged store holds exactly what one process would have written; with
Activault's token cleaning the kept tokens per example vary, and each machine then drops
its own last partial file, as Activault's own distributed runs do (``dropped_tokens`` in
``cfg.json`` adds them up).

Example:
    >>> merge_store("/scratch/acts/3f1c...")  # doctest: +SKIP
    PosixPath('/scratch/acts/3f1c...')
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..errors import ActstoreError, CaptureError, ConfigError
from ..formats.parts import PartFormat, PartInfo, part_dir, parts_root
from ..formats.registry import available_formats, get_format
from ..storage.location import Location
from ..storage.lock import FileLock

__all__ = [
    "MissingPartsError",
    "PartFormat",
    "PartInfo",
    "find_unmerged",
    "is_published",
    "merge_store",
    "missing_ranges",
    "part_dir",
    "part_format",
    "part_formats",
    "parts_root",
]

log = logging.getLogger(__name__)


class MissingPartsError(CaptureError):
    """A distributed capture cannot be merged: some slices have no published part."""

    def __init__(self, message: str, missing: list[tuple[int, int]] | None = None) -> None:
        super().__init__(message)
        self.missing = missing or []
        """The example ranges ``[start, stop)`` no finished part holds."""


# ---------------------------------------------------------------------- formats


def part_format(name: str) -> PartFormat:
    """The :class:`PartFormat` of storage format ``name`` (its ``FormatSpec.parts``)."""
    spec = get_format(name)
    if spec.parts is None:
        with_parts = [f.name for f in available_formats() if f.parts is not None]
        raise ConfigError(
            f"distributed capture does not support the {name!r} format yet; "
            f"formats with parts: {', '.join(with_parts)}"
        )
    return spec.parts()


def part_formats() -> list[PartFormat]:
    """Every format that captures in parts and whose code is importable."""
    return [spec.parts() for spec in available_formats() if spec.parts is not None]


# ---------------------------------------------------------------------- merge


def missing_ranges(parts: list[PartInfo], n_examples: int) -> list[tuple[int, int]]:
    """Example ranges no part covers. Overlapping parts (two splittings mixed) are an error.

    Example:
        >>> p = lambda a, b: PartInfo(path=Path("."), start=a, stop=b, n_examples=9, identity=0)
        >>> missing_ranges([p(0, 3), p(6, 9)], 9)
        [(3, 6)]
    """
    gaps, at = [], 0
    for part in sorted(parts, key=lambda p: (p.start, p.stop)):
        if part.start < at:
            raise ConfigError(
                f"parts overlap at example {part.start} ({part.path}): they come from "
                "captures with different --num-machines or shard sizes; delete the parts of "
                "one of them"
            )
        if part.start > at:
            gaps.append((at, part.start))
        at = part.stop
    if at < n_examples:
        gaps.append((at, n_examples))
    return gaps


def is_published(final: Path | str, fmt: str | PartFormat) -> bool:
    """True when the store at ``final`` opens with its format's reader (a half-merged or
    unmerged store does not)."""
    name = fmt.name if isinstance(fmt, PartFormat) else fmt
    spec = get_format(name)
    if not Location.parse(final).exists() or not spec.detect(
        Location.parse(final).files(cache=False)
    ):
        return False
    try:
        reader = spec.open_reader(str(final))
    except ActstoreError:
        return False
    reader.close()
    return True


def merge_store(final: Path | str, fmt: str | PartFormat) -> Path | str:
    """Publish the store ``final`` of format ``fmt`` from its parts; returns its location.

    Raises :class:`MissingPartsError` if a slice has no published part (then nothing is
    published). An already published store is returned as it is. Machines finishing
    together queue on a lock file next to a local store; for object storage the merge is
    idempotent (a second merger finding the store published just returns it).
    """
    layout = fmt if isinstance(fmt, PartFormat) else part_format(fmt)
    if "://" not in str(final):
        final = Path(final).expanduser().resolve()
    if is_published(final, layout):
        return final
    if isinstance(final, str):
        try:
            return _merge(final, layout)
        except ActstoreError:
            if is_published(final, layout):
                return final
            raise
    lock_path = final.parent / f".{final.name}.merge.lock"
    final.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(lock_path)
    with lock:
        if is_published(final, layout):
            return final
        location = _merge(final, layout)
        lock.release(remove=True)
    return location


def _merge(final: Path | str, layout: PartFormat) -> Path | str:
    parts = sorted(layout.list_parts(final), key=lambda p: (p.start, p.stop))
    if not parts:
        raise MissingPartsError(f"no part of {final} is published yet")
    if len({repr(p.identity) for p in parts}) > 1 or len({p.n_examples for p in parts}) > 1:
        raise ConfigError(
            f"the parts of {final} come from different captures; delete the stale ones"
        )
    gaps = missing_ranges(parts, parts[0].n_examples)
    if gaps:
        raise MissingPartsError(
            f"cannot publish {final}: no finished part holds examples "
            + ", ".join(f"[{a}, {b})" for a, b in gaps)
            + f" of {parts[0].n_examples}. Rerun the machines of those slices (the same "
            "capture command with their --machine-id, or the Ray run again: finished "
            "slices are kept), then `actstore merge` the output",
            gaps,
        )
    location = layout.merge(parts, final)
    log.info("published %s from %d parts", location, len(parts))
    return location


def find_unmerged(out: str | Path) -> list[tuple[Path | str, PartFormat]]:
    """``(final location, format)`` of every capture under ``out`` (a directory, or an
    ``s3://`` run for Activault) whose parts are waiting."""
    if "://" not in str(out):
        out = Path(out).expanduser().resolve()
    found: list[tuple[Path | str, PartFormat]] = []
    for fmt in part_formats():
        if isinstance(out, str) and not fmt.remote:
            continue
        try:
            found += [(final, fmt) for final in fmt.pending(out)]
        except ActstoreError:
            continue
    return found
