"""Hugging Face ``datasets``: ``save_to_disk`` directories, local data files (parquet, arrow,
json, csv, text; a file or a folder of them), local copies of Hub repositories, and Hub ids.

Every kind but saved directories goes through one call, ``datasets.load_dataset(builder or
id, data_files=..., ...)`` (:class:`HFDataset`), so local files exercise the Hub's path.
Text is read in Arrow batches of the one column it uses, only as far as the budget needs.
Local files are always read that way (streamed, in stored order, no Arrow cache built), so
``--streaming`` changes nothing for them, not even the store's hash; a Hub id is streamed
only with ``--streaming`` (otherwise ``datasets`` downloads it first).

Example:
    >>> HFDataset(kind="files", path="parquet", data_files=("a.parquet",)).describe()
    {'kind': 'hf_files', 'split': 'train', 'builder': 'parquet', 'data_files': ['a.parquet']}
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

import numpy as np

from ...errors import ConfigError, CorruptStoreError, StoreNotFoundError, require
from .columns import arrow_kind, pick_field
from .packing import Rows

#: Local file suffix -> the ``datasets`` builder that reads it.
BUILDERS = {
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".txt": "text",
}
#: Rows per Arrow batch read.
ARROW_BATCH = 1000
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def looks_like_hub_id(dataset: str) -> bool:
    """Whether ``dataset``, not a local path, could name a Hub dataset (``org/name``)."""
    return (
        "/" in dataset and not Path(dataset).expanduser().exists() and bool(_HUB_ID.match(dataset))
    )


def is_hub_id(dataset: str) -> bool:
    """Whether ``dataset`` has the shape of a Hub id (existence is not checked)."""
    return bool(_HUB_ID.match(dataset))


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
            return load_saved(self.path, self.split)
        where = self.path if self.data_files is None else ", ".join(self.data_files)
        try:
            with _quiet_datasets():
                return datasets.load_dataset(
                    self.path,
                    name=self.config,
                    data_files=None if self.data_files is None else list(self.data_files),
                    split=self.split,
                    streaming=self.streaming,
                )
        except Exception as err:
            mapped = _load_error(err, where, self)
            if mapped is None:
                raise
            raise mapped from err

    def tables(self, ds: Any, batch_size: int, where: str) -> Iterator[Any]:
        """``ds`` (loaded from this dataset) in Arrow tables of ``batch_size`` rows, in
        stored order. Data is parsed as it is read (local files always stream), so a file
        that does not parse fails here, as one :class:`CorruptStoreError` naming ``where``."""
        with _quiet_datasets():
            try:
                yield from ds.with_format("arrow").iter(batch_size=batch_size)
            except Exception as err:
                if not _unreadable(err):
                    raise
                raise _corrupt(err, where, self) from err

    def describe(self) -> dict[str, Any]:
        """What identifies the dataset in a store's metadata (``streaming`` only for Hub
        ids: a local file gives the same rows either way)."""
        out: dict[str, Any] = {"kind": f"hf_{self.kind}", "split": self.split}
        if self.kind in ("hub", "repo"):
            out.update(id=self.path, config=self.config)
        else:
            out.update(builder=self.path, data_files=list(self.data_files or ()))
        if self.streaming and self.kind == "hub":
            out["streaming"] = True
        return out


#: ``datasets``' messages for a split the dataset does not have (streamed, downloaded).
_NO_SPLIT = re.compile(
    r"^(?:Bad split: .*\. Available splits|Unknown split \".*\"\. Should be one of):? (\[.*\])"
)
#: Exceptions (by type name) of data that does not parse: pandas' (csv), ``datasets``'.
_PARSE_ERRORS = frozenset(
    {"ParserError", "EmptyDataError", "DatasetGenerationError", "CastError", "JSONDecodeError"}
)
#: Builder -> what its files must hold, for messages.
_FILE_KINDS = {
    "json": "JSON",
    "csv": "CSV",
    "parquet": "Parquet",
    "arrow": "Arrow",
    "text": "UTF-8 text",
}


def _unreadable(err: BaseException) -> bool:
    """Whether ``err`` says that data cannot be parsed (not that it is missing, offline or
    too big for memory)."""
    import pyarrow as pa

    if isinstance(err, MemoryError):
        return False
    return isinstance(err, (pa.ArrowException, UnicodeDecodeError)) or (
        type(err).__name__ in _PARSE_ERRORS
    )


def _corrupt(err: BaseException, where: str, hf: HFDataset) -> CorruptStoreError:
    """One line for data of ``where`` that does not parse, and what to do about it."""
    cause = err
    while type(cause).__name__ == "DatasetGenerationError" and cause.__cause__ is not None:
        cause = cause.__cause__  # "An error occurred while generating the dataset": the why
    kind = _FILE_KINDS.get(hf.path, "data") if hf.kind == "files" else "data"
    return CorruptStoreError(
        f"cannot read {where}: it is not valid {kind} ({_first_line(cause)}); repair or "
        "re-create it, or give another --dataset"
    )


def _load_error(err: Exception, where: str, hf: HFDataset) -> Exception | None:
    """The one-line error for a failed ``load_dataset`` (None when unknown)."""
    name, text = type(err).__name__, str(err)
    if isinstance(err, ValueError) and "corresponds to no data" in text:
        return ConfigError(f"{where} holds no rows")
    no_split = _NO_SPLIT.match(text) if isinstance(err, ValueError) else None
    if no_split is not None:
        return ConfigError(
            f"{where} has no split {hf.split!r}; choose one with --split (it has "
            f"{no_split.group(1)})"
        )
    if _unreadable(err):
        return _corrupt(err, where, hf)
    if isinstance(err, ValueError):
        return ConfigError(f"cannot load {where}: {_first_line(err)}")
    if isinstance(err, ConnectionError):
        return StoreNotFoundError(
            f"dataset {hf.path!r} is not in the local Hugging Face cache and the Hub is "
            "offline (HF_HUB_OFFLINE); download it once online, or give local files"
        )
    if isinstance(err, FileNotFoundError) or name in (
        "DatasetNotFoundError",
        "DataFilesNotFoundError",
    ):
        return StoreNotFoundError(f"cannot load {where}: {_first_line(err)}")
    return None


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


@contextlib.contextmanager
def _quiet_datasets():
    """Silence ``datasets``' progress bars and logs while loading and reading: its errors
    are also raised, and are reported once, by the caller."""
    from datasets.utils import logging as ds_logging

    level, bars = ds_logging.get_verbosity(), ds_logging.is_progress_bar_enabled()
    ds_logging.set_verbosity(ds_logging.CRITICAL)
    ds_logging.disable_progress_bar()
    try:
        yield
    finally:
        ds_logging.set_verbosity(level)
        if bars:
            ds_logging.enable_progress_bar()


def load_saved(path: str, split: str | None):
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


def data_files(path: Path) -> tuple[str, tuple[str, ...]] | None:
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


# ---------------------------------------------------------------------------- text rows


def hf_rows(
    hf: HFDataset,
    root: str,
    description: dict[str, Any],
    text_field: str | None,
    token_field: str | None,
) -> Rows:
    """The text or token-id column of ``hf`` (chosen from its Arrow type), read lazily;
    ``description`` identifies the dataset (the column is added to it)."""
    ds = hf.load()
    first = next(hf.tables(ds, 1, root), None)
    if first is None or first.num_rows == 0:
        raise ConfigError(f"{root} holds no rows")
    kinds = {f.name: arrow_kind(f.type) for f in first.schema}
    name, kind = pick_field(kinds, where=root, text_field=text_field, token_field=token_field)
    tables = hf.tables(ds.select_columns([name]), ARROW_BATCH, root)
    if kind == "tokens":
        items: Iterator[Any] = _token_rows(tables, name, root)
        description = {**description, "token_column": name}
    else:
        # Text files are read line by line: skip blank lines, as for a .txt read directly.
        items = _documents(tables, name, skip_blank=hf.kind == "files" and hf.path == "text")
        description = {**description, "text_field": name}
    total = ds.num_rows if hf.kind == "saved" or not hf.streaming else None
    if hf.kind == "files" and hf.path == "text":
        total = None  # rows are lines, blank ones included
    return Rows(kind=kind, items=items, description=description, total=total)


def _documents(tables: Iterator[Any], name: str, *, skip_blank: bool) -> Iterator[str]:
    for table in tables:
        for value in table.column(name).to_pylist():
            if value is None or (skip_blank and not value.strip()):
                continue
            yield value


def _token_rows(tables: Iterator[Any], name: str, root: str) -> Iterator[np.ndarray]:
    for table in tables:
        flat, lengths = _flatten(table.column(name).combine_chunks(), name, root)
        ends = np.cumsum(lengths)
        for start, end in zip(ends - lengths, ends):
            yield flat[start:end]


def _flatten(array: Any, name: str, root: str) -> tuple[np.ndarray, np.ndarray]:
    """A column of (nested) integer lists: every id end to end, and each row's count."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(array.type, pa.ExtensionType):
        array = array.storage
    if array.null_count:
        raise ConfigError(f"{root}: column {name!r} has a row with no token ids (null)")
    lengths = pc.list_value_length(array).to_numpy(zero_copy_only=False).astype(np.int64)
    values = array.flatten()
    if isinstance(values.type, pa.ExtensionType):
        values = values.storage
    if pa.types.is_integer(values.type):
        if values.null_count:
            raise ConfigError(f"{root}: column {name!r} has a null token id")
        return values.to_numpy(zero_copy_only=False).astype(np.int64, copy=False), lengths
    flat, inner = _flatten(values, name, root)  # nested lists: a row's ids are its lists'
    sums = np.concatenate([[0], np.cumsum(inner)])
    ends = np.cumsum(lengths)
    return flat, sums[ends] - sums[ends - lengths]
