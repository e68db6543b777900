"""Image sources: a folder of images (class subfolders give labels) or an image column of a
``datasets`` dataset, decoded and preprocessed in DataLoader workers.

Example:
    >>> import tempfile
    >>> tmp = tempfile.TemporaryDirectory(); root = Path(tmp.name)
    >>> for name in ("n02/b.JPEG", "n01/a.png", "n01/notes.txt"):
    ...     (root / name).parent.mkdir(exist_ok=True); (root / name).touch()
    >>> [p.relative_to(root).as_posix() for p in image_files(root)]
    ['n01/a.png', 'n02/b.JPEG']
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ...errors import ConfigError, CorruptStoreError
from .base import ExampleSource, SourceBatch
from .digest import blobs_digest, files_digest
from .hf import HFDataset

if TYPE_CHECKING:
    from ..models import LoadedModel

IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff"})


class _ImageDataset(torch.utils.data.Dataset):
    """Decodes and preprocesses one image (runs inside DataLoader workers)."""

    def __init__(self, load, processor) -> None:
        self.load = load
        self.processor = processor

    def __len__(self) -> int:
        return self.load.n

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, str]:
        """``(index, pixels, "")``, or ``(index, empty, why)`` for an image that does not
        decode (said in one line by :func:`_collate`'s caller, not a worker's traceback)."""
        try:
            image = self.load(index).convert("RGB")
        except (OSError, ValueError, SyntaxError) as err:  # what PIL raises for bad bytes
            return index, torch.empty(0), f"{self.load.name(index)} ({type(err).__name__}: {err})"
        pixels = self.processor(images=image, return_tensors="pt")["pixel_values"][0]
        return index, pixels, ""


def _collate(items: list[tuple[int, torch.Tensor, str]]) -> tuple[torch.Tensor, Any]:
    """Stack a batch; a batch with images that did not decode gives ``(None, reasons)``."""
    bad = [why for _, _, why in items if why]
    if bad:
        return None, bad  # type: ignore[return-value]
    return torch.tensor([i for i, _, _ in items]), torch.stack([p for _, p, _ in items])


class _Loader:
    """Picklable callable index -> PIL image (files, a datasets column, or images in memory)."""

    def __init__(
        self,
        files: Sequence[str] | None = None,
        hf: HFDataset | None = None,
        column: str | None = None,
        images: list | None = None,
    ) -> None:
        self.files, self.hf, self.column, self.images = files, hf, column, images
        self._ds = None
        if files is not None:
            self.n = len(files)
        elif images is not None:
            self.n = len(images)
        else:
            self.n = len(self._dataset())

    def _dataset(self):
        if self._ds is None:
            assert self.hf is not None
            self._ds = self.hf.load()
        return self._ds

    def __getstate__(self):
        return {**self.__dict__, "_ds": None}

    def name(self, index: int) -> str:
        """Where example ``index``'s image comes from, for messages."""
        if self.files is not None:
            return self.files[index]
        return f"image {index} of the dataset"

    def __call__(self, index: int):
        from PIL import Image

        if self.files is not None:
            return Image.open(self.files[index])
        if self.images is not None:
            return self.images[index]
        return self._dataset()[index][self.column]


class ImageSource(ExampleSource):
    """Images from a folder (class subfolders give labels) or a datasets image column."""

    def __init__(
        self,
        loader: _Loader,
        labels: np.ndarray | None,
        classes: list[str] | None,
        root: str,
        description: dict[str, Any],
        model: LoadedModel,
        max_examples: int | None = None,
    ) -> None:
        self.loader, self.labels, self.classes = loader, labels, classes
        self._root, self._description, self.model = root, description, model
        self._max = max_examples
        self._n = loader.n if max_examples is None else min(loader.n, max_examples)

    @property
    def n_examples(self) -> int:
        return self._n

    @property
    def root(self) -> str:
        return self._root

    def describe(self) -> dict[str, Any]:
        return dict(self._description)

    @property
    def plan_extras(self) -> dict[str, Any]:
        """``CapturePlan.extras``: the image files in example order (folders only), so a
        writer can check that a reader's own listing of the folder agrees."""
        return {} if self.loader.files is None else {"image_files": self.loader.files}

    def for_model(self, model: LoadedModel) -> ImageSource:
        return ImageSource(
            self.loader,
            self.labels,
            self.classes,
            self._root,
            self._description,
            model,
            self._max,
        )

    def batches(self, start: int, batch_size: int, num_workers: int = 0) -> Iterator[SourceBatch]:
        dataset = torch.utils.data.Subset(
            _ImageDataset(self.loader, self.model.image_processor),
            range(start, self.n_examples),
        )
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=False,
            num_workers=num_workers,
            pin_memory=self.model.device.type == "cuda",
            persistent_workers=False,
            collate_fn=_collate,
        )
        for indices, pixels in loader:
            if indices is None:
                raise CorruptStoreError(
                    f"{pixels[0]} is not an image that can be decoded"
                    + (f" (and {len(pixels) - 1} more in its batch)" if len(pixels) > 1 else "")
                    + "; replace or remove it, or give another --dataset"
                )
            ids = indices.numpy().astype(np.int64)
            yield SourceBatch(
                example_ids=ids,
                inputs={"pixel_values": pixels.to(self.model.device, self.model.dtype)},
                labels=None if self.labels is None else self.labels[ids],
            )


def image_files(root: Path) -> list[Path]:
    """The images under ``root`` in capture order (sorted paths): example i is file i.

    Example:
        >>> import tempfile
        >>> tmp = tempfile.TemporaryDirectory(); root = Path(tmp.name)
        >>> (root / "n01").mkdir(); (root / "n01" / "a.JPEG").touch(); (root / "x.txt").touch()
        >>> [p.relative_to(root).as_posix() for p in image_files(root)]
        ['n01/a.JPEG']
    """
    return sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())


def image_folder(root: Path, model: LoadedModel, max_examples: int | None) -> ImageSource:
    """A folder of images; when every image sits in a subfolder, subfolders are classes."""
    files = image_files(root)
    if not files:
        raise ConfigError(
            f"{root} holds no images (looked for {', '.join(sorted(IMAGE_SUFFIXES))}); "
            "point --dataset at a folder of images or of class subfolders"
        )
    rel = [p.relative_to(root) for p in files]
    labels = classes = None
    if all(len(r.parts) >= 2 for r in rel):
        classes = sorted({r.parts[0] for r in rel})
        index = {c: i for i, c in enumerate(classes)}
        labels = np.array([index[r.parts[0]] for r in rel], dtype=np.int64)
    used = files if max_examples is None else files[:max_examples]
    description = {
        "kind": "image_folder",
        "root": str(root),
        "n_images": len(files),
        "classes": classes,
        # the bytes of every image the store is made from (read once, here)
        "image_digest": files_digest([str(p) for p in used], str(root)),
    }
    loader = _Loader(files=[str(p) for p in files])
    return ImageSource(loader, labels, classes, str(root), description, model, max_examples)


def hf_images(
    hf: HFDataset,
    root: str,
    description: dict[str, Any],
    model: LoadedModel,
    max_examples: int | None,
) -> ImageSource:
    """The image column (``image``, ``img`` or ``pixel_values``) of a datasets dataset, with
    its labels (``label``, ``labels`` or ``fine_label``) when it has them."""
    ds = hf.load()
    columns = list(ds.column_names or next(iter(ds), {}))
    column = next((c for c in ("image", "img", "pixel_values") if c in columns), None)
    if column is None:
        raise ConfigError(f"{root} has no image column (columns: {columns})")
    label_col = next((c for c in ("label", "labels", "fine_label") if c in columns), None)
    if hf.streaming:
        assert max_examples is not None
        records = list(ds.take(max_examples))
        label_values = None if label_col is None else [r[label_col] for r in records]
        loader = _Loader(images=[r[column] for r in records])
        digest = blobs_digest(_pixels(r[column]) for r in records)
    else:
        label_values = None if label_col is None else ds[label_col]
        loader = _Loader(hf=hf, column=column)
        n = loader.n if max_examples is None else min(loader.n, max_examples)
        digest = blobs_digest(_stored_images(ds, column, n))
    labels = classes = None
    if label_values is not None:
        labels = np.asarray(label_values, dtype=np.int64)
        names = getattr(ds.features[label_col], "names", None) if ds.features else None
        classes = list(names) if names else [str(i) for i in range(int(labels.max()) + 1)]
    description = {
        **description,
        "column": column,
        "n_images": loader.n,
        "classes": classes,
        "image_digest": digest,
    }
    return ImageSource(loader, labels, classes, root, description, model, max_examples)


def _pixels(image: Any) -> bytes:
    """A decoded image's mode, size and pixels."""
    head = f"{image.mode} {image.size[0]}x{image.size[1]}|".encode()
    return head + image.tobytes()


def _stored_images(ds: Any, column: str, n: int) -> Iterator[bytes]:
    """The first ``n`` images of ``column`` as stored: each one's encoded bytes (or its
    file's bytes when the column holds paths), read from Arrow without decoding."""
    seen = 0
    for table in ds.select_columns([column]).with_format("arrow").iter(batch_size=256):
        for value in table.column(column).to_pylist():
            if seen == n:
                return
            seen += 1
            if isinstance(value, dict) and value.get("bytes") is not None:
                yield bytes(value["bytes"])
            elif isinstance(value, dict) and value.get("path"):
                yield Path(value["path"]).read_bytes()
            else:
                yield repr(value).encode()
        if seen == n:
            return
