"""Publication, one job of :class:`~actstore.formats.writer.ShardedWriter`: the format's
index, then the root manifest (every file's size and keyed block digests) last; then the
bookkeeping is removed, the files made read-only and the directory renamed into place. A
crash after the manifest is written is finished by the next open of the same capture."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import CaptureError
from ..faults import point
from ..storage import atomic_write_json, fsync_dir, make_tree_read_only, remove_tree
from ..storage.manifest import ManifestBuilder
from .journal import BOOKKEEPING, PART
from .shard import ShardRecord
from .sharded import ShardedBase

log = logging.getLogger(__name__)


class Publication(ShardedBase):
    """How a writer publishes its store."""

    def sealed_files(self) -> list[tuple[str, os.PathLike]]:
        """Every finished shard's files, named as published (relative to the output)."""
        if self.complete:
            return []
        rel = self.final.relative_to(self.output).as_posix()
        prefix = "" if rel == "." else rel + "/"
        return [
            (prefix + name, self.partial / name)
            for e in self._shards
            for name in [*e.files, *e.chunks]
        ]

    def close(self) -> Path:
        """Finish the last shard, write the index and the root manifest, publish; returns
        the store's directory."""
        if self.complete:
            return self.final
        if self._lock is None:
            raise CaptureError(f"the writer of {self.final} was aborted; nothing to publish")
        start, stop = self.example_range
        if self._sink is not None and self.position == stop:
            self._finish_shard(self._shard_index)
        try:
            self._drain_commits()
        except BaseException:
            self.abort()
            raise
        self._shutdown_pools()
        total = sum(e.n_examples for e in self._shards)
        if total != stop - start:
            self.abort()
            where = (
                f"rerun the same capture to resume from {self.partial}"
                if self.partial.exists()
                else "no shard was finished, so nothing was kept"
            )
            raise CaptureError(
                f"only {self.position - start} of {stop - start} examples were written; {where}"
            )
        try:
            self._close_sides()
            stats = self.statistics()
            if self.is_part:
                atomic_write_json(self.partial / PART, self._part_doc(), indent=None)
            if not self.is_part or self.parts_are_stores:
                self.write_index(self.partial, self._shards, stats)
            point(f"{self.format_name}.index_written")
            self._write_manifest(self.partial, self._shards, self.summary(self._rows(stats)))
            point(f"{self.format_name}.manifest_written")
            self._finish_publication()
        except BaseException:
            self.abort()  # the finished shards stay: a rerun publishes them
            raise
        log.info("published %s (%d shards, %d examples)", self.final, len(self._shards), total)
        return self.final

    def _part_doc(self) -> dict[str, Any]:
        return {
            "example_range": list(self.example_range),
            "record": self.record,
            "plan": self.plan.to_json_dict(),
            "options": dataclasses.asdict(self.options),
            "shards": [e.to_doc() for e in self._shards],
        }

    def _write_manifest(
        self, directory: Path, shards: Sequence[ShardRecord], summary: dict[str, Any]
    ) -> None:
        builder = ManifestBuilder(
            format=self.format_name, store_id=self.store_id, record=self.record
        )
        for entry in shards:
            for name, file in entry.files.items():
                builder.add(name, file, self._digests[name])
        for name in self._side_names(directory, shards):
            builder.add_file(directory, name, unit=self.side_unit(name))
        builder.add_tree(directory, skip=self.manifest_skip(), exclude=BOOKKEEPING)
        builder.write(directory, summary=summary)

    def _side_names(self, directory: Path, shards: Sequence[ShardRecord]) -> list[str]:
        names = set(shards[-1].sides) if shards else set()
        return sorted(n for n in names if (directory / n).is_file())

    def _finish_publication(self) -> None:
        """Drop the bookkeeping, make the files read-only, rename the partial directory
        into place, release the lock (also finishes a publication a crash cut short)."""
        for name in BOOKKEEPING:
            _remove(self.partial / name)
        point(f"{self.format_name}.bookkeeping_removed")
        make_tree_read_only(self.partial)
        if self.final.is_dir() and not any(self.final.iterdir()):
            self.final.rmdir()  # an empty directory made for the output
        self.final.parent.mkdir(parents=True, exist_ok=True)
        fsync_dir(self.partial)
        os.rename(self.partial, self.final)
        fsync_dir(self.final.parent)
        point(f"{self.format_name}.published")
        self.complete = True
        self.resume_from = self.example_range[1]
        self._release()

    def _close_sides(self) -> None:
        for handle in self._sides.values():
            handle.flush()
            os.fsync(handle.fileno())
            handle.close()
        self._sides.clear()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        remove_tree(path)
    else:
        path.unlink(missing_ok=True)
