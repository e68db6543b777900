"""SAELens's cached-activations layout: names, features and how examples fall into files.

A store is one Hugging Face ``datasets`` directory as ``Dataset.save_to_disk`` leaves it:
``data-{i:05d}-of-{n:05d}.arrow`` files (Arrow IPC streams), ``state.json`` (which lists
them) and ``dataset_info.json`` (the features). Every row is one example: one column per
site, named by its TransformerLens hook name, of feature ``Array2D((context_size, d_in))``,
and ``token_ids`` as a fixed-length list of int32. ``sae_lens``'s ``ActivationsStore``
loads it with ``datasets.load_from_disk`` and reads the column of its ``hook_name``.

actstore adds sidecar files that ``datasets`` and ``sae_lens`` ignore: ``actstore.json``
(the layout and capture plan), ``statistics.json`` (exact per-site statistics) and
the root manifest. For every record batch ``actstore.json`` also records where each
column's values start in its file (``values_at``): a reader fetches a block with one ranged
read of just those bytes (one manifest block), without walking the Arrow stream.

Example i of a store lives in file ``i // examples_per_shard``; inside a file, Arrow record
batches of ``examples_per_block`` examples are the blocks actstore reads and checksums.

Example:
    >>> hook_name(Site("resid", 5)), hook_site("blocks.3.hook_mlp_out")
    ('blocks.5.hook_resid_post', Site(kind='mlp_out', layer=3))
    >>> data_file_name(0, 3)
    'data-00000-of-00003.arrow'
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import xxhash

from ...batch import CapturePlan
from ...errors import ConfigError, CorruptStoreError
from ...sites import Site
from ..metacheck import MAX_DIM, Fields

STATE = "state.json"
INFO = "dataset_info.json"
SIDECAR = "actstore.json"
STATISTICS = "statistics.json"
TOKENS = "token_ids"
FORMAT_TAG = "actstore-saelens"
VERSION = 1
#: numpy/Arrow dtypes an ``Array2D`` column may hold here.
DTYPES = ("float32", "float16")
#: Target bytes of one block of one column (an Arrow record batch).
BLOCK_BYTES = 2 << 20

#: Sub-layer inputs have no site spelling in TransformerLens; its layer-norm outputs are them.
_LN_HOOKS = {"attn_in": "ln1.hook_normalized", "mlp_in": "ln2.hook_normalized"}
_HOOK = re.compile(r"^blocks\.(\d+)\.(.+)$")


def hook_name(site: Site | str, family: str = "") -> str:
    """The TransformerLens hook name of an actstore site in a model of ``family``
    (:meth:`Site.tl_name_in`: BERT's block output is ``hook_normalized_resid_post``)."""
    site = Site.parse(site)
    if site.kind in _LN_HOOKS:
        return f"blocks.{site.layer}.{_LN_HOOKS[site.kind]}"
    name = site.tl_name_in(family)
    if name is None:
        raise ConfigError(f"site {site} has no TransformerLens hook name for the saelens format")
    return name


def hook_site(name: str) -> Site | None:
    """The actstore site a TransformerLens hook name denotes (None if it has none)."""
    match = _HOOK.match(str(name))
    if match is None:
        return None
    ln = {hook: kind for kind, hook in _LN_HOOKS.items()}
    if match.group(2) in ln:
        return Site(ln[match.group(2)], int(match.group(1)))
    try:
        return Site.parse(name)
    except ConfigError:
        return None


class ColumnSite(Site):
    """The key of a column whose name denotes no actstore site: a cache ``sae_lens`` wrote
    from a Hugging Face model names its column after a module (``transformer.h.1``), which
    says nothing of what the values mean in actstore's terms. Such a column is read under its
    own name (``reader.blocks("transformer.h.1")``), but it has no kind or layer, so the
    cache has no capture plan and cannot be converted.

    Example:
        >>> str(ColumnSite("transformer.h.1", -1))
        'transformer.h.1'
    """

    def __post_init__(self) -> None:  # ``kind`` is the column's name, not a site kind
        pass

    def __str__(self) -> str:
        return self.kind


def data_file_name(index: int, n_files: int) -> str:
    """The name ``save_to_disk`` gives file ``index`` of ``n_files``."""
    return f"data-{index:05d}-of-{n_files:05d}.arrow"


@dataclass(frozen=True, kw_only=True)
class SaelensLayout:
    """Shape of one store: what every file and block holds."""

    sites: tuple[str, ...]
    """actstore site names (``"resid.3"``), in column order."""
    context_size: int
    d_in: int
    dtype: str
    """Stored dtype of the activation columns (``float32`` or ``float16``)."""
    n_examples: int
    examples_per_shard: int
    examples_per_block: int
    has_tokens: bool
    family: str = ""
    """The model family (column names follow its TransformerLens hooks)."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is not supported; choose one of {DTYPES}")
        if min(self.context_size, self.d_in, self.examples_per_shard, self.examples_per_block) < 1:
            raise ConfigError("context_size, d_in and examples per file and block must be >= 1")
        if self.examples_per_shard % self.examples_per_block:
            raise ConfigError(
                f"examples_per_shard ({self.examples_per_shard}) must be a multiple of "
                f"examples_per_block ({self.examples_per_block})"
            )

    @property
    def columns(self) -> tuple[str, ...]:
        """The activation columns: one TransformerLens hook name per site."""
        return tuple(hook_name(s, self.family) for s in self.sites)

    @property
    def n_shards(self) -> int:
        return max(1, math.ceil(self.n_examples / self.examples_per_shard))

    def shard_range(self, index: int) -> tuple[int, int]:
        """Examples ``[start, stop)`` of file ``index``."""
        start = index * self.examples_per_shard
        return start, min(start + self.examples_per_shard, self.n_examples)

    def file_name(self, index: int) -> str:
        return data_file_name(index, self.n_shards)

    @property
    def example_nbytes(self) -> int:
        """Activation bytes of one example, all sites."""
        itemsize = 4 if self.dtype == "float32" else 2
        return len(self.sites) * self.context_size * self.d_in * itemsize

    def features(self) -> Any:
        """The ``datasets.Features`` of a row (what sae_lens's cache runner declares)."""
        from datasets import Array2D, Features, Sequence, Value

        spec: dict[str, Any] = {
            column: Array2D(shape=(self.context_size, self.d_in), dtype=self.dtype)
            for column in self.columns
        }
        if self.has_tokens:
            spec[TOKENS] = Sequence(Value("int32"), length=self.context_size)
        return Features(spec)

    def to_dict(self) -> dict[str, Any]:
        return {
            "sites": list(self.sites),
            "context_size": self.context_size,
            "d_in": self.d_in,
            "dtype": self.dtype,
            "n_examples": self.n_examples,
            "examples_per_shard": self.examples_per_shard,
            "examples_per_block": self.examples_per_block,
            "has_tokens": self.has_tokens,
            "family": self.family,
        }

    @classmethod
    def from_dict(cls, doc: Any, *, source: str = SIDECAR) -> SaelensLayout:
        """The layout ``actstore.json`` records, each field of its type and in range (a
        hostile value is one :class:`CorruptStoreError`)."""
        f = Fields(doc, f"{source}: layout")
        try:
            layout = cls(
                sites=tuple(f.texts("sites")),
                context_size=f.count("context_size", lo=1, hi=MAX_DIM),
                d_in=f.count("d_in", lo=1, hi=MAX_DIM),
                dtype=f.text("dtype"),
                n_examples=f.count("n_examples"),
                examples_per_shard=f.count("examples_per_shard", lo=1),
                examples_per_block=f.count("examples_per_block", lo=1),
                has_tokens=f.flag("has_tokens"),
                family=f.text("family", optional=True) or "",
            )
            columns = layout.columns  # every site parses and has a hook name
        except (KeyError, TypeError, ValueError, ConfigError) as err:
            raise CorruptStoreError(f"{source}: malformed layout ({err}); re-capture") from err
        if not layout.sites or len(set(columns)) != len(columns):
            raise CorruptStoreError(f"{source}: malformed layout (sites {list(layout.sites)})")
        return layout


def choose_layout(
    plan: CapturePlan,
    *,
    dtype: str = "float32",
    shard_mb: float = 1000.0,
    examples_per_shard: int | None = None,
    block_kb: int | None = None,
) -> SaelensLayout:
    """The layout of a capture ``plan``: blocks of about :data:`BLOCK_BYTES` per column
    (``block_kb`` overrides), files of about ``shard_mb`` MB (at most 2 GB)."""
    for site in plan.sites:
        hook_name(site, plan.family)  # every kind has a hook name; fails clearly if not
    if plan.modality != "text":
        raise ConfigError(
            "the saelens format holds language-model activations (sae_lens trains on text); "
            "capture image models into the saev, zarr, activault or pickle formats"
        )
    itemsize = 4 if dtype == "float32" else 2
    column_bytes = plan.tokens_per_example * plan.d_model * itemsize
    example_bytes = column_bytes * len(plan.sites) + (4 * plan.tokens_per_example)
    per_block = max(1, (block_kb * 1024 if block_kb else BLOCK_BYTES) // column_bytes)
    if examples_per_shard is None:
        if not 0 < shard_mb <= 2000:
            raise ConfigError(
                f"shard_mb must be in (0, 2000] (files of at most ~2 GB), not {shard_mb}"
            )
        examples_per_shard = max(1, int(shard_mb * 1e6) // example_bytes)
        examples_per_shard = max(1, examples_per_shard // per_block) * per_block
    if examples_per_shard < 1:
        raise ConfigError(f"examples_per_shard must be >= 1, not {examples_per_shard}")
    if examples_per_shard * example_bytes > 2_000_000_000:
        raise ConfigError(
            f"{examples_per_shard} examples make {examples_per_shard * example_bytes / 1e9:.1f} GB "
            "files; Arrow files here stay under 2 GB: lower examples_per_shard"
        )
    per_block = min(per_block, examples_per_shard)
    while examples_per_shard % per_block:
        per_block -= 1
    return SaelensLayout(
        sites=tuple(str(s) for s in plan.sites),
        context_size=plan.tokens_per_example,
        d_in=plan.d_model,
        dtype=dtype,
        n_examples=plan.n_examples,
        examples_per_shard=examples_per_shard,
        examples_per_block=per_block,
        has_tokens=plan.has_tokens,
        family=plan.family,
    )


def values_offsets(data: Any, block_columns: tuple[str, ...] | list[str]) -> list[list[int]]:
    """Byte offset in an Arrow stream file (``data``: a pyarrow buffer of the whole file) of
    the values of each of ``block_columns`` in each record batch: the flat, contiguous
    buffer an ``Array2D`` (or fixed-length token) column keeps its numbers in."""
    import pyarrow as pa

    try:
        table = pa.ipc.open_stream(pa.BufferReader(data)).read_all()
        chunks = [table.column(c).chunks for c in block_columns]
    except (pa.ArrowInvalid, KeyError) as err:
        raise CorruptStoreError(
            f"not a readable Arrow stream with {block_columns} ({err})"
        ) from err
    out = []
    for batch in zip(*chunks):
        at = []
        for chunk in batch:
            storage = chunk.storage if isinstance(chunk, pa.ExtensionArray) else chunk
            flat = storage.flatten()
            if not pa.types.is_primitive(flat.type):
                flat = flat.flatten()
            at.append(flat.to_numpy(zero_copy_only=True).ctypes.data - data.address)
        out.append(at)
    return out


def dataset_state(names: list[str], digests: str) -> dict[str, Any]:
    """``state.json`` as ``datasets``' ``save_to_disk`` writes it for Arrow files ``names``
    (in order), its fingerprint a pure function of the files' concatenated ``digests``
    (``datasets`` only keys its cache with it): what the writer writes and the reader
    checks."""
    return {
        "_data_files": [{"filename": n} for n in names],
        "_fingerprint": xxhash.xxh3_64_hexdigest(digests.encode()),
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
