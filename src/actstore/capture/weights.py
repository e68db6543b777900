"""The checkpoint tensors a truncated model needs, read lazily from safetensors files.

A checkpoint is ``model.safetensors`` or, sharded, the files that
``model.safetensors.index.json`` names (local directory or Hugging Face cache; a hub id
downloads only the shards it needs). :meth:`Checkpoint.lazy_tensors` opens only the files
holding a wanted tensor and hands ``transformers`` a safetensors slice per tensor: a
slice reads its bytes when ``from_pretrained`` copies it into the model, so tensors of
blocks after the last one needed, never asked for, are never read (nor their files opened).
Sizes come from the index and the files' headers, never from tensor data.

Example:
    >>> ckpt = Checkpoint.find("/models/llama")  # doctest: +SKIP
    >>> keep = needed_filter(meta_model, "layers", last_block=5, skip=set())  # doctest: +SKIP
    >>> tensors, files = ckpt.lazy_tensors(keep)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CorruptStoreError, StoreNotFoundError
from ..storage.local import load_json

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def _fetch(source: str, filename: str, *, required: bool, download: bool = True) -> str | None:
    """Local path of ``filename`` of ``source`` (a directory or a hub id; downloads it into
    the Hugging Face cache when needed and ``download`` allows)."""
    local = Path(source).expanduser()
    if local.is_dir():
        path = local / filename
        if path.is_file():
            return str(path)
        if required:
            raise StoreNotFoundError(
                f"{source}: {filename} is missing (the checkpoint's index names it); "
                "restore the file or download the model again"
            )
        return None
    from transformers.utils import cached_file

    try:
        return cached_file(
            source,
            filename,
            local_files_only=not download,
            _raise_exceptions_for_missing_entries=required,
            _raise_exceptions_for_connection_errors=required,
        )
    except OSError as err:
        raise StoreNotFoundError(f"{source}: cannot get {filename} ({err})") from None


@dataclass(frozen=True)
class Checkpoint:
    """Where each tensor of a safetensors checkpoint lives."""

    source: str
    """The local directory or hub id."""
    weight_map: dict[str, str]
    """Tensor name -> file name (relative to the checkpoint)."""
    total_size: int | None
    """Bytes of all its tensors (the index's ``total_size``), when known."""
    tensor_bytes: dict[str, int] | None = None
    """Bytes of each tensor, when its file's header has been read (a one-file checkpoint)."""
    mapped: bool = True
    """False: a one-file checkpoint that is not on this machine and whose header could not
    be read (``find(download=False)``, Hub unreachable): its tensors and sizes are unknown."""

    @classmethod
    def find(cls, source: str, *, download: bool = True) -> Checkpoint | None:
        """The safetensors checkpoint of ``source``, or None when it has none (``.bin``).

        With ``download=False`` (``--dry-run``) only the small index may be downloaded: a
        one-file checkpoint not on this machine yet is not, its header is read from the Hub
        (a few kilobytes) when the Hub answers, else its tensors are unknown (``mapped``
        False)."""
        index = _fetch(source, INDEX, required=False)
        if index is not None:
            try:
                data = load_json(Path(index).read_bytes())
                weight_map = dict(data["weight_map"])
                total = (data.get("metadata") or {}).get("total_size")
            except (ValueError, KeyError, TypeError, AttributeError) as err:
                raise CorruptStoreError(f"{index} is not a safetensors index ({err})") from None
            return cls(
                source=source,
                weight_map=weight_map,
                total_size=int(total) if isinstance(total, (int, float)) else None,
            )
        single = _fetch(source, SINGLE, required=False, download=download)
        if single is not None:
            sizes = _header_sizes(single)
        elif download or Path(source).expanduser().is_dir():
            return None
        else:
            remote = _hub_header_sizes(source)
            if remote is None:
                return cls(source=source, weight_map={}, total_size=None, mapped=False)
            if not remote:  # the Hub has no such file
                return None
            sizes = remote
        return cls(
            source=source,
            weight_map=dict.fromkeys(sizes, SINGLE),
            total_size=sum(sizes.values()),
            tensor_bytes=sizes,
        )

    @property
    def files(self) -> list[str]:
        return sorted(set(self.weight_map.values())) if self.mapped else [SINGLE]

    def path(self, filename: str) -> str:
        local = _fetch(self.source, filename, required=True)
        if local is None:  # required: _fetch raises rather than return None
            raise StoreNotFoundError(f"{self.source}: cannot get {filename}")
        return local

    def lazy_tensors(
        self, keep: Callable[[str], bool]
    ) -> tuple[dict[str, Any], contextlib.ExitStack]:
        """``{name: safetensors slice}`` of the tensors ``keep`` accepts, and the stack
        holding their open files (close it once the model is loaded)."""
        wanted: dict[str, list[str]] = {}
        for name, filename in self.weight_map.items():
            if keep(name):
                wanted.setdefault(filename, []).append(name)
        stack = contextlib.ExitStack()
        tensors: dict[str, Any] = {}
        try:
            for filename, names in sorted(wanted.items()):
                handle = stack.enter_context(_open(self.path(filename)))
                for name in names:
                    tensors[name] = handle.get_slice(name)
        except BaseException:
            stack.close()
            raise
        return tensors, stack

    def read_plan(self, keep: Callable[[str], bool]) -> tuple[int | None, list[str]]:
        """(bytes of the tensors ``keep`` accepts, the files holding them), from those
        files' headers only; the bytes are None when a file is not on this machine yet
        (nothing is downloaded), or the checkpoint is not ``mapped``."""
        if not self.mapped:
            return None, self.files
        by_file: dict[str, list[str]] = {}
        for name, filename in self.weight_map.items():
            if keep(name):
                by_file.setdefault(filename, []).append(name)
        kept = 0
        for filename, names in by_file.items():
            sizes = self.tensor_bytes
            if sizes is None:
                local = _fetch(self.source, filename, required=False, download=False)
                if local is None:
                    return None, sorted(by_file)
                sizes = _header_sizes(local)
            kept += sum(sizes[name] for name in names)
        return kept, sorted(by_file)


def _open(path: str):
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(path, framework="pt")
    except (OSError, SafetensorError) as err:
        raise CorruptStoreError(
            f"{path} is not a readable safetensors file ({err}); download the model again"
        ) from None


def _header_sizes(path: str) -> dict[str, int]:
    """Bytes of each tensor of a safetensors file, from its JSON header."""
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < length < 2**30:
            raise CorruptStoreError(
                f"{path} is not a readable safetensors file (header length {length}); "
                "download the model again"
            )
        try:
            header = load_json(f.read(length))
        except ValueError as err:
            raise CorruptStoreError(
                f"{path} is not a readable safetensors file ({err}); download the model again"
            ) from None
    try:
        header.pop("__metadata__", None)
        return {
            name: int(info["data_offsets"][1] - info["data_offsets"][0])
            for name, info in header.items()
        }
    except (AttributeError, KeyError, IndexError, TypeError, ValueError) as err:
        raise CorruptStoreError(
            f"{path} is not a readable safetensors file (its header: {err!r}); download the "
            "model again"
        ) from None


def _hub_header_sizes(repo_id: str) -> dict[str, int] | None:
    """Bytes of each tensor of the Hub's ``model.safetensors`` of ``repo_id``, from its
    header alone (HTTP range requests); empty when the Hub has no such file, None when the
    Hub cannot say (offline, unreachable, no access)."""
    from huggingface_hub import parse_safetensors_file_metadata
    from huggingface_hub.errors import EntryNotFoundError

    try:
        header = parse_safetensors_file_metadata(repo_id, SINGLE)
    except EntryNotFoundError:
        return {}
    except Exception:  # noqa: BLE001 - a size the Hub does not give is reported unknown
        return None
    return {
        name: int(info.data_offsets[1] - info.data_offsets[0])
        for name, info in header.tensors.items()
    }


def block_of(blocks_path: str) -> Callable[[str], int | None]:
    """``name -> block index`` for checkpoint tensor names (any prefix, e.g. ``model.``),
    None for tensors outside the blocks."""
    pattern = re.compile(r"(?:^|\.)" + re.escape(blocks_path) + r"\.(\d+)\.")

    def index(name: str) -> int | None:
        m = pattern.search(name)
        return int(m.group(1)) if m else None

    return index


def model_names(model: Any) -> Callable[[str], str | None] | None:
    """``checkpoint name -> name in model`` (None: ``model`` has no such tensor) by the rules
    ``from_pretrained`` applies (the architecture's renamings, the base model prefix), or
    None when this transformers version does not expose them."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )

        mapping = get_model_conversion_mapping(model, None, None)
    except (ImportError, TypeError, AttributeError):
        return None
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    expected = model.state_dict()
    prefix = model.base_model_prefix

    def target(name: str) -> str | None:
        renamed, _ = rename_source_key(name, renamings, converters, prefix, expected)
        if renamed not in expected and name in expected:
            renamed, _ = rename_source_key(name, [], [], prefix, expected)
        return renamed if renamed in expected else None

    return target


def tail_names(model: Any, blocks_path: str) -> set[str]:
    """Tensors registered after the blocks (the final norm): never needed by a site."""
    names = list(model.state_dict())
    inside = [i for i, n in enumerate(names) if n.startswith(blocks_path + ".")]
    return set(names[inside[-1] + 1 :]) if inside else set()


def needed_filter(
    model: Any, blocks_path: str, last_block: int, skip: set[str]
) -> Callable[[str], bool]:
    """Accepts the checkpoint tensors ``model`` (blocks ``0..last_block``) loads, except
    those landing on ``skip``; without transformers' renaming rules, every tensor except
    later blocks' (the rest is never materialised: transformers drops unexpected keys)."""
    index = block_of(blocks_path)
    target = model_names(model)

    def keep(name: str) -> bool:
        i = index(name)
        if i is not None and i > last_block:
            return False
        if target is None:
            return True
        landed = target(name)
        return landed is not None and landed not in skip

    return keep
