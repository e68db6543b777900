"""Read a pkl.gz store safely: every byte checked before it is parsed.

Opening validates ``metadata.json`` (read through the store's root manifest: an edited file
fails before it is parsed) for required fields, disjoint sample id ranges, every listed
shard present with its recorded size, and, in stores actstore wrote, every shard holding
every layer and the sample count the capture declared. Loading a shard reads its bytes
whole, checks them (the keyed manifest digest and the spec's sha256) and only then
decompresses and unpickles them, through :mod:`actstore.safe_pickle`: a restricted
unpickler that refuses anything but numeric arrays, plain containers and scalars, and
refuses to read or allocate more than the metadata allows (a gzip or pickle bomb is stopped
before its memory is taken). The shard's structure is then checked: exactly the listed
layers, each listing the same sample ids, inside the declared range, without repeats,
arrays of the declared width. The last decoded shard is cached, so reading the blocks of
every layer of one shard decodes it once.

:class:`PickleReader` is built in layers: :mod:`.shards` (metadata.json and the shards,
checked as they are opened and loaded), :mod:`.verify` (``verify``); this module adds
blocks, statistics, the spec's items, conversion and ``describe``.

Example:
    >>> import tempfile
    >>> from actstore.testing import FormatCase, make_acts, make_batches, make_plan
    >>> plan, out = make_plan(), tempfile.TemporaryDirectory()  # layers 1 and 3, 6 tokens
    >>> batches = make_batches(plan, make_acts(plan))
    >>> r = PickleReader(FormatCase("pickle").write(out.name, plan, batches))
    >>> item = next(r.items(3))  # the spec's iter_activations, checked
    >>> item["activation"].shape, item["sample_idx"]
    ((6, 8), 0)
"""

from __future__ import annotations

import bisect
import os
from collections import OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from ...batch import Batch, CapturePlan
from ...errors import ConfigError, CorruptStoreError, IndexOutOfRangeError
from ...sites import Site
from ...stats import RunningStats
from ...storage.location import Location
from ..arrays import LazyRows
from ..blocks import Block
from .layout import METADATA, is_shard_filename, layer_key, plan_sites
from .verify import PickleVerify

if TYPE_CHECKING:
    import torch
else:
    from ..._lazy import torch


def detect(files) -> bool:
    """``metadata.json`` with the spec's ``shards`` and ``extraction_config`` (damaged JSON
    beside pkl.gz shards is claimed, so the reader names the fault)."""
    if not files.exists(METADATA):
        return False
    try:
        doc = files.read_json(METADATA)
    except CorruptStoreError:
        return any(is_shard_filename(n) for n in files.list())
    return isinstance(doc, dict) and "shards" in doc and "extraction_config" in doc


class PickleReader(PickleVerify):
    """Read access to one pkl.gz store, local or ``s3://bucket/prefix``; picklable (the
    shard cache is not carried). ``verify_reads``: check each shard against its checksum when
    it is read. ``cache_dir`` / ``cache_bytes`` / ``s3``: the local cache tier and S3
    settings of a remote store (default ``$ACTSTORE_CACHE``)."""

    format_name = "pickle"

    def __init__(
        self, location: str | os.PathLike | Location, *, cache_shards: int = 1, **kwargs: Any
    ) -> None:
        """``cache_shards``: decoded shards kept in memory; ``kwargs``: every reader's
        (``verify_reads``, ``cache_dir``, ``cache_bytes``, ``s3``)."""
        self._cache_size = max(1, cache_shards)
        super().__init__(location, **kwargs)

    # ------------------------------------------------------------------ properties

    @property
    def sites(self) -> tuple[Site, ...]:
        """The stored layers (the spec's ``layer_{idx}`` keys) as ``resid.idx`` sites."""
        return plan_sites(self.metadata.layers)

    def native_name(self, site: Site) -> str:
        return layer_key(site.layer)

    @property
    def tokens_per_example(self) -> int | None:
        """Tokens per sample (None when samples differ in length: a store another tool
        wrote, whose ``reader[...]`` is refused; read blocks or :meth:`items`)."""
        own = self.metadata.actstore.get("tokens_per_example")
        return own if isinstance(own, int) else None

    def n_rows(self, site: Any) -> int:
        layer = self.site(site).layer
        return sum(self.shard_rows(i) for i, info in enumerate(self.shards) if layer in info.layers)

    @property
    def tokens(self) -> LazyRows | None:
        """Token ids ``[n_samples, T]`` (int32) from each item's ``metadata.token_ids``, in
        sample id order; rows are read (their shard loaded and checked) only when indexed.
        None when the capture kept none."""
        if not self.metadata.actstore.get("has_tokens"):
            return None
        width = int(self.metadata.actstore.get("tokens_per_example") or 0)
        return _ItemTokens(self, width)

    @property
    def labels(self) -> LazyRows | None:
        """Class labels ``[n_samples]`` (int64) from each item's ``metadata.label``, read
        as they are indexed; None when the capture kept none."""
        if not self.metadata.actstore.get("has_labels"):
            return None
        return _ItemLabels(self)

    @property
    def classes(self) -> list[str] | None:
        classes = self.metadata.actstore.get("classes")
        return list(classes) if classes is not None else None

    @property
    def d_model(self) -> int:
        hidden = (self.metadata.extraction_config.get("model_params") or {}).get("hidden_size")
        if isinstance(hidden, int):
            return hidden
        if not self.shards:
            raise CorruptStoreError(f"{self.url}: no shards and no model_params.hidden_size")
        first = self.load_shard(0)[layer_key(self.shards[0].layers[0])][0]
        return int(first["activation"].shape[1])

    @property
    def dtype(self) -> np.dtype:
        return np.dtype("<f4")

    @property
    def n_examples(self) -> int:
        return self.metadata.n_samples

    def __repr__(self) -> str:
        return (
            f"PickleReader({self.url!r}, samples={self.n_examples}, "
            f"layers={list(self.layers)}, shards={len(self.shards)})"
        )

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": OrderedDict()}

    def close(self) -> None:
        """Drop cached shards and open files."""
        self._cache.clear()
        self.files.close()

    # ------------------------------------------------------------------ blocks

    def site_blocks(self, site: Site) -> list[Block]:
        """One block per shard holding ``site``: its samples' rows, in sample id order."""
        return [
            Block(site=site, n_rows=self.shard_rows(i), loc=(i,))
            for i, info in enumerate(self.shards)
            if site.layer in info.layers
        ]

    def read_block(self, block: Block, out: np.ndarray | None = None) -> np.ndarray:
        """Rows of ``block`` as ``[n_rows, D]`` float32."""
        (index,) = block.loc
        items = self.load_shard(index)[layer_key(block.site.layer)]
        if out is None:
            out = np.empty((block.n_rows, self.d_model), dtype=self.dtype)
        np.concatenate([item["activation"] for item in items], out=out, casting="same_kind")
        return out

    #: Where :meth:`verify_statistics` finds the statistics.
    statistics_file = f"{METADATA} (statistics.activation_statistics)"

    def stored_record(self) -> tuple[str, Any] | None:
        """The writer's capture record: ``metadata.json``'s ``extraction_config`` and
        whether the shards are compressed."""
        raw = self.files.read_json(METADATA)
        if not isinstance(raw, dict) or not self.shards:
            return None
        compress = {bool(s.compressed) for s in self.shards}
        if len(compress) != 1:
            return None
        return METADATA, {
            "extraction_config": raw.get("extraction_config"),
            "compress": compress.pop(),
        }

    def statistics_record(self, site: Site) -> Any:
        return (self.metadata.statistics.get("activation_statistics") or {}).get(
            layer_key(site.layer)
        )

    def statistics_shards(self) -> list[int] | None:
        """Rows of each shard (one writer shard each); None for a store without actstore's
        manifest (the spec's own tools fold statistics their own way)."""
        if self.checks.manifest is None:
            return None
        return [self.shard_rows(i) for i in range(len(self.shards))]

    def site_statistics(self, site: Site) -> RunningStats | None:
        """Exact running statistics of ``site`` (None in stores that lack them)."""
        record = (self.metadata.statistics.get("activation_statistics") or {}).get(
            layer_key(site.layer)
        )
        return None if record is None else RunningStats.from_dict(record)

    # ------------------------------------------------------------------ spec-level access

    def items(self, layer: int) -> Iterator[dict[str, Any]]:
        """Every item of ``layer`` in sample id order: the spec's ``iter_activations``."""
        key = layer_key(self.site(layer).layer)
        for i, info in enumerate(self.shards):
            if int(layer) in info.layers:
                yield from self.load_shard(i)[key]

    def item(self, sample_idx: int, layer: int) -> dict[str, Any]:
        """The item of global sample id ``sample_idx`` at ``layer``."""
        key = layer_key(self.site(layer).layer)
        index = bisect.bisect_right(self._firsts, sample_idx) - 1
        if index >= 0 and sample_idx <= self.shards[index].sample_id_range[1]:
            for item in self.load_shard(index)[key]:
                if item["sample_idx"] == sample_idx:
                    return item
        raise IndexOutOfRangeError(f"sample id {sample_idx} is not stored in {self.url}")

    # ------------------------------------------------------------------ conversion

    def capture_plan(self) -> CapturePlan:
        """The capture plan that produced this store (best effort for foreign stores)."""
        md, own = self.metadata, self.metadata.actstore
        config = md.extraction_config
        params = config.get("model_params") or {}
        tokens = own.get("tokens_per_example")
        if tokens is None and self.shards:
            # a foreign store: the spec's max_seq_length need not be the arrays' length (they
            # may be unpadded), so the first sample says it (example_batches checks the rest)
            info = self.shards[0]
            first = self.load_shard(0)[layer_key(info.layers[0])][0]
            tokens = int(first["activation"].shape[0])
        if not isinstance(tokens, int):
            raise ConfigError(f"{self.url}: metadata gives no sequence length; cannot convert")
        return CapturePlan(
            ckpt=str(config.get("model_name", "unknown")),
            family=str(config.get("model_architecture", "unknown")),
            modality=own.get("modality", "text"),
            sites=plan_sites(self.layers),
            n_model_layers=int(params.get("num_hidden_layers") or max(self.layers) + 1),
            d_model=self.d_model,
            tokens_per_example=tokens,
            has_cls=bool(own.get("has_cls")),
            n_examples=md.n_samples,
            dataset_root=str(config.get("dataset_name") or ""),
            data=own.get("data") or {},
            classes=own.get("classes"),
            has_labels=bool(own.get("has_labels")),
            has_tokens=bool(own.get("has_tokens")),
            batch_size=int(config.get("batch_size") or 32),
        )

    def example_batches(self, batch_size: int, start: int = 0) -> Iterator[Batch]:
        """The stored samples as capture batches (example ids ``0..n-1`` in sample id order),
        starting at example ``start``: what conversion feeds to another format's writer."""
        position = 0
        for index, info in enumerate(self.shards):
            if position + info.num_samples <= start:
                position += info.num_samples
                continue
            shard = self.load_shard(index)
            columns = [shard[layer_key(layer)] for layer in self.layers]
            for lo in range(max(0, start - position), info.num_samples, batch_size):
                hi = min(lo + batch_size, info.num_samples)
                yield self._batch(columns, lo, hi, position)
            position += info.num_samples

    def _batch(self, columns: list[list[dict]], lo: int, hi: int, position: int) -> Batch:
        try:
            acts = {
                f"resid.{layer}": torch.from_numpy(
                    np.stack([item["activation"] for item in items[lo:hi]]).astype(
                        np.float32, copy=False
                    )
                )
                for layer, items in zip(self.layers, columns)
            }
        except ValueError as err:
            raise ConfigError(
                f"{self.url}: samples have different lengths; only fixed-length "
                "stores convert to other formats"
            ) from err
        first = columns[0][lo:hi]
        metas = [item.get("metadata") or {} for item in first]
        tokens = labels = None
        if all("token_ids" in m for m in metas):
            tokens = np.stack([np.asarray(m["token_ids"], dtype=np.int32) for m in metas])
        if all("label" in m for m in metas):
            labels = np.asarray([m["label"] for m in metas], dtype=np.int64)
        return Batch(
            acts=acts,
            example_ids=np.arange(position + lo, position + hi),
            token_ids=tokens,
            labels=labels,
            texts=[str(item.get("text_preview", "")) for item in first],
        )

    # ------------------------------------------------------------------ inspect / verify

    def describe_format(self) -> dict[str, Any]:
        md = self.metadata
        config = md.extraction_config
        return {
            "format": f"pkl.gz activation shards v{md.version}",
            "shape": (
                f"{md.n_samples} samples x {len(md.layers)} layers {list(md.layers)} x "
                f"{config.get('max_seq_length')} tokens x {self.d_model} dims"
            ),
            "n_examples": md.n_samples,
            "layers": list(md.layers),
            "shards": f"{len(self.shards)} ({'gzip' if any(s.compressed for s in self.shards) else 'plain pickle'})",
            "created_at": md.created_at,
            "distributed": {
                k: md.distributed_config.get(k)
                for k in ("machine_id", "total_machines")
                if k in md.distributed_config
            },
        }


class _ItemLabels(LazyRows):
    """``reader.labels`` of a pkl.gz store: sample ``i``'s class label (sample id order)."""

    def __init__(self, reader: PickleReader) -> None:
        counts = [s.num_samples for s in reader.shards]
        super().__init__(np.int64, (sum(counts),))
        self.reader = reader
        self.starts = np.cumsum([0, *counts])

    def rows(self, index: np.ndarray) -> np.ndarray:
        out = np.empty(len(index), dtype=self.dtype)
        key = layer_key(self.reader.layers[0])
        shard_of = np.searchsorted(self.starts, index, side="right") - 1
        for shard in np.unique(shard_of):
            items = self.reader.load_shard(int(shard))[key]
            for j in np.flatnonzero(shard_of == shard):
                label = (items[int(index[j] - self.starts[shard])].get("metadata") or {}).get(
                    "label"
                )
                if not isinstance(label, (int, np.integer)):
                    raise CorruptStoreError(
                        f"{self.reader.url}: sample row {int(index[j])} lacks its label; the "
                        "store is damaged, re-capture it"
                    )
                out[j] = int(label)
        return out


class _ItemTokens(LazyRows):
    """``reader.tokens`` of a pkl.gz store: row ``i`` is the ``i``-th sample (sample id
    order), read from the one shard holding it."""

    def __init__(self, reader: PickleReader, width: int) -> None:
        counts = [s.num_samples for s in reader.shards]
        super().__init__(np.int32, (sum(counts), width))
        self.reader = reader
        self.starts = np.cumsum([0, *counts])

    def rows(self, index: np.ndarray) -> np.ndarray:
        out = np.empty((len(index), *self.row_shape), dtype=self.dtype)
        key = layer_key(self.reader.layers[0])
        shard_of = np.searchsorted(self.starts, index, side="right") - 1
        for shard in np.unique(shard_of):
            items = self.reader.load_shard(int(shard))[key]
            for j in np.flatnonzero(shard_of == shard):
                ids = (items[int(index[j] - self.starts[shard])].get("metadata") or {}).get(
                    "token_ids"
                )
                if ids is None or len(ids) != self.row_shape[0]:
                    raise CorruptStoreError(
                        f"{self.reader.url}: sample row {int(index[j])} lacks its "
                        f"{self.row_shape[0]} token ids; the store is damaged, re-capture it"
                    )
                out[j] = np.asarray(ids, dtype=np.int32)
        return out
