"""Example sources for capture: image folders, text/JSONL files, and Hugging Face datasets
(saved with ``save_to_disk``, local parquet/arrow/json/csv files or folders of them, or Hub
ids, optionally streamed).

Every source has a fixed, deterministic example order and a known ``n_examples`` before
capture starts (the store's metadata and content hash depend on it), and can restart at
any example (resume). Text is tokenised once and packed into fixed-length contexts:
documents are joined with the tokenizer's end-of-sequence (or separator) token and cut
into windows of ``context_length`` tokens, each starting with the model's start token
when it has one (BERT's [CLS], Llama's <s>); the incomplete tail is dropped and logged.
Pre-tokenized datasets (a column of token ids) are packed the same way but used as is: no
token is added or re-tokenised, so rows of exactly ``context_length`` tokens stay rows.

Every kind but image folders, .txt/.jsonl files and saved datasets goes through one call,
``datasets.load_dataset(builder_or_hub_id, data_files=..., ...)`` (:class:`HFDataset`), so
local files exercise the same path as the Hub. Streaming reads the dataset in its stored
order and stops as soon as the example budget (``max_examples``/``max_tokens``) is filled.

Example:
    >>> src = open_source("embedded", model)  # doctest: +SKIP
    >>> src.n_examples, src.tokens_per_example  # doctest: +SKIP
    (781, 128)
"""

from __future__ import annotations

import abc
import contextlib
import json
import logging
import os
import re
import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

import numpy as np
import torch
from tqdm.auto import tqdm

from ..errors import ConfigError, CorruptStoreError, StoreNotFoundError, require
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


class ExampleSource(abc.ABC):
    """A deterministic, indexable sequence of model inputs (what capture runs over).

    Optional facts have defaults here, so capture reads them directly: a source that
    knows its examples' token count says so in ``tokens_per_example`` (else capture probes
    one batch), text sources keep their ``token_ids``, labelled image sources ``labels`` and
    ``classes``.
    """

    #: Tokens per example when known without running the model (else None).
    tokens_per_example: int | None = None
    #: int32 ``[n_examples, T]`` token ids when the source is packed text, else None.
    token_ids: np.ndarray | None = None
    #: int64 label per example when known, else None.
    labels: np.ndarray | None = None
    #: Class names when labels are known (index = label), else None.
    classes: list[str] | None = None

    @property
    @abc.abstractmethod
    def n_examples(self) -> int:
        """Total number of examples."""

    @property
    @abc.abstractmethod
    def root(self) -> str:
        """Absolute path (or Hub id) of the dataset (saev's ``dataset`` field)."""

    @property
    def has_tokens(self) -> bool:
        """Whether batches carry token ids."""
        return self.token_ids is not None

    @property
    def plan_extras(self) -> dict[str, Any]:
        """Facts for ``CapturePlan.extras`` (none by default)."""
        return {}

    @abc.abstractmethod
    def describe(self) -> dict[str, Any]:
        """Plain, JSON-able description of the dataset (pickled into saev's ``data`` field)."""

    @abc.abstractmethod
    def batches(self, start: int, batch_size: int, num_workers: int = 0) -> Iterator[SourceBatch]:
        """Batches of consecutive examples ``start, start+1, ...``; batch k starts at
        ``start + k * batch_size``."""


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


def _image_folder(root: Path, model: LoadedModel, max_examples: int | None) -> ImageSource:
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
    loader = _Loader(files=[str(p) for p in files])
    return ImageSource(loader, labels, classes, str(root), description, model, max_examples)


# ---------------------------------------------------------------------------- text


class TextSource(ExampleSource):
    """Packed fixed-length token contexts (``token_ids``: int32 ``[n_examples, T]``)."""

    def __init__(
        self, token_ids: np.ndarray, root: str, description: dict[str, Any], model: LoadedModel
    ) -> None:
        self.token_ids: np.ndarray = token_ids
        self.tokens_per_example = int(token_ids.shape[1])
        self._root, self._description, self.model = root, description, model

    @property
    def n_examples(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def root(self) -> str:
        return self._root

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
    limit: int | None,
    progress: bool = True,
) -> TextSource:
    """Pack ``docs`` into contexts; keep the first ``limit`` (the example budget)."""
    if not docs:
        raise ConfigError(f"{root} holds no text documents")
    windows, dropped = pack_documents(docs, model.tokenizer, context_length, progress=progress)
    if len(windows) == 0:
        raise ConfigError(
            f"{root} has fewer tokens than one context of {context_length}; "
            "lower --context-length or add text"
        )
    if limit is not None:
        windows = windows[:limit]
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

#: Local file suffix -> the ``datasets`` builder that reads it.
BUILDERS = {
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".txt": "text",
}
#: Columns taken as pre-tokenized input when the text field is absent.
TOKEN_COLUMNS = ("input_ids", "tokens")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def looks_like_hub_id(dataset: str) -> bool:
    """Whether ``dataset``, not a local path, could name a Hub dataset (``org/name``)."""
    return (
        "/" in dataset and not Path(dataset).expanduser().exists() and bool(_HUB_ID.match(dataset))
    )


@dataclass(frozen=True, kw_only=True)
class HFDataset:
    """How to load one split of a ``datasets`` dataset: a ``save_to_disk`` directory
    (``saved``), local data files through a builder (``files``), a Hub id (``hub``), or a
    local copy of a Hub repository (``repo``: a folder with a README.md dataset card), which
    ``datasets`` reads exactly as the Hub one."""

    kind: Literal["saved", "files", "hub", "repo"]
    path: str
    """The saved directory, the builder name (``parquet``...), the Hub id or the repo folder."""
    data_files: tuple[str, ...] | None = None
    config: str | None = None
    split: str = "train"
    streaming: bool = False

    def load(self):
        """The split, as a ``Dataset`` (or an ``IterableDataset`` when streaming)."""
        datasets = require("datasets", "datasets")
        if self.kind == "saved":
            return _load_hf(self.path, self.split)
        where = self.path if self.data_files is None else ", ".join(self.data_files)
        try:
            with _quiet_datasets():
                ds = datasets.load_dataset(
                    self.path,
                    name=self.config,
                    data_files=None if self.data_files is None else list(self.data_files),
                    split=self.split,
                    streaming=self.streaming,
                )
        except ValueError as err:
            if "corresponds to no data" in str(err):
                raise ConfigError(f"{where} holds no rows") from err
            if "split" in str(err).lower():
                raise ConfigError(
                    f"{where} has no split {self.split!r}; choose one with --split"
                ) from err
            raise ConfigError(f"cannot load {where}: {_first_line(err)}") from err
        except ConnectionError as err:
            raise StoreNotFoundError(
                f"dataset {self.path!r} is not in the local Hugging Face cache and the Hub is "
                "offline (HF_HUB_OFFLINE); download it once online, or give local files"
            ) from err
        except FileNotFoundError as err:
            raise StoreNotFoundError(f"cannot load {where}: {_first_line(err)}") from err
        except Exception as err:
            if type(err).__name__ in ("DatasetNotFoundError", "DataFilesNotFoundError"):
                raise StoreNotFoundError(f"cannot load {where}: {_first_line(err)}") from err
            if type(err).__name__ in ("DatasetGenerationError", "ArrowInvalid"):
                raise CorruptStoreError(f"cannot read {where}: {_first_line(err)}") from err
            raise
        return ds

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": f"hf_{self.kind}", "split": self.split}
        if self.kind in ("hub", "repo"):
            out.update(id=self.path, config=self.config)
        else:
            out.update(builder=self.path, data_files=list(self.data_files or ()))
        if self.streaming:
            out["streaming"] = True
        return out


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


@contextlib.contextmanager
def _quiet_datasets():
    """Silence ``datasets``' progress bars and info logs while loading."""
    from datasets.utils import logging as ds_logging

    level, bars = ds_logging.get_verbosity(), ds_logging.is_progress_bar_enabled()
    ds_logging.set_verbosity_error()
    ds_logging.disable_progress_bar()
    try:
        yield
    finally:
        ds_logging.set_verbosity(level)
        if bars:
            ds_logging.enable_progress_bar()


def _load_hf(path: str, split: str | None):
    datasets = require("datasets", "datasets")
    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ConfigError(f"{path} has splits {sorted(ds)}; choose one with --split")
        ds = ds[split]
    return ds


def check_hub_reachable(hub_id: str) -> None:
    """Fail at once, in one line, when the Hub cannot answer (instead of minutes of retries).

    Offline mode (``HF_HUB_OFFLINE``) is left to ``datasets``, which then reads its cache."""
    datasets = require("datasets", "datasets")
    if datasets.config.HF_HUB_OFFLINE:
        return
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = endpoint.hostname or "huggingface.co", endpoint.port or 443
    try:
        socket.create_connection((host, port), timeout=3).close()
    except OSError as err:
        raise StoreNotFoundError(
            f"dataset {hub_id!r} is not a local path and the Hugging Face Hub ({host}) cannot "
            "be reached; set HF_HUB_OFFLINE=1 to use a cached copy, or give local files"
        ) from err


def _budget(context_length: int, max_examples: int | None, max_tokens: int | None) -> int | None:
    """Contexts the example and token budgets allow (None: no limit)."""
    if max_tokens is None:
        return max_examples
    n = max_tokens // context_length
    if n < 1:
        raise ConfigError(
            f"--max-tokens {max_tokens} is less than one context of {context_length} tokens"
        )
    return n if max_examples is None else min(n, max_examples)


def _column(columns: Sequence[str], text_field: str, where: str) -> str:
    if text_field in columns:
        return text_field
    for name in TOKEN_COLUMNS:
        if name in columns:
            return name
    raise ConfigError(
        f"{where} has no {text_field!r} column and no token column "
        f"({', '.join(TOKEN_COLUMNS)}); columns: {list(columns)}; choose one with --text-field"
    )


def _stream_rows(ds, column: str, enough: Any, keep: Any = None) -> list:
    """Values of ``column`` in dataset order (those ``keep`` accepts) until
    ``enough(values)`` says stop."""
    rows: list = []
    for record in ds:
        if keep is not None and not keep(record[column]):
            continue
        rows.append(record[column])
        if enough(rows):
            break
    return rows


def _has_text(doc: Any) -> bool:
    return bool(str(doc).strip())


def pack_token_rows(rows: Sequence[Sequence[int]], context_length: int) -> tuple[np.ndarray, int]:
    """Concatenate pre-tokenized rows, as is, and cut ``[n, context_length]`` windows.

    Returns the windows and the number of trailing tokens dropped.

    Example:
        >>> pack_token_rows([[5, 6, 7], [8, 9]], 2)[0].tolist()
        [[5, 6], [7, 8]]
    """
    pieces = [np.asarray(r, dtype=np.int64).reshape(-1) for r in rows]
    return _cut(np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64), context_length)


def _cut(stream: np.ndarray, context_length: int) -> tuple[np.ndarray, int]:
    n = len(stream) // context_length
    windows = stream[: n * context_length].reshape(n, context_length)
    return np.ascontiguousarray(windows.astype(np.int32)), len(stream) - n * context_length


def _token_stream(ds, column: str) -> tuple[np.ndarray, int]:
    """Every token of a (non-streamed) dataset's token column, concatenated in row order,
    straight from Arrow (no Python list per row), and the number of rows."""
    import pyarrow.compute as pc

    table = ds.select_columns([column]).with_format("arrow")[:]
    flat = pc.list_flatten(table.column(column))
    return flat.to_numpy().astype(np.int64, copy=False), table.num_rows


def _token_source(
    stream: np.ndarray,
    n_rows: int,
    root: str,
    description: dict[str, Any],
    model: LoadedModel,
    context_length: int,
    limit: int | None,
) -> TextSource:
    windows, dropped = _cut(stream, context_length)
    if len(windows) == 0:
        raise ConfigError(
            f"{root} has fewer tokens than one context of {context_length}; "
            "lower --context-length or add rows"
        )
    vocab = model.module.get_input_embeddings().num_embeddings
    low, high = int(stream.min()), int(stream.max())
    if low < 0 or high >= vocab:
        raise ConfigError(
            f"{root} holds token id {high if high >= vocab else low}, outside {model.ckpt}'s "
            f"vocabulary of {vocab}: was it tokenized for another model? Use its text column "
            "with --text-field"
        )
    if limit is not None:
        windows = windows[:limit]
    log.info(
        "packed %d pre-tokenized rows into %d contexts of %d tokens (%d tail tokens dropped)",
        n_rows,
        len(windows),
        context_length,
        dropped,
    )
    description = {**description, "context_length": context_length, "n_rows": n_rows}
    return TextSource(windows, root, description, model)


def _hf_text(
    hf: HFDataset,
    root: str,
    description: dict[str, Any],
    model: LoadedModel,
    text_field: str,
    context_length: int,
    limit: int | None,
    progress: bool,
) -> TextSource:
    ds = hf.load()
    first = next(iter(ds), None)
    if first is None:
        raise ConfigError(f"{root} holds no rows")
    column = _column(list(ds.column_names or first), text_field, root)
    tokenized = not isinstance(first[column], str)
    if tokenized:
        description = {**description, "token_column": column}
    else:
        description = {**description, "text_field": column}
    # Text files are read line by line: skip blank lines, as for a .txt read directly.
    keep = _has_text if hf.kind == "files" and hf.path == "text" else None
    if tokenized:
        if hf.streaming:
            assert limit is not None
            rows = _stream_rows(ds, column, _TokenCount(limit * context_length))
            stream = np.concatenate([np.asarray(r, dtype=np.int64).reshape(-1) for r in rows])
            n_rows = len(rows)
        else:
            stream, n_rows = _token_stream(ds, column)
        return _token_source(stream, n_rows, root, description, model, context_length, limit)
    if hf.streaming:
        assert limit is not None
        count = _DocTokenCount(limit, context_length, model.tokenizer)
        rows = _stream_rows(ds, column, count, keep)
    else:
        rows = ds[column]
    docs = [str(t) for t in rows if keep is None or keep(t)]
    return _text_source(docs, root, description, model, context_length, limit, progress)


class _TokenCount:
    """Stop streaming token rows once ``need`` tokens are in hand."""

    def __init__(self, need: int) -> None:
        self.need, self.have, self.seen = need, 0, 0

    def __call__(self, rows: list) -> bool:
        for row in rows[self.seen :]:
            self.have += len(row)
        self.seen = len(rows)
        return self.have >= self.need


class _DocTokenCount(_TokenCount):
    """Stop streaming documents once packing them fills ``n_windows`` contexts: counts
    each document's tokens plus its separator, as :func:`pack_documents` lays them out."""

    def __init__(self, n_windows: int, context_length: int, tokenizer) -> None:
        prefix = _start_tokens(tokenizer)
        super().__init__(n_windows * (context_length - len(prefix)))
        self.tokenizer = tokenizer
        sep = (
            tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
        )
        self.per_doc = 0 if sep is None else 1

    def __call__(self, rows: list) -> bool:
        for doc in rows[self.seen :]:
            ids = self.tokenizer(str(doc), add_special_tokens=False)["input_ids"]
            self.have += len(ids) + self.per_doc
        self.seen = len(rows)
        return self.have >= self.need


def _hf_images(
    hf: HFDataset,
    root: str,
    description: dict[str, Any],
    model: LoadedModel,
    max_examples: int | None,
) -> ImageSource:
    ds = hf.load()
    columns = list(ds.column_names or next(iter(ds), {}))
    column = next((c for c in ("image", "img", "pixel_values") if c in columns), None)
    if column is None:
        raise ConfigError(f"{root} has no image column (columns: {columns})")
    label_col = next((c for c in ("label", "labels", "fine_label") if c in columns), None)
    images = None
    if hf.streaming:
        assert max_examples is not None
        records = list(ds.take(max_examples))
        images = [r[column] for r in records]
        label_values = None if label_col is None else [r[label_col] for r in records]
        loader = _Loader(images=images)
    else:
        label_values = None if label_col is None else ds[label_col]
        loader = _Loader(hf=hf, column=column)
    labels = classes = None
    if label_values is not None:
        labels = np.asarray(label_values, dtype=np.int64)
        names = getattr(ds.features[label_col], "names", None) if ds.features else None
        classes = list(names) if names else [str(i) for i in range(int(labels.max()) + 1)]
    description = {**description, "column": column, "n_images": loader.n, "classes": classes}
    return ImageSource(loader, labels, classes, root, description, model, max_examples)


def _hf_saved(path: Path, model, split, text_field, context_length, limit, max_examples, progress):
    """A ``save_to_disk`` directory (description as in earlier versions: same store hash)."""
    hf = HFDataset(kind="saved", path=str(path), split=split)
    description = {"kind": "hf_dataset", "root": str(path), "split": split}
    if model.modality == "image":
        return _hf_images(hf, str(path), description, model, max_examples)
    return _hf_text(hf, str(path), description, model, text_field, context_length, limit, progress)


def _data_files(path: Path) -> tuple[str, tuple[str, ...]] | None:
    """(builder, files) for a data file or a folder of them; None when ``path`` is neither."""
    if path.is_file():
        builder = BUILDERS.get(path.suffix.lower())
        return None if builder is None else (builder, (str(path),))
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in BUILDERS)
    if not files:
        return None
    builders = sorted({BUILDERS[p.suffix.lower()] for p in files})
    if len(builders) > 1:
        raise ConfigError(
            f"{path} mixes data files of kinds {', '.join(builders)}; "
            "point --dataset at one kind (a file, or a folder of one kind)"
        )
    return builders[0], tuple(str(p) for p in files)


# ---------------------------------------------------------------------------- entry point


def open_source(
    dataset: str,
    model: LoadedModel,
    *,
    context_length: int = 128,
    max_examples: int | None = None,
    max_tokens: int | None = None,
    split: str = "train",
    text_field: str = "text",
    dataset_config: str | None = None,
    streaming: bool = False,
    progress: bool = True,
) -> ExampleSource:
    """Open ``dataset`` for ``model``'s modality: ``"embedded"``, an image folder, a .txt or
    .jsonl file, a ``save_to_disk`` directory, parquet/arrow/json/csv files (or a folder of
    them), or a Hugging Face Hub id (``org/name``, with ``dataset_config``).

    ``max_tokens`` caps the examples at ``max_tokens // context_length`` contexts (text).
    ``streaming`` reads Hub ids and data files without a full download, in stored order,
    up to the budget, which it therefore needs."""
    if model.modality == "text":
        limit = _budget(context_length, max_examples, max_tokens)
    elif max_tokens is not None:
        raise ConfigError("--max-tokens counts text tokens; for images use --max-examples")
    else:
        limit = max_examples
    if streaming and limit is None:
        raise ConfigError(
            "--streaming reads only what the store needs, so it needs --max-examples or "
            "--max-tokens"
        )
    if dataset == EMBEDDED_DATASET:
        if model.modality != "text":
            raise ConfigError("the embedded dataset is text; give an image folder for a ViT")
        docs, root = embedded_documents()
        description = {"kind": "embedded", "name": "python-language-reference"}
        return _text_source(docs, root, description, model, context_length, limit, progress)
    path = Path(dataset).expanduser().resolve()
    if not path.exists():
        local = dataset.startswith((".", "/", "~")) or Path(dataset).suffix.lower() in BUILDERS
        if local or not _HUB_ID.match(dataset):
            raise StoreNotFoundError(
                f"dataset {dataset!r} does not exist (a Hub id looks like org/name)"
            )
        check_hub_reachable(dataset)
        hf = HFDataset(
            kind="hub", path=dataset, config=dataset_config, split=split, streaming=streaming
        )
        return _hf_open(hf, dataset, model, text_field, context_length, limit, progress)
    is_hf = (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()
    if path.is_dir() and is_hf:
        if streaming:
            raise ConfigError(f"{path} is a save_to_disk directory, read whole; drop --streaming")
        return _hf_saved(
            path, model, split, text_field, context_length, limit, max_examples, progress
        )
    legacy = path.is_file() and path.suffix in (".txt", ".jsonl") and not streaming
    if legacy and model.modality == "text":
        docs = _read_text_file(path, text_field)
        description = {"kind": "text_file", "path": str(path), "text_field": text_field}
        return _text_source(docs, str(path), description, model, context_length, limit, progress)
    if legacy:
        raise ConfigError(f"{path} is text but {model.ckpt} is an image model")
    if path.is_dir() and model.modality == "image" and image_files(path):
        if streaming:
            raise ConfigError(f"{path} is an image folder, read from disk; drop --streaming")
        return _image_folder(path, model, max_examples)
    found = _data_files(path)
    if path.is_dir() and (dataset_config is not None or (found and (path / "README.md").exists())):
        hf = HFDataset(
            kind="repo", path=str(path), config=dataset_config, split=split, streaming=streaming
        )
        return _hf_open(hf, str(path), model, text_field, context_length, limit, progress)
    if dataset_config is not None:
        raise ConfigError(
            f"--dataset-config applies to Hub ids and local copies of Hub repositories; "
            f"{path} is neither"
        )
    if found is not None and split != "train":
        raise ConfigError(
            f"{path} is plain data files, which form one split ('train'); drop --split "
            "(or add a README.md dataset card naming the splits)"
        )
    if found is None and path.is_dir() and model.modality == "image":
        return _image_folder(path, model, max_examples)  # explains that it holds no images
    if found is None:
        raise ConfigError(
            f"cannot tell what kind of dataset {path} is: give an image folder, a .txt, "
            ".jsonl, .json, .csv, .parquet or .arrow file (or a folder of them), a directory "
            "written by datasets' save_to_disk, or a Hub id"
        )
    builder, files = found
    hf = HFDataset(kind="files", path=builder, data_files=files, split="train", streaming=streaming)
    return _hf_open(hf, str(path), model, text_field, context_length, limit, progress)


def _hf_open(
    hf: HFDataset,
    root: str,
    model: LoadedModel,
    text_field: str,
    context_length: int,
    limit: int | None,
    progress: bool,
) -> ExampleSource:
    if model.modality == "image":
        return _hf_images(hf, root, hf.describe(), model, limit)
    return _hf_text(hf, root, hf.describe(), model, text_field, context_length, limit, progress)
