"""Write a saev protocol 2.1 directory, crash-safely and resumably.

A writer holds the store's lock (``.<HASH>.lock``, see :mod:`actstore.storage.lock`)
from open to close. ``<dump_to>/.<HASH>.partial/`` is created complete (metadata.json and
an empty progress.json) under a temporary name and renamed, so a crash leaves no partial
directory or a resumable one. Shards are appended sequentially into it; each write is
digested block by block (xxh3, one block per example and layer). When a shard is full it
is fsynced, its block checksums are written beside it (``acts000000.bin.xxh3``) and it is
recorded (with its statistics) in ``progress.json``; a crashed capture rerun with the same
config finds that directory, re-checks the finished shards, drops the unfinished one and
resumes at the next shard. ``close()`` writes shards.json, statistics.json and the
manifest checksums.xxh128, renames the directory to ``<dump_to>/<HASH>``, removes
progress.json and makes the files read-only. Readers never accept a ``.partial``
directory. Every step calls :func:`actstore.faults.point` (crash tests).

Files besides the spec's: ``statistics.json`` (per-layer mean/variance/norm),
``acts*.bin.xxh3`` (block checksums, :mod:`actstore.storage.blocksums`),
``checksums.xxh128`` (``xxhsum -c`` format: xxh3-128 of every other file except the
shards, which their sidecars cover), ``tokens.bin`` (int32 ``[n_examples, T]`` token ids,
text models) and ``classes.json`` (label names, when labels.bin holds classes).

Example:
    >>> w = SaevWriter(metadata, dump_to="/scratch/acts")  # doctest: +SKIP
    >>> for batch in batches: w.write(batch)  # doctest: +SKIP
    >>> w.close()  # doctest: +SKIP
    PosixPath('/scratch/acts/3f1c...')
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...batch import Batch, CapturePlan
from ...errors import CaptureError, ConfigError, CorruptStoreError, StoreExistsError
from ...faults import point
from ...stats import RunningStats, merge_all
from ...storage import (
    atomic_write_bytes,
    atomic_write_json,
    fsync_dir,
    hash_file,
    make_read_only,
    publish_dir,
    read_json,
)
from ...storage.blocksums import BlockHasher, hash_blocks_of_file, sidecar_name
from ...storage.lock import StoreLock
from ..base import WriterBase
from .layout import (
    DEFAULT_PATCHES_PER_SHARD,
    SaevMetadata,
    encode_data,
    encode_saev_img_folder,
    shard_name,
)

log = logging.getLogger(__name__)

PROGRESS = "progress.json"
CHECKSUMS = "checksums.xxh128"
#: The manifest of stores written before block checksums (whole-file sha256).
LEGACY_CHECKSUMS = "checksums.sha256"
STATISTICS = "statistics.json"
PART = "part.json"


def saev_metadata(
    plan: CapturePlan,
    *,
    dialect: str = "protocol",
    patches_per_shard: int = DEFAULT_PATCHES_PER_SHARD,
) -> SaevMetadata:
    """The metadata a capture ``plan`` produces (the content hash depends on all of it)."""
    if any(site.kind != "resid" for site in plan.sites):
        raise ConfigError(
            "the saev protocol stores the residual stream only (its 'layers'); capture "
            "attention/MLP sites into the zarr, activault or pickle formats"
        )
    data = encode_data(plan.data)
    if dialect == "saev" and plan.data.get("kind") == "image_folder":
        files = plan.extras.get("image_files")
        if files is None or tuple(files) == imagefolder_files(plan.dataset_root):
            data = encode_saev_img_folder(plan.dataset_root)
        else:
            log.warning(
                "saev's ImgFolder (torchvision's ImageFolder) lists the images of %s differently "
                "from this capture (images outside class folders, .gif/.ppm/.pgm files or "
                "nested folders), so metadata 'data' does not claim ImgFolder: saev trains on "
                "these shards, but its visuals cannot map examples back to images. Keep only "
                "class folders of .jpg/.png/... images to get an ImgFolder.",
                plan.dataset_root,
            )
    return SaevMetadata(
        family=plan.family,
        ckpt=plan.ckpt,
        layers=tuple(plan.layers),
        patches_per_ex=plan.tokens_per_example - (1 if plan.has_cls else 0),
        cls_token=plan.has_cls,
        d_model=plan.d_model,
        n_examples=plan.n_examples,
        patches_per_shard=patches_per_shard,
        data=data,
        dataset=plan.dataset_root,
        dialect=dialect,
    )


#: torchvision's IMG_EXTENSIONS (saev's ImgFolder reads folders with torchvision's ImageFolder).
IMAGEFOLDER_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def plan_arguments(
    plan: CapturePlan, dialect: str, patches_per_shard: int
) -> tuple[SaevMetadata, dict[str, Any]]:
    """The metadata and writer keywords a capture ``plan`` gives (local or S3 writers)."""
    metadata = saev_metadata(plan, dialect=dialect, patches_per_shard=patches_per_shard)
    return metadata, {
        "has_tokens": plan.has_tokens,
        "classes": plan.classes,
        "has_labels": plan.has_labels,
    }


def imagefolder_files(root: str) -> tuple[str, ...]:
    """The images torchvision's ``ImageFolder(root)`` (hence saev's ``ImgFolder``) indexes,
    in its order: class folders sorted by name, each walked with ``sorted(os.walk(...))``,
    file names sorted; files directly under ``root`` are not examples.

    Example:
        >>> imagefolder_files("/data/imagenet/val")[:1]  # doctest: +SKIP
        ('/data/imagenet/val/n01440764/ILSVRC2012_val_00000293.JPEG',)
    """
    with os.scandir(root) as entries:
        classes = sorted(e.name for e in entries if e.is_dir())
    out = []
    for name in classes:
        for dirpath, _, files in sorted(os.walk(os.path.join(root, name), followlinks=True)):
            out += [
                os.path.join(dirpath, f)
                for f in sorted(files)
                if f.lower().endswith(IMAGEFOLDER_EXTENSIONS)
            ]
    return tuple(out)


def store_dir(metadata: SaevMetadata, dump_to: str | os.PathLike) -> Path:
    """Where the published directory goes: ``<dump_to>/<HASH>`` or, for the saev dialect,
    ``<dump_to>/saev/shards/<h8>`` (saev's readers require the ``saev/shards`` parents)."""
    root = Path(dump_to).expanduser().resolve()
    if metadata.dialect == "saev" and root.parts[-2:] != ("saev", "shards"):
        root = root / "saev" / "shards"
    return root / metadata.content_hash()


class SaevWriter(WriterBase):
    """Writer for one saev directory; see the module docstring for the crash protocol.

    With ``example_range=(start, stop)`` it writes one part of a distributed capture
    instead: examples ``[start, stop)`` of the store ``metadata`` describes (``start`` on a
    shard boundary, shards numbered globally) into the directory ``dump_to`` itself, which
    it publishes with a ``part.json`` manifest; :func:`merge_parts` joins the parts.
    """

    def __init__(
        self,
        metadata: SaevMetadata,
        dump_to: str | os.PathLike,
        *,
        has_tokens: bool = False,
        classes: list[str] | None = None,
        has_labels: bool = False,
        example_range: tuple[int, int] | None = None,
        break_lock: bool = False,
    ) -> None:
        self.metadata = metadata
        self.is_part = example_range is not None
        self.example_range = _check_part_range(metadata, example_range)
        self._first_shard = self.example_range[0] // metadata.examples_per_shard
        self.dump_to = Path(dump_to).expanduser().resolve()
        if self.is_part:
            self.final_dir = self.dump_to
        else:
            self.final_dir = store_dir(metadata, dump_to)
        self.partial_dir = self.final_dir.parent / f".{self.final_dir.name}.partial"
        self.has_tokens, self.has_labels, self.classes = has_tokens, has_labels, classes
        if has_labels and classes is not None and len(classes) > 256:
            raise ConfigError(f"labels.bin holds uint8 labels; {len(classes)} classes do not fit")
        self.complete = False
        self.resume_from = self.example_range[0]
        self._shards: list[dict[str, Any]] = []
        self._file = None
        self._io: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._hasher: BlockHasher | None = None
        self._stats: _ShardStats | None = None
        self._in_shard = 0
        self._written = 0  # examples written by this process (after resume_from)
        self._side_files: dict[str, Any] = {}
        self._lock = StoreLock.acquire(self.final_dir, break_lock=break_lock)
        try:
            self._open()
        except BaseException:
            self.abort()
            raise

    @classmethod
    def from_plan(
        cls,
        plan: CapturePlan,
        dump_to: str | os.PathLike,
        *,
        dialect: str = "protocol",
        patches_per_shard: int = DEFAULT_PATCHES_PER_SHARD,
        break_lock: bool = False,
    ) -> SaevWriter:
        """The writer for a capture plan (used as ``open_writer`` by capture)."""
        metadata, kwargs = plan_arguments(plan, dialect, patches_per_shard)
        return cls(metadata, dump_to, break_lock=break_lock, **kwargs)

    # ------------------------------------------------------------------ open / resume

    def _open(self) -> None:
        md = self.metadata
        if self.final_dir.exists():
            self._check_existing(self.final_dir)
            leftover = self.final_dir / PROGRESS  # a crash between publish and cleanup
            if leftover.exists():
                leftover.unlink()
                make_read_only(self.final_dir)
            self.complete = True
            self.resume_from = self.example_range[1]
            self._lock.release()
            log.info("%s is already published; nothing to write", self.final_dir)
            return
        self.final_dir.parent.mkdir(parents=True, exist_ok=True)
        if self.partial_dir.exists():
            self._check_existing(self.partial_dir)
            self._resume()
        else:
            # Built complete under a temporary name, then renamed: a crash leaves either no
            # partial directory or one a rerun can resume.
            init = self.partial_dir.with_name(self.partial_dir.name + "-init")
            if init.exists():
                shutil.rmtree(init)  # a crash while creating it (we hold the lock)
            init.mkdir()
            point("saev.init_created")
            atomic_write_bytes(init / "metadata.json", md.to_json_text().encode())
            atomic_write_json(init / PROGRESS, {"shards": []})
            point("saev.init_filled")
            os.rename(init, self.partial_dir)
            fsync_dir(self.partial_dir.parent)
            point("saev.partial_created")
        for name, needed in (("tokens.bin", self.has_tokens), ("labels.bin", self.has_labels)):
            if needed:
                done = self.resume_from - self.example_range[0]
                f = open(self.partial_dir / name, "r+b" if done else "wb")  # noqa: SIM115 - open until close()
                f.truncate(done * self._side_row_bytes(name))
                f.seek(0, os.SEEK_END)
                self._side_files[name] = f

    def _side_row_bytes(self, name: str) -> int:
        md = self.metadata
        return md.tokens_per_ex * 4 if name == "tokens.bin" else md.patches_per_ex

    def _check_existing(self, directory: Path) -> None:
        found = read_json(directory / "metadata.json")
        if found != self.metadata.to_json_dict():
            raise StoreExistsError(
                f"{directory} exists with different metadata (a hash collision or an edited "
                "file); move it away or choose another output directory"
            )

    def _resume(self) -> None:
        """Keep finished shards whose checksums still match; drop everything after them."""
        try:
            progress = read_json(self.partial_dir / PROGRESS)
            entries = list(progress["shards"])
        except (CorruptStoreError, KeyError, TypeError) as err:
            log.warning("%s is unreadable (%s); starting the capture over", PROGRESS, err)
            entries = []
        kept: list[dict[str, Any]] = []
        for entry in entries:
            if not isinstance(entry, dict):
                break
            index = self._first_shard + len(kept)
            if (
                index >= self.metadata.n_shards
                or entry.get("name") != shard_name(index)
                or entry.get("n_examples") != self.metadata.shard_examples(index)
            ):
                break  # a kept shard must hold its full count, or later examples would shift
            path = self.partial_dir / entry["name"]
            side = self.partial_dir / sidecar_name(entry["name"])
            expected = self.metadata.shard_nbytes(index)
            if not path.exists() or path.stat().st_size != expected or not side.exists():
                break
            raw = side.read_bytes()
            recorded = np.frombuffer(raw[16:], dtype="<u8") if len(raw) >= 16 else None
            if (
                _xxh128(raw) != entry.get("blocks")
                or recorded is None
                or not np.array_equal(hash_blocks_of_file(path, self._unit), recorded)
            ):
                log.warning("%s fails its checksums; rewriting from there", path)
                break
            kept.append(entry)
        keep_names = (
            {e["name"] for e in kept}
            | {sidecar_name(e["name"]) for e in kept}
            | {
                "metadata.json",
                PROGRESS,
                "tokens.bin",
                "labels.bin",
            }
        )
        for child in self.partial_dir.iterdir():
            if child.name not in keep_names:
                child.unlink()
        self._shards = kept
        self.resume_from = self.example_range[0] + sum(e["n_examples"] for e in kept)
        for name in ("tokens.bin", "labels.bin"):
            side = self.partial_dir / name
            need = (self.resume_from - self.example_range[0]) * self._side_row_bytes(name)
            if side.exists() and side.stat().st_size < need:
                raise CorruptStoreError(
                    f"{side} is shorter than its finished shards; "
                    f"delete {self.partial_dir} and capture again"
                )
        atomic_write_json(self.partial_dir / PROGRESS, {"shards": kept})
        point("saev.resumed")
        log.info(
            "resuming %s: %d finished shards (%d examples) kept",
            self.partial_dir,
            len(kept),
            self.resume_from - self.example_range[0],
        )

    @property
    def _unit(self) -> int:
        """Checksum block: one example's tokens at one layer (what a loader block reads)."""
        md = self.metadata
        return md.tokens_per_ex * md.d_model * 4

    # ------------------------------------------------------------------ writing

    def write(self, batch: Batch) -> None:
        """Append ``batch``'s examples (those not already stored) in order."""
        if self.complete:
            raise CaptureError(f"{self.final_dir} is already published")
        md = self.metadata
        start = self.resume_from + self._written
        keep = batch.example_ids >= start
        if not keep.all():
            batch = batch.select(keep)
        if batch.n_examples == 0:
            return
        expected = np.arange(start, start + batch.n_examples)
        if not np.array_equal(batch.example_ids, expected):
            raise CaptureError(
                f"batches must arrive in example order: expected ids from {start}, "
                f"got {batch.example_ids[:4].tolist()}..."
            )
        if start + batch.n_examples > self.example_range[1]:
            raise CaptureError(
                f"examples beyond {self.example_range[1]}, the end of what this writer holds"
            )
        acts = _layer_arrays(batch, md)  # L x [B, T, D] float32, no copy
        self._write_side(batch, md)
        row = 0
        while row < batch.n_examples:
            if self._file is None:
                self._start_shard()
            room = md.examples_per_shard - self._in_shard
            parts = [a[row : row + room] for a in acts]
            self._append(parts)
            point("saev.appended")
            row += len(parts[0])
            if self._in_shard == md.examples_per_shard:
                self._finish_shard()
        self._wait_io()  # the batch's memory is the caller's again once write() returns
        self._written += batch.n_examples

    def _write_side(self, batch: Batch, md: SaevMetadata) -> None:
        if "tokens.bin" in self._side_files:
            if batch.token_ids is None:
                raise CaptureError("this store keeps token ids but the batch has none")
            self._side_files["tokens.bin"].write(batch.token_ids.astype("<i4").tobytes())
        if "labels.bin" in self._side_files:
            if batch.labels is None:
                raise CaptureError("this store keeps labels but the batch has none")
            if batch.labels.min() < 0 or batch.labels.max() > 255:
                raise CaptureError("labels must lie in 0..255 to fit labels.bin (uint8)")
            per_patch = np.repeat(batch.labels.astype(np.uint8)[:, None], md.patches_per_ex, 1)
            self._side_files["labels.bin"].write(per_patch.tobytes())

    def _start_shard(self) -> None:
        index = self._first_shard + len(self._shards)
        self._file = open(self.partial_dir / shard_name(index), "wb", buffering=0)  # noqa: SIM115 - open until the shard ends
        self._hasher = BlockHasher(self._unit)
        md = self.metadata
        self._stats = _ShardStats(len(md.layers), md.tokens_per_ex, md.d_model)
        self._in_shard = 0

    def _append(self, parts: list[np.ndarray]) -> None:
        """Append the shard's next examples, given per layer (``[n, T, D]`` each).

        Each (example, layer) slab is one checksum block and, in the file, follows the
        previous one: one gathered write (``writev``) straight from the capture's tensors,
        on the I/O thread, while this thread digests the slabs and folds them into the
        statistics (file writes, xxhash and numpy release the GIL). No copy is made; at
        most one write is in flight, and none outlives :meth:`write`."""
        n = len(parts[0])
        slabs = [memoryview(a[i]).cast("B") for i in range(n) for a in parts]
        self._wait_io()
        if self._io is None:
            self._io = ThreadPoolExecutor(1, thread_name_prefix="saev-writer-io")
        self._pending = self._io.submit(_write_all, self._file.fileno(), slabs)
        self._hasher.update_blocks(slabs)
        self._stats.update(parts)
        self._in_shard += n

    def _wait_io(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _stop_io(self) -> None:
        io, self._io = self._io, None
        if io is not None:
            io.shutdown()
        self._wait_io()

    def _finish_shard(self) -> None:
        """Pad (saev dialect), fsync and record the current shard as finished."""
        md = self.metadata
        index = self._first_shard + len(self._shards)
        pad = md.shard_nbytes(index) - self._in_shard * md.example_nbytes
        self._wait_io()
        if pad:
            zeros = bytes(pad)
            _write_all(self._file.fileno(), [memoryview(zeros)])
            self._hasher.update(zeros)
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        point("saev.shard_synced")
        sidecar = self._hasher.sidecar_bytes()
        atomic_write_bytes(self.partial_dir / sidecar_name(shard_name(index)), sidecar)
        point("saev.sidecar_written")
        for f in self._side_files.values():
            f.flush()
            os.fsync(f.fileno())
        self._shards.append(
            {
                "name": shard_name(index),
                "n_examples": self._in_shard,
                "blocks": _xxh128(sidecar),
                "stats": [s.to_dict() for s in self._stats.finish()],
            }
        )
        atomic_write_json(self.partial_dir / PROGRESS, {"shards": self._shards}, indent=None)
        point("saev.shard_recorded")

    def sealed_files(self) -> list[tuple[str, Path]]:
        """Every finished shard and its block checksums, named as published (``<HASH>/...``
        relative to ``dump_to``); they live in the ``.partial`` directory until close."""
        rel = self.final_dir.relative_to(self.dump_to).as_posix()
        prefix = "" if rel == "." else rel + "/"
        if self.complete:
            return []
        return [
            (prefix + name, self.partial_dir / name)
            for entry in self._shards
            for name in (entry["name"], sidecar_name(entry["name"]))
        ]

    # ------------------------------------------------------------------ publish

    def close(self) -> Path:
        """Finish the last shard, write the index files and publish the directory."""
        if self.complete:
            return self.final_dir
        md = self.metadata
        in_open_shard = self._in_shard if self._file is not None else 0
        total = sum(e["n_examples"] for e in self._shards) + in_open_shard
        start, stop = self.example_range
        if total != stop - start:
            # Leave the open shard unfinished: recording it (zero-padded) as finished would
            # make a resume keep a short shard and shift every later example.
            self.abort()
            raise CaptureError(
                f"only {total} of {stop - start} examples were written; rerun the same "
                f"capture to resume from {self.partial_dir}"
            )
        if self._file is not None:
            self._finish_shard()
        self._stop_io()
        for f in self._side_files.values():
            f.close()
        self._side_files.clear()
        d = self.partial_dir
        if self.is_part:
            atomic_write_json(
                d / PART, {"example_range": [start, stop], "shards": self._shards}, indent=None
            )
            if self.classes is not None and self.has_labels:
                atomic_write_json(d / "classes.json", self.classes)
        else:
            _write_index(d, md, self._shards, self.classes if self.has_labels else None)
        point("saev.index_written")
        publish_dir(d, self.final_dir)
        point("saev.published")
        (self.final_dir / PROGRESS).unlink()
        fsync_dir(self.final_dir)
        make_read_only(self.final_dir)
        self._lock.release()
        self.complete = True
        log.info("published %s (%d shards, %d examples)", self.final_dir, len(self._shards), total)
        return self.final_dir

    def abort(self) -> None:
        """Close files without publishing; finished shards stay for a resume."""
        with contextlib.suppress(Exception):  # the failed write is the caller's error
            self._stop_io()
        if self._file is not None:
            self._file.close()
            self._file = None
        for f in self._side_files.values():
            f.close()
        self._side_files.clear()
        self._lock.release()


class _ShardStats:
    """Per-layer statistics of one shard, folded in runs of examples counted from the shard
    start: the result does not depend on how batches (or a resume) split the shard."""

    def __init__(self, n_layers: int, tokens: int, d: int) -> None:
        self.stats = [RunningStats(d) for _ in range(n_layers)]
        self.per = max(1, self.stats[0].rows_per_chunk // tokens)
        self._pending = np.empty((n_layers, self.per, tokens, d), dtype="<f4")
        self._fill = 0

    def update(self, parts: list[np.ndarray]) -> None:
        """Fold the shard's next examples, given per layer (``[n, T, D]`` each). Whole runs
        are folded straight from the caller's arrays; only a run's ends are buffered."""
        i, n = 0, len(parts[0])
        if self._fill or n < self.per:
            take = min(self.per - self._fill, n)
            for buf, part in zip(self._pending, parts):
                buf[self._fill : self._fill + take] = part[:take]
            self._fill += take
            i = take
            if self._fill == self.per:
                self._fold(list(self._pending))
                self._fill = 0
        while n - i >= self.per:
            self._fold([part[i : i + self.per] for part in parts])
            i += self.per
        if i < n:
            for buf, part in zip(self._pending, parts):
                buf[: n - i] = part[i:]
            self._fill = n - i

    def finish(self) -> list[RunningStats]:
        if self._fill:
            self._fold([buf[: self._fill] for buf in self._pending])
            self._fill = 0
        return self.stats

    def _fold(self, chunks: list[np.ndarray]) -> None:
        for stats, chunk in zip(self.stats, chunks):
            stats.update(chunk)


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing these dirty pages to disk now, without waiting
    (Linux ``sync_file_range``): the disk works while the capture goes on, and the
    shard's ``fsync`` waits only for the tail."""
    if _SYNC_FILE_RANGE is not None and nbytes:
        _SYNC_FILE_RANGE(fd, ctypes.c_int64(offset), ctypes.c_int64(nbytes), 2)  # _WRITE


def _libc_sync_file_range():
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


_SYNC_FILE_RANGE = _libc_sync_file_range()


def _write_all(fd: int, views: list[memoryview]) -> None:
    """Write ``views`` one after another at the file position (``writev``, resuming
    after short writes), then start their writeback."""
    start = os.lseek(fd, 0, os.SEEK_CUR)
    total = sum(len(v) for v in views)
    _write_views(fd, views)
    _start_writeback(fd, start, total)


def _write_views(fd: int, views: list[memoryview]) -> None:
    max_iov = min(1024, os.sysconf("SC_IOV_MAX"))
    i = 0
    while i < len(views):
        batch = views[i : i + max_iov]
        done = os.writev(fd, batch)
        for view in batch:  # skip the views written, trim a partly written one
            if done >= len(view):
                done -= len(view)
                i += 1
                continue
            views[i] = view[done:]
            break


def _xxh128(data: bytes) -> str:
    import xxhash

    return xxhash.xxh3_128_hexdigest(data)


def _layer_arrays(batch: Batch, md: SaevMetadata) -> list[np.ndarray]:
    """The batch's ``resid.<layer>`` tensors as C-order float32 ``[B, T, D]`` arrays, one
    per stored layer (views of the tensors when they already are: no copy)."""
    try:
        tensors = [batch.acts[f"resid.{layer}"] for layer in md.layers]
    except KeyError as err:
        raise CaptureError(f"batch lacks site {err}; it has {sorted(batch.acts)}") from None
    arrays = [
        np.ascontiguousarray(t.detach().to(torch.float32).numpy(), dtype="<f4") for t in tensors
    ]
    want = (batch.n_examples, md.tokens_per_ex, md.d_model)
    for layer, array in zip(md.layers, arrays):
        if array.shape != want:
            raise CaptureError(
                f"batch activations of layer {layer} have shape {array.shape}, metadata says {want}"
            )
    return arrays


def remove_partial(final_dir: Path) -> None:
    """Delete the resumable partial directory of ``final_dir`` (to start over)."""
    partial = final_dir.parent / f".{final_dir.name}.partial"
    if partial.exists():
        shutil.rmtree(partial)


def _write_index(
    directory: Path, md: SaevMetadata, shards: list[dict[str, Any]], classes: list[str] | None
) -> None:
    """shards.json, statistics.json, classes.json and checksums.xxh128 of a finished store,
    from the shard records (name, n_examples, sidecar digest, per-layer stats) in shard
    order. The manifest lists every file but itself and the shards (covered by their
    sidecars, which it lists)."""
    d = directory
    atomic_write_json(
        d / "shards.json", [{"name": e["name"], "n_examples": e["n_examples"]} for e in shards]
    )
    atomic_write_json(
        d / STATISTICS,
        {
            "sites": {
                str(layer): merge_all(
                    [RunningStats.from_dict(e["stats"][i]) for e in shards]
                ).to_dict()
                for i, layer in enumerate(md.layers)
            }
        },
        indent=None,
    )
    if classes is not None:
        atomic_write_json(d / "classes.json", classes)
    lines = [f"{e['blocks']}  {sidecar_name(e['name'])}" for e in shards]
    for name in ("metadata.json", "tokens.bin", "labels.bin", "classes.json"):
        if (d / name).exists():
            lines.append(f"{hash_file(d / name, 'xxh128')}  {name}")
    for name in ("shards.json", STATISTICS):
        lines.append(f"{hash_file(d / name, 'xxh128')}  {name}")
    atomic_write_bytes(d / CHECKSUMS, ("\n".join(lines) + "\n").encode())


# ---------------------------------------------------------------------- distributed parts


def _check_part_range(md: SaevMetadata, example_range: tuple[int, int] | None) -> tuple[int, int]:
    if example_range is None:
        return (0, md.n_examples)
    start, stop = (int(x) for x in example_range)
    per = md.examples_per_shard
    if not 0 <= start < stop <= md.n_examples:
        raise ConfigError(
            f"example range [{start}, {stop}) is empty or outside [0, {md.n_examples})"
        )
    if start % per or (stop != md.n_examples and stop % per):
        raise ConfigError(
            f"a saev part must cover whole shards of {per} examples; [{start}, {stop}) does "
            "not (split the dataset with actstore.dist.split_examples)"
        )
    return (start, stop)


def read_part(part_dir: str | os.PathLike) -> tuple[SaevMetadata, dict[str, Any]]:
    """Metadata and ``part.json`` manifest of a published part directory."""
    part_dir = Path(part_dir)
    md = SaevMetadata.from_json_dict(
        read_json(part_dir / "metadata.json"), source=str(part_dir / "metadata.json")
    )
    manifest = read_json(part_dir / PART)
    try:
        start, stop = (int(x) for x in manifest["example_range"])
        held = sum(int(e["n_examples"]) for e in manifest["shards"])
    except (KeyError, TypeError, ValueError) as err:
        raise CorruptStoreError(
            f"{part_dir / PART} is malformed ({err!r}); re-capture this part"
        ) from err
    if held != stop - start:
        raise CorruptStoreError(
            f"{part_dir / PART} lists {held} examples for the range "
            f"[{start}, {stop}); re-capture this part"
        )
    return md, manifest


def merge_parts(part_dirs: Sequence[str | os.PathLike], final_dir: str | os.PathLike) -> Path:
    """Join published parts, in example order and together covering every example, into
    the store ``final_dir``. Shards are hard-linked (copied across file systems), token
    and label files concatenated, statistics merged shard by shard in order: the result is
    byte-identical to a single-process capture of the same activations.

    Example:
        >>> merge_parts(sorted(parts_root.glob("part-*")), "/scratch/acts/3f1c...")  # doctest: +SKIP
    """
    final_dir = Path(final_dir)
    if final_dir.exists():
        raise StoreExistsError(f"{final_dir} already exists; refusing to overwrite it")
    parts = [Path(p) for p in part_dirs]
    if not parts:
        raise ConfigError("merge_parts needs at least one part")
    md, _ = read_part(parts[0])
    shards: list[dict[str, Any]] = []
    expected_start = 0
    for part in parts:
        part_md, manifest = read_part(part)
        if part_md != md:
            raise ConfigError(f"{part} belongs to a different capture than {parts[0]}")
        start, stop = manifest["example_range"]
        if start != expected_start:
            raise ConfigError(f"{part} starts at example {start}, expected {expected_start}")
        expected_start = stop
        shards.extend(manifest["shards"])
    if expected_start != md.n_examples:
        raise ConfigError(f"the parts end at example {expected_start} of {md.n_examples}")
    work = final_dir.parent / f".{final_dir.name}.merging"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    shutil.copyfile(parts[0] / "metadata.json", work / "metadata.json")
    for part in parts:
        for entry in read_part(part)[1]["shards"]:
            for name in (entry["name"], sidecar_name(entry["name"])):
                _link_or_copy(part / name, work / name)
    for name in ("tokens.bin", "labels.bin"):
        if (parts[0] / name).exists():
            with open(work / name, "wb") as out:
                for part in parts:
                    with open(part / name, "rb") as f:
                        shutil.copyfileobj(f, out, 8 << 20)
    classes = read_json(parts[0] / "classes.json") if (parts[0] / "classes.json").exists() else None
    _write_index(work, md, shards, classes)
    publish_dir(work, final_dir)
    make_read_only(final_dir)
    log.info("merged %d parts into %s (%d shards)", len(parts), final_dir, len(shards))
    return final_dir


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
