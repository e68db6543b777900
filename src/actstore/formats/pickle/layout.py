"""The pkl.gz activation shard format, version 1.0: names, metadata.json, validation.

A store is a directory holding ``metadata.json`` and shards ``shard_{id:04d}.pkl.gz``
(``.pkl`` uncompressed). A shard is a pickled dict ``{"layer_{idx}": [item, ...]}``; an
item is ``{"sample_idx", "activation" (float32 [seq_len, hidden]), "shape",
"text_preview" (first 200 chars), "metadata" {"token_count", "dataset_idx", "machine_id"}}``.
``layer_{idx}`` is the output of block ``idx`` (``resid.idx``, Hugging Face's
``hidden_states[idx + 1]``).

Beyond the spec's fields, actstore records (all ignored by the spec's own loader):
``extraction_config.actstore`` (what it needs to rebuild a capture plan), per-shard
``num_tokens``, per-item ``metadata.token_ids`` / ``metadata.label`` when known,
``statistics.activation_statistics`` (exact per-layer mean/variance/norm) and, in
``distributed_config``, ``samples_per_machine`` and the ``example_range`` a machine wrote.

Example:
    >>> shard_filename(3, compressed=True), layer_key(15)
    ('shard_0003.pkl.gz', 'layer_15')
    >>> ShardInfo.from_dict({"shard_id": 1, "filename": "shard_0001.pkl.gz", "size_bytes": 10,
    ...     "num_samples": 2, "layers": [3], "sample_id_range": [0, 1], "compressed": True,
    ...     "checksum": "sha256:" + "0" * 64}).sample_ids
    range(0, 2)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import pairwise
from pathlib import PurePosixPath
from typing import Any

from ...batch import CapturePlan
from ...errors import ConfigError, CorruptStoreError, ProtocolVersionError
from ...sites import Site
from ..metacheck import MAX_DIM, Fields

VERSION = "1.0"
METADATA = "metadata.json"
TEXT_PREVIEW_CHARS = 200
#: The spec's shard size guidance (bytes): recommended 50-500 MB, min 10 MB, max 2 GB.
MIN_SHARD_BYTES = 10 * 1000**2
MAX_SHARD_BYTES = 2 * 1000**3
DEFAULT_SHARD_MB = 256
_LAYER_KEY = re.compile(r"^layer_(\d+)$")
_SHARD_FILE = re.compile(r"^shard_(\d{4,})\.pkl(\.gz)?$")


def shard_filename(shard_id: int, compressed: bool) -> str:
    """``shard_0001.pkl.gz`` (or ``.pkl``)."""
    return f"shard_{shard_id:04d}.pkl" + (".gz" if compressed else "")


def is_shard_filename(name: str) -> bool:
    return _SHARD_FILE.match(name) is not None


def layer_key(layer: int) -> str:
    """The shard dict key of ``layer``: ``layer_15``."""
    return f"layer_{layer}"


def utc_text(seconds: float) -> str:
    """A time in seconds since the epoch as the spec writes it (ISO 8601 UTC,
    ``2025-01-09T12:00:00Z``).

    Example:
        >>> utc_text(0)
        '1970-01-01T00:00:00Z'
    """
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def samples_per_shard_for(plan: CapturePlan, shard_mb: float) -> int:
    """Samples per shard so that a shard holds about ``shard_mb`` MB of float32 activations."""
    per_sample = plan.tokens_per_example * plan.d_model * 4 * len(plan.sites)
    return max(1, int(shard_mb * 1000**2) // per_sample)


def extraction_config(plan: CapturePlan, samples_per_shard: int) -> dict[str, Any]:
    """The spec's ``extraction_config`` for a capture ``plan``, plus actstore's own record."""
    if any(site.kind != "resid" for site in plan.sites):
        raise ConfigError(
            "pkl.gz shards (spec 1.0) store the residual stream only (its layer_{idx} keys); "
            "capture attention/MLP sites into the zarr or activault formats"
        )
    return {
        "model_name": plan.ckpt,
        "model_architecture": plan.family,
        "model_params": {"hidden_size": plan.d_model, "num_hidden_layers": plan.n_model_layers},
        "dataset_name": plan.dataset_root,
        "dataset_config": plan.data.get("kind"),
        "dataset_split": plan.data.get("split"),
        "layers_extracted": list(plan.layers),
        "max_seq_length": plan.tokens_per_example,
        "batch_size": plan.batch_size,
        "actstore": {
            "modality": plan.modality,
            "n_examples": plan.n_examples,
            "tokens_per_example": plan.tokens_per_example,
            "has_cls": plan.has_cls,
            "samples_per_shard": samples_per_shard,
            "data": plan.data,
            "classes": plan.classes,
            "has_labels": plan.has_labels,
            "has_tokens": plan.has_tokens,
        },
    }


def distributed_config(
    *,
    machine_id: int = 0,
    total_machines: int = 1,
    samples_per_machine: int,
    example_range: tuple[int, int],
) -> dict[str, Any]:
    """The spec's ``distributed_config`` of one machine's output."""
    return {
        "machine_id": machine_id,
        "total_machines": total_machines,
        "multihost": False,
        "num_hosts": 1,
        "mesh_type": "1d",
        "samples_per_machine": samples_per_machine,
        "example_range": list(example_range),
    }


@dataclass(frozen=True, kw_only=True)
class ShardInfo:
    """One entry of ``metadata.json``'s ``shards`` list."""

    shard_id: int
    filename: str
    size_bytes: int
    num_samples: int
    layers: tuple[int, ...]
    sample_id_range: tuple[int, int]
    """First and last sample id, inclusive."""
    compressed: bool
    checksum: str
    """``"sha256:<hex>"`` of the file's bytes."""
    num_tokens: int | None = None
    """Rows per layer (sum of seq_len); actstore's addition, absent in foreign stores."""

    @property
    def sha256(self) -> str:
        return self.checksum.split(":", 1)[1]

    @property
    def sample_ids(self) -> range:
        """The id range the entry declares (ids inside need not be contiguous)."""
        return range(self.sample_id_range[0], self.sample_id_range[1] + 1)

    def to_dict(self) -> dict[str, Any]:
        out = {
            "shard_id": self.shard_id,
            "filename": self.filename,
            "size_bytes": self.size_bytes,
            "num_samples": self.num_samples,
            "layers": list(self.layers),
            "sample_id_range": list(self.sample_id_range),
            "compressed": self.compressed,
            "checksum": self.checksum,
        }
        if self.num_tokens is not None:
            out["num_tokens"] = self.num_tokens
        return out

    @classmethod
    def from_dict(cls, doc: Any, *, source: str = METADATA) -> ShardInfo:
        """Parse and validate one shard entry."""
        where = (
            f"{source}: shard entry {doc.get('shard_id', '?') if isinstance(doc, dict) else '?'}"
        )
        if not isinstance(doc, dict):
            raise CorruptStoreError(f"{where} must be an object")
        ints = ("shard_id", "size_bytes", "num_samples")
        for key in (*ints, "filename", "layers", "sample_id_range", "compressed", "checksum"):
            if key not in doc:
                raise CorruptStoreError(f"{where} lacks {key!r}")
        if not all(_is_int(doc[k]) and doc[k] >= 0 for k in ints):
            raise CorruptStoreError(f"{where}: {', '.join(ints)} must be non-negative integers")
        rng = doc["sample_id_range"]
        if not (
            isinstance(rng, list)
            and len(rng) == 2
            and all(_is_int(x) for x in rng)
            and rng[0] <= rng[1]
        ):
            raise CorruptStoreError(f"{where}: sample_id_range must be [first, last] integers")
        if doc["num_samples"] > rng[1] - rng[0] + 1:
            raise CorruptStoreError(
                f"{where}: {doc['num_samples']} samples cannot have ids in {rng}"
            )
        if not (isinstance(doc["layers"], list) and all(_is_int(x) for x in doc["layers"])):
            raise CorruptStoreError(f"{where}: layers must be a list of integers")
        checksum = doc["checksum"]
        if not (isinstance(checksum, str) and re.fullmatch(r"sha256:[0-9a-f]{64}", checksum)):
            raise CorruptStoreError(f"{where}: checksum must be 'sha256:<64 hex digits>'")
        name = doc["filename"]
        if not isinstance(name, str) or not _safe_relative(name):
            raise CorruptStoreError(f"{where}: filename {name!r} must be a path inside the store")
        if not isinstance(doc["compressed"], bool):
            raise CorruptStoreError(f"{where}: compressed must be true or false")
        num_tokens = doc.get("num_tokens")
        if num_tokens is not None and not (_is_int(num_tokens) and num_tokens >= 0):
            raise CorruptStoreError(f"{where}: num_tokens must be a non-negative integer")
        return cls(
            shard_id=doc["shard_id"],
            filename=name,
            size_bytes=doc["size_bytes"],
            num_samples=doc["num_samples"],
            layers=tuple(doc["layers"]),
            sample_id_range=(rng[0], rng[1]),
            compressed=doc["compressed"],
            checksum=checksum,
            num_tokens=num_tokens,
        )


@dataclass(frozen=True, kw_only=True)
class PickleMetadata:
    """``metadata.json`` of a pkl.gz store."""

    version: str
    created_at: str
    extraction_config: dict[str, Any]
    distributed_config: dict[str, Any] = field(default_factory=dict)
    shards: tuple[ShardInfo, ...] = ()
    statistics: dict[str, Any] = field(default_factory=dict)

    @property
    def layers(self) -> tuple[int, ...]:
        """Layers stored: ``layers_extracted``, else the union of the shards' layers."""
        listed = self.extraction_config.get("layers_extracted")
        if listed:
            return tuple(int(x) for x in listed)
        return tuple(sorted({layer for s in self.shards for layer in s.layers}))

    @property
    def n_samples(self) -> int:
        return sum(s.num_samples for s in self.shards)

    @property
    def actstore(self) -> dict[str, Any]:
        """actstore's own record in ``extraction_config`` (empty for foreign stores)."""
        return self.extraction_config.get("actstore") or {}

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "created_at": self.created_at,
            "extraction_config": self.extraction_config,
            "distributed_config": self.distributed_config,
            "shards": [s.to_dict() for s in self.shards],
            "statistics": self.statistics,
        }

    @classmethod
    def from_json_dict(cls, doc: Any, *, source: str = METADATA) -> PickleMetadata:
        """Parse and validate ``metadata.json``: required fields, shard entries, unique shard
        ids and file names, disjoint sample id ranges (sample ids are globally unique)."""
        if not isinstance(doc, dict):
            raise CorruptStoreError(f"{source} must hold a JSON object")
        for key in ("version", "created_at", "extraction_config", "shards", "statistics"):
            if key not in doc:
                raise CorruptStoreError(f"{source} lacks the required field {key!r}")
        version = doc["version"]
        if not isinstance(version, str) or not re.fullmatch(r"\d+\.\d+", version):
            raise CorruptStoreError(
                f"{source}: version must be a string such as {VERSION!r}, not {version!r}; the "
                "metadata was edited or damaged: restore it or re-create the store"
            )
        if version.split(".")[0] != VERSION.split(".")[0]:
            raise ProtocolVersionError(
                f"{source} has version {version!r}; this reader implements {VERSION} and "
                "cannot read another major version"
            )
        for key, typ in (
            ("extraction_config", dict),
            ("statistics", dict),
            ("shards", list),
            ("created_at", str),
        ):
            if not isinstance(doc[key], typ):
                raise CorruptStoreError(f"{source}: {key} must be a JSON {typ.__name__}")
        dist = doc.get("distributed_config") or {}
        if not isinstance(dist, dict):
            raise CorruptStoreError(f"{source}: distributed_config must be an object")
        _check_configs(doc["extraction_config"], dist, source)
        shards = tuple(ShardInfo.from_dict(s, source=source) for s in doc["shards"])
        for attr in ("shard_id", "filename"):
            values = [getattr(s, attr) for s in shards]
            if len(set(values)) != len(values):
                raise CorruptStoreError(f"{source}: two shards share a {attr}")
        ordered = sorted(shards, key=lambda s: s.sample_id_range)
        for a, b in pairwise(ordered):
            if b.sample_id_range[0] <= a.sample_id_range[1]:
                raise CorruptStoreError(
                    f"{source}: shards {a.shard_id} and {b.shard_id} have overlapping sample id "
                    f"ranges {list(a.sample_id_range)} and {list(b.sample_id_range)}; sample "
                    "ids must be unique (merge machines' outputs with `actstore merge`)"
                )
        return cls(
            version=version,
            created_at=doc["created_at"],
            extraction_config=doc["extraction_config"],
            distributed_config=dist,
            shards=shards,
            statistics=doc["statistics"],
        )


def _check_configs(config: dict[str, Any], dist: dict[str, Any], source: str) -> None:
    """The fields of ``extraction_config`` and ``distributed_config`` a reader uses, each of
    its type and in range (the spec's, then actstore's own record when present)."""
    f = Fields(config, f"{source}: extraction_config")
    params = f.obj("model_params", optional=True)
    if params is not None:
        p = Fields(params, f"{source}: extraction_config.model_params")
        p.count("hidden_size", lo=1, hi=MAX_DIM, optional=True)
        p.count("num_hidden_layers", lo=1, hi=MAX_DIM, optional=True)
    f.counts("layers_extracted", hi=MAX_DIM, optional=True)
    f.count("max_seq_length", lo=1, hi=MAX_DIM, optional=True)
    f.count("batch_size", lo=1, optional=True)
    own = f.obj("actstore", optional=True)
    if own:
        a = Fields(own, f"{source}: extraction_config.actstore")
        a.text("modality")
        a.count("n_examples")
        a.count("tokens_per_example", lo=1, hi=MAX_DIM)
        a.count("samples_per_shard", lo=1)
        for key in ("has_cls", "has_labels", "has_tokens"):
            a.flag(key)
        a.obj("data")
        a.texts("classes", optional=True)
    d = Fields(dist, f"{source}: distributed_config")
    d.count("machine_id", optional=True)
    d.count("total_machines", lo=1, optional=True)
    d.count("samples_per_machine", optional=True)
    d.count("num_hosts", lo=1, optional=True)
    d.flag("multihost", optional=True)
    d.text("mesh_type", optional=True)
    ranges = [("distributed_config", dist)]
    machines = dist.get("machines")
    if machines is not None:
        if not isinstance(machines, list):
            raise d.fault("machines", "a list of objects", machines)
        for k, machine in enumerate(machines):
            m = Fields(machine, f"{source}: distributed_config.machines[{k}]")
            m.count("machine_id")
            m.count("num_samples")
            ranges.append((f"distributed_config.machines[{k}]", machine))
    for where, holder in ranges:
        span = Fields(holder, f"{source}: {where}").counts("example_range", optional=True)
        if span is not None and (len(span) != 2 or span[0] > span[1]):
            raise CorruptStoreError(
                f"{source}: {where}.example_range must be [start, stop], not {span}; the "
                "metadata was edited or damaged: restore it or re-create the store"
            )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _safe_relative(name: str) -> bool:
    path = PurePosixPath(name)
    return bool(name) and not path.is_absolute() and ".." not in path.parts and "\\" not in name


def plan_sites(layers: tuple[int, ...]) -> tuple[Site, ...]:
    return tuple(Site("resid", layer) for layer in layers)
