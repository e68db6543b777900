"""Read a pkl.gz store safely: checksums verified, a restricted unpickler, ids checked.

Opening validates ``metadata.json`` (required fields, disjoint sample id ranges, every
listed shard present with its recorded size, inside the store, and, in stores actstore
wrote, every shard holding every layer and metadata.json matching the xxh3-128 digest in
the hidden manifest ``.actstore-manifest.xxh128``). Loading a shard reads it once, hashing
the bytes as they stream through gzip into :mod:`actstore.safe_pickle` (which refuses
anything but numeric arrays, plain containers and scalars, and stops reading past the
size the metadata declares), then compares the sha256 with the metadata (unless
``verify_reads=False``) and checks the shard's structure: exactly the listed layers, each
listing the same sample ids, inside the declared range, without repeats, arrays of the
declared width. The last decoded shard is cached, so reading the blocks of every layer of
one shard decodes it once.

Example:
    >>> r = PickleReader("acts-pkl")  # doctest: +SKIP
    >>> for item in r.items(15):  # the spec's iter_activations, verified  # doctest: +SKIP
    ...     item["activation"].shape, item["sample_idx"]
"""

from __future__ import annotations

import bisect
import gzip
import io
import os
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ... import safe_pickle
from ...batch import Batch, CapturePlan
from ...errors import (
    ConfigError,
    CorruptStoreError,
    IndexOutOfRangeError,
    LayerNotStoredError,
    StoreNotFoundError,
    UnsafeDataError,
)
from ...stats import RunningStats
from ...storage import FileHasher, read_json
from ...storage.files import StoreFiles, open_files
from ...storage.local import IO_CHUNK
from ...storage.object import S3Config
from ..base import Block, ReaderBase, VerifyReport
from .layout import (
    MANIFEST,
    MAX_SHARD_BYTES,
    METADATA,
    PROGRESS,
    PickleMetadata,
    ShardInfo,
    is_shard_filename,
    layer_key,
    plan_sites,
)

#: Bytes an item may hold besides its activation array (text preview, token ids, ...).
ITEM_OVERHEAD = 64 << 10


class _HashingReader:
    """Read-only file wrapper hashing every byte read (what gzip and pickle read from)."""

    def __init__(self, raw, progress: Callable[[int], None] | None = None) -> None:
        self.raw, self.hasher, self.progress = raw, FileHasher("sha256"), progress

    def _seen(self, data) -> None:
        self.hasher.update(data)
        if self.progress is not None:
            self.progress(len(data))

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self._seen(data)
        return data

    def readinto(self, buffer) -> int:
        n = self.raw.readinto(buffer)
        self._seen(memoryview(buffer)[:n])
        return n

    def readline(self, limit: int = -1) -> bytes:
        data = self.raw.readline(limit)
        self._seen(data)
        return data

    def drain(self) -> None:
        while self.read(IO_CHUNK):
            pass


class PickleReader(ReaderBase):
    """Read access to one pkl.gz store, local or ``s3://bucket/prefix``; picklable (the
    shard cache is not carried). ``verify_reads``: check each shard against its checksum when
    it is read. ``cache_dir`` / ``cache_bytes`` / ``s3``: the local cache tier and S3
    settings of a remote store (default ``$ACTSTORE_CACHE``)."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        cache_shards: int = 1,
        verify_reads: bool = True,
        cache_dir: str | os.PathLike | None = None,
        cache_bytes: int | str | None = None,
        s3: S3Config | None = None,
    ) -> None:
        self.files: StoreFiles = open_files(
            path, cache_dir=cache_dir, cache_bytes=cache_bytes, s3=s3
        )
        self.remote = self.files.local_path is None
        self.verify_reads = verify_reads
        self.path = self.files.local_path or Path(self.files.url)
        meta = self.path / METADATA
        if not self.remote and not self.path.is_dir():
            raise StoreNotFoundError(f"{self.path} is not a directory of pkl.gz shards")
        if not self.files.exists(METADATA):
            meta = self.files.url_of(METADATA)
            if self.files.exists(PROGRESS):
                raise CorruptStoreError(
                    f"{self.files.url} is an unfinished capture (no metadata.json yet): rerun the "
                    "same capture command to resume and publish it"
                )
            raise StoreNotFoundError(f"{meta} does not exist; is {self.files.url} a pkl.gz store?")
        self._check_manifest()
        self.metadata = PickleMetadata.from_json_dict(
            self.files.read_json(METADATA) if self.remote else read_json(meta),
            source=self.files.url_of(METADATA),
        )
        self.shards = sorted(self.metadata.shards, key=lambda s: s.sample_id_range)
        self._check_declared()
        root = self.path.resolve()
        for info in self.shards:
            file, size = self._where(info.filename), self.files.size(info.filename)
            if not self.remote and not Path(file).resolve().is_relative_to(root):
                raise CorruptStoreError(
                    f"shard {file} is a symlink to {Path(file).resolve()}, outside the store; "
                    "a store's files must lie inside it: copy the file in or re-capture"
                )
            if size is None:
                raise StoreNotFoundError(f"shard {file} is missing; restore it or re-capture")
            if size != info.size_bytes:
                raise CorruptStoreError(
                    f"shard {file} has {size} bytes, metadata.json says "
                    f"{info.size_bytes}: it is truncated or was replaced; restore it"
                )
        self._firsts = [s.sample_id_range[0] for s in self.shards]
        self._cache_size = max(1, cache_shards)
        self._cache: OrderedDict[int, dict[str, Any]] = OrderedDict()
        self._rows: dict[int, int] = {}

    def _check_manifest(self) -> None:
        """metadata.json must match the digest actstore recorded when it published."""
        if not self.files.exists(MANIFEST):
            return
        text = self.files.read_bytes(MANIFEST).decode("utf-8")
        listed = dict(line.split("  ", 1)[::-1] for line in text.splitlines() if "  " in line)
        hasher = FileHasher("xxh128")
        hasher.update(self.files.read_bytes(METADATA))
        if listed.get(METADATA) != hasher.hexdigest():
            raise CorruptStoreError(
                f"{self.files.url_of(METADATA)} does not match the digest in {MANIFEST}: it was edited after the "
                "store was published; restore it or re-capture"
            )

    def _check_declared(self) -> None:
        """Cheap consistency checks, so tampered metadata fails instead of serving less."""
        md = self.metadata
        hidden = (md.extraction_config.get("model_params") or {}).get("hidden_size")
        if hidden is not None and (not isinstance(hidden, int) or hidden < 1):
            raise CorruptStoreError(f"{self.path / METADATA}: hidden_size {hidden!r} is invalid")
        stray = [info.layers for info in self.shards if set(info.layers) - set(md.layers)]
        if stray:
            raise CorruptStoreError(
                f"{self.path / METADATA}: a shard lists layers {list(stray[0])} outside "
                f"layers_extracted {list(md.layers)}"
            )
        if md.actstore:  # written by actstore: every shard holds every layer
            short = [i.filename for i in self.shards if set(i.layers) != set(md.layers)]
            if short:
                raise CorruptStoreError(
                    f"{self.path / METADATA}: shard {short[0]} does not list every layer of "
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
                    f"{self.path / METADATA}: the shards hold {md.n_samples} samples, the "
                    f"capture declared {declared}; restore the metadata or re-capture"
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
    def sites(self) -> tuple[int, ...]:
        """The stored layers (``layer_{idx}`` keys), as ints like the saev reader's."""
        return self.metadata.layers

    @property
    def layers(self) -> tuple[int, ...]:
        return self.metadata.layers

    @property
    def d_model(self) -> int:
        hidden = (self.metadata.extraction_config.get("model_params") or {}).get("hidden_size")
        if isinstance(hidden, int):
            return hidden
        if not self.shards:
            raise CorruptStoreError(f"{self.files.url}: no shards and no model_params.hidden_size")
        first = self.load_shard(0)[layer_key(self.shards[0].layers[0])][0]
        return int(first["activation"].shape[1])

    @property
    def dtype(self) -> np.dtype:
        return np.dtype("<f4")

    @property
    def n_examples(self) -> int:
        return self.metadata.n_samples

    def __len__(self) -> int:
        return self.metadata.n_samples

    def __repr__(self) -> str:
        return (
            f"PickleReader({self.files.url!r}, samples={self.n_examples}, "
            f"layers={list(self.layers)}, shards={len(self.shards)})"
        )

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": OrderedDict()}

    def close(self) -> None:
        """Drop cached shards."""
        self._cache.clear()

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

    def _where(self, name: str) -> Any:
        """How messages name file ``name`` (its path, or its URL on object storage)."""
        return self.files.url_of(name) if self.remote else self.path / name

    def _open(self, info: ShardInfo) -> Any:
        """A binary file object over shard ``info`` (the I/O seam): the local file, or the
        whole remote object fetched with ranged GETs (kept in the cache tier if any)."""
        if not self.remote:
            return open(self.path / info.filename, "rb")
        return io.BytesIO(self.files.read_range(info.filename, 0, info.size_bytes))

    def _read(self, info: ShardInfo, progress: Callable[[int], None] | None) -> dict[str, Any]:
        file = self._where(info.filename)
        try:
            with self._open(info) as raw:
                tee = _HashingReader(raw, progress)
                if info.compressed:
                    with gzip.GzipFile(fileobj=tee, mode="rb") as gz:
                        data = safe_pickle.load(gz, max_bytes=self._max_shard_bytes(info))
                        if gz.read(IO_CHUNK):  # to the end: checks gzip's CRC too
                            raise CorruptStoreError("bytes follow the pickle")
                else:
                    data = safe_pickle.load(tee, max_bytes=self._max_shard_bytes(info))
                tee.drain()
        except (OSError, EOFError, zlib.error) as err:
            raise CorruptStoreError(
                f"shard {file} cannot be decompressed ({err}); it is "
                "damaged: restore it or re-capture"
            ) from err
        except CorruptStoreError as err:
            raise CorruptStoreError(f"shard {file}: {err}") from err
        if self.verify_reads and tee.hasher.hexdigest() != info.sha256:
            raise CorruptStoreError(
                f"shard {file} fails its checksum (metadata.json has {info.checksum}); the file "
                "was changed after it was written: restore it or re-capture"
            )
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
            ids = []
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

    def _layer(self, site: Any) -> int:
        layer = int(site)
        if layer not in self.metadata.layers:
            raise LayerNotStoredError(
                f"layer {layer} is not stored here; stored layers: {list(self.metadata.layers)}"
            )
        return layer

    def blocks(self, site: Any) -> list[Block]:
        """One block per shard holding ``site``: its samples' rows, in sample id order."""
        layer = self._layer(site)
        return [
            Block(site=layer, n_rows=self.shard_rows(i), loc=(i,))
            for i, info in enumerate(self.shards)
            if layer in info.layers
        ]

    def read_block(self, block: Block, out: np.ndarray | None = None) -> np.ndarray:
        """Rows of ``block`` as ``[n_rows, D]`` float32."""
        (index,) = block.loc
        items = self.load_shard(index)[layer_key(int(block.site))]
        if out is None:
            out = np.empty((block.n_rows, self.d_model), dtype=self.dtype)
        np.concatenate([item["activation"] for item in items], out=out, casting="same_kind")
        return out

    def statistics(self, site: Any) -> RunningStats | None:
        """Exact running statistics of layer ``site`` (None in stores that lack them)."""
        layer = self._layer(site)
        record = (self.metadata.statistics.get("activation_statistics") or {}).get(layer_key(layer))
        return None if record is None else RunningStats.from_dict(record)

    # ------------------------------------------------------------------ spec-level access

    def items(self, layer: int) -> Iterator[dict[str, Any]]:
        """Every item of ``layer`` in sample id order: the spec's ``iter_activations``."""
        key = layer_key(self._layer(layer))
        for i, info in enumerate(self.shards):
            if int(layer) in info.layers:
                yield from self.load_shard(i)[key]

    def item(self, sample_idx: int, layer: int) -> dict[str, Any]:
        """The item of global sample id ``sample_idx`` at ``layer``."""
        key = layer_key(self._layer(layer))
        index = bisect.bisect_right(self._firsts, sample_idx) - 1
        if index >= 0 and sample_idx <= self.shards[index].sample_id_range[1]:
            for item in self.load_shard(index)[key]:
                if item["sample_idx"] == sample_idx:
                    return item
        raise IndexOutOfRangeError(f"sample id {sample_idx} is not stored in {self.files.url}")

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
            raise ConfigError(
                f"{self.files.url}: metadata gives no sequence length; cannot convert"
            )
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
                f"{self.files.url}: samples have different lengths; only fixed-length "
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

    def describe(self) -> dict[str, Any]:
        """Summary for ``actstore inspect``."""
        md = self.metadata
        config = md.extraction_config
        files = [METADATA] + [s.filename for s in self.shards]
        out: dict[str, Any] = {
            "path": self.files.url,
            "format": f"pkl.gz activation shards v{md.version}",
            "model": f"{config.get('model_name')} ({config.get('model_architecture')})",
            "dataset": config.get("dataset_name"),
            "sites": [f"layer {layer}" for layer in md.layers],
            "shape": (
                f"{md.n_samples} samples x {len(md.layers)} layers {list(md.layers)} x "
                f"{config.get('max_seq_length')} tokens x {self.d_model} dims"
            ),
            "n_examples": md.n_samples,
            "layers": list(md.layers),
            "d_model": self.d_model,
            "shards": f"{len(self.shards)} ({'gzip' if any(s.compressed for s in self.shards) else 'plain pickle'})",
            "created_at": md.created_at,
            "distributed": {
                k: md.distributed_config.get(k)
                for k in ("machine_id", "total_machines")
                if k in md.distributed_config
            },
            "bytes": sum(self.files.size(f) or 0 for f in files),
            "files": files,
        }
        return out

    def verify(self, *, progress: Callable[[int], None] | None = None) -> VerifyReport:
        """Re-read every shard: checksum, safe unpickling, structure, NaN/Inf values, and
        the statistics' totals against the shards. ``progress(n_bytes)`` as data is read."""
        report = VerifyReport(self.files.url)
        self._verify_files(report)
        non_finite = 0
        for index, info in enumerate(self.shards):
            self._cache.pop(index, None)
            try:
                data = self.load_shard(index, progress=progress)
            except (CorruptStoreError, UnsafeDataError) as err:
                report.faults.append(str(err))
                continue
            report.files_checked += 1
            report.bytes_checked += info.size_bytes
            for layer in info.layers:
                for item in data[layer_key(layer)]:
                    non_finite += int(
                        item["activation"].size - np.count_nonzero(np.isfinite(item["activation"]))
                    )
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
        return report

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

    def _verify_files(self, report: VerifyReport) -> None:
        """Every file inside the store and accounted for; the manifest present (own stores)."""
        listed = {s.filename for s in self.shards}
        if not self.remote:
            root = self.path.resolve()
            for child in sorted(self.path.iterdir()):
                if not child.resolve().is_relative_to(root):
                    report.faults.append(f"{child.name} is a symlink out of the store")
        for name in sorted(self.files.list()):
            if is_shard_filename(name) and name not in listed:
                report.faults.append(f"{name} is not listed in {METADATA}")
        if not self.files.exists(MANIFEST):
            message = f"no checksum manifest ({MANIFEST}): metadata.json cannot be verified"
            (report.faults if self.metadata.actstore else report.notes).append(message)


def detect_remote(location: str) -> bool:
    """Whether ``s3://bucket/prefix`` holds a pkl.gz store (one HEAD and one small GET)."""
    from ...storage.object import join_key, open_location

    store, prefix = open_location(location)
    key = join_key(prefix, METADATA)
    if store.size(key) is None:
        return False
    try:
        doc = store.get_json(key)
    except CorruptStoreError:
        return False
    return isinstance(doc, dict) and "shards" in doc and "extraction_config" in doc
