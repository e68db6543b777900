"""Activault's layout: key names, hook names, and the megabatch file (pure functions).

A run is a prefix holding ``cfg.json`` and one folder per hook::

    {run}/cfg.json
    {run}/{hook}/metadata.json
    {run}/{hook}/statistics.json
    {run}/{hook}/{group uuid}--{n}.pt

A megabatch file is ``torch.save`` (to a stream, not a path, so records sit under
``archive/``) of ``{"states": [rows, seq, d], "input_ids": int64 [rows, seq],
"tensor_bytes": int}``. Equal shapes and dtypes give files of exactly equal size, which
Activault's reader requires (it downloads exactly ``bytes_per_file`` bytes of every file).

actstore writes ``{uuid}--{n}.pt`` (the published layout); it reads that and Activault's
own ``{uuid}--{n}_{job}.saved.pt``. Activault's reader accepts any key under the prefix.

Example:
    >>> hook_name(Site("mlp_out", 24))
    'models.layers.24.mlp.post'
    >>> parse_data_file("0f909221-ff28-4a94-a43f-cfe973e835cf--5_0.saved.pt")
    DataFile(uuid='0f909221-ff28-4a94-a43f-cfe973e835cf', n=5, job='0')
"""

from __future__ import annotations

import io
import itertools
import re
import uuid as uuid_lib
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import ConfigError, CorruptStoreError
from ...sites import Site

if TYPE_CHECKING:
    import torch
else:
    from ..._lazy import torch

CFG = "cfg.json"
METADATA = "metadata.json"
STATISTICS = "statistics.json"

#: The torch dtypes a megabatch may hold, by the name used in options and
#: ``metadata["dtype"]`` (``getattr(torch, name)``; see :func:`parse_dtype`).
DTYPES = ("bfloat16", "float16", "float32")

#: Site kind -> Activault hook suffix after ``models.layers.{L}``. ``resid`` (the block's
#: output) is ``.post``: Activault's own fallback maps a ``post`` hook it cannot find as a
#: module to ``hidden_states[L + 1]``, the same residual stream.
_HOOK_SUFFIX = {
    "resid": "post",
    "mlp_out": "mlp.post",
    "mlp_in": "mlp.pre",
    "attn_out": "self_attn.post",
    "attn_in": "self_attn.pre",
    "resid_pre": "pre",  # the block's input, as Activault names a module's pre-hook
}
_SUFFIX_KIND = {v: k for k, v in _HOOK_SUFFIX.items()}
_HOOK_RE = re.compile(
    r"^models\.layers\.(\d+)\.(post|pre|mlp\.post|mlp\.pre|self_attn\.post|self_attn\.pre)$"
)
_OLD_HOOK_RE = re.compile(r"^blocks\.(\d+)\.hook_resid_post$")

_DATA_RE = re.compile(
    r"^(?P<uuid>[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12})"
    r"--(?P<n>\d+)(?:_(?P<job>[^./]+))?(?:\.saved)?\.pt$"
)


def hook_name(site: Site | str) -> str:
    """Activault's hook (and folder) name for an actstore site.

    Example:
        >>> hook_name("attn_in.3"), hook_name("resid.0")
        ('models.layers.3.self_attn.pre', 'models.layers.0.post')
    """
    site = Site.parse(site)
    if site.layer < 0:
        raise ConfigError(f"resolve negative layers before naming hooks (got {site})")
    if site.kind not in _HOOK_SUFFIX:
        raise ConfigError(
            f"Activault has no hook name for {site}; store one of {', '.join(_HOOK_SUFFIX)}"
        )
    return f"models.layers.{site.layer}.{_HOOK_SUFFIX[site.kind]}"


def hook_site(hook: str) -> Site | None:
    """The actstore site a hook name stands for, or None for names actstore does not know.

    Example:
        >>> hook_site("models.layers.24.mlp.post"), hook_site("blocks.3.hook_resid_post")
        (Site(kind='mlp_out', layer=24), Site(kind='resid', layer=3))
    """
    if m := _HOOK_RE.match(hook):
        return Site(_SUFFIX_KIND[m.group(2)], int(m.group(1)))
    if m := _OLD_HOOK_RE.match(hook):
        return Site("resid", int(m.group(1)))
    return None


def check_hook_prefixes(hooks: Iterable[str]) -> None:
    """Refuse hook folder names where one is a string prefix of another.

    Activault's reader lists ``{run}/{hook}`` without a trailing slash, so the files of
    ``.../mlp.pre_ln/`` would be read as ``.../mlp.pre`` data.

    Example:
        >>> check_hook_prefixes(["models.layers.1.post", "models.layers.10.post"])
    """
    names = sorted(set(hooks))
    for name in names:
        if not name or "/" in name or name in (".", ".."):
            raise ConfigError(f"invalid hook folder name {name!r}")
    for a, b in itertools.pairwise(names):
        if b.startswith(a):
            raise ConfigError(
                f"hook folder {a!r} is a prefix of {b!r}: Activault's reader, which lists "
                f"'{{run}}/{a}' without a trailing slash, would read {b!r}'s files as {a!r} data; "
                "rename one of them or write them to different runs"
            )


@dataclass(frozen=True)
class DataFile:
    """The parts of a megabatch file name."""

    uuid: str
    n: int
    job: str | None = None

    @property
    def sort_key(self) -> tuple[str, int, str]:
        """Upload order within a job (n counts a hook's uploads), then the uuid."""
        return (self.job or "", self.n, self.uuid)


def data_file_name(group_uuid: str, n: int) -> str:
    """``{uuid}--{n}.pt``: the name actstore writes.

    Example:
        >>> data_file_name("0f909221-ff28-4a94-a43f-cfe973e835cf", 1)
        '0f909221-ff28-4a94-a43f-cfe973e835cf--1.pt'
    """
    if n < 1:
        raise ConfigError(f"upload counters start at 1, not {n}")
    return f"{group_uuid}--{n}.pt"


def parse_data_file(name: str) -> DataFile | None:
    """Parse a megabatch name (ours or Activault's ``..._{job}.saved.pt``); None otherwise."""
    m = _DATA_RE.match(name)
    if m is None:
        return None
    return DataFile(m.group("uuid").lower(), int(m.group("n")), m.group("job"))


def group_uuid(run_id: str, group: int) -> str:
    """The uuid shared by every hook's file of ``group`` (deterministic per run).

    Deterministic names mean a retried or resumed upload replaces, never duplicates, a file.

    Example:
        >>> group_uuid("6f1c0d3e-0000-4000-8000-000000000000", 0) == group_uuid(
        ...     "6f1c0d3e-0000-4000-8000-000000000000", 0)
        True
    """
    return str(uuid_lib.uuid5(uuid_lib.UUID(run_id), f"group-{group}"))


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"torch.bfloat16"`` (the string ``metadata["dtype"]`` holds)."""
    return str(dtype)


def parse_dtype(text: str) -> torch.dtype:
    """``"torch.bfloat16"`` (or ``"bfloat16"``) -> ``torch.bfloat16``, without ``eval``."""
    name = str(text).removeprefix("torch.")
    if name in ("half",):
        name = "float16"
    if name in ("float", "float32"):
        name = "float32"
    if name not in DTYPES:
        raise CorruptStoreError(
            f"unsupported activation dtype {text!r}; Activault stores torch.bfloat16, "
            "torch.float16 or torch.float32"
        )
    return getattr(torch, name)


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype rows are returned in (bfloat16 widens exactly to float32)."""
    return np.dtype(np.float16) if dtype == torch.float16 else np.dtype(np.float32)


def tensor_bytes(states: torch.Tensor, input_ids: torch.Tensor) -> int:
    """Activault's ``tensor_bytes``: raw bytes of both tensors."""
    return states.numel() * states.element_size() + input_ids.numel() * input_ids.element_size()


def serialize_megabatch(states: torch.Tensor, input_ids: torch.Tensor) -> io.BytesIO:
    """``torch.save`` of the megabatch dict into a fresh buffer (records under ``archive/``).

    Both tensors are made contiguous CPU tensors owning exactly their storage, because
    ``torch.save`` writes whole storages: a view of a larger tensor would change the size.
    """
    buffer = io.BytesIO()
    write_megabatch(states, input_ids, buffer)
    return buffer


def write_megabatch(states: torch.Tensor, input_ids: torch.Tensor, file: Any) -> None:
    """``torch.save`` of the megabatch dict into ``file``, a writable binary stream (the
    bytes :func:`serialize_megabatch` holds, written straight from the tensors' storage:
    ``torch.save`` hands the stream views of it, no copy in between)."""
    states = _owning(states.detach().to("cpu"))
    input_ids = _owning(input_ids.detach().to("cpu", torch.int64))
    if states.dim() != 3 or input_ids.shape != states.shape[:2]:
        raise ConfigError(
            f"a megabatch is states [rows, seq, d] with input_ids [rows, seq]; got "
            f"{tuple(states.shape)} and {tuple(input_ids.shape)}"
        )
    torch.save(
        {"states": states, "input_ids": input_ids, "tensor_bytes": tensor_bytes(states, input_ids)},
        file,
    )


def _owning(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if it is contiguous and owns exactly its storage, else a compact copy."""
    exact = t.numel() * t.element_size()
    if t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == exact:
        return t
    return t.contiguous().clone()


class _BufferReader(io.RawIOBase):
    """A seekable read-only file over a buffer: ``torch.load`` reads tensor records straight
    from it with ``readinto`` (``io.BytesIO`` would first copy the whole buffer)."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self._view = memoryview(data).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), len(self._view) - self._pos))
        memoryview(buffer).cast("B")[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n


def load_megabatch(data: bytes | bytearray | memoryview, *, source: str) -> dict[str, Any]:
    """Load a megabatch with ``torch.load(weights_only=True)`` (never a full unpickler).

    Returns ``{"states": tensor, "input_ids": tensor | None}``; a file holding a bare tensor
    (very old Activault files) gives ``input_ids=None``.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # torch.load takes any seekable binary file; its annotation names only IO[bytes]
            buf = _BufferReader(data)
            obj = torch.load(buf, map_location="cpu", weights_only=True)  # type: ignore[arg-type]
    except Exception as err:  # any failure means a damaged file
        raise CorruptStoreError(
            f"{source} is not a loadable megabatch ({type(err).__name__}: {err}); the file is "
            "damaged or not a torch.save archive: re-create it"
        ) from err
    if isinstance(obj, torch.Tensor):
        return {"states": obj, "input_ids": None}
    if not isinstance(obj, dict) or not isinstance(obj.get("states"), torch.Tensor):
        raise CorruptStoreError(
            f"{source} holds {type(obj).__name__}, not a dict with a 'states' tensor"
        )
    ids = obj.get("input_ids")
    return {"states": obj["states"], "input_ids": ids if isinstance(ids, torch.Tensor) else None}
