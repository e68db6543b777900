"""The three JSON documents of an Activault run: metadata.json, statistics.json, cfg.json.

``metadata.json`` (per hook) keeps Activault's keys in Activault's order; its reader needs
``shape``, ``input_ids_shape``, ``dtype`` and ``bytes_per_file``. ``statistics.json`` keeps
Activault's ``mean``, ``std``, ``norm``, ``M2`` and adds ``count``, which makes it exact and
mergeable (Activault's own file has no count and its ``std`` omits within-batch variance).
``cfg.json`` (per run) keeps Activault's keys and adds an ``actstore`` section: the commit
record that makes resume exact.

Example:
    >>> md = HookMetadata.for_shape(rows=4, seq=6, d=8, dtype="torch.bfloat16", batches_per_file=1)
    >>> md.with_bytes(2405).to_dict()["bytes_per_file"]
    2405
"""

from __future__ import annotations

import math
import re
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ...errors import CorruptStoreError
from ...stats import RunningStats
from ..metacheck import MAX_COUNT, MAX_DIM, Fields
from .layout import parse_dtype

#: Most megabatch files a run may commit per hook (a record naming more is damaged).
MAX_FILES = 1 << 32

#: Version of the ``actstore`` section in cfg.json.
RUN_RECORD_VERSION = 3
#: The record version since which runs have root manifests and file digests (2), and
#: keep their token positions (3: ``actstore-positions.npy``).
DIGESTS_SINCE, POSITIONS_SINCE = 2, 3


@dataclass(frozen=True, kw_only=True)
class HookMetadata:
    """One hook's ``metadata.json`` (megabatch shape, dtype and exact file size)."""

    batch_size: int
    """Rows per megabatch file (Activault's final metadata holds the megabatch row count)."""
    sequence_length: int
    dtype: str
    """``"torch.bfloat16"`` style (Activault's reader ``eval``s it)."""
    d_in: int
    batches_per_file: int
    bytes_per_file: int | None = None
    """Exact size of every data file; absent until the first file is uploaded."""

    @classmethod
    def for_shape(
        cls, *, rows: int, seq: int, d: int, dtype: str, batches_per_file: int
    ) -> HookMetadata:
        return cls(
            batch_size=rows,
            sequence_length=seq,
            dtype=dtype,
            d_in=d,
            batches_per_file=batches_per_file,
        )

    def with_bytes(self, n: int) -> HookMetadata:
        return replace(self, bytes_per_file=n)

    @property
    def file_bytes(self) -> int:
        """:attr:`bytes_per_file` of metadata read from a run (:meth:`from_dict` requires it)."""
        if self.bytes_per_file is None:
            raise CorruptStoreError("hook metadata.json lacks bytes_per_file (no file uploaded)")
        return self.bytes_per_file

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.batch_size, self.sequence_length, self.d_in)

    @property
    def input_ids_shape(self) -> tuple[int, int]:
        return (self.batch_size, self.sequence_length)

    @property
    def tokens_per_file(self) -> int:
        return self.batch_size * self.sequence_length

    def to_dict(self) -> dict[str, Any]:
        """Activault's key order: batch_size, sequence_length, dtype, d_in,
        batches_per_file, shape, input_ids_shape, bytes_per_file."""
        out: dict[str, Any] = {
            "batch_size": self.batch_size,
            "sequence_length": self.sequence_length,
            "dtype": self.dtype,
            "d_in": self.d_in,
            "batches_per_file": self.batches_per_file,
            "shape": list(self.shape),
            "input_ids_shape": list(self.input_ids_shape),
        }
        if self.bytes_per_file is not None:
            out["bytes_per_file"] = self.bytes_per_file
        return out

    @classmethod
    def from_dict(cls, doc: Any, *, source: str, exact: bool = False) -> HookMetadata:
        """Validate what a reader needs; ``shape`` wins over the per-batch fields (an
        Activault run's ``batch_size`` is its capture batch). ``exact`` (a run actstore
        wrote): every field is the one actstore writes for that shape, so an edited
        ``d_in``, ``sequence_length`` or ``batch_size`` is a fault too."""
        if not isinstance(doc, dict):
            raise CorruptStoreError(f"{source} is not a JSON object")
        md = cls._parse(doc, source=source)
        if exact and doc != md.to_dict():
            differ = sorted(k for k in {*doc, *md.to_dict()} if doc.get(k) != md.to_dict().get(k))
            raise CorruptStoreError(
                f"{source}: {', '.join(differ)} {'does' if len(differ) == 1 else 'do'} not "
                f"describe its files (shape {list(md.shape)}): it was edited; restore it or "
                "capture again"
            )
        return md

    @classmethod
    def _parse(cls, doc: dict[str, Any], *, source: str) -> HookMetadata:
        missing = [k for k in ("shape", "dtype", "bytes_per_file") if k not in doc]
        if missing:
            hint = (
                " (Activault writes bytes_per_file after the first upload of a run; "
                "a restarted Activault job leaves it out until its next upload)"
                if missing == ["bytes_per_file"]
                else ""
            )
            raise CorruptStoreError(f"{source} lacks {', '.join(missing)}{hint}")
        f = Fields(doc, source)
        shape = f.counts("shape", hi=MAX_COUNT)
        ids_shape = f.counts("input_ids_shape", hi=MAX_COUNT, optional=True) or shape[:2]
        nbytes = f.count("bytes_per_file")
        batches_per_file = f.count("batches_per_file", lo=1, optional=True) or 1
        try:
            parse_dtype(f.text("dtype"))
        except (TypeError, ValueError) as err:
            raise CorruptStoreError(f"{source} is malformed: {err}") from err
        if len(shape) != 3 or min(shape) < 1 or max(shape[1:]) > MAX_DIM:
            problem = f"shape {shape} is not [rows, seq, d]"
        elif ids_shape != shape[:2]:
            problem = f"input_ids_shape {ids_shape} does not match shape {shape}"
        elif nbytes < 1:
            problem = f"bytes_per_file {nbytes} is not positive"
        else:
            return cls(
                batch_size=shape[0],
                sequence_length=shape[1],
                d_in=shape[2],
                dtype=str(doc["dtype"]),
                bytes_per_file=nbytes,
                batches_per_file=batches_per_file,
            )
        raise CorruptStoreError(f"{source} is malformed: {problem}")


def statistics_to_dict(stats: RunningStats) -> dict[str, Any]:
    """``statistics.json``: Activault's keys (mean, std, norm, M2) plus ``count``.

    Example:
        >>> sorted(statistics_to_dict(RunningStats.of(np.ones((2, 3)))))
        ['M2', 'count', 'mean', 'norm', 'std']
    """
    return {
        "mean": stats.mean.tolist(),
        "std": stats.std.tolist(),
        "norm": stats.norm_mean,
        "M2": stats.m2.tolist(),
        "count": stats.count,
    }


def statistics_from_dict(doc: Any, *, source: str, exact: bool = False) -> RunningStats | None:
    """Inverse of :func:`statistics_to_dict`; None for Activault's count-less files.
    ``exact`` (a run actstore wrote, which always stores its exact statistics): a file
    without them is a fault, never None."""
    if not isinstance(doc, dict) or "count" not in doc:
        if exact:
            raise CorruptStoreError(
                f"{source} holds no exact statistics (no count), where actstore's writer "
                "stored them: it was edited or replaced; restore it or capture again"
            )
        return None
    try:
        mean = np.asarray(doc["mean"], dtype=np.float64)
        m2 = np.asarray(doc["M2"], dtype=np.float64)
        count, norm = int(doc["count"]), float(doc["norm"])
    except (KeyError, TypeError, ValueError) as err:
        raise CorruptStoreError(f"{source} is malformed: {err!r}") from err
    if mean.shape != m2.shape or mean.ndim != 1:
        raise CorruptStoreError(f"{source} is malformed: mean and M2 must be equal-length lists")
    return RunningStats(d=mean.shape[0], count=count, mean=mean, m2=m2, norm_mean=norm)


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    """The ``actstore`` section of cfg.json: what was captured and what is committed."""

    run_id: str
    """Random uuid of the run; group uuids derive from it."""
    hooks: dict[str, str]
    """Hook folder name -> actstore site name."""
    rows_per_file: int
    sequence_length: int
    dtype: str
    plan: dict[str, Any]
    """The capture plan (model, sites, dataset, shapes): a resume must match it."""
    groups: int = 0
    """Groups committed: files ``group_uuid(run_id, g)--{g+1}.pt`` for g < groups exist in
    every hook folder."""
    next_example: int = 0
    next_skip: int = 0
    """Kept tokens of ``next_example`` already stored (a file can end mid-example)."""
    token_mask: bool | None = None
    """Whether batches carried a token mask (cleaning); None before the first batch."""
    complete: bool = False
    dropped_tokens: int = 0
    """Kept tokens after the last full file, not stored (files must be equal size)."""
    num_runs: int = 1
    """Kept at 1 (read for compatibility): resumes and merges write what one uninterrupted
    capture writes."""
    digests: dict[str, list[str]] = field(default_factory=dict)
    """Hook -> keyed digest (16 hex) of each committed file, for the root manifest written
    at completion (Activault's own reader ignores this key)."""
    version: int = RUN_RECORD_VERSION
    """Version of the record as read (1: an older actstore, no :attr:`digests`; such a run
    is read but never resumed)."""

    @property
    def tokens_per_file(self) -> int:
        return self.rows_per_file * self.sequence_length

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "activault",
            "version": self.version,
            "run_id": self.run_id,
            "complete": self.complete,
            "groups": self.groups,
            "next_example": self.next_example,
            "next_skip": self.next_skip,
            "token_mask": self.token_mask,
            "dropped_tokens": self.dropped_tokens,
            "rows_per_file": self.rows_per_file,
            "sequence_length": self.sequence_length,
            "dtype": self.dtype,
            "hooks": self.hooks,
            "plan": self.plan,
            "num_runs": self.num_runs,
            "digests": self.digests,
        }

    @classmethod
    def from_dict(cls, doc: Any, *, source: str) -> RunRecord:
        f = Fields(doc, f"{source}: the 'actstore' section")
        version = f.count("version", lo=1, hi=1 << 16)
        f.count("groups", hi=MAX_FILES)
        for key in ("next_example", "next_skip"):
            f.count(key)
        f.count("dropped_tokens", optional=True)
        f.count("num_runs", lo=1, optional=True)
        f.count("rows_per_file", lo=1)
        f.count("sequence_length", lo=1, hi=MAX_DIM)
        f.text("dtype")
        f.flag("complete")
        f.flag("token_mask", optional=True)
        f.obj("plan")
        hooks = f.obj("hooks")
        if not hooks or not all(isinstance(v, str) for v in hooks.values()):
            raise f.fault("hooks", "an object of hook folder -> site name", hooks)
        digests = f.obj("digests", optional=True) or {}
        if not all(
            isinstance(v, list)
            and all(isinstance(x, str) and re.fullmatch(r"[0-9a-f]{16}", x) for x in v)
            for v in digests.values()
        ):
            raise f.fault("digests", "an object of hook -> 16-hex-digit file digests", digests)
        try:
            uuid.UUID(f.text("run_id"))
        except ValueError:
            raise f.fault("run_id", "a UUID", doc["run_id"]) from None
        try:
            if version > RUN_RECORD_VERSION:
                raise CorruptStoreError(
                    f"{source} was written by a newer actstore (record version {doc['version']}); "
                    "upgrade actstore"
                )
            record = cls(
                run_id=str(doc["run_id"]),
                hooks=dict(doc["hooks"]),
                rows_per_file=int(doc["rows_per_file"]),
                sequence_length=int(doc["sequence_length"]),
                dtype=str(doc["dtype"]),
                plan=dict(doc["plan"]),
                groups=int(doc["groups"]),
                next_example=int(doc["next_example"]),
                next_skip=int(doc["next_skip"]),
                token_mask=doc.get("token_mask"),
                complete=bool(doc["complete"]),
                dropped_tokens=int(doc.get("dropped_tokens", 0)),
                num_runs=int(doc.get("num_runs", 1)),
                digests={
                    str(h): [str(x) for x in v] for h, v in dict(doc.get("digests", {})).items()
                },
                version=version,
            )
        except (KeyError, TypeError, ValueError) as err:
            raise CorruptStoreError(f"{source}: malformed 'actstore' section ({err!r})") from err
        record.check(source)
        return record

    def check(self, source: str) -> None:
        """Refuse impossible values (an edited cfg.json must fail, never serve fewer rows)."""
        positive = {"rows_per_file": self.rows_per_file, "sequence_length": self.sequence_length}
        counts = {
            "groups": self.groups,
            "next_example": self.next_example,
            "next_skip": self.next_skip,
            "dropped_tokens": self.dropped_tokens,
        }
        bad = [f"{k}={v}" for k, v in positive.items() if v < 1]
        bad += [f"{k}={v}" for k, v in counts.items() if v < 0]
        if bad:
            raise CorruptStoreError(
                f"{source}: impossible values in the 'actstore' section ({', '.join(bad)}); "
                "the file was edited or damaged: restore it or capture again"
            )


def run_cfg(
    record: RunRecord, *, run_name: str, bucket: str, batch_size: int, batches_per_file: int
) -> dict[str, Any]:
    """cfg.json: Activault's ``Config.to_dict()`` keys, then the ``actstore`` record."""
    plan = record.plan
    tokens = record.groups * record.tokens_per_file
    return {
        "run_name": run_name,
        "transformer_config": {"model_name": plan.get("ckpt"), "dtype": record.dtype},
        "data_config": {
            "bucket_name": bucket,
            "data_key": plan.get("dataset_root"),
            "n_batches": math.ceil(int(plan.get("n_examples", 0)) / max(batch_size, 1)),
            "seq_length": record.sequence_length,
            "batch_size": batch_size,
            "seed": 0,
            "skip_cache": False,
            "start_batch": 0,
            "clean_added_tokens": bool(record.token_mask),
            "clean_default_system_prompt": bool(record.token_mask),
        },
        "upload_config": {"batches_per_upload": batches_per_file, "hooks": list(record.hooks)},
        "total_tokens": tokens,
        "d_model": plan.get("d_model"),
        "n_total_files": record.groups,
        "batches_processed": record.next_example // max(batch_size, 1),
        "num_runs": record.num_runs,
        "actstore": record.to_dict(),
    }
