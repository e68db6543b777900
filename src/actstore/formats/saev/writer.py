"""Write a saev protocol 2.1 directory: the format's part of the crash protocol.

:class:`SaevWriter` is a :class:`~actstore.formats.writer.ShardedWriter` (which owns the
partial directory, progress journal, verified resume, statistics, root manifest,
publication and the write pipeline): it lays out one shard file per shard, C-order float32
``(S, L, T, D)``, each (example, layer) slab one manifest block handed to the pipeline
straight from the cast tensors (no copy), and at publication writes ``shards.json``,
``statistics.json`` and ``classes.json``.

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

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ...batch import Batch, CapturePlan
from ...errors import CaptureError, ConfigError
from ...sites import Site
from ...stats import RunningStats
from ...storage import atomic_write_bytes, atomic_write_json
from ...storage.location import Location
from ..pipeline import ShardOutput
from ..shard import ShardRecord, ShardSink
from ..writer import ShardedWriter
from .layout import (
    DEFAULT_PATCHES_PER_SHARD,
    SaevMetadata,
    encode_data,
    encode_saev_img_folder,
    shard_name,
)
from .options import SaevOptions

if TYPE_CHECKING:
    import torch

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
            data = encode_saev_img_folder(plan.dataset_root, plan.data_identity)
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
    writes_batch_memory = True  # each slab is written from the batch where it lies

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
        return _ShardFile(self.metadata, index, shard_name(index))

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
        self, directory: Path, shards: Sequence[ShardRecord], stats: dict[Site, RunningStats]
    ) -> None:
        atomic_write_json(
            directory / "shards.json",
            [{"name": shard_name(e.index), "n_examples": e.n_examples} for e in shards],
        )
        atomic_write_json(
            directory / STATISTICS,
            {"sites": {str(site.layer): st.to_dict() for site, st in stats.items()}},
            indent=None,
        )
        if self.classes is not None:
            atomic_write_json(directory / "classes.json", self.classes)


class _ShardFile(ShardSink):
    """One shard file, C-order ``(S, L, T, D)``: each (example, layer) slab is one manifest
    block (what a loader block reads), written at its place; the saev dialect's full-size
    shard files are grown to size sparsely (the padding reads as zeros, takes no disk)."""

    def __init__(self, md: SaevMetadata, index: int, name: str) -> None:
        self.md, self.index, self.name = md, index, name
        self.n = 0

    def open(self, out: ShardOutput) -> None:
        out.declare(self.name, unit=self.md.tokens_per_ex * self.md.d_model * 4)

    def append(self, batch: Batch, acts: Mapping[Site, torch.Tensor], out: ShardOutput) -> None:
        md = self.md
        parts = [acts[Site("resid", layer)].numpy() for layer in md.layers]
        n = batch.n_examples
        slabs = [parts[j][i] for i in range(n) for j in range(len(parts))]
        out.write(self.name, slabs, self.n * md.example_nbytes)
        self.n += n

    def finish(self, out: ShardOutput) -> None:
        out.extend(self.name, self.md.shard_nbytes(self.index))
