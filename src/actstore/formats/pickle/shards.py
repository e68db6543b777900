"""Opening a pkl.gz store and loading its shards safely: ``metadata.json`` read through
the root manifest and checked against the shards (:class:`PickleShards`, the first layer
of :class:`~.reader.PickleReader`); each shard read whole, checked, then decompressed and
unpickled within the bounds the metadata allows, and its structure checked."""

from __future__ import annotations

import gzip
import hashlib
import io
import zlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from ... import safe_pickle
from ...errors import CorruptStoreError, StoreNotFoundError
from ..base import ReaderBase
from .layout import MAX_SHARD_BYTES, METADATA, PickleMetadata, ShardInfo, layer_key

#: Bytes an item may hold besides its activation array (text preview, token ids, ...).
ITEM_OVERHEAD = 64 << 10


class PickleShards(ReaderBase):
    """A pkl.gz store's metadata and shards, checked as they are opened and loaded."""

    _cache_size: int

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

    @property
    def layers(self) -> tuple[int, ...]:
        return self.metadata.layers

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
