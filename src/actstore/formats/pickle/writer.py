"""Write a pkl.gz store: the format's part of the crash protocol.

:class:`PickleWriter` is a :class:`~actstore.formats.writer.ShardedWriter` (which owns the
partial directory, progress record, verified resume, statistics, root manifest and
publication). Shard ``k`` (id ``k + 1``) always holds samples ``[k * S, (k + 1) * S)`` with
``S`` samples per shard: the writer buffers a shard's items in memory and, when it is full,
pickles them (protocol 5) through gzip into ``shard_{id:04d}.pkl.gz``, hashing the bytes as
they pass (the spec's sha256, and one manifest block per shard). At publication it writes
the spec's ``metadata.json``. One machine's part of a distributed capture
(``example_range``, on a shard boundary) writes the shards a single-machine capture would
have, its items carrying its ``machine_id``.

Times recorded in ``metadata.json`` come from the first attempt of the capture (a resumed
capture keeps them); with ``SOURCE_DATE_EPOCH`` set they are that time and zero seconds, so
two captures of the same data are byte-identical.

Example:
    >>> import tempfile
    >>> from actstore.testing import make_acts, make_batches, make_plan
    >>> plan, out = make_plan(), tempfile.TemporaryDirectory()  # 23 examples
    >>> w = PickleWriter.from_plan(plan, Location.parse(out.name))
    >>> for batch in make_batches(plan, make_acts(plan)):
    ...     w.write(batch)
    >>> sorted(p.name for p in w.close().iterdir())  # published at the output itself
    ['actstore-manifest.json', 'metadata.json', 'shard_0001.pkl.gz']
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import pickle
from collections.abc import Mapping, Sequence
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ...batch import Batch, CapturePlan
from ...errors import ConfigError
from ...faults import point
from ...sites import Site
from ...stats import RunningStats
from ...storage import FileHasher, atomic_write_bytes
from ...storage.location import Location
from ..pipeline import ShardOutput
from ..shard import ShardRecord, ShardSink
from ..writer import ShardedWriter
from .layout import (
    MAX_SHARD_BYTES,
    METADATA,
    MIN_SHARD_BYTES,
    TEXT_PREVIEW_CHARS,
    VERSION,
    PickleMetadata,
    ShardInfo,
    distributed_config,
    extraction_config,
    layer_key,
    samples_per_shard_for,
    shard_filename,
    utc_text,
)
from .options import PickleOptions

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: Pickle protocol of shards: 5 writes array buffers in one piece (Python >= 3.8 reads it).
PICKLE_PROTOCOL = 5


class _Sha256Writer:
    """Write-only file wrapper computing the spec's sha256 of what passes through."""

    def __init__(self, raw: Any) -> None:
        self.raw, self.sha, self.size = raw, FileHasher("sha256"), 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.sha.update(view)
        self.size += len(view)
        return self.raw.write(view)

    def flush(self) -> None:
        pass


def per_shard(plan: CapturePlan, options: PickleOptions) -> int:
    """Samples per shard of ``plan`` under ``options``."""
    return options.samples_per_shard or samples_per_shard_for(plan, options.shard_mb)


class PickleWriter(ShardedWriter):
    """Writer of one pkl.gz store (``out`` is the store directory), or one machine's part."""

    format_name = "pickle"
    options_type = PickleOptions
    parts_are_stores = True
    #: Ask capture for each example's decoded text (the items' ``text_preview``).
    wants_texts = True

    def __init__(
        self,
        plan: CapturePlan,
        output: Location,
        options: PickleOptions | None = None,
        *,
        example_range: tuple[int, int] | None = None,
        store: Location | None = None,
        machine_id: int = 0,
        total_machines: int = 1,
        samples_per_machine: int | None = None,
    ) -> None:
        options = options or PickleOptions()
        self.samples_per_shard = per_shard(plan, options)
        self.config = extraction_config(plan, self.samples_per_shard)
        start, stop = example_range if example_range is not None else (0, plan.n_examples)
        self.machine_id = machine_id
        self.per_machine = samples_per_machine if samples_per_machine is not None else stop - start
        if machine_id * self.per_machine != start:
            raise ConfigError(
                f"machine {machine_id} with {self.per_machine} samples per machine starts at "
                f"sample {machine_id * self.per_machine}, not {start}: sample ids would not be unique"
            )
        self.total_machines = total_machines
        shard_bytes = (
            self.samples_per_shard * plan.tokens_per_example * plan.d_model * 4 * len(plan.sites)
        )
        if shard_bytes > MAX_SHARD_BYTES:
            raise ConfigError(
                f"{self.samples_per_shard} samples per shard make {shard_bytes / 1e9:.1f} GB "
                "shards; the spec caps shards at 2 GB: lower samples_per_shard or shard_mb"
            )
        if shard_bytes < MIN_SHARD_BYTES and plan.n_examples > self.samples_per_shard:
            log.info("shards of %.1f MB are below the spec's 10 MB minimum", shard_bytes / 1e6)
        super().__init__(
            plan=plan,
            store=store or output,
            output=output,
            options=options,
            record={"extraction_config": self.config, "compress": options.compress},
            examples_per_shard=self.samples_per_shard,
            example_range=example_range,
        )

    @classmethod
    def shard_examples(cls, plan: CapturePlan, options: Any) -> int:
        return per_shard(plan, options or PickleOptions())

    @classmethod
    def for_slice(cls, plan: CapturePlan, store: Location, options: Any, sl: Any) -> PickleWriter:
        """One machine's part: its items carry ``sl.machine_id`` (the spec's field)."""
        return cls(
            plan,
            store.parent,
            options,
            example_range=(sl.start, sl.stop),
            store=store,
            machine_id=sl.machine_id,
            total_machines=sl.n_machines,
            samples_per_machine=sl.per_machine,
        )

    # ------------------------------------------------------------------ the format's part

    def open_shard(self, index: int, directory: Path) -> ShardSink:
        return _PickleShard(self, index, directory)

    def write_index(
        self, directory: Path, shards: Sequence[ShardRecord], stats: dict[Site, RunningStats]
    ) -> None:
        """``metadata.json``: the spec's metadata, shard entries in sample order."""
        infos = [ShardInfo.from_dict(e.info[name]["shard"]) for e in shards for name in e.files]
        by_machine: dict[int, list[ShardInfo]] = {}
        per = self.per_machine
        for e in shards:
            for name in e.files:
                info = e.info[name]
                by_machine.setdefault(info["machine_id"], []).append(
                    ShardInfo.from_dict(info["shard"])
                )
                per = info["per_machine"]
        if len(by_machine) <= 1:
            dist = distributed_config(
                machine_id=next(iter(by_machine), self.machine_id),
                total_machines=self.total_machines,
                samples_per_machine=per,
                example_range=self.example_range,
            )
        else:  # merged from several machines: the spec's "merge metadata files"
            dist = {
                "machine_id": None,
                "total_machines": len(by_machine),
                "multihost": False,
                "num_hosts": len(by_machine),
                "mesh_type": "1d",
                "samples_per_machine": per,
                "machines": [
                    {
                        "machine_id": m,
                        "example_range": [
                            held[0].sample_id_range[0],
                            held[-1].sample_id_range[1] + 1,
                        ],
                        "num_samples": sum(i.num_samples for i in held),
                    }
                    for m, held in sorted(by_machine.items())
                ],
            }
        seconds = 0.0 if self.reproducible else round(self.elapsed(), 3)
        doc = PickleMetadata(
            version=VERSION,
            created_at=utc_text(self.started),
            extraction_config=self.config,
            distributed_config=dist,
            shards=tuple(infos),
            statistics=_statistics(
                infos, self.plan.layers, {s.layer: st for s, st in stats.items()}, seconds
            ),
        ).to_json_dict()
        data = (json.dumps(doc, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
        atomic_write_bytes(directory / METADATA, data)


class _PickleShard(ShardSink):
    """One shard's items, buffered until the shard is full, then pickled through gzip on
    the writer's CPU pool (shards compress in parallel while the next ones fill)."""

    def __init__(self, writer: PickleWriter, index: int, directory: Path) -> None:
        self.w, self.index, self.directory = writer, index, directory
        self.items: dict[str, list[dict[str, Any]]] = {}
        self.n = 0
        self.n_tokens = 0
        self.name = shard_filename(index + 1, writer.options.compress)
        self._info: dict[str, dict[str, Any]] = {}

    def open(self, out: ShardOutput) -> None:
        """The shard's file is created only when it is full (:meth:`finish`)."""

    def append(self, batch: Batch, acts: Mapping[Site, torch.Tensor], out: ShardOutput) -> None:
        w = self.w
        arrays = {layer: acts[Site("resid", layer)].numpy() for layer in w.plan.layers}
        start = w.example_range[0]
        for i, example in enumerate(batch.example_ids.tolist()):
            meta: dict[str, Any] = {
                "token_count": int(batch.token_mask[i].sum())
                if batch.token_mask is not None
                else int(arrays[w.plan.layers[0]].shape[1]),
                "dataset_idx": example,
                "machine_id": w.machine_id,
            }
            if batch.token_ids is not None:
                meta["token_ids"] = np.array(batch.token_ids[i], dtype=np.int32)  # a copy
            if batch.labels is not None:
                meta["label"] = int(batch.labels[i])
            text = batch.texts[i][:TEXT_PREVIEW_CHARS] if batch.texts is not None else ""
            for layer, array in arrays.items():
                self.items.setdefault(layer_key(layer), []).append(
                    {
                        "sample_idx": w.machine_id * w.per_machine + example - start,
                        "activation": array[i].copy(),
                        "shape": tuple(array[i].shape),
                        "text_preview": text,
                        "metadata": meta,
                    }
                )
            self.n_tokens += int(arrays[w.plan.layers[0]].shape[1])
        self.n += batch.n_examples

    def finish(self, out: ShardOutput) -> None:
        self.stream = out.stream(self.name)
        out.submit(self._encode)

    def _encode(self) -> None:
        w = self.w
        items, self.items = self.items, {}
        first_item = items[layer_key(w.plan.layers[0])]
        first, last = first_item[0]["sample_idx"], first_item[-1]["sample_idx"]
        sink = _Sha256Writer(self.stream)
        if w.options.compress:
            with gzip.GzipFile(
                filename="",
                mode="wb",
                fileobj=sink,
                compresslevel=w.options.compresslevel,
                mtime=0,
            ) as gz:
                pickle.dump(items, gz, protocol=PICKLE_PROTOCOL)
        else:
            pickle.dump(items, sink, protocol=PICKLE_PROTOCOL)
        point("pickle.shard_written")
        info = ShardInfo(
            shard_id=self.index + 1,
            filename=self.name,
            size_bytes=sink.size,
            num_samples=self.n,
            layers=tuple(w.plan.layers),
            sample_id_range=(first, last),
            compressed=w.options.compress,
            checksum=f"sha256:{sink.sha.hexdigest()}",
            num_tokens=self.n_tokens,
        )
        self._info = {
            self.name: {
                "shard": info.to_dict(),
                "machine_id": w.machine_id,
                "per_machine": w.per_machine,
            }
        }

    def info(self) -> dict[str, dict[str, Any]]:
        return self._info


def _statistics(
    shards: Sequence[ShardInfo],
    layers: Sequence[int],
    stats: dict[int, RunningStats],
    seconds: float,
) -> dict[str, Any]:
    return {
        "total_shards": len(shards),
        "total_samples": sum(s.num_samples for s in shards),
        "total_size_bytes": sum(s.size_bytes for s in shards),
        "layers_extracted": list(layers),
        "extraction_duration_seconds": round(seconds, 3),
        "activation_statistics": {layer_key(k): stats[k].to_dict() for k in layers if k in stats},
    }


def merge_stores(stores: Sequence[str | os.PathLike], out: str | os.PathLike) -> Path:
    """Merge the pkl.gz stores several machines wrote (``actstore capture --format pickle
    --machine-id i --num-machines n``: each a readable store of its slice) into one store
    at ``out``: shards hard-linked, never rewritten, one merged ``metadata.json`` listing
    every machine, statistics merged exactly. Sample ids must not overlap.

    Example:
        >>> merge_stores(["run/machine_0", "run/machine_1"], "run/merged")  # doctest: +SKIP
    """
    from ..journal import read_part

    docs = sorted(((read_part(s), Path(s)) for s in stores), key=lambda d: d[0]["example_range"])
    if not docs:
        raise ConfigError("merging needs at least one store")
    for (a, pa), (b, pb) in pairwise(docs):
        if b["example_range"][0] < a["example_range"][1]:
            raise ConfigError(
                f"{pa} and {pb} hold overlapping sample ids ({a['example_range']}, "
                f"{b['example_range']}): these machines did not use distinct machine ids, or a "
                "slice was captured twice"
            )
    first = docs[0][0]
    plan = CapturePlan.from_json_dict(first["plan"])
    out = Location.parse(out)
    writer = PickleWriter(plan, out, PickleOptions(**first["options"]))
    return writer.merge([p for _, p in docs])
