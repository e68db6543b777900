"""Merging parts, one job of :class:`~actstore.formats.writer.ShardedWriter`: published
parts of a distributed capture joined into the store, byte-identical to a one-process
capture."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConfigError
from ..storage import link_or_copy
from .journal import PART, part_checks, read_part
from .shard import ShardRecord
from .sharded import ShardedBase

if TYPE_CHECKING:
    from ..storage.integrity import Integrity

log = logging.getLogger(__name__)


class PartMerge(ShardedBase):
    """How a writer publishes its store from published parts."""

    def merge(self, part_dirs: Sequence[str | os.PathLike]) -> Path:
        """Publish this writer's store (opened for the whole capture, nothing written) from
        published parts in example order that together cover every example: shard files are
        hard-linked (copied across file systems), side files concatenated, statistics merged
        shard by shard in order, the index and manifest written as one process would.

        Example:
            >>> SaevWriter.from_plan(plan, out, options).merge(parts)  # doctest: +SKIP
        """
        if self.complete:
            return self.final
        parts = [Path(p) for p in part_dirs]
        if not parts:
            raise ConfigError("merging needs at least one part")
        shards: list[tuple[ShardRecord, Path]] = []  # each with the part holding it
        at = 0
        record = json.loads(json.dumps(self.record, default=str))
        checks = {part: part_checks(part) for part in parts}
        for part in parts:
            doc = read_part(part, checks[part])
            if doc["record"] != record:
                raise ConfigError(f"{part} belongs to a different capture than {self.final}")
            start, stop = doc["example_range"]
            if start != at:
                raise ConfigError(f"{part} starts at example {start}, expected {at}")
            at = stop
            shards += [(ShardRecord.from_doc(e, str(part / PART)), part) for e in doc["shards"]]
        if at != self.plan.n_examples:
            raise ConfigError(f"the parts end at example {at} of {self.plan.n_examples}")
        self._begin()
        try:
            self._merge_into(self.partial, parts, shards, checks)
        except BaseException:
            self.abort()
            raise
        log.info("merged %d parts into %s (%d shards)", len(parts), self.final, len(shards))
        return self.final

    def _merge_into(
        self,
        work: Path,
        parts: list[Path],
        shards: list[tuple[ShardRecord, Path]],
        checks: dict[Path, Integrity],
    ) -> None:
        side_names = sorted(shards[-1][0].sides) if shards else []
        sides = {n: open(work / n, "wb") for n in side_names}  # noqa: SIM115 - closed below
        try:
            for part in parts:
                for name, handle in sides.items():
                    for piece in checks[part].read_pieces(name):
                        handle.write(piece)
            for entry, source in shards:
                for name in entry.files:
                    link_or_copy(source / name, work / name)
                    self._digests[name] = checks[source].digests(name)
                for name in entry.chunks:
                    link_or_copy(source / name, work / name)
            sizes = {n: h.tell() for n, h in sides.items()}
        finally:
            for handle in sides.values():
                handle.flush()
                os.fsync(handle.fileno())
                handle.close()
        self._shards = [dataclasses.replace(entry, sides=sizes) for entry, _ in shards]
        stats = self.statistics()
        self.write_index(work, self._shards, stats)
        self._write_manifest(work, self._shards, self.summary(self._rows(stats)))
        self._finish_publication()
