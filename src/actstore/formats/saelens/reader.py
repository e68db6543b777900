"""Read a SAELens activation cache: actstore's own, or one ``sae_lens`` itself wrote.

The Arrow files are memory-mapped with pyarrow (as ``datasets`` does), so a block read is
one copy out of the page cache. On object storage (``s3://bucket/prefix``) a block is one
ranged GET of just its values, whose place in the file ``actstore.json`` records
(``values_at``); whole blocks are checked against their xxh3-64 as they arrive, locally
and remotely alike. ``state.json``, the index ``datasets`` opens first, is the manifest:
a prefix without it is refused. A store actstore wrote carries sidecars: file sizes are
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
import threading
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
    IndexOutOfRangeError,
    LayerNotStoredError,
    StoreNotFoundError,
)
from ...sites import Site
from ...stats import RunningStats
from ...storage import FileHasher, read_json
from ...storage.files import StoreFiles, open_files
from ...storage.local import IO_CHUNK
from ...storage.object import S3Config
from ..base import Block, ReaderBase, VerifyReport
from .layout import (
    BLOCK_BYTES,
    CHECKSUMS,
    FORMAT_TAG,
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
    """Read access to one cache, a directory or ``s3://bucket/prefix``; picklable (memory
    maps, S3 clients and threads reopen per process).

    ``verify_reads``: check every whole block read against its xxh3-64 in
    ``checksums.json``. ``cache_dir`` / ``cache_bytes`` / ``s3``: the local cache tier and
    S3 settings of a remote store (see :func:`~actstore.storage.files.open_files`).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        verify_reads: bool = True,
        cache_dir: str | os.PathLike | None = None,
        cache_bytes: int | str | None = None,
        s3: S3Config | None = None,
    ) -> None:
        from datasets import Array2D, Features

        self.io: StoreFiles = open_files(path, cache_dir=cache_dir, cache_bytes=cache_bytes, s3=s3)
        self.remote = self.io.local_path is None
        self.url = self.io.url
        self.path = self.io.local_path or Path(self.url.rstrip("/").rpartition("/")[2])
        self.verify_reads = verify_reads
        if self.path.name.endswith(".partial") or self.io.exists(PROGRESS):
            raise CorruptStoreError(
                f"{self.url} is an unfinished capture (a .partial directory): rerun the same "
                "capture command to resume and publish it"
            )
        if not self.remote and not self.path.is_dir():
            raise StoreNotFoundError(f"{self.path} is not a directory (a SAELens cache)")
        if not self.io.exists(STATE):
            raise StoreNotFoundError(
                f"{self.url} holds no saelens store (no {STATE}): an unfinished upload or a "
                "wrong URL; finish the copy (actstore cp) or fix the URL"
                if self.remote
                else f"{self.path / STATE} does not exist; is {self.path} a dataset saved with "
                "save_to_disk?"
            )
        state = self._json(STATE)
        try:
            self.files = tuple(str(e["filename"]) for e in state["_data_files"])
            features = Features.from_dict(self._json(INFO)["features"])
        except (KeyError, TypeError, ValueError) as err:
            raise CorruptStoreError(
                f"{self.url}: state.json or dataset_info.json is malformed ({err!r})"
            ) from err
        for name in self.files:
            if "/" in name or os.sep in name or name.startswith(".") or not self.io.exists(name):
                raise StoreNotFoundError(
                    f"{self.io.url_of(name)} is missing; "
                    + (
                        "finish the upload (actstore cp) or re-capture"
                        if self.remote
                        else "restore it or re-capture"
                    )
                )
        self.columns = tuple(k for k, f in features.items() if isinstance(f, Array2D))
        if not self.columns:
            raise CorruptStoreError(
                f"{self.url} holds no Array2D activation column (columns: {list(features)})"
            )
        shapes = {tuple(features[c].shape) for c in self.columns}
        dtypes = {features[c].dtype for c in self.columns}
        if len(shapes) > 1 or len(dtypes) > 1:
            raise ConfigError(
                f"{self.url}: columns differ in shape or dtype ({shapes}, {dtypes}); "
                "actstore reads caches whose hooks share (context_size, d_in) and dtype"
            )
        (self.context_size, self._d_in), (dtype,) = shapes.pop(), dtypes
        self._dtype = np.dtype(dtype)
        self.has_tokens = TOKENS in features
        self.block_columns = (*self.columns, *((TOKENS,) if self.has_tokens else ()))
        self.record: dict[str, Any] | None = None
        self.layout: SaelensLayout | None = None
        if self.io.exists(SIDECAR):
            self._open_own()
        else:
            warnings.warn(
                f"{self.url} has no actstore sidecars (a cache sae_lens wrote?): its contents "
                "cannot be verified and it has no stored statistics",
                UnverifiedStoreWarning,
                stacklevel=2,
            )
        self._tables: dict[int, Any] = {}
        self._batch_rows: list[list[int]] | None = None
        self._checked_at: dict[int, list[list[int]] | None] = {}  # _values_at, per file
        self._starts: np.ndarray | None = None
        self._digests: dict[str, Any] | None = None
        self._tokens: np.ndarray | None = None
        self._pid = os.getpid()

    def _json(self, name: str) -> Any:
        """A JSON file of the store (local errors name the path; remote ones the URL)."""
        return self.io.read_json(name) if self.remote else read_json(self.path / name)

    def _open_own(self) -> None:
        record = self._json(SIDECAR)
        layout = SaelensLayout.from_dict(record.get("layout"), source=self.io.url_of(SIDECAR))
        listed = record.get("files") or []
        if tuple(layout.columns) != self.columns or [e.get("name") for e in listed] != list(
            self.files
        ):
            raise CorruptStoreError(
                f"{self.url}: {SIDECAR} does not match state.json/dataset_info.json "
                "(files or columns differ); restore the store or re-capture"
            )
        if self.remote:  # every sidecar is in before a store counts as uploaded
            for name in (CHECKSUMS, STATISTICS):
                if not self.io.exists(name):
                    raise StoreNotFoundError(
                        f"{self.io.url_of(name)} is missing: an unfinished upload; finish the "
                        "copy (actstore cp) or re-capture"
                    )
        for entry in listed:
            size = self.io.size(entry["name"])
            if size != entry.get("bytes"):
                raise CorruptStoreError(
                    f"{self.io.url_of(entry['name'])} has {size} bytes, expected "
                    f"{entry.get('bytes')} (truncated or replaced); restore it or re-capture"
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
            f"SaelensReader({self.url!r}, columns={list(self.columns)}, "
            f"context_size={self.context_size}, d_in={self.d_model})"
        )

    # ------------------------------------------------------------------ files

    def _table(self, index: int) -> Any:
        """File ``index`` as a pyarrow Table (one chunk per record batch): memory-mapped on
        local disk; on object storage the whole file is fetched (only caches without
        actstore's ``values_at`` and ``verify()`` need that)."""
        import pyarrow as pa

        if os.getpid() != self._pid:  # forked: maps are the parent's
            self._tables, self._pid = {}, os.getpid()
        table = self._tables.get(index)
        if table is None:
            name = self.files[index]
            if self.remote:
                data = self.io.read_range(name, 0, self.io.require(name))
            else:
                try:
                    data = pa.memory_map(str(self.path / name))
                except OSError as err:
                    raise CorruptStoreError(f"{self.path / name} cannot be read ({err})") from err
            table = self._parse(name, data)
            table = self._tables.setdefault(index, table)
        return table

    def _parse(self, name: str, data: Any) -> Any:
        """The Arrow stream in ``data`` (a memory map or buffer) as a Table."""
        import pyarrow as pa

        source = data if isinstance(data, pa.MemoryMappedFile) else pa.py_buffer(data)
        try:
            table = pa.ipc.open_stream(source).read_all()
        except (pa.ArrowInvalid, OSError) as err:
            raise CorruptStoreError(
                f"{self.io.url_of(name)} is not a readable Arrow stream ({err})"
            ) from err
        missing = [c for c in self.columns if c not in table.column_names]
        if missing:
            raise CorruptStoreError(f"{self.io.url_of(name)} lacks the columns {missing}")
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

    def _values_at(self, index: int) -> list[list[int]] | None:
        """Byte offsets of each block column's values per record batch of file ``index``
        (from ``actstore.json``; None for caches without them), checked against the
        record batches once per file (every block read asks)."""
        if index in self._checked_at:
            return self._checked_at[index]
        at = None if self.record is None else self.record["files"][index].get("values_at")
        if at is not None and (
            len(at) != len(self._rows()[index])
            or any(len(a) != len(self.block_columns) for a in at)
        ):
            raise CorruptStoreError(
                f"{self.io.url_of(SIDECAR)}: values_at of {self.files[index]} does not match "
                "its record batches; restore the store or re-capture"
            )
        return self._checked_at.setdefault(index, at)

    def close(self) -> None:
        """Drop memory maps and fetched files (reopened on next use)."""
        self._tables = {}
        if os.getpid() == self._pid:
            self.io.close()

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
        """``[n_rows, D]`` rows of ``block``: a view of the memory map, or (on object
        storage) of one ranged read of just those bytes. Whole record batches are checked
        against their xxh3-64 in ``checksums.json``."""
        f, b, lo, k = block.loc
        column = self.column(block.site)
        t, d = self.context_size, self.d_model
        at = self._values_at(f)
        if at is not None:  # one read of exactly the block's bytes (no Arrow parsing)
            row_bytes = t * d * self.dtype.itemsize
            start = at[b][self.block_columns.index(column)] + lo * row_bytes
            if self.remote:
                view = self.io.read_view(self.files[f], start, k * row_bytes)
            else:  # pread into a per-thread buffer: cold reads at the disk's pace, unlike
                # page faults on a memory map (measured ~3x faster over a cold store)
                view = self.io.read_range(
                    self.files[f], start, k * row_bytes, out=_scratch(k * row_bytes)
                )
            values = np.frombuffer(view, dtype=self.dtype).reshape(-1, d)
        else:
            chunk = self._table(f).column(column).chunk(b)
            values = _chunk_values(chunk, t, d)[lo * t : (lo + k) * t]
        if values.shape[0] != block.n_rows:
            raise CorruptStoreError(f"{self.io.url_of(self.files[f])}: block is short")
        if lo == 0 and k == self._rows()[f][b]:
            self._check(f, b, column, values)
        return values

    def _check(self, f: int, b: int, column: str, values: np.ndarray) -> None:
        """Raise unless ``values`` (all of ``column`` in batch ``b`` of file ``f``) match
        their xxh3-64 in ``checksums.json`` (stores actstore wrote, ``verify_reads``)."""
        if not self.verify_reads or self.layout is None:
            return
        if self._digests is None:
            sums = self._json(CHECKSUMS) if self.io.exists(CHECKSUMS) else {}
            self._digests = (sums.get("blocks") or {}) if isinstance(sums, dict) else {}
        blocks = self._digests.get(self.files[f])
        if blocks is None:
            return
        want = blocks[b][self.block_columns.index(column)] if b < len(blocks) else None
        if xxhash.xxh3_64_hexdigest(np.ascontiguousarray(values).data) != want:
            raise CorruptStoreError(
                f"{self.io.url_of(self.files[f])}: block {b} of {column} fails its xxh3 "
                "checksum: the stored data was changed or damaged; restore the file or "
                "re-capture (verify_reads=False reads it anyway)"
            )

    def read_block(self, block: Block, out: np.ndarray | None = None) -> np.ndarray:
        """Rows of ``block`` as ``[n_rows, D]`` in :attr:`dtype` (into ``out`` if given)."""
        values = self._values(block)
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

    # ------------------------------------------------------------------ random access

    def __getitem__(self, key: Any) -> np.ndarray:
        """``reader[example, site, token]``: example and token take ints, slices or int
        arrays; site is one column (any spelling :meth:`column` takes) or ``:`` for all.
        On object storage only the bytes of the tokens asked for are fetched."""
        if not isinstance(key, tuple):
            key = (key,)
        if len(key) > 3:
            raise IndexError("index as reader[example, site, token]")
        ex, site, token = (*key, *(slice(None),) * (3 - len(key)))
        examples = _indices(ex, self.n_examples, "example")
        if isinstance(site, slice):
            if site != slice(None):
                raise IndexError("sites are selected by name (reader[ex, 'resid.3']) or all (:)")
            columns = list(self.columns)
        else:
            columns = [self.column(site)]
        t, d = self.context_size, self.d_model
        picked = _indices(token, t, "token")
        t0, t1 = (int(picked.min()), int(picked.max()) + 1) if picked.size else (0, 0)
        buf = np.empty((len(examples), len(columns), t1 - t0, d), dtype=self.dtype)
        if t1 > t0 and len(examples):
            self._read_spans(examples, columns, t0, t1, buf)
        out = buf[:, :, picked - t0]
        if not isinstance(site, slice):
            out = out[:, 0]
        if isinstance(token, (int, np.integer)):
            out = out[..., 0, :]
        return out[0] if isinstance(ex, (int, np.integer)) else out

    def _locate(self, examples: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """File, record batch and row in it of each example."""
        if self._starts is None:
            spans = [(f, b, n) for f, rows in enumerate(self._rows()) for b, n in enumerate(rows)]
            self._spans = np.array([(f, b) for f, b, _ in spans], dtype=np.int64).reshape(-1, 2)
            self._starts = np.cumsum([0] + [n for _, _, n in spans])[:-1]
        k = np.searchsorted(self._starts, examples, side="right") - 1
        return self._spans[k, 0], self._spans[k, 1], examples - self._starts[k]

    def _read_spans(
        self, examples: np.ndarray, columns: list[str], t0: int, t1: int, buf: np.ndarray
    ) -> None:
        """Tokens ``[t0, t1)`` of each example and column into ``buf[i, j]``."""
        t, d = self.context_size, self.d_model
        files, batches, rows = self._locate(examples)
        for f in np.unique(files):
            mine = np.flatnonzero(files == f)
            at = self._values_at(int(f)) if self.remote else None
            if at is not None:  # one merged set of ranged GETs per file
                item = self.dtype.itemsize
                ranges = [
                    (
                        at[batches[i]][self.block_columns.index(c)] + (rows[i] * t + t0) * d * item,
                        buf[i, j],
                    )
                    for i in mine
                    for j, c in enumerate(columns)
                ]
                self.io.read_ranges(self.files[f], ranges)
                continue
            table = self._table(int(f))
            for i in mine:
                for j, c in enumerate(columns):
                    values = _chunk_values(table.column(c).chunk(int(batches[i])), t, d)
                    buf[i, j] = values[rows[i] * t + t0 : rows[i] * t + t1]

    # ------------------------------------------------------------------ statistics, tokens

    def statistics(self, site: Hashable) -> RunningStats | None:
        """Exact statistics of ``site`` (None for caches without actstore's sidecars)."""
        column = self.column(site)
        if self.layout is None or not self.io.exists(STATISTICS):
            return None
        index = self.columns.index(column)
        return RunningStats.from_dict(self._json(STATISTICS)["sites"][self.layout.sites[index]])

    @property
    def tokens(self) -> np.ndarray | None:
        """Token ids ``[n_examples, context_size]`` (int32), or None without that column."""
        if not self.has_tokens:
            return None
        if self._tokens is not None:
            return self._tokens
        parts = []
        for f in range(len(self.files)):
            at = self._values_at(f) if self.remote else None
            if at is not None:  # just the token bytes of each record batch
                counts = self._rows()[f]
                got = [np.empty(n * self.context_size, dtype="<i4") for n in counts]
                self.io.read_ranges(self.files[f], [(a[-1], g) for a, g in zip(at, got)])
                for b, values in enumerate(got):
                    self._check(f, b, TOKENS, values)
                parts += [g.reshape(-1, self.context_size) for g in got]
                continue
            column = self._table(f).column(TOKENS)
            for chunk in column.chunks:
                flat = chunk.flatten().to_numpy(zero_copy_only=False)
                parts.append(flat.reshape(-1, self.context_size))
        if not parts:
            return np.empty((0, self.context_size), dtype=np.int32)
        tokens = np.concatenate(parts).astype(np.int32, copy=False)
        if self.remote:
            self._tokens = tokens
        return tokens

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
        files = {n: size for n, size in self.io.list().items() if "/" not in n}
        plan = (self.record or {}).get("plan") or {}
        out: dict[str, Any] = {
            "path": self.url,
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
            "files": sorted(files),
            "bytes": sum(files.values()),
        }
        if self.layout is not None:
            out["blocks"] = f"{self.layout.examples_per_block} examples per Arrow record batch"
        if self.has_tokens and self.n_examples:
            out["token_ids[0][:16]"] = self.tokens[0, :16].tolist()
        return out

    def verify(self, *, progress: Callable[[int], None] | None = None) -> VerifyReport:
        """Re-hash every file (sha256) and block (xxh3-64) against ``checksums.json``,
        check row counts and shapes, count non-finite values. A cache without actstore's
        sidecars gets the structural checks and a note. On object storage each file is
        fetched once (one file in memory at a time)."""
        report = VerifyReport(self.url)
        sums = None
        if self.layout is None:
            report.notes.append(
                "no actstore checksums (a cache sae_lens wrote): contents unverified"
            )
        elif not self.io.exists(CHECKSUMS):
            report.faults.append(f"{CHECKSUMS} is missing")
        else:
            sums = self._json(CHECKSUMS)
            for name, digest in sums.get("files", {}).items():
                if not self.io.exists(name):
                    report.faults.append(f"{name} is listed in {CHECKSUMS} but missing")
                    continue
                if self.remote and name in self.files:
                    continue  # hashed below, from the one download of the file
                if _sha256(self.io.iter_chunks(name), progress) != digest:
                    report.faults.append(f"{name}: checksum mismatch (stored data was changed)")
                report.files_checked += 1
                report.bytes_checked += self.io.require(name)
            for name in self.files:
                if name not in sums.get("files", {}):
                    report.faults.append(f"{name} has no checksum in {CHECKSUMS}")
        non_finite, rows = 0, 0
        for f, name in enumerate(self.files):
            try:
                if self.remote:  # one download per file: sha256 and blocks from memory
                    data = self.io.read_range(name, 0, self.io.require(name), cache=False)
                    table = self._parse(name, data)
                    if sums is not None and name in sums.get("files", {}):
                        if _sha256(data, progress) != sums["files"][name]:
                            report.faults.append(
                                f"{name}: checksum mismatch (stored data was changed)"
                            )
                        report.files_checked += 1
                        report.bytes_checked += len(data)
                else:
                    table = self._table(f)
                expected = None if sums is None else sums["blocks"].get(name, [])
                n_batches = table.column(self.columns[0]).num_chunks
                if expected is not None and len(expected) != n_batches:
                    report.faults.append(
                        f"{name}: {len(expected)} block checksums, {n_batches} blocks"
                    )
                    expected = None
                for b in range(n_batches):
                    digests = []
                    for column in self.block_columns:
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
                report.bytes_checked += self.io.require(name)
        if self.layout is not None and rows != self.layout.n_examples and not report.faults:
            report.faults.append(
                f"the files hold {rows} examples, {SIDECAR} says {self.layout.n_examples}"
            )
        if non_finite:
            report.notes.append(f"{non_finite} activation values are NaN or infinite")
        return report


def _sha256(data: Any, progress: Callable[[int], None] | None) -> str:
    """sha256 of ``data`` (an iterable of buffers, or one buffer) with ``progress(n)``."""
    hasher = FileHasher("sha256")
    pieces = [data] if isinstance(data, memoryview) else data
    for piece in pieces:
        for start in range(0, len(piece), IO_CHUNK):
            chunk = piece[start : start + IO_CHUNK]
            hasher.update(chunk)
            if progress is not None:
                progress(len(chunk))
    return hasher.hexdigest()


def _indices(key: Any, n: int, what: str) -> np.ndarray:
    """``key`` (int, slice or int array) as an array of indices into ``range(n)``."""
    if isinstance(key, slice):
        return np.arange(n)[key]
    picked = np.asarray(key)
    if picked.dtype == bool or not np.issubdtype(picked.dtype, np.integer):
        raise IndexError(f"{what} indices must be ints, slices or int arrays")
    picked = picked.reshape(-1)
    if picked.size and (picked.min() < -n or picked.max() >= n):
        raise IndexOutOfRangeError(f"{what} index out of range (0..{n - 1})")
    return picked % n if n else picked


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


def detect_remote(location: str) -> bool:
    """Whether ``s3://bucket/prefix`` holds a saelens store: its manifest ``state.json`` and
    an actstore sidecar or ``Array2D`` features (HEADs and one small GET)."""
    from ...storage.object import join_key, open_location

    store, prefix = open_location(location)
    if store.size(join_key(prefix, STATE)) is None:
        return False
    for name in (SIDECAR, INFO):
        if store.size(join_key(prefix, name)) is None:
            continue
        try:
            doc = store.get_json(join_key(prefix, name))
        except CorruptStoreError:
            return True  # let the reader report the damaged file
        if name == SIDECAR:
            return isinstance(doc, dict) and doc.get("format") == FORMAT_TAG
        features = (doc.get("features") if isinstance(doc, dict) else None) or {}
        return any(isinstance(f, dict) and f.get("_type") == "Array2D" for f in features.values())
    return False


_LOCAL = threading.local()


def _scratch(nbytes: int) -> np.ndarray:
    """A per-thread byte buffer of ``nbytes`` (reused: no fresh pages to fault in per block)."""
    buf = getattr(_LOCAL, "buf", None)
    if buf is None or len(buf) < nbytes:
        buf = _LOCAL.buf = np.empty(nbytes, dtype=np.uint8)
    return buf[:nbytes]
