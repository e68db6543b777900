"""Write a saev protocol 2.1 directory: the format's part of the crash protocol.

:class:`SaevWriter` is a :class:`~actstore.formats.writer.ShardedWriter` (which owns the
partial directory, progress record, verified resume, statistics, root manifest and
publication): it lays out one shard file per shard, C-order float32 ``(S, L, T, D)``, and at
publication writes ``shards.json``, ``statistics.json`` and ``classes.json``. A shard's
examples are appended with one gathered ``writev`` per batch, on an I/O thread, straight
from the capture's tensors (no copy), while this thread digests each (example, layer) slab:
one manifest block, what a loader block reads. ``sync_file_range`` starts the writeback as
the capture goes, so a shard's fsync waits only for its tail.

Files besides the spec's: ``statistics.json`` (per-layer mean/variance/norm),
``tokens.bin`` (int32 ``[n_examples, T]`` token ids, text models), ``classes.json`` (label
names, when labels.bin holds classes), and the root manifest (``actstore-manifest.json``,
``actstore-blocks.xxh3``).

Example:
    >>> import tempfile
    >>> from actstore.testing import make_acts, make_batches, make_plan
    >>> plan, out = make_plan(), tempfile.TemporaryDirectory()  # 23 examples, 2 layers
    >>> w = SaevWriter.from_plan(plan, Location.parse(out.name), SaevOptions())
    >>> for batch in make_batches(plan, make_acts(plan)):
    ...     w.write(batch)
    >>> sorted(p.name for p in w.close().iterdir())  # doctest: +NORMALIZE_WHITESPACE
    ['acts000000.bin', 'actstore-blocks.xxh3', 'actstore-manifest.json', 'metadata.json',
     'shards.json', 'statistics.json', 'tokens.bin']
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ...batch import Batch, CapturePlan
from ...errors import CaptureError, ConfigError
from ...faults import point
from ...sites import Site
from ...stats import RunningStats
from ...storage import atomic_write_bytes, atomic_write_json
from ...storage.location import Location
from ...storage.manifest import BlockHasher
from ..shard import ShardSink, WrittenFile, as_float32
from ..writer import ShardedWriter
from .layout import (
    DEFAULT_PATCHES_PER_SHARD,
    SaevMetadata,
    encode_data,
    encode_saev_img_folder,
    shard_name,
)
from .options import SaevOptions

log = logging.getLogger(__name__)

STATISTICS = "statistics.json"


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
            "attention/MLP sites into the zarr, activault or saelens formats"
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


def imagefolder_files(root: str) -> tuple[str, ...]:
    """The images torchvision's ``ImageFolder(root)`` (hence saev's ``ImgFolder``) indexes,
    in its order: class folders sorted by name, each walked with ``sorted(os.walk(...))``,
    file names sorted; files directly under ``root`` are not examples.

    Example:
        >>> import pathlib, tempfile
        >>> tmp = tempfile.TemporaryDirectory(); root = pathlib.Path(tmp.name)
        >>> for name in ("dog/b.png", "dog/a.jpg", "cat/c.png", "notes.txt", "README.png"):
        ...     (root / name).parent.mkdir(exist_ok=True); (root / name).touch()
        >>> [str(pathlib.Path(f).relative_to(root)) for f in imagefolder_files(str(root))]
        ['cat/c.png', 'dog/a.jpg', 'dog/b.png']
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


class SaevWriter(ShardedWriter):
    """Writer of one saev directory (or one part of a distributed capture, see
    :class:`~actstore.formats.writer.ShardedWriter`)."""

    format_name = "saev"
    options_type = SaevOptions

    def __init__(
        self,
        plan: CapturePlan,
        output: Location,
        options: SaevOptions | None = None,
        *,
        example_range: tuple[int, int] | None = None,
        store: Location | None = None,
    ) -> None:
        options = options or SaevOptions()
        md = saev_metadata(
            plan, dialect=options.dialect, patches_per_shard=options.patches_per_shard
        )
        self.metadata = md
        self.has_tokens, self.has_labels = plan.has_tokens, plan.has_labels
        self.classes = plan.classes if plan.has_labels else None
        if self.has_labels and self.classes is not None and len(self.classes) > 256:
            raise ConfigError(
                f"labels.bin holds uint8 labels; {len(self.classes)} classes do not fit"
            )
        super().__init__(
            plan=plan,
            store=store or self._location_of(md, output),
            output=output,
            options=options,
            record={
                "metadata": md.to_json_dict(),
                "tokens": self.has_tokens,
                "labels": self.has_labels,
                "classes": self.classes,
            },
            examples_per_shard=md.examples_per_shard,
            example_range=example_range,
        )

    @classmethod
    def shard_examples(cls, plan: CapturePlan, options: Any) -> int:
        options = options or SaevOptions()
        return saev_metadata(
            plan, dialect=options.dialect, patches_per_shard=options.patches_per_shard
        ).examples_per_shard

    @classmethod
    def store_location(cls, plan: CapturePlan, location: Location, options: Any) -> Location:
        """``<out>/<HASH>`` or, for the saev dialect, ``<out>/saev/shards/<h8>``."""
        options = options or SaevOptions()
        md = saev_metadata(
            plan, dialect=options.dialect, patches_per_shard=options.patches_per_shard
        )
        return cls._location_of(md, location)

    @staticmethod
    def _location_of(md: SaevMetadata, location: Location) -> Location:
        location = Location.parse(location)
        if location.is_local:
            return Location.parse(store_dir(md, location.path()))
        if md.dialect == "saev" and not location.url.endswith("/saev/shards"):
            location = location.child("saev").child("shards")
        return location.child(md.content_hash())

    # ------------------------------------------------------------------ the format's part

    def init_files(self, directory: Path) -> None:
        atomic_write_bytes(directory / "metadata.json", self.metadata.to_json_text().encode())

    def open_shard(self, index: int, directory: Path) -> ShardSink:
        return _ShardFile(self.metadata, index, directory / shard_name(index), self.store_id)

    def side_rows(self, batch: Batch) -> dict[str, bytes]:
        out = {}
        if self.has_tokens:
            if batch.token_ids is None:
                raise CaptureError("this store keeps token ids but the batch has none")
            out["tokens.bin"] = np.ascontiguousarray(batch.token_ids, dtype="<i4").tobytes()
        if self.has_labels:
            if batch.labels is None:
                raise CaptureError("this store keeps labels but the batch has none")
            if batch.labels.min() < 0 or batch.labels.max() > 255:
                raise CaptureError("labels must lie in 0..255 to fit labels.bin (uint8)")
            per_patch = np.repeat(
                batch.labels.astype(np.uint8)[:, None], self.metadata.patches_per_ex, 1
            )
            out["labels.bin"] = per_patch.tobytes()
        return out

    def side_unit(self, name: str) -> int:
        """One example's row: ``reader.tokens[i]`` reads and checks just that."""
        md = self.metadata
        return md.tokens_per_ex * 4 if name == "tokens.bin" else md.patches_per_ex

    def write_index(
        self, directory: Path, shards: Sequence[dict[str, Any]], stats: dict[Site, RunningStats]
    ) -> None:
        atomic_write_json(
            directory / "shards.json",
            [{"name": shard_name(e["index"]), "n_examples": e["n_examples"]} for e in shards],
        )
        atomic_write_json(
            directory / STATISTICS,
            {"sites": {str(site.layer): st.to_dict() for site, st in stats.items()}},
            indent=None,
        )
        if self.classes is not None:
            atomic_write_json(directory / "classes.json", self.classes)


class _ShardFile(ShardSink):
    """One shard file: examples appended as they come, padded (saev dialect) at the end."""

    def __init__(self, md: SaevMetadata, index: int, path: Path, store_id: str) -> None:
        self.md, self.index, self.path = md, index, path
        self.file = open(path, "wb", buffering=0)  # noqa: SIM115 - open until finish/abort
        self.hasher = BlockHasher(store_id, path.name, md.tokens_per_ex * md.d_model * 4)
        self.n = 0
        self._io = ThreadPoolExecutor(1, thread_name_prefix="saev-writer-io")
        self._pending: Future | None = None

    def append(self, batch: Batch) -> None:
        """Each (example, layer) slab is one block and, in the file, follows the previous
        one: one gathered write straight from the capture's tensors on the I/O thread while
        this thread digests the slabs, then the writer folds the statistics (file writes,
        xxhash and numpy release the GIL). At most one write is in flight, until
        :meth:`settle`."""
        md = self.md
        parts = [as_float32(batch.acts[f"resid.{layer}"]) for layer in md.layers]
        n = batch.n_examples
        slabs = [memoryview(a[i]).cast("B") for i in range(n) for a in parts]
        self.settle()
        self._pending = self._io.submit(_write_all, self.file.fileno(), slabs)
        for slab in slabs:
            self.hasher.update(slab)
        self.n += n

    def settle(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def finish(self) -> list[WrittenFile]:
        self.settle()
        pad = self.md.shard_nbytes(self.index) - self.n * self.md.example_nbytes
        if pad:
            zeros = bytes(pad)
            _write_all(self.file.fileno(), [memoryview(zeros)])
            self.hasher.update(zeros)
        os.fsync(self.file.fileno())
        self.file.close()
        self._io.shutdown()
        point("saev.shard_file_synced")
        entry, digests = self.hasher.entry()
        return [WrittenFile(self.path.name, entry, digests)]

    def abort(self) -> None:
        with contextlib.suppress(Exception):  # the failed write is the caller's error
            self.settle()
        self._io.shutdown()
        self.file.close()


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
