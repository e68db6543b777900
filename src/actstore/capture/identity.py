"""What a store's identity says of the model that made it: the content of its weights.

A store's record holds ``CapturePlan.data["weights"]`` (and the compute dtype beside it,
see :func:`~actstore.capture.runner.source_plan`), so weights changed in place, even to the
same size and mtime, make another store, never "Already captured":

- a local model directory (the embedded model included): ``{"digest": xxh3-128}`` over
  the bytes of what loading reads: the checkpoint's weight files (``model.safetensors``, or
  the shards of ``model.safetensors.index.json`` that hold a tensor of a block up to the
  deepest one the capture needs; ``pytorch_model.bin`` and its shards, which transformers
  reads whole), and every other file at the top of the directory (``config.json``, the
  tokenizer and image processor files: they decide the values too), but hidden files,
  ``*.md`` and weight files loading does not read (``training_args.bin``,
  ``optimizer.pt``, a second copy in another format);
- a Hugging Face Hub id: ``{"revision": commit}``, the commit its files come from (Hub
  files are named by their content under a commit), read from where config.json is
  cached; nothing is downloaded for it.

The bytes are read every time a command needs the digest (once per process: the result
is kept for the process only, keyed by each file's size, mtime, inode and ctime), never
answered from a cache keyed by size and mtime across processes, which an edit that puts
them back would defeat. The cost is in docs/performance.md (identity section).

Example:
    >>> weights_identity("embedded", last_block=2)  # doctest: +SKIP
    {'digest': '5f0d...'}
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from ..hub import resolve_checkpoint
from ..storage.local import load_json
from .data.digest import blobs_digest, files_digest

#: Files a checkpoint's weights may be kept in (read only when loading reads them).
WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".h5",
    ".msgpack",
    ".onnx",
    ".gguf",
    ".ot",
    ".pkl",
    ".npz",
)
#: A tensor name's block index (``model.layers.12.``, ``h.3.``, ``encoder.layer.5.``).
_BLOCK = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)\.")

#: (path, files' stat, last block) -> identity, for this process only.
_DONE: dict[tuple[Any, ...], dict[str, str]] = {}


def weights_identity(model: str, *, last_block: int | None = None) -> dict[str, str]:
    """The identity of ``model``'s weights (a local directory, ``embedded`` or a Hub id)
    as a capture of blocks ``0..last_block`` (None: all) reads them."""
    path = Path(resolve_checkpoint(model)).expanduser()
    if not path.is_dir():
        return {"revision": hub_revision(str(model))}
    root = path.resolve()
    files = weight_files(root, last_block)
    stats = tuple((name, *_stat(root / name)) for name in files)
    key = (str(root), stats, last_block)
    found = _DONE.get(key)
    if found is None:
        present = [str(root / name) for name, *st in stats if st[0] >= 0]
        absent = [name.encode() for name, *st in stats if st[0] < 0]
        digest = files_digest(present, str(root))
        if absent:  # named by an index but not there: part of what loading finds
            digest = blobs_digest([digest.encode(), b"absent", *absent])
        found = _DONE[key] = {"digest": digest}
    return dict(found)


def _stat(path: Path) -> tuple[int, int, int, int]:
    try:
        st = os.stat(path)
    except OSError:
        return (-1, 0, 0, 0)
    return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)


def weight_files(root: Path, last_block: int | None = None) -> list[str]:
    """The files of model directory ``root`` its identity covers, sorted (see the module
    docstring): what loading blocks ``0..last_block`` reads, and the other top-level files."""
    names = sorted(
        entry.name
        for entry in os.scandir(root)
        if entry.is_file() and not entry.name.startswith(".") and not entry.name.endswith(".md")
    )
    plain = [n for n in names if not n.lower().endswith(WEIGHT_SUFFIXES)]
    return sorted({*plain, *_checkpoint_files(root, names, last_block)})


def _checkpoint_files(root: Path, names: list[str], last_block: int | None) -> list[str]:
    """The weight files loading reads: as :class:`~actstore.capture.weights.Checkpoint`
    finds them (safetensors first, else transformers' ``.bin`` files), else every file of
    a weight suffix."""
    for index, single in (
        ("model.safetensors.index.json", "model.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model.bin"),
    ):
        if index in names:
            return _indexed(root / index, last_block)
        if single in names:
            return [single]
    return [n for n in names if n.lower().endswith(WEIGHT_SUFFIXES)]


def _indexed(index: Path, last_block: int | None) -> list[str]:
    """The shards of a sharded checkpoint's ``index`` holding a tensor a capture of blocks
    ``0..last_block`` may need (shards of later blocks only are never opened)."""
    try:
        weight_map = load_json(index.read_bytes())["weight_map"]
        items = [(str(k), str(v)) for k, v in dict(weight_map).items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []  # the index itself is digested; loading says what is wrong with it
    out = set()
    for tensor, shard in items:
        m = _BLOCK.search(tensor)
        if last_block is None or m is None or int(m.group(1)) <= last_block:
            out.add(shard)
    return sorted(out)


def hub_revision(model: str) -> str:
    """The commit a Hub model's cached config.json comes from (``unknown`` when it is not
    in the cache's ``snapshots/<commit>/`` layout); nothing is downloaded here beyond what
    reading its config already fetched."""
    from .weights import _fetch

    try:
        path = _fetch(model, "config.json", required=False, download=False)
    except Exception:  # noqa: BLE001 - the config check names what is wrong with the model
        path = None
    parts = Path(path).parts if path else ()
    if "snapshots" in parts[:-1]:
        return parts[parts.index("snapshots") + 1]
    return "unknown"


def module_identity(module: Any) -> dict[str, str]:
    """The identity of a model given loaded (built in place, no checkpoint): the digest
    of its parameters and buffers (names, dtypes, shapes, bytes)."""
    import numpy as np
    import torch

    blobs: list[bytes] = []
    for name, tensor in sorted(module.state_dict().items()):
        if tensor.device.type == "meta":
            blobs += [name.encode(), b"meta"]
            continue
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
        head = f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode()
        blobs += [head, np.asarray(raw.numpy()).tobytes()]
    return {"module": blobs_digest(blobs)}
