"""Layout of the Zarr v2 prompt/response activation store: names, constants and the pure
parameter maths (``P_max``, ``R_max``, ``T_chunk``, truncation, chunk keys).

A store holds, for ``N`` samples, ``L`` stored sites (the ``L`` axis), hidden size ``H``::

    arrays/prompt_activations    (N, L, P_max, H) <f2, chunks (1, 1, T_chunk_prompt, H)
    arrays/response_activations  (N, L, R_max, H) <f2, chunks (1, 1, T_chunk_response, H)

Position ``l`` of the ``L`` axis is site ``sites[l]`` (``"resid.6"``: the output of block 6);
``layers[l]`` is its block index. Both lists are in the store's attributes.

Chunk sizing: a prompt chunk should hold 0.5-2 MiB (``T_chunk * H * 2`` bytes). The padded
length is cut into the fewest equal chunks of at most ``TARGET_CHUNK_BYTES`` (1 MiB), so a
chunk lands in (0.5, 1] MiB whenever the length allows it. When even the whole padded length
is smaller than that (short prompts, small ``H`` as in tiny test models), one chunk holds the
whole ``(sample, layer)`` slice: fewer bytes than the target, but still one file and one read
per query, which is what the target is for. A single token wider than 2 MiB gets one token per
chunk. Responses use ``T_chunk_response = R_max`` (one chunk per query), as the spec says.

Example:
    >>> choose_t_chunk(512, 4096)            # 512 tokens of 8 KiB: 4 chunks of 128 (1 MiB)
    128
    >>> choose_t_chunk(300, 4096)            # 3 equal chunks of 100 tokens (800 KiB)
    100
    >>> choose_t_chunk(64, 32)               # tiny model: one chunk per (sample, layer)
    64
    >>> choose_max_len([3, 5, 9, 40], quantile=0.5)
    5
    >>> truncation([3, 5, 9, 40], 5)
    (2, 0.5)
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import ConfigError, CorruptStoreError
from ...sites import Site

#: Version of this layout; readers accept the same major version.
SCHEMA_VERSION = "1.0"
#: ``format`` attribute of every store (how ``open_store`` recognises one).
FORMAT_TAG = "actstore-zarr-logger"
#: ``format`` field of a sharded run's manifest.json.
RUN_FORMAT_TAG = "actstore-zarr-run"
#: Default directory name of a store.
STORE_NAME = "activations.zarr"
#: Where a sharded run keeps its stores (``run/shards/shard-XXXX.zarr``).
SHARDS_DIR = "shards"

PARTS = ("prompt", "response")
ACTIVATIONS = {"prompt": "arrays/prompt_activations", "response": "arrays/response_activations"}
LENGTHS = {"prompt": "arrays/prompt_len", "response": "arrays/response_len"}
#: Untruncated lengths (the spec's ``prompt_len`` is capped at ``P_max``).
FULL_LENGTHS = {"prompt": "arrays/prompt_len_full", "response": "arrays/response_len_full"}
TOKEN_IDS = {"prompt": "arrays/prompt_token_ids", "response": "arrays/response_token_ids"}
TEXT_FILES = {"prompt": "text/prompts.jsonl", "response": "text/responses.jsonl"}
SAMPLE_KEY = "arrays/sample_key"
HALLU_LABEL = "arrays/hallu_label"
SPLIT = "arrays/split"
#: xxh3-128 of each sample's stored bytes (prompt slab then response slab, padded, C order).
DIGEST = "arrays/content_xxh128"
CONFIG_FILE = "meta/config.json"
STATISTICS_FILE = "meta/statistics.json"
#: Folder of the keyed xxh3-64 of every activation chunk file: one file per part and writer
#: shard, ``meta/chunksums/<part>.<shard:06d>.npy`` (uint64 ``[samples of the shard, L,
#: n_chunks]``; 0: the chunk is not stored, it holds only padding).
CHUNKSUMS_DIR = "meta/chunksums"


def chunksums_name(part: str, shard: int) -> str:
    """The chunk digest file of writer shard ``shard`` of ``part``."""
    return f"{CHUNKSUMS_DIR}/{part}.{shard:06d}.npy"


def chunk_id(part: str, sample: int, layer: int, chunk: int) -> str:
    """The name a chunk's digest is keyed by (whatever the key separator on disk)."""
    return f"{ACTIVATIONS[part]}/{sample}.{layer}.{chunk}"


ACT_DTYPE = np.dtype("<f2")
ITEMSIZE = ACT_DTYPE.itemsize
SAMPLE_KEY_DTYPE = np.dtype("|S64")
DIGEST_DTYPE = np.dtype("|S32")

TARGET_CHUNK_BYTES = 1 << 20
MIN_CHUNK_BYTES = 512 << 10
MAX_CHUNK_BYTES = 2 << 20
#: Rows per chunk of the small per-sample arrays (lengths, keys, labels).
SAMPLE_CHUNK_ROWS = 1 << 16
DEFAULT_QUANTILE = 0.99
PROMPT_KEEP = ("first", "last")


def choose_max_len(
    lengths: Sequence[int] | np.ndarray,
    *,
    quantile: float = DEFAULT_QUANTILE,
    given: int | None = None,
) -> int:
    """``given`` if set, else the ``quantile`` of ``lengths``: the smallest observed length
    that at least that fraction of samples fit (0 when they are all empty, e.g. no responses).

    Example:
        >>> choose_max_len([10, 20, 30], quantile=1.0), choose_max_len([], given=64)
        (30, 64)
    """
    if given is not None:
        if given < 0:
            raise ConfigError(f"a maximum length must be >= 0, not {given}")
        return int(given)
    if not 0.0 < quantile <= 1.0:
        raise ConfigError(f"the length quantile must lie in (0, 1], not {quantile}")
    values = np.asarray(lengths, dtype=np.int64)
    if values.size == 0:
        raise ConfigError("cannot choose a maximum length from no samples; give it explicitly")
    return int(np.quantile(values, quantile, method="inverted_cdf"))


def choose_t_chunk(
    max_len: int, hidden_size: int, *, target_bytes: int = TARGET_CHUNK_BYTES
) -> int:
    """Tokens per chunk for a padded length ``max_len`` (see the module docstring); 1 for an
    empty part (a zero-length axis has no chunks, but Zarr needs a chunk length >= 1)."""
    if max_len < 0 or hidden_size < 1:
        raise ConfigError(f"need max_len >= 0 and hidden_size >= 1, not {max_len}, {hidden_size}")
    if max_len == 0:
        return 1
    per_chunk = max(1, target_bytes // (hidden_size * ITEMSIZE))
    n_chunks = math.ceil(max_len / per_chunk)
    return math.ceil(max_len / n_chunks)


def truncation(lengths: Sequence[int] | np.ndarray, max_len: int) -> tuple[int, float]:
    """How many of ``lengths`` exceed ``max_len``, as a count and a fraction."""
    values = np.asarray(lengths, dtype=np.int64)
    count = int(np.count_nonzero(values > max_len))
    return count, (count / values.size if values.size else 0.0)


def length_summary(lengths: Sequence[int] | np.ndarray) -> dict[str, int]:
    """Median, p95, p99 and max of ``lengths`` (the spec's open question 1), for the attrs."""
    values = np.asarray(lengths, dtype=np.int64)
    if values.size == 0:
        return {}
    q = lambda p: int(np.quantile(values, p, method="inverted_cdf"))
    return {"p50": q(0.5), "p95": q(0.95), "p99": q(0.99), "max": int(values.max())}


@dataclass(frozen=True, kw_only=True)
class ZarrLayout:
    """Shapes and chunking of one store (everything the byte layout depends on)."""

    n_samples: int
    sites: tuple[str, ...]
    """Site of each position of the ``L`` axis (``"resid.6"``)."""
    layers: tuple[int, ...]
    """Block index of each position of the ``L`` axis."""
    hidden_size: int
    p_max: int
    r_max: int
    t_chunk_prompt: int
    t_chunk_response: int
    prompt_keep: str = "first"
    """Which prompt tokens a prompt longer than ``P_max`` keeps: its ``first`` or ``last``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "sites", tuple(str(s) for s in self.sites))
        object.__setattr__(self, "layers", tuple(int(x) for x in self.layers))
        if self.n_samples < 1:
            raise ConfigError(f"a store needs at least one sample, not {self.n_samples}")
        if not self.sites or len(self.sites) != len(self.layers):
            raise ConfigError(f"sites {self.sites} and layers {self.layers} must pair up")
        if len(set(self.sites)) != len(self.sites):
            raise ConfigError(f"sites {self.sites} name the same site twice")
        if self.hidden_size < 1 or self.p_max < 0 or self.r_max < 0:
            raise ConfigError("hidden_size must be >= 1, p_max and r_max >= 0")
        if self.p_max + self.r_max == 0:
            raise ConfigError("p_max and r_max are both 0: nothing would be stored")
        for name, t, cap in (
            ("t_chunk_prompt", self.t_chunk_prompt, self.p_max),
            ("t_chunk_response", self.t_chunk_response, self.r_max),
        ):
            if not 1 <= t <= max(cap, 1):
                raise ConfigError(f"{name}={t} must lie in 1..{max(cap, 1)} (the padded length)")
        if self.prompt_keep not in PROMPT_KEEP:
            raise ConfigError(f"prompt_keep must be one of {PROMPT_KEEP}, not {self.prompt_keep!r}")

    @property
    def n_layers(self) -> int:
        return len(self.sites)

    def max_len(self, part: str) -> int:
        """``P_max`` or ``R_max``."""
        return self.p_max if _part(part) == "prompt" else self.r_max

    def t_chunk(self, part: str) -> int:
        return self.t_chunk_prompt if _part(part) == "prompt" else self.t_chunk_response

    def chunk_shape(self, part: str) -> tuple[int, int, int, int]:
        """``(1, 1, T_chunk, H)``."""
        return (1, 1, self.t_chunk(part), self.hidden_size)

    def shape(self, part: str) -> tuple[int, int, int, int]:
        """``(N, L, P_max or R_max, H)``."""
        return (self.n_samples, self.n_layers, self.max_len(part), self.hidden_size)

    def chunk_nbytes(self, part: str) -> int:
        return self.t_chunk(part) * self.hidden_size * ITEMSIZE

    def n_chunks(self, part: str) -> int:
        """Chunks along the token axis of one ``(sample, layer)``."""
        return math.ceil(self.max_len(part) / self.t_chunk(part))

    def sample_nbytes(self) -> int:
        """Padded bytes of one sample over all layers and both parts."""
        return self.n_layers * (self.p_max + self.r_max) * self.hidden_size * ITEMSIZE

    def kept(self, prompt_len: int, response_len: int) -> tuple[int, int, int, int]:
        """``(prompt start, prompt kept, response start, response kept)`` token positions in a
        sequence laid out as prompt then response, after truncation to ``P_max``/``R_max``.

        Example:
            >>> ZarrLayout(n_samples=1, sites=("resid.0",), layers=(0,), hidden_size=4,
            ...            p_max=3, r_max=2, t_chunk_prompt=3, t_chunk_response=2,
            ...            prompt_keep="last").kept(5, 4)
            (2, 3, 5, 2)
        """
        p_kept = min(prompt_len, self.p_max)
        p_start = prompt_len - p_kept if self.prompt_keep == "last" else 0
        return p_start, p_kept, prompt_len, min(response_len, self.r_max)

    def layer_index(self, layer: int | str) -> int:
        """Position on the ``L`` axis of a site in any spelling :meth:`Site.parse` takes (an
        int is ``resid.<layer>``), or of a stored name as written."""
        try:
            name = str(Site.parse(layer))
        except ConfigError:
            name = str(layer)
        if name not in self.sites and str(layer) in self.sites:
            name = str(layer)
        try:
            return self.sites.index(name)
        except ValueError:
            from ...errors import LayerNotStoredError

            raise LayerNotStoredError(
                f"{name} is not stored; stored sites: {', '.join(self.sites)}"
            ) from None

    def with_samples(self, n_samples: int) -> ZarrLayout:
        """The same layout for ``n_samples`` samples (a shard, or a merge of shards)."""
        return ZarrLayout(**{**asdict(self), "n_samples": n_samples})

    def same_bytes_as(self, other: ZarrLayout) -> bool:
        """True if stores of both layouts lay out a sample identically (shards can merge)."""
        return asdict(self.with_samples(1)) == asdict(other.with_samples(1))

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "layout") -> ZarrLayout:
        """The layout a store records, each field of its type and in range."""
        from ..metacheck import MAX_DIM, Fields

        f = Fields(data, f"{source} (layout)")
        missing = [k for k in _LAYOUT_FIELDS if k not in data]
        if missing:
            raise CorruptStoreError(f"{source} lacks the layout field {missing[0]!r}")
        try:
            return cls(
                n_samples=f.count("n_samples", lo=1),
                sites=tuple(f.texts("sites")),
                layers=tuple(f.counts("layers", hi=MAX_DIM)),
                hidden_size=f.count("hidden_size", lo=1, hi=MAX_DIM),
                p_max=f.count("p_max", hi=MAX_DIM),
                r_max=f.count("r_max", hi=MAX_DIM),
                t_chunk_prompt=f.count("t_chunk_prompt", lo=1, hi=MAX_DIM),
                t_chunk_response=f.count("t_chunk_response", lo=1, hi=MAX_DIM),
                prompt_keep=f.text("prompt_keep"),
            )
        except (TypeError, ValueError) as err:
            raise CorruptStoreError(f"{source} has an invalid layout: {err}") from None


_LAYOUT_FIELDS = (
    "n_samples",
    "sites",
    "layers",
    "hidden_size",
    "p_max",
    "r_max",
    "t_chunk_prompt",
    "t_chunk_response",
    "prompt_keep",
)


@dataclass(frozen=True, kw_only=True)
class LengthChoice:
    """How ``P_max``/``R_max``/``T_chunk`` were chosen, with the truncation they cause."""

    layout: ZarrLayout
    attrs: dict[str, Any] = field(default_factory=dict)
    """Truncation counts/fractions, length quantiles and the rule used (for the store attrs)."""


def choose_layout(
    *,
    n_samples: int,
    sites: Sequence[str],
    layers: Sequence[int],
    hidden_size: int,
    prompt_lengths: Sequence[int] | np.ndarray,
    response_lengths: Sequence[int] | np.ndarray,
    p_max: int | None = None,
    r_max: int | None = None,
    quantile: float = DEFAULT_QUANTILE,
    t_chunk_prompt: int | None = None,
    t_chunk_response: int | None = None,
    prompt_keep: str = "first",
) -> LengthChoice:
    """Pick the layout for a dataset with these full (untruncated) token lengths.

    Example:
        >>> c = choose_layout(n_samples=4, sites=["resid.1"], layers=[1], hidden_size=4096,
        ...                   prompt_lengths=[90, 120, 300, 1000], response_lengths=[5, 9, 12, 80],
        ...                   quantile=0.75, r_max=64)
        >>> c.layout.p_max, c.layout.t_chunk_prompt, c.layout.r_max, c.layout.t_chunk_response
        (300, 100, 64, 64)
        >>> c.attrs["prompt_truncated_count"], c.attrs["response_truncated_fraction"]
        (1, 0.25)
    """
    prompt_lengths = np.asarray(prompt_lengths, dtype=np.int64)
    response_lengths = np.asarray(response_lengths, dtype=np.int64)
    for name, values in (("prompt", prompt_lengths), ("response", response_lengths)):
        if values.size != n_samples:
            raise ConfigError(f"{values.size} {name} lengths given for {n_samples} samples")
        if values.size and values.min() < 0:
            raise ConfigError(f"{name} lengths must be >= 0")
    p = choose_max_len(prompt_lengths, quantile=quantile, given=p_max)
    r = choose_max_len(response_lengths, quantile=quantile, given=r_max)
    layout = ZarrLayout(
        n_samples=n_samples,
        sites=tuple(sites),
        layers=tuple(layers),
        hidden_size=hidden_size,
        p_max=p,
        r_max=r,
        t_chunk_prompt=(
            min(t_chunk_prompt, max(p, 1)) if t_chunk_prompt else choose_t_chunk(p, hidden_size)
        ),
        t_chunk_response=min(t_chunk_response, max(r, 1)) if t_chunk_response else max(r, 1),
        prompt_keep=prompt_keep,
    )
    attrs: dict[str, Any] = {
        "length_rule": {
            "P_max": "given" if p_max is not None else f"quantile {quantile} of prompt lengths",
            "R_max": "given" if r_max is not None else f"quantile {quantile} of response lengths",
            "T_chunk_prompt": "given"
            if t_chunk_prompt
            else f"fewest equal chunks of <= {TARGET_CHUNK_BYTES} bytes",
            "T_chunk_response": "given" if t_chunk_response else "R_max",
        },
        "prompt_len_quantiles": length_summary(prompt_lengths),
        "response_len_quantiles": length_summary(response_lengths),
    }
    attrs.update(truncation_attrs(prompt_lengths, response_lengths, layout))
    return LengthChoice(layout=layout, attrs=attrs)


def truncation_attrs(
    prompt_lengths: np.ndarray, response_lengths: np.ndarray, layout: ZarrLayout
) -> dict[str, Any]:
    """The spec's truncation record for these full lengths."""
    pc, pf = truncation(prompt_lengths, layout.p_max)
    rc, rf = truncation(response_lengths, layout.r_max)
    return {
        "prompt_truncated_count": pc,
        "prompt_truncated_fraction": pf,
        "response_truncated_count": rc,
        "response_truncated_fraction": rf,
    }


def chunk_key(indices: Sequence[int], separator: str = ".") -> str:
    """Zarr v2 chunk key of chunk grid position ``indices``.

    Example:
        >>> chunk_key((12, 3, 1, 0))
        '12.3.1.0'
    """
    return separator.join(str(int(i)) for i in indices)


def parse_chunk_key(key: str, separator: str = ".") -> tuple[int, ...] | None:
    """Inverse of :func:`chunk_key`; None if ``key`` is not a chunk key.

    Example:
        >>> parse_chunk_key("12.3.1.0"), parse_chunk_key(".zarray")
        ((12, 3, 1, 0), None)
    """
    parts = key.split(separator)
    if not all(p.isdigit() for p in parts):
        return None
    return tuple(int(p) for p in parts)


def _part(part: str) -> str:
    if part not in PARTS:
        raise ConfigError(f"part must be 'prompt' or 'response', not {part!r}")
    return part


def shard_ranges(n_samples: int, n_shards: int) -> list[tuple[int, int]]:
    """Split ``0..n_samples`` into ``n_shards`` contiguous ranges differing by at most one."""
    if n_shards < 1 or n_samples < n_shards:
        raise ConfigError(f"cannot split {n_samples} samples into {n_shards} non-empty shards")
    base, extra = divmod(n_samples, n_shards)
    out, start = [], 0
    for k in range(n_shards):
        stop = start + base + (1 if k < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def shard_path(run_dir: str | os.PathLike, index: int) -> Path:
    """``run_dir/shards/shard-XXXX.zarr``."""
    return Path(run_dir) / SHARDS_DIR / f"shard-{index:04d}.zarr"
