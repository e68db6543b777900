"""Resume, one job of :class:`~actstore.formats.writer.ShardedWriter`: at open, a
published store of this capture is complete, a publication cut short is finished, and an
unfinished one is resumed: recorded shards whose files still hash to their digests are
kept, everything after them deleted, side files truncated to match."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from ..errors import CorruptStoreError, OtherCaptureError, StoreExistsError
from ..faults import point
from ..storage import remove_tree
from ..storage.manifest import MANIFEST, RootManifest, hash_file_blocks, hash_ranges, store_id_of
from .journal import BOOKKEEPING, PROGRESS, read_journal
from .pipeline import put_intact
from .shard import ShardRecord
from .sharded import ShardedBase, files_below

log = logging.getLogger(__name__)


class Resume(ShardedBase):
    """How a writer opens over what an earlier attempt left."""

    def _open(self) -> None:
        if self.final.exists() and not (self.final.is_dir() and not any(self.final.iterdir())):
            self._check_published()
            return
        if self.partial.exists():
            if (self.partial / MANIFEST).is_file():  # crashed between manifest and rename
                self._check_record(self.partial)
                self._finish_publication()
                return
            self._resume()

    def _check_record(self, directory: Path) -> None:
        """``directory``'s root manifest was written for this capture record, or refuse."""
        try:
            manifest = RootManifest.from_bytes(
                (directory / MANIFEST).read_bytes(), str(directory / MANIFEST)
            )
        except (OSError, CorruptStoreError) as err:
            raise StoreExistsError(
                f"{directory} holds a publication cut short with an unreadable manifest "
                f"({err}); delete it to start this capture over"
            ) from err
        if manifest.record != self.store_id:
            raise StoreExistsError(
                f"{directory} holds another capture, cut short while publishing; rerun that "
                "capture to finish it, or delete the directory to start this one"
            )

    def _check_published(self) -> None:
        """``final`` holds a store: ours with this record (complete), or refuse."""
        from ..storage.files import LocalFiles
        from ..storage.integrity import Integrity

        try:
            checks = Integrity.open(LocalFiles(self.final))
            damaged = checks.small_file_faults()
            manifest = checks.manifest
        except CorruptStoreError as err:
            manifest, damaged = None, [str(err)]
        if damaged and manifest is not None and manifest.record == store_id_of(self.record):
            raise StoreExistsError(
                f"{self.final} holds this capture, damaged ({damaged[0]}); run actstore verify "
                "on it, then move it away or restore it"
            )
        if manifest is not None and manifest.record != store_id_of(self.record):
            raise OtherCaptureError(
                f"{self.final} holds another capture (its record is not this one's); "
                "choose another output or move it away",
                location=str(self.final),
            )
        if manifest is None:
            raise StoreExistsError(
                f"{self.final} already holds something else (another capture, a damaged store "
                "or files not written by actstore); choose another output or move it away"
            )
        self.complete = True
        self.resume_from = self.example_range[1]
        self._release()
        log.info("%s is already published; nothing to write", self.final)

    def _resume(self) -> None:
        """Keep recorded shards whose files still hash to their digests; drop the rest."""
        try:
            progress, entries = read_journal(self.partial)
            recorded = progress["record"]
            self._init_names = [str(n) for n in progress["init"]]
            if not self.reproducible:
                self.started = float(progress["started"])
            self._elapsed_before = float(entries[-1]["elapsed"] if entries else progress["elapsed"])
        except (CorruptStoreError, KeyError, TypeError, ValueError, OSError) as err:
            log.warning("%s is unreadable (%s); starting this capture over", self.partial, err)
            remove_tree(self.partial)
            return
        if recorded != json.loads(json.dumps(self.record, default=str)):
            raise StoreExistsError(
                f"{self.partial} holds an unfinished capture with another configuration; "
                "rerun that capture to finish it, or delete the directory to start this one"
            )
        kept: list[ShardRecord] = []
        for doc in entries:
            index = self.first_shard + len(kept)
            try:
                entry = ShardRecord.from_doc(doc, f"{self.partial / PROGRESS} (shard {index})")
            except CorruptStoreError as err:
                log.warning("%s; rewriting from shard %d", err, index)
                break
            if entry.index != index or entry.n_examples != self._shard_size(index):
                break
            if not self.shard_intact(entry):
                log.warning(
                    "shard %d of %s fails its checksums; rewriting from there", index, self.partial
                )
                break
            kept.append(entry)
        keep = {name for e in kept for name in e.files}
        sides = kept[-1].sides if kept else {}
        skip = tuple(f.strip("/") + "/" for f in self.manifest_skip())
        for name in files_below(self.partial, exclude=BOOKKEEPING):
            if name in keep or name in sides or name in self._init_names:
                continue
            if any(name.startswith(f) for f in skip):
                continue  # the format's own chunk folders: discard_after decides
            (self.partial / name).unlink()
        for name, size in sides.items():
            path = self.partial / name
            if not path.is_file() or path.stat().st_size < size:
                log.warning("%s is shorter than its finished shards; starting over", path)
                remove_tree(self.partial)
                return
            os.truncate(path, size)
        self._shards = kept
        self._created = True
        self.resume_from = self.example_range[0] + sum(e.n_examples for e in kept)
        self.discard_after(self.partial, self.resume_from)
        self._save_progress()
        point(f"{self.format_name}.resumed")
        log.info(
            "resuming %s: %d finished shards (%d examples) kept",
            self.partial,
            len(kept),
            self.resume_from - self.example_range[0],
        )

    def shard_intact(self, entry: ShardRecord) -> bool:
        """On resume: whether recorded shard ``entry``'s files still hash to their digests,
        and the files it put whole (:meth:`put_files`: zarr's chunks) to theirs."""
        try:
            for name, want in entry.files.items():
                path = self.partial / name
                if not path.is_file() or path.stat().st_size != want.size:
                    return False
                if want.ranges is not None:
                    got, digests = hash_ranges(self.store_id, name, path.read_bytes(), want.ranges)
                else:
                    got, digests = hash_file_blocks(self.store_id, path, name, want.unit)
                if got.digest != want.digest:
                    return False
                self._digests[name] = digests
            puts = self.put_files(entry)
        except (CorruptStoreError, KeyError, TypeError, ValueError, AttributeError, OSError):
            return False
        if puts is None:
            return False
        return all(put_intact(self.partial / n, self.store_id, i, d) for n, i, d in puts)
