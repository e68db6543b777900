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
import gzip
import hashlib
import io
import os
import re
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from ... import safe_pickle
from ...batch import Batch, CapturePlan
from ...errors import (
    ConfigError,
    CorruptStoreError,
    IndexOutOfRangeError,
    StoreNotFoundError,
    UnsafeDataError,
)
from ...sites import Site
from ...stats import RunningStats
from ...storage.location import Location
from ..arrays import LazyRows
from ..base import Block, ReaderBase, VerifyReport
from .layout import (
    MAX_SHARD_BYTES,
    METADATA,
    VERSION,
    PickleMetadata,
    ShardInfo,
    distributed_config,
    is_shard_filename,
    layer_key,
    plan_sites,
    shard_filename,
)

if TYPE_CHECKING:
    import torch
else:
    from ..._lazy import torch

#: Bytes an item may hold besides its activation array (text preview, token ids, ...).
ITEM_OVERHEAD = 64 << 10


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


class PickleReader(ReaderBase):
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

    def open_index(self) -> None:
        """metadata.json read and checked against the shards' sizes."""
        if not self.files.exists(METADATA):
            raise StoreNotFoundError(
                f"{self.files.url_of(METADATA)} does not exist; is {self.url} a pkl.gz store?"
            )
        raw = self.files.read_json(METADATA)
        config = raw.get("extraction_config") if isinstance(raw, dict) else None
        ours = isinstance(config, dict) and bool(config.get("actstore"))
        self.open_checks(ours=ours)
        self.metadata = PickleMetadata.from_json_dict(
            self.checks.read_json(METADATA), source=self.files.url_of(METADATA)
        )
        self.shards = sorted(self.metadata.shards, key=lambda s: s.sample_id_range)
        self._check_declared()
        listed = self.files.list()  # one listing, not a stat per shard
        for info in self.shards:
            url, size = self.files.url_of(info.filename), listed.get(info.filename)
            if size is None:
                raise StoreNotFoundError(f"shard {url} is missing; restore it or re-capture")
            if size != info.size_bytes:
                raise CorruptStoreError(
                    f"shard {url} has {size} bytes, metadata.json says "
                    f"{info.size_bytes}: it is truncated or was replaced; restore it"
                )
        self._firsts = [s.sample_id_range[0] for s in self.shards]
        self._cache: OrderedDict[int, dict[str, Any]] = OrderedDict()
        self._rows: dict[int, int] = {}

    def _check_declared(self) -> None:
        """Cheap consistency checks, so tampered metadata fails instead of serving less."""
        md = self.metadata
        hidden = (md.extraction_config.get("model_params") or {}).get("hidden_size")
        if hidden is not None and (not isinstance(hidden, int) or hidden < 1):
            raise CorruptStoreError(
                f"{self.files.url_of(METADATA)}: hidden_size {hidden!r} is invalid"
            )
        layers = set(md.layers)  # (a property over every shard: computed once)
        stray = [info.layers for info in self.shards if set(info.layers) - layers]
        if stray:
            raise CorruptStoreError(
                f"{self.files.url_of(METADATA)}: a shard lists layers {list(stray[0])} outside "
                f"layers_extracted {list(md.layers)}"
            )
        if md.actstore:  # written by actstore: every shard holds every layer
            short = [i.filename for i in self.shards if set(i.layers) != layers]
            if short:
                raise CorruptStoreError(
                    f"{self.files.url_of(METADATA)}: shard {short[0]} does not list every layer of "
                    f"{list(md.layers)} (actstore writes all layers to every shard): the "
                    "metadata was edited; restore it or re-capture"
                )
            ranged = md.distributed_config.get("example_range")
            if ranged is None:
                ranged = [0, md.actstore.get("n_examples")]
            try:
                declared = int(ranged[1]) - int(ranged[0])
            except (TypeError, ValueError, IndexError):
                declared = md.n_samples
            if md.n_samples != declared:
                raise CorruptStoreError(
                    f"{self.files.url_of(METADATA)}: the shards hold {md.n_samples} samples, the "
                    f"capture declared {declared}; restore the metadata or re-capture"
                )
            width = md.actstore["tokens_per_example"]  # checked an int by the parse
            wrong = [i for i in self.shards if i.num_tokens != i.num_samples * width]
            if wrong:
                raise CorruptStoreError(
                    f"{self.files.url_of(METADATA)}: shard {wrong[0].filename} declares "
                    f"{wrong[0].num_tokens} tokens, but its {wrong[0].num_samples} samples of "
                    f"{width} tokens are {wrong[0].num_samples * width}: the metadata was "
                    "edited; restore it or re-capture"
                )

    def _max_shard_bytes(self, info: ShardInfo) -> int:
        """The most bytes shard ``info`` may decompress to, from what the metadata declares."""
        config = self.metadata.extraction_config
        hidden = (config.get("model_params") or {}).get("hidden_size")
        seq = config.get("max_seq_length")
        if not (isinstance(hidden, int) and isinstance(seq, int) and seq > 0):
            return MAX_SHARD_BYTES + (MAX_SHARD_BYTES >> 2)
        per_item = seq * hidden * 4 + ITEM_OVERHEAD
        return (len(info.layers) * info.num_samples * per_item) * 5 // 4 + (1 << 20)

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
    def layers(self) -> tuple[int, ...]:
        return self.metadata.layers

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

    # ------------------------------------------------------------------ shards

    def load_shard(
        self, index: int, *, progress: Callable[[int], None] | None = None
    ) -> dict[str, Any]:
        """Shard ``index`` (in sample id order) as the spec's dict, checksum- and
        structure-checked, through the restricted unpickler."""
        cached = self._cache.get(index)
        if cached is not None:
            self._cache.move_to_end(index)
            return cached
        info = self.shards[index]
        data = self._read(info, progress)
        self._cache[index] = data
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return data

    def _read(self, info: ShardInfo, progress: Callable[[int], None] | None) -> dict[str, Any]:
        """Shard ``info``: its bytes read whole and checked, then decompressed and unpickled
        within the bounds the metadata allows."""
        file = self.files.url_of(info.filename)
        raw = self.files.read_bytes(info.filename)
        if progress is not None:
            progress(len(raw))
        self.checks.check(info.filename, 0, raw)
        if self.verify_reads and hashlib.sha256(raw).hexdigest() != info.sha256:
            raise CorruptStoreError(
                f"shard {file} fails its checksum (metadata.json has {info.checksum}); the file "
                "was changed after it was written: restore it or re-capture"
            )
        limit = self._max_shard_bytes(info)
        try:
            if info.compressed:
                with gzip.GzipFile(fileobj=io.BytesIO(raw), mode="rb") as gz:
                    data = safe_pickle.load(gz, max_bytes=limit)
                    if gz.read(1 << 16):  # to the end: checks gzip's CRC too
                        raise CorruptStoreError("bytes follow the pickle")
            else:
                data = safe_pickle.load(io.BytesIO(raw), max_bytes=limit)
        except (OSError, EOFError, zlib.error) as err:
            raise CorruptStoreError(
                f"shard {file} cannot be decompressed ({err}); it is damaged: restore it or re-capture"
            ) from err
        except CorruptStoreError as err:
            raise CorruptStoreError(f"shard {file}: {err}") from err
        self._check_structure(data, info, file)
        return data

    def _check_structure(self, data: Any, info: ShardInfo, file: Any) -> None:
        if not isinstance(data, dict):
            raise CorruptStoreError(f"shard {file} holds a {type(data).__name__}, not a dict")
        if set(data) != {layer_key(layer) for layer in info.layers}:
            raise CorruptStoreError(
                f"shard {file} holds {sorted(data)}, metadata.json lists layers "
                f"{list(info.layers)}: the metadata was edited; restore it or re-capture"
            )
        config = self.metadata.extraction_config
        hidden = (config.get("model_params") or {}).get("hidden_size")
        reference: list[int] | None = None
        lo, hi = info.sample_id_range
        for layer in info.layers:
            items = data.get(layer_key(layer))
            if not isinstance(items, list) or len(items) != info.num_samples:
                raise CorruptStoreError(
                    f"shard {file}: {layer_key(layer)} must list {info.num_samples} samples"
                )
            ids: list[Any] = []  # checked to be ints in range below
            for item in items:
                if not isinstance(item, dict) or not isinstance(item.get("activation"), np.ndarray):
                    raise CorruptStoreError(
                        f"shard {file}: {layer_key(layer)} has an item without an activation array"
                    )
                act, shape = item["activation"], item.get("shape")
                if (
                    act.ndim != 2
                    or act.dtype.kind != "f"
                    or not isinstance(shape, (tuple, list))
                    or tuple(shape) != act.shape
                    or (isinstance(hidden, int) and act.shape[1] != hidden)
                ):
                    raise CorruptStoreError(
                        f"shard {file}: sample {item.get('sample_idx')} has activation "
                        f"{act.dtype}{list(act.shape)} and shape {item.get('shape')}; expected "
                        f"a float [seq_len, {hidden or 'hidden'}] array matching 'shape'"
                    )
                ids.append(item.get("sample_idx"))
            # numpy integers too: a foreign writer may store np.int64 ids (pickle keeps them)
            if not all(
                isinstance(i, (int, np.integer)) and not isinstance(i, bool) and lo <= i <= hi
                for i in ids
            ):
                raise CorruptStoreError(
                    f"shard {file}: sample ids missing, not integers or "
                    f"outside the declared range [{lo}, {hi}]"
                )
            if len(set(ids)) != len(ids):
                raise CorruptStoreError(f"shard {file}: {layer_key(layer)} repeats sample ids")
            if reference is None:
                reference = ids
            elif ids != reference:
                raise CorruptStoreError(f"shard {file}: layers list different samples")
            rows = sum(int(item["activation"].shape[0]) for item in items)
            if info.num_tokens is not None and rows != info.num_tokens:
                raise CorruptStoreError(
                    f"shard {file}: {layer_key(layer)} holds {rows} tokens, metadata.json says "
                    f"{info.num_tokens} (num_tokens): the metadata was edited; restore it or "
                    "re-capture"
                )

    def shard_rows(self, index: int) -> int:
        """Rows (tokens) per layer in shard ``index``."""
        info = self.shards[index]
        if info.num_tokens is not None:
            return info.num_tokens
        if index not in self._rows:
            items = self.load_shard(index)[layer_key(info.layers[0])]
            self._rows[index] = sum(int(item["activation"].shape[0]) for item in items)
        return self._rows[index]

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

    def verify(self, *, progress: Callable[[int], None] | None = None) -> VerifyReport:
        """Every file against the root manifest, then every shard decoded: checksum, safe
        unpickling, structure, NaN/Inf values, and the statistics' totals against the
        shards. ``progress(n_bytes)`` as data is read."""
        report = VerifyReport(self.url)
        n_files, n_bytes = self.checks.verify(report.faults, progress=None)
        listed = {s.filename for s in self.shards}
        for name in sorted(self.files.list()):
            if is_shard_filename(name) and name not in listed:
                report.faults.append(f"{name} is not listed in {METADATA}")
        non_finite = 0
        held: dict[int, tuple[list[int], list[Any]]] = {}  # shard -> sample ids, machine ids
        for index, info in enumerate(self.shards):
            self._cache.pop(index, None)
            try:
                data = self.load_shard(index, progress=progress)
            except (CorruptStoreError, UnsafeDataError) as err:
                report.faults.append(str(err))
                continue
            first = data[layer_key(info.layers[0])] if info.layers else []
            held[index] = (
                [int(item["sample_idx"]) for item in first],
                [(item.get("metadata") or {}).get("machine_id") for item in first],
            )
            for layer in info.layers:
                for item in data[layer_key(layer)]:
                    non_finite += int(
                        item["activation"].size - np.count_nonzero(np.isfinite(item["activation"]))
                    )
        report.files_checked, report.bytes_checked = max(n_files, len(self.shards)), n_bytes
        totals = self.metadata.statistics
        if totals.get("total_samples", self.n_examples) != self.n_examples:
            report.faults.append(
                f"statistics.total_samples is {totals['total_samples']} but the "
                f"shards hold {self.n_examples} samples"
            )
        for layer in self.layers:
            stats = self.statistics(layer) if self._has_stats(layer, report) else None
            rows = sum(self.shard_rows(i) for i, s in enumerate(self.shards) if layer in s.layers)
            if stats is not None and (stats.count != rows or stats.d != self.d_model):
                report.faults.append(
                    f"statistics of layer {layer} count {stats.count} rows of width "
                    f"{stats.d}; the shards hold {rows} of {self.d_model}"
                )
        for key, want in (
            ("total_shards", len(self.shards)),
            ("total_size_bytes", sum(s.size_bytes for s in self.shards)),
        ):
            if key in totals and totals[key] != want:
                report.faults.append(f"statistics.{key} is {totals[key]}, the store has {want}")
        if non_finite:
            report.notes.append(f"{non_finite} activation values are NaN or infinite")
        if self.metadata.actstore and len(held) == len(self.shards):
            report.faults += [f"{METADATA}: {f}" for f in self._metadata_faults(held)]
        self.verify_statistics(report)
        self.verify_record(report)
        return report

    def _metadata_faults(self, held: dict[int, tuple[list[int], list[Any]]]) -> list[str]:
        """What ``metadata.json`` says of the shards, against the shards (``held``: each
        shard's sample ids and items' machine ids, as decoded): every field actstore's
        writer derives from the data (shard entries, distributed_config, the statistics'
        totals), for a store actstore wrote. Only the creation time and the extraction
        duration are not derived from the data; they must be a time and a number."""
        md, faults = self.metadata, []
        edited = "the metadata was edited; restore it or re-capture"
        if md.version != VERSION:
            faults.append(f"version is {md.version!r}; actstore writes {VERSION!r}: {edited}")
        if not re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", md.created_at):
            faults.append(f"created_at {md.created_at!r} is not a UTC time: {edited}")
        for index, info in enumerate(self.shards):
            ids = held[index][0]
            if info.filename != shard_filename(info.shard_id, info.compressed):
                faults.append(
                    f"shard entry {info.shard_id} names {info.filename!r}, not "
                    f"{shard_filename(info.shard_id, info.compressed)!r}: {edited}"
                )
            if ids and list(info.sample_id_range) != [min(ids), max(ids)]:
                faults.append(
                    f"shard {info.filename} declares sample ids {list(info.sample_id_range)}; "
                    f"it holds {min(ids)}..{max(ids)}: {edited}"
                )
        faults += self._distributed_faults(held, edited)
        totals = md.statistics
        want = {
            "total_shards": len(self.shards),
            "total_samples": md.n_samples,
            "total_size_bytes": sum(s.size_bytes for s in self.shards),
            "layers_extracted": list(md.layers),
        }
        for key, value in want.items():
            if key not in totals or totals[key] != value:
                faults.append(f"statistics.{key} is {totals.get(key)!r}, the store has {value}")
        seconds = totals.get("extraction_duration_seconds")
        if not (
            isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and 0 <= seconds
        ):
            faults.append(f"statistics.extraction_duration_seconds {seconds!r} is not a duration")
        return list(dict.fromkeys(faults))

    def _distributed_faults(
        self, held: dict[int, tuple[list[int], list[Any]]], edited: str
    ) -> list[str]:
        """``distributed_config`` against the shards: the example range they hold and the
        machine each item says wrote it."""
        dist = self.metadata.distributed_config
        by_machine: dict[Any, list[int]] = {}
        for ids, machines in held.values():
            for i, m in zip(ids, machines):
                by_machine.setdefault(m, []).append(i)
        if "machines" not in dist:
            lo = min((min(ids) for ids, _ in held.values() if ids), default=0)
            hi = max((max(ids) + 1 for ids, _ in held.values() if ids), default=0)
            machine, per = dist.get("machine_id"), dist.get("samples_per_machine")
            want = distributed_config(
                machine_id=machine if isinstance(machine, int) else -1,
                total_machines=dist.get("total_machines"),  # type: ignore[arg-type]
                samples_per_machine=per,  # type: ignore[arg-type]
                example_range=(lo, hi),
            )
            faults = []
            if dist != want or set(by_machine) != {machine}:
                faults.append(
                    f"distributed_config {dist} does not describe the shards (machine "
                    f"{sorted(by_machine, key=str)} wrote samples {lo}..{hi - 1}): {edited}"
                )
            elif not (
                isinstance(per, int)
                and isinstance(machine, int)
                and isinstance(dist.get("total_machines"), int)
                and machine * per == lo
                and hi == min(lo + per, md_examples(self))
                and machine < dist["total_machines"]
                and dist["total_machines"] * per >= md_examples(self)
            ):
                faults.append(
                    f"distributed_config: machine {machine} of {dist['total_machines']} with "
                    f"{per} samples per machine cannot hold samples {lo}..{hi - 1}: {edited}"
                )
            return faults
        want_machines = [
            {
                "machine_id": m,
                "example_range": [min(ids), max(ids) + 1],
                "num_samples": len(ids),
            }
            for m, ids in sorted(by_machine.items(), key=lambda kv: str(kv[0]))
        ]
        expected = {
            "machine_id": None,
            "total_machines": len(by_machine),
            "multihost": False,
            "num_hosts": len(by_machine),
            "mesh_type": "1d",
            "samples_per_machine": dist.get("samples_per_machine"),
            "machines": want_machines,
        }
        if dist != expected:
            return [f"distributed_config does not describe the merged shards: {edited}"]
        return []

    def _has_stats(self, layer: int, report: VerifyReport) -> bool:
        try:
            stats = self.statistics(layer)
        except CorruptStoreError as err:
            report.faults.append(f"statistics of layer {layer}: {err}")
            return False
        if stats is not None and (stats.mean.shape != (stats.d,) or stats.m2.shape != (stats.d,)):
            report.faults.append(f"statistics of layer {layer} have vectors of the wrong length")
            return False
        return stats is not None


def md_examples(reader: PickleReader) -> int:
    """Examples of the whole capture a store (or one machine's part of it) belongs to."""
    return int(reader.metadata.actstore.get("n_examples") or 0)


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
