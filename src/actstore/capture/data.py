"""Example sources for capture: image folders, text/JSONL files, saved Hugging Face datasets.

Every source has a fixed, deterministic example order and a known ``n_examples`` before
capture starts (the store's metadata and content hash depend on it), and can restart at
any example (resume). Text is tokenised once and packed into fixed-length contexts:
documents are joined with the tokenizer's end-of-sequence (or separator) token and cut
into windows of ``context_length`` tokens, each starting with the model's start token
when it has one (BERT's [CLS], Llama's <s>); the incomplete tail is dropped and logged.

Example:
    >>> src = open_source("embedded", model)  # doctest: +SKIP
    >>> src.n_examples, src.tokens_per_example  # doctest: +SKIP
    (781, 128)
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from ..errors import ConfigError, CorruptStoreError, StoreNotFoundError
from ..progress import bar_switch
from .models import LoadedModel

log = logging.getLogger(__name__)

#: Alias for the embedded text corpus: the Python language reference shipped with CPython.
EMBEDDED_DATASET = "embedded"
IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff"})


@dataclass(frozen=True, kw_only=True)
class SourceBatch:
    """Model inputs for examples ``example_ids`` plus what writers keep beside activations."""

    example_ids: np.ndarray
    inputs: dict[str, torch.Tensor]
    token_ids: np.ndarray | None = None
    labels: np.ndarray | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    """Per-example fields for ``Batch.extras`` (prompt/response lengths, texts...)."""


class ExampleSource:
    """Base class: a deterministic, indexable sequence of model inputs."""

    #: Total number of examples.
    n_examples: int
    #: Absolute path of the dataset root (saev's ``dataset`` field).
    root: str
    #: Class names when labels are known (index = label), else None.
    classes: list[str] | None = None

    def describe(self) -> dict[str, Any]:
        """Plain, JSON-able description of the dataset (pickled into saev's ``data`` field)."""
        raise NotImplementedError

    def batches(self, start: int, batch_size: int, num_workers: int = 0) -> Iterator[SourceBatch]:
        """Batches of consecutive examples ``start, start+1, ...``; batch k starts at
        ``start + k * batch_size``."""
        raise NotImplementedError


# ---------------------------------------------------------------------------- images


class _ImageDataset(torch.utils.data.Dataset):
    """Decodes and preprocesses one image (runs inside DataLoader workers)."""

    def __init__(self, load, processor) -> None:
        self.load = load
        self.processor = processor

    def __len__(self) -> int:
        return self.load.n

    def __getitem__(self, index: int):
        image = self.load(index).convert("RGB")
        pixels = self.processor(images=image, return_tensors="pt")["pixel_values"][0]
        return index, pixels


class _Loader:
    """Picklable callable index -> PIL image (files or a saved HF dataset column)."""

    def __init__(
        self,
        files: Sequence[str] | None = None,
        hf_path: str | None = None,
        split: str | None = None,
        column: str | None = None,
    ) -> None:
        self.files, self.hf_path, self.split, self.column = files, hf_path, split, column
        self._ds = None
        self.n = len(files) if files is not None else len(self._dataset())

    def _dataset(self):
        if self._ds is None:
            self._ds = _load_hf(self.hf_path, self.split)
        return self._ds

    def __getstate__(self):
        return {**self.__dict__, "_ds": None}

    def __call__(self, index: int):
        from PIL import Image

        if self.files is not None:
            return Image.open(self.files[index])
        return self._dataset()[index][self.column]


class ImageSource(ExampleSource):
    """Images from a folder (class subfolders give labels) or a saved HF dataset."""

    def __init__(
        self,
        loader: _Loader,
        labels: np.ndarray | None,
        classes: list[str] | None,
        root: str,
        description: dict[str, Any],
        model: LoadedModel,
    ) -> None:
        self.loader, self.labels, self.classes = loader, labels, classes
        self.root, self._description, self.model = root, description, model
        self.n_examples = loader.n

    def describe(self) -> dict[str, Any]:
        return dict(self._description)

    @property
    def plan_extras(self) -> dict[str, Any]:
        """``CapturePlan.extras``: the image files in example order (folders only), so a
        writer can check that a reader's own listing of the folder agrees."""
        return {} if self.loader.files is None else {"image_files": self.loader.files}

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
        )
        for indices, pixels in loader:
            ids = indices.numpy().astype(np.int64)
            yield SourceBatch(
                example_ids=ids,
                inputs={"pixel_values": pixels.to(self.model.device, self.model.dtype)},
                labels=None if self.labels is None else self.labels[ids],
            )


def image_files(root: Path) -> list[Path]:
    """The images under ``root`` in capture order (sorted paths): example i is file i.

    Example:
        >>> image_files(Path("imagenet/val"))[:1]  # doctest: +SKIP
        [PosixPath('imagenet/val/n01440764/ILSVRC2012_val_00000293.JPEG')]
    """
    return sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())


def _image_folder(root: Path, model: LoadedModel) -> ImageSource:
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
    description = {
        "kind": "image_folder",
        "root": str(root),
        "n_images": len(files),
        "classes": classes,
    }
    return ImageSource(
        _Loader(files=[str(p) for p in files]), labels, classes, str(root), description, model
    )


# ---------------------------------------------------------------------------- text


class TextSource(ExampleSource):
    """Packed fixed-length token contexts (``token_ids``: int32 ``[n_examples, T]``)."""

    def __init__(
        self, token_ids: np.ndarray, root: str, description: dict[str, Any], model: LoadedModel
    ) -> None:
        self.token_ids, self.root, self._description = token_ids, root, description
        self.model = model
        self.n_examples = int(token_ids.shape[0])

    def describe(self) -> dict[str, Any]:
        return dict(self._description)

    def batches(self, start: int, batch_size: int, num_workers: int = 0) -> Iterator[SourceBatch]:
        for lo in range(start, self.n_examples, batch_size):
            hi = min(lo + batch_size, self.n_examples)
            ids = self.token_ids[lo:hi]
            input_ids = torch.from_numpy(ids.astype(np.int64)).to(self.model.device)
            yield SourceBatch(
                example_ids=np.arange(lo, hi, dtype=np.int64),
                inputs={"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)},
                token_ids=ids,
            )


def pack_documents(
    docs: Sequence[str], tokenizer, context_length: int, *, progress: bool = True
) -> tuple[np.ndarray, int]:
    """Tokenise ``docs`` and pack them into ``[n, context_length]`` int32 windows.

    Returns the windows and the number of trailing tokens dropped.

    Example:
        >>> windows, dropped = pack_documents(["a b", "c"], tok, 4)  # doctest: +SKIP
    """
    prefix = _start_tokens(tokenizer)
    sep = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    content = context_length - len(prefix)
    if content < 1:
        raise ConfigError(f"context_length {context_length} leaves no room for content tokens")
    pieces: list[np.ndarray] = []
    step = 512
    # Documents are tokenised whole, then cut into windows: silence the "longer than the
    # model's maximum length" warning, which does not apply to packing.
    from .models import quiet_transformers

    with (
        quiet_transformers(),
        tqdm(
            total=len(docs), desc="tokenising", unit="doc", leave=False, **bar_switch(progress)
        ) as bar,
    ):
        for lo in range(0, len(docs), step):
            encoded = tokenizer(list(docs[lo : lo + step]), add_special_tokens=False)
            for ids in encoded["input_ids"]:
                pieces.append(np.asarray(ids, dtype=np.int32))
                if sep is not None:
                    pieces.append(np.asarray([sep], dtype=np.int32))
            bar.update(min(step, len(docs) - lo))
    stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
    n = len(stream) // content
    dropped = len(stream) - n * content
    body = stream[: n * content].reshape(n, content)
    windows = np.concatenate([np.tile(np.asarray(prefix, dtype=np.int32), (n, 1)), body], axis=1)
    return np.ascontiguousarray(windows), dropped


def _start_tokens(tokenizer) -> list[int]:
    """The special tokens the tokenizer puts before content (e.g. [CLS] or <s>), if any."""
    with_special = tokenizer("x", add_special_tokens=True)["input_ids"]
    plain = tokenizer("x", add_special_tokens=False)["input_ids"]
    for i in range(len(with_special) - len(plain) + 1):
        if with_special[i : i + len(plain)] == plain:
            return list(with_special[:i])
    return []


def _text_source(
    docs: Sequence[str],
    root: str,
    description: dict[str, Any],
    model: LoadedModel,
    context_length: int,
    max_examples: int | None,
    progress: bool = True,
) -> TextSource:
    if not docs:
        raise ConfigError(f"{root} holds no text documents")
    windows, dropped = pack_documents(docs, model.tokenizer, context_length, progress=progress)
    if len(windows) == 0:
        raise ConfigError(
            f"{root} has fewer tokens than one context of {context_length}; "
            "lower --context-length or add text"
        )
    if max_examples is not None:
        windows = windows[:max_examples]
    log.info(
        "packed %d documents into %d contexts of %d tokens (%d tail tokens dropped)",
        len(docs),
        len(windows),
        context_length,
        dropped,
    )
    description = {
        **description,
        "context_length": context_length,
        "n_docs": len(docs),
        "tokenizer": model.ckpt,
    }
    return TextSource(windows, root, description, model)


def _read_text_file(path: Path, text_field: str) -> list[str]:
    if path.suffix == ".jsonl":
        docs = []
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise CorruptStoreError(
                        f"{path}:{lineno} is not valid JSON: {err.msg}"
                    ) from err
                if not isinstance(record, dict) or text_field not in record:
                    raise ConfigError(
                        f"{path}:{lineno} has no {text_field!r} field; "
                        "choose the field with --text-field"
                    )
                docs.append(str(record[text_field]))
        return docs
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def embedded_documents() -> tuple[list[str], str]:
    """The embedded corpus: each topic of the Python language reference is one document."""
    from pydoc_data import topics

    return [topics.topics[k] for k in sorted(topics.topics)], str(Path(topics.__file__).resolve())


# ---------------------------------------------------------------------------- HF datasets


def _load_hf(path: str, split: str | None):
    from ..errors import require

    datasets = require("datasets", "datasets")
    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ConfigError(f"{path} has splits {sorted(ds)}; choose one with --split")
        ds = ds[split]
    return ds


def _hf_source(
    path: Path,
    model: LoadedModel,
    split: str,
    text_field: str,
    context_length: int,
    max_examples: int | None,
    progress: bool = True,
) -> ExampleSource:
    ds = _load_hf(str(path), split)
    columns = ds.column_names
    description = {"kind": "hf_dataset", "root": str(path), "split": split}
    if model.modality == "image":
        column = next((c for c in ("image", "img", "pixel_values") if c in columns), None)
        if column is None:
            raise ConfigError(f"{path} has no image column (columns: {columns})")
        label_col = next((c for c in ("label", "labels", "fine_label") if c in columns), None)
        labels = classes = None
        if label_col is not None:
            labels = np.asarray(ds[label_col], dtype=np.int64)
            names = getattr(ds.features[label_col], "names", None)
            classes = list(names) if names else [str(i) for i in range(int(labels.max()) + 1)]
        loader = _Loader(hf_path=str(path), split=split, column=column)
        description.update(column=column, n_images=loader.n, classes=classes)
        return ImageSource(loader, labels, classes, str(path), description, model)
    if text_field not in columns:
        raise ConfigError(
            f"{path} has no {text_field!r} column (columns: {columns}); "
            "choose one with --text-field"
        )
    docs = [str(t) for t in ds[text_field]]
    description["text_field"] = text_field
    return _text_source(docs, str(path), description, model, context_length, max_examples, progress)


# ---------------------------------------------------------------------------- entry point


def open_source(
    dataset: str,
    model: LoadedModel,
    *,
    context_length: int = 128,
    max_examples: int | None = None,
    split: str = "train",
    text_field: str = "text",
    progress: bool = True,
) -> ExampleSource:
    """Open ``dataset`` (path or ``"embedded"``) for ``model``'s modality."""
    if dataset == EMBEDDED_DATASET:
        if model.modality != "text":
            raise ConfigError("the embedded dataset is text; give an image folder for a ViT")
        docs, root = embedded_documents()
        description = {"kind": "embedded", "name": "python-language-reference"}
        return _text_source(docs, root, description, model, context_length, max_examples, progress)
    path = Path(dataset).expanduser().resolve()
    if not path.exists():
        raise StoreNotFoundError(f"dataset {dataset!r} does not exist")
    is_hf = (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()
    if path.is_dir() and is_hf:
        source = _hf_source(path, model, split, text_field, context_length, max_examples, progress)
    elif path.is_dir():
        if model.modality != "image":
            raise ConfigError(
                f"{path} is a folder, which actstore reads as images, but {model.ckpt} is a "
                "text model; give a .txt or .jsonl file or a saved HF dataset"
            )
        source = _image_folder(path, model)
    elif path.suffix in (".txt", ".jsonl"):
        if model.modality != "text":
            raise ConfigError(f"{path} is text but {model.ckpt} is an image model")
        docs = _read_text_file(path, text_field)
        description = {"kind": "text_file", "path": str(path), "text_field": text_field}
        return _text_source(
            docs, str(path), description, model, context_length, max_examples, progress
        )
    else:
        raise ConfigError(
            f"cannot tell what kind of dataset {path} is: give an image folder, a .txt or "
            ".jsonl file, or a directory written by datasets.Dataset.save_to_disk"
        )
    if max_examples is not None and isinstance(source, ImageSource):
        source.n_examples = min(source.n_examples, max_examples)
    return source
