"""Read a SAELens activation cache: actstore's own, or one ``sae_lens`` itself wrote.

The Arrow files are memory-mapped with pyarrow (as ``datasets`` does), so a block read is
one copy out of the page cache. A store actstore wrote carries sidecars: file sizes are
checked on opening, ``verify()`` re-hashes every file (sha256) and every block of every
column (xxh3-64), and exact statistics are served. A cache ``sae_lens`` wrote has none of
them: it opens with one warning that its contents cannot be verified, and ``verify()``
checks only its structure and values.

Sites are the columns' TransformerLens hook names (``blocks.3.hook_resid_post``); every
method taking a site also accepts actstore's names (``resid.3``, ``3``, a :class:`Site`).

Example:
    >>> r = SaelensReader("acts-saelens")  # doctest: +SKIP
    >>> r.sites, r.site_of("blocks.3.hook_resid_post")  # doctest: +SKIP
    (('blocks.3.hook_resid_post',), Site(kind='resid', layer=3))
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from ...batch import CapturePlan
from ...errors import (
    ConfigError,
    CorruptStoreError,
    LayerNotStoredError,
    StoreNotFoundError,
)
from ...sites import Site
from ...stats import RunningStats
from ...storage import FileHasher, read_json
from ...storage.local import IO_CHUNK
from ..base import Block, ReaderBase, VerifyReport
from .layout import (
    BLOCK_BYTES,
    CHECKSUMS,
    INFO,
    PROGRESS,
    SIDECAR,
    STATE,
    STATISTICS,
    TOKENS,
    SaelensLayout,
    hook_name,
    hook_site,
)

log = logging.getLogger(__name__)


class UnverifiedStoreWarning(UserWarning):
    """A store without actstore's checksums was opened: its contents cannot be verified."""


class SaelensReader(ReaderBase):
    """Read access to one cache directory; picklable (memory maps reopen per process)."""

    def __init__(self, path: str | os.PathLike) -> None:
        from datasets import Array2D, Features

        self.path = Path(path).expanduser()
        if self.path.name.endswith(".partial") or (self.path / PROGRESS).exists():
            raise CorruptStoreError(
                f"{self.path} is an unfinished capture (a .partial directory): rerun the same "
                "capture command to resume and publish it"
            )
        if not self.path.is_dir():
            raise StoreNotFoundError(f"{self.path} is not a directory (a SAELens cache)")
        if not (self.path / STATE).is_file():
            raise StoreNotFoundError(
                f"{self.path / STATE} does not exist; is {self.path} a dataset saved with "
                "save_to_disk?"
            )
        state = read_json(self.path / STATE)
        try:
            self.files = tuple(str(e["filename"]) for e in state["_data_files"])
            features = Features.from_dict(read_json(self.path / INFO)["features"])
        except (KeyError, TypeError, ValueError) as err:
            raise CorruptStoreError(
                f"{self.path}: state.json or dataset_info.json is malformed ({err!r})"
            ) from err
        for name in self.files:
            if os.sep in name or name.startswith(".") or not (self.path / name).is_file():
                raise StoreNotFoundError(f"{self.path / name} is missing; restore it or re-capture")
        self.columns = tuple(k for k, f in features.items() if isinstance(f, Array2D))
        if not self.columns:
            raise CorruptStoreError(
                f"{self.path} holds no Array2D activation column (columns: {list(features)})"
            )
        shapes = {tuple(features[c].shape) for c in self.columns}
        dtypes = {features[c].dtype for c in self.columns}
        if len(shapes) > 1 or len(dtypes) > 1:
            raise ConfigError(
                f"{self.path}: columns differ in shape or dtype ({shapes}, {dtypes}); "
                "actstore reads caches whose hooks share (context_size, d_in) and dtype"
            )
        (self.context_size, self._d_in), (dtype,) = shapes.pop(), dtypes
        self._dtype = np.dtype(dtype)
        self.has_tokens = TOKENS in features
        self.record: dict[str, Any] | None = None
        self.layout: SaelensLayout | None = None
        if (self.path / SIDECAR).is_file():
            self._open_own()
        else:
            warnings.warn(
                f"{self.path} has no actstore sidecars (a cache sae_lens wrote?): its contents "
                "cannot be verified and it has no stored statistics",
                UnverifiedStoreWarning,
                stacklevel=2,
            )
        self._tables: dict[int, Any] = {}
        self._batch_rows: list[list[int]] | None = None
        self._pid = os.getpid()

    def _open_own(self) -> None:
        record = read_json(self.path / SIDECAR)
        layout = SaelensLayout.from_dict(record.get("layout"), source=str(self.path / SIDECAR))
        listed = record.get("files") or []
        if tuple(layout.columns) != self.columns or [e.get("name") for e in listed] != list(
            self.files
        ):
            raise CorruptStoreError(
                f"{self.path}: {SIDECAR} does not match state.json/dataset_info.json "
                "(files or columns differ); restore the store or re-capture"
            )
        for entry in listed:
            file = self.path / entry["name"]
            if file.stat().st_size != entry.get("bytes"):
                raise CorruptStoreError(
                    f"{file} has {file.stat().st_size} bytes, expected {entry.get('bytes')} "
                    "(truncated or replaced); restore it or re-capture"
                )
        self.record, self.layout = record, layout

    # ------------------------------------------------------------------ properties

    @property
    def verified(self) -> bool:
        """True for stores with actstore's checksums and statistics."""
        return self.layout is not None

    @property
    def sites(self) -> tuple[str, ...]:
        """The activation columns (TransformerLens hook names)."""
        return self.columns

    def site_of(self, name: Hashable) -> Site:
        """The actstore site a column holds."""
        site = hook_site(str(name))
        if site is None:
            raise ConfigError(
                f"column {name!r} names no actstore site (a cache sae-lens wrote from HF module "
                "names): load it with the loader by column name; it cannot be converted"
            )
        return site

    def column(self, site: Hashable) -> str:
        """The column of ``site``: a hook name, ``"resid.3"``, ``3`` or a :class:`Site`."""
        if isinstance(site, str) and site in self.columns:
            return site
        try:
            name = hook_name(Site.parse(site))  # type: ignore[arg-type]
        except (ConfigError, KeyError):
            name = None
        if name not in self.columns:
            raise LayerNotStoredError(
                f"site {site!r} is not stored here; stored: {', '.join(self.columns)}"
            )
        return name

    @property
    def d_model(self) -> int:
        return self._d_in

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def n_examples(self) -> int:
        if self.layout is not None:
            return self.layout.n_examples
        return sum(sum(rows) for rows in self._rows())

    tokens_per_example = property(lambda self: self.context_size)

    def __len__(self) -> int:
        return self.n_examples

    def __repr__(self) -> str:
        return (
            f"SaelensReader({str(self.path)!r}, columns={list(self.columns)}, "
            f"context_size={self.context_size}, d_in={self.d_model})"
        )

    # ------------------------------------------------------------------ files

    def _table(self, index: int) -> Any:
        """File ``index`` as a memory-mapped pyarrow Table (one chunk per record batch)."""
        import pyarrow as pa

        if os.getpid() != self._pid:  # forked: maps are the parent's
            self._tables, self._pid = {}, os.getpid()
        table = self._tables.get(index)
        if table is None:
            path = self.path / self.files[index]
            try:
                table = pa.ipc.open_stream(pa.memory_map(str(path))).read_all()
            except (pa.ArrowInvalid, OSError) as err:
                raise CorruptStoreError(f"{path} is not a readable Arrow stream ({err})") from err
            missing = [c for c in self.columns if c not in table.column_names]
            if missing:
                raise CorruptStoreError(f"{path} lacks the columns {missing}")
            table = self._tables.setdefault(index, table)
        return table

    def _rows(self) -> list[list[int]]:
        """Examples in each record batch of each file."""
        if self._batch_rows is None:
            if self.layout is not None:
                lay = self.layout
                out = []
                for index in range(len(self.files)):
                    start, stop = lay.shard_range(index)
                    n, per = stop - start, lay.examples_per_block
                    out.append([min(per, n - lo) for lo in range(0, n, per)])
            else:
                out = [
                    [len(b) for b in self._table(i).to_batches()] for i in range(len(self.files))
                ]
            self._batch_rows = out
        return self._batch_rows

    def close(self) -> None:
        """Drop memory maps (reopened on next use)."""
        self._tables = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tables": {}}

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    # ------------------------------------------------------------------ blocks

    def blocks(self, site: Hashable) -> list[Block]:
        """Every row of ``site`` once, in storage order. A block is one record batch (split
        into runs of about 2 MiB in foreign caches, whose batches can be large);
        ``loc = (file, batch, first example in batch, n examples)``."""
        column = self.column(site)
        t = self.context_size
        per = max(1, BLOCK_BYTES // (t * self.d_model * self.dtype.itemsize))
        out = []
        for f, rows in enumerate(self._rows()):
            for b, n in enumerate(rows):
                step = n if self.layout is not None else per
                for lo in range(0, n, step):
                    k = min(step, n - lo)
                    out.append(Block(site=column, n_rows=k * t, loc=(f, b, lo, k)))
        return out

    def _values(self, block: Block) -> np.ndarray:
        """Zero-copy ``[n_rows, D]`` view of ``block`` in the memory map."""
        f, b, lo, k = block.loc
        chunk = self._table(f).column(self.column(block.site)).chunk(b)
        return _chunk_values(chunk, self.context_size, self.d_model)[
            lo * self.context_size : (lo + k) * self.context_size
        ]

    def read_block(self, block: Block, out: np.ndarray | None = None) -> np.ndarray:
        """Rows of ``block`` as ``[n_rows, D]`` in :attr:`dtype` (into ``out`` if given)."""
        values = self._values(block)
        if values.shape[0] != block.n_rows:
            raise CorruptStoreError(f"{self.path / self.files[block.loc[0]]}: block is short")
        if out is None:
            return values.copy()
        np.copyto(out, values, casting="same_kind")
        return out

    def read_block_scatter(self, block: Block, out: np.ndarray, rows: np.ndarray) -> None:
        """Row ``i`` of ``block`` into ``out[rows[i]]`` (skipped where ``rows[i] < 0``)."""
        values = self._values(block)
        keep = rows >= 0
        if keep.all():
            out[rows] = values
        else:
            out[rows[keep]] = values[keep]

    def cls_rows(self, block: Block) -> np.ndarray | None:
        return None

    def aligned_on(self, sites: Any) -> bool:
        return True

    def statistics(self, site: Hashable) -> RunningStats | None:
        """Exact statistics of ``site`` (None for caches without actstore's sidecars)."""
        column = self.column(site)
        path = self.path / STATISTICS
        if self.layout is None or not path.is_file():
            return None
        index = self.columns.index(column)
        return RunningStats.from_dict(read_json(path)["sites"][self.layout.sites[index]])

    @property
    def tokens(self) -> np.ndarray | None:
        """Token ids ``[n_examples, context_size]`` (int32), or None without that column."""
        if not self.has_tokens:
            return None
        parts = []
        for f in range(len(self.files)):
            column = self._table(f).column(TOKENS)
            for chunk in column.chunks:
                flat = chunk.flatten().to_numpy(zero_copy_only=False)
                parts.append(flat.reshape(-1, self.context_size))
        if not parts:
            return np.empty((0, self.context_size), dtype=np.int32)
        return np.concatenate(parts).astype(np.int32, copy=False)

    labels = None
    classes = None
    torch_dtype = None

    # ------------------------------------------------------------------ conversion

    def capture_plan(self) -> CapturePlan:
        """The capture that produced the store (pieced together for foreign caches)."""
        if self.record is not None:
            plan = dict(self.record["plan"])
            plan["sites"] = tuple(Site.parse(s) for s in plan["sites"])
            try:
                return CapturePlan(**plan)
            except TypeError as err:
                raise CorruptStoreError(f"{self.path / SIDECAR}: bad plan record ({err})") from err
        sites = [hook_site(c) for c in self.columns]
        unknown = [c for c, s in zip(self.columns, sites) if s is None]
        if unknown:
            raise ConfigError(
                f"{self.path}: hooks {unknown} have no actstore site name, so this cache "
                "cannot convert (the loader still reads them by hook name)"
            )
        return CapturePlan(
            ckpt="unknown",
            family="unknown",
            modality="text",
            sites=tuple(s for s in sites if s is not None),
            n_model_layers=max(s.layer for s in sites if s is not None) + 1,
            d_model=self.d_model,
            tokens_per_example=self.context_size,
            has_cls=False,
            n_examples=self.n_examples,
            dataset_root="",
            data={},
            classes=None,
            has_labels=False,
            has_tokens=self.has_tokens,
            batch_size=32,
        )

    # ------------------------------------------------------------------ inspect / verify

    def describe(self) -> dict[str, Any]:
        """Summary for ``actstore inspect``."""
        files = sorted(p for p in self.path.iterdir() if p.is_file())
        plan = (self.record or {}).get("plan") or {}
        out: dict[str, Any] = {
            "path": str(self.path),
            "format": "SAELens activation cache (datasets save_to_disk)"
            + ("" if self.verified else ", not written by actstore: unverified"),
            "model": f"{plan.get('ckpt', 'unknown')} ({plan.get('family', 'unknown')})",
            "dataset": plan.get("dataset_root"),
            "sites": [f"{c} ({hook_site(c)})" if hook_site(c) else c for c in self.columns],
            "shape": (
                f"{self.n_examples} examples x {self.context_size} tokens x {self.d_model} dims "
                f"({self.dtype.name}) per site"
            ),
            "n_examples": self.n_examples,
            "context_size": self.context_size,
            "d_model": self.d_model,
            "dtype": self.dtype.name,
            "files": [p.name for p in files],
            "bytes": sum(p.stat().st_size for p in files),
        }
        if self.layout is not None:
            out["blocks"] = f"{self.layout.examples_per_block} examples per Arrow record batch"
        if self.has_tokens and self.n_examples:
            out["token_ids[0][:16]"] = self.tokens[0, :16].tolist()
        return out

    def verify(self, *, progress: Callable[[int], None] | None = None) -> VerifyReport:
        """Re-hash every file (sha256) and block (xxh3-64) against ``checksums.json``,
        check row counts and shapes, count non-finite values. A cache without actstore's
        sidecars gets the structural checks and a note."""
        report = VerifyReport(str(self.path))
        sums = None
        if self.layout is None:
            report.notes.append(
                "no actstore checksums (a cache sae_lens wrote): contents unverified"
            )
        elif not (self.path / CHECKSUMS).is_file():
            report.faults.append(f"{CHECKSUMS} is missing")
        else:
            sums = read_json(self.path / CHECKSUMS)
            for name, digest in sums.get("files", {}).items():
                path = self.path / name
                if not path.is_file():
                    report.faults.append(f"{name} is listed in {CHECKSUMS} but missing")
                    continue
                if _sha256(path, progress) != digest:
                    report.faults.append(f"{name}: checksum mismatch (stored data was changed)")
                report.files_checked += 1
                report.bytes_checked += path.stat().st_size
            for name in self.files:
                if name not in sums.get("files", {}):
                    report.faults.append(f"{name} has no checksum in {CHECKSUMS}")
        non_finite, rows = 0, 0
        block_columns = [*self.columns, *([TOKENS] if self.has_tokens else [])]
        for f, name in enumerate(self.files):
            try:
                table = self._table(f)
                expected = None if sums is None else sums["blocks"].get(name, [])
                if (
                    expected is not None
                    and len(expected) != table.column(self.columns[0]).num_chunks
                ):
                    report.faults.append(
                        f"{name}: {len(expected)} block checksums, "
                        f"{table.column(self.columns[0]).num_chunks} blocks"
                    )
                    expected = None
                for b in range(table.column(self.columns[0]).num_chunks):
                    digests = []
                    for column in block_columns:
                        chunk = table.column(column).chunk(b)
                        if column == TOKENS:
                            values = chunk.flatten().to_numpy(zero_copy_only=False)
                        else:
                            values = _chunk_values(chunk, self.context_size, self.d_model)
                            non_finite += int(values.size - np.count_nonzero(np.isfinite(values)))
                        digests.append(xxhash.xxh3_64_hexdigest(np.ascontiguousarray(values).data))
                    if expected is not None and digests != expected[b]:
                        report.faults.append(f"{name}: block {b} fails its xxh3 checksum")
                rows += table.num_rows
            except CorruptStoreError as err:
                report.faults.append(str(err))
            if sums is None:
                report.files_checked += 1
                report.bytes_checked += (self.path / name).stat().st_size
        if self.layout is not None and rows != self.layout.n_examples and not report.faults:
            report.faults.append(
                f"the files hold {rows} examples, {SIDECAR} says {self.layout.n_examples}"
            )
        if non_finite:
            report.notes.append(f"{non_finite} activation values are NaN or infinite")
        return report


def _chunk_values(chunk: Any, context_size: int, d_in: int) -> np.ndarray:
    """``[n * context_size, d_in]`` zero-copy view of an ``Array2D`` record-batch chunk."""
    storage = getattr(chunk, "storage", chunk)
    if storage.null_count:
        raise CorruptStoreError("an activation row is null")
    flat = storage.flatten().flatten()
    if flat.null_count or len(flat) != len(storage) * context_size * d_in:
        raise CorruptStoreError(
            f"a record batch holds {len(flat)} values for {len(storage)} rows of "
            f"({context_size}, {d_in})"
        )
    return flat.to_numpy(zero_copy_only=True).reshape(-1, d_in)


def _sha256(path: Path, progress: Callable[[int], None] | None) -> str:
    hasher = FileHasher("sha256")
    buf = bytearray(IO_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            hasher.update(view[:n])
            if progress is not None:
                progress(n)
    return hasher.hexdigest()
