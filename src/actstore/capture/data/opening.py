"""``open_source``: which kind of dataset ``--dataset`` names, and the source that reads it.

Kinds, in the order they are recognised: ``embedded``; a Hub id (a path that does not
exist and looks like ``org/name``); a ``save_to_disk`` directory; a ``.txt`` or ``.jsonl``
file; a ``.npy`` or ``.bin`` token file; a folder of images (image models); a local copy of
a Hub repository (a folder with a README.md card, or any folder with ``--dataset-config``);
parquet/arrow/json/csv/txt files or a folder of them.

Example:
    >>> src = open_source("embedded", model)  # doctest: +SKIP
    >>> src.n_examples, src.tokens_per_example  # doctest: +SKIP
    (1009, 128)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import ConfigError, StoreNotFoundError
from .base import ExampleSource
from .hf import BUILDERS, HFDataset, check_hub_reachable, data_files, hf_rows, is_hub_id
from .images import hf_images, image_files, image_folder
from .packing import Rows, pack_rows
from .text_files import EMBEDDED_DATASET, embedded_rows, jsonl_rows, txt_rows
from .token_files import TOKEN_FILE_SUFFIXES, token_file_source

if TYPE_CHECKING:
    from ..models import LoadedModel

#: The kinds of dataset ``--dataset`` may name, for messages.
KINDS_HINT = (
    "give an image folder, a .txt, .jsonl, .json, .csv, .parquet or .arrow file (or a "
    "folder of them), a .npy or .bin token file, a directory written by datasets' "
    "save_to_disk, or a Hub id"
)


@dataclass(frozen=True, kw_only=True)
class _Request:
    """What ``open_source`` was asked for, with the example budget worked out."""

    model: LoadedModel
    context_length: int
    limit: int | None
    """Examples to keep (contexts for text); None: all."""
    split: str
    text_field: str | None
    token_field: str | None
    dataset_config: str | None
    streaming: bool
    progress: bool
    vocab_size: int | None

    @property
    def image(self) -> bool:
        return self.model.modality == "image"

    def pack(self, rows: Rows, root: str) -> ExampleSource:
        return pack_rows(
            rows,
            root,
            self.model,
            context_length=self.context_length,
            limit=self.limit,
            vocab_size=self.vocab_size,
            progress=self.progress,
        )

    def hf(self, hf: HFDataset, root: str, description: dict[str, Any]) -> ExampleSource:
        if self.image:
            return hf_images(hf, root, description, self.model, self.limit)
        rows = hf_rows(hf, root, description, self.text_field, self.token_field)
        return self.pack(rows, root)


def open_source(
    dataset: str,
    model: LoadedModel,
    *,
    context_length: int = 128,
    max_examples: int | None = None,
    max_tokens: int | None = None,
    split: str = "train",
    text_field: str | None = None,
    token_field: str | None = None,
    dataset_config: str | None = None,
    streaming: bool = False,
    progress: bool = True,
    vocab_size: int | None = None,
) -> ExampleSource:
    """Open ``dataset`` for ``model``'s modality (see the module docstring for the kinds).

    ``max_tokens`` caps the examples at ``max_tokens // context_length`` contexts (text),
    and text is read only as far as the budget needs. ``streaming`` streams a Hub id in
    stored order instead of downloading it, so it needs a budget; local data is always
    read that way. Pre-tokenized ids must be below ``vocab_size`` (default: the model's
    embedding rows)."""
    if streaming and max_examples is None and max_tokens is None:
        raise ConfigError(
            "--streaming reads only what the store needs, so it needs --max-examples or "
            "--max-tokens"
        )
    request = _Request(
        model=model,
        context_length=context_length,
        limit=_budget(model, context_length, max_examples, max_tokens),
        split=split,
        text_field=text_field,
        token_field=token_field,
        dataset_config=dataset_config,
        streaming=streaming,
        progress=progress,
        vocab_size=vocab_size if vocab_size is not None else model_vocab_size(model),
    )
    if dataset == EMBEDDED_DATASET:
        return _embedded(request)
    path = Path(dataset).expanduser().resolve()
    if not path.exists():
        return _hub(dataset, request)
    return _local(path, request)


def _budget(
    model: LoadedModel, context_length: int, max_examples: int | None, max_tokens: int | None
) -> int | None:
    """Examples the example and token budgets allow (None: no limit)."""
    if max_tokens is None:
        return max_examples
    if model.modality != "text":
        raise ConfigError("--max-tokens counts text tokens; for images use --max-examples")
    n = max_tokens // context_length
    if n < 1:
        raise ConfigError(
            f"--max-tokens {max_tokens} is less than one context of {context_length} tokens"
        )
    return n if max_examples is None else min(n, max_examples)


def model_vocab_size(model: LoadedModel) -> int | None:
    """Rows of the model's input embedding (the ids it can take); the tokenizer's size for
    a model without weights (preflight's stand-in); None for image models."""
    if model.modality != "text":
        return None
    from transformers import PreTrainedModel

    if isinstance(model.module, PreTrainedModel):
        embeddings = model.module.get_input_embeddings()
        # nn.Module.__getattr__ is typed Tensor | Module; an embedding's num_embeddings is an int
        return int(embeddings.num_embeddings)  # type: ignore[arg-type]
    return None if model.tokenizer is None else len(model.tokenizer)


def _embedded(request: _Request) -> ExampleSource:
    if request.image:
        raise ConfigError("the embedded dataset is text; give an image folder for a ViT")
    rows, root = embedded_rows()
    return request.pack(rows, root)


def _hub(dataset: str, request: _Request) -> ExampleSource:
    local = dataset.startswith((".", "/", "~")) or Path(dataset).suffix.lower() in BUILDERS
    if local or not is_hub_id(dataset):
        raise StoreNotFoundError(
            f"dataset {dataset!r} does not exist (a Hub id looks like org/name)"
        )
    check_hub_reachable(dataset)
    hf = HFDataset(
        kind="hub",
        path=dataset,
        config=request.dataset_config,
        split=request.split,
        streaming=request.streaming,
    )
    return request.hf(hf, dataset, hf.describe())


def _local(path: Path, request: _Request) -> ExampleSource:
    if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
        hf = HFDataset(kind="saved", path=str(path), split=request.split)
        # The description of earlier versions, so the store hash stays the same.
        description = {"kind": "hf_dataset", "root": str(path), "split": request.split}
        return request.hf(hf, str(path), description)
    suffix = path.suffix.lower()
    if path.is_file() and suffix in (".txt", ".jsonl", *TOKEN_FILE_SUFFIXES):
        return _file(path, suffix, request)
    if path.is_dir() and request.image and image_files(path):
        return image_folder(path, request.model, request.limit)
    return _data_files(path, request)


def _file(path: Path, suffix: str, request: _Request) -> ExampleSource:
    """A .txt or .jsonl file, or a token file (text models only)."""
    if request.image:
        raise ConfigError(f"{path} is text but {request.model.ckpt} is an image model")
    if suffix in TOKEN_FILE_SUFFIXES:
        if request.text_field is not None or request.token_field is not None:
            raise ConfigError(
                f"{path} is a token file, with no fields; drop --text-field/--token-field"
            )
        return token_file_source(
            path,
            request.model,
            context_length=request.context_length,
            limit=request.limit,
            vocab_size=request.vocab_size,
        )
    read = jsonl_rows if suffix == ".jsonl" else txt_rows
    return request.pack(read(path, request.text_field, request.token_field), str(path))


def _data_files(path: Path, request: _Request) -> ExampleSource:
    """A local Hub repository copy, or parquet/arrow/json/csv/txt files (or a folder)."""
    found = data_files(path)
    repo = found is not None and (path / "README.md").exists()
    if path.is_dir() and (request.dataset_config is not None or repo):
        hf = HFDataset(
            kind="repo",
            path=str(path),
            config=request.dataset_config,
            split=request.split,
            streaming=not request.image,
        )
        return request.hf(hf, str(path), hf.describe())
    if request.dataset_config is not None:
        raise ConfigError(
            f"--dataset-config applies to Hub ids and local copies of Hub repositories; "
            f"{path} is neither"
        )
    if found is not None and request.split != "train":
        raise ConfigError(
            f"{path} is plain data files, which form one split ('train'); drop --split "
            "(or add a README.md dataset card naming the splits)"
        )
    if found is None and path.is_dir() and request.image:
        return image_folder(path, request.model, request.limit)  # explains: no images
    if found is None:
        raise ConfigError(f"cannot tell what kind of dataset {path} is: {KINDS_HINT}")
    builder, files = found
    hf = HFDataset(kind="files", path=builder, data_files=files, streaming=not request.image)
    return request.hf(hf, str(path), hf.describe())
