"""Read a SAELens activation cache: actstore's own, or one ``sae_lens`` itself wrote.

In a store actstore wrote, ``actstore.json`` records where every block's values lie in its
Arrow file (``values_at``): a block (one record batch of one column) is one ranged read of
just those bytes, through the files layer (local disk or ``s3://``), checked against the
root manifest before it is returned; random access (``reader[...]``) and token ids read and
check whole blocks the same way, and ``state.json``, ``dataset_info.json``,
``actstore.json`` and ``statistics.json`` are checked before they are parsed. A cache
``sae_lens`` wrote has none of this: it opens with one warning that its contents cannot be
verified (the root manifest's, logged once per location), and its Arrow files are parsed
with pyarrow (memory-mapped on local disk).

Sites are :class:`~actstore.sites.Site` keys; the columns' TransformerLens hook names
(``blocks.3.hook_resid_post``, ``hook_normalized_resid_post`` for BERT) are the format's own
spelling and are accepted wherever a site is. A column of a foreign cache named after a
Hugging Face module (``transformer.h.1``) denotes no site: its key is a
:class:`~.layout.ColumnSite` spelled as the column, readable but not convertible.

Example:
    >>> import tempfile
    >>> from actstore.testing import FormatCase, make_acts, make_batches, make_plan
    >>> plan, out = make_plan(sites=(Site("resid", 3),)), tempfile.TemporaryDirectory()
    >>> batches = make_batches(plan, make_acts(plan))
    >>> r = SaelensReader(FormatCase("saelens").write(out.name, plan, batches))
    >>> r.sites, r.columns
    ((Site(kind='resid', layer=3),), ('blocks.3.hook_resid_post',))
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import xxhash

from ...batch import CapturePlan
from ...errors import ConfigError, CorruptStoreError, StoreNotFoundError
from ...sites import Site
from ...stats import RunningStats
from ..arrays import LazyRows
from ..base import Block, Extent, ReaderBase, VerifyReport, scratch
from ..metacheck import MAX_COUNT, Fields, is_int
from .layout import (
    BLOCK_BYTES,
    FORMAT_TAG,
    INFO,
    SIDECAR,
    STATE,
    STATISTICS,
    TOKENS,
    ColumnSite,
    SaelensLayout,
    hook_site,
)
from .writer import _ranges
from .writer import _values_at as _values_at_of


def detect(files) -> bool:
    """``state.json`` with actstore's ``actstore.json`` or ``Array2D`` features (a damaged
    ``actstore.json`` is claimed, so the reader names the fault)."""
    if not files.exists(STATE):
        return False
    if files.exists(SIDECAR):
        try:
            doc = files.read_json(SIDECAR)
        except CorruptStoreError:
            return True
        return isinstance(doc, dict) and doc.get("format") == FORMAT_TAG
    if not files.exists(INFO):
        return False
    try:
        features = (files.read_json(INFO) or {}).get("features") or {}
    except (CorruptStoreError, AttributeError):
        return False
    return any(isinstance(f, dict) and f.get("_type") == "Array2D" for f in features.values())


def _features_text(features: Any) -> str:
    """A row's features in brief: ``column: shape dtype`` (``length`` for sequences)."""
    out = []
    for name, feature in features.items():
        shape = getattr(feature, "shape", None) or getattr(feature, "length", None)
        dtype = getattr(feature, "dtype", None) or getattr(
            getattr(feature, "feature", None), "dtype", "?"
        )
        out.append(f"{name}: {shape} {dtype}")
    return ", ".join(out)


class SaelensReader(ReaderBase):
    """Read access to one cache, a directory or ``s3://bucket/prefix``; picklable.

    ``verify_reads``: check everything read against the root manifest. ``cache_dir`` /
    ``cache_bytes`` / ``s3``: the local cache tier and S3 settings of a remote store (see
    :func:`~actstore.storage.files.open_files`).
    """

    format_name = "saelens"

    def open_index(self) -> None:
        """state.json, dataset_info.json and (in actstore's caches) the sidecar, checked."""
        from datasets import Array2D, Features

        if not self.files.exists(STATE):
            raise StoreNotFoundError(
                f"{self.url} holds no saelens store (no {STATE}): a wrong path, a directory not "
                "written by Dataset.save_to_disk, or an unfinished copy (finish it with actstore cp)"
            )
        ours = self.files.exists(SIDECAR)
        self.open_checks(ours=ours)
        state = self.checks.read_json(STATE)
        try:
            self.arrow_files = tuple(str(e["filename"]) for e in state["_data_files"])
            features = Features.from_dict(self.checks.read_json(INFO)["features"])
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise CorruptStoreError(
                f"{self.url}: state.json or dataset_info.json is malformed ({err!r})"
            ) from err
        for name in self.arrow_files:
            if "/" in name or os.sep in name or name.startswith(".") or not self.files.exists(name):
                raise StoreNotFoundError(
                    f"{self.files.url_of(name)} is missing: restore it, finish the copy "
                    "(actstore cp) or re-capture"
                )
        self.columns = tuple(k for k, f in features.items() if isinstance(f, Array2D))
        if not self.columns:
            raise CorruptStoreError(
                f"{self.url} holds no Array2D activation column (columns: {list(features)})"
            )
        if ours:
            self._check_index_files(features)
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
        if ours:
            sites = [Site.parse(s) for s in self._open_own().sites]
        else:  # Integrity.open warned once that it cannot be verified
            sites = [hook_site(c) or ColumnSite(c, -1) for c in self.columns]
        self._column_sites = dict(zip(self.columns, sites))
        self._tables: dict[int, Any] = {}
        self._batch_rows: list[list[int]] | None = None
        self._starts: np.ndarray | None = None
        self._statistics: dict[str, Any] | None = None

    def _check_index_files(self, features: Any) -> None:
        """In a cache actstore wrote, ``dataset_info.json``'s features and ``state.json``
        are what its writer derives from ``actstore.json``'s layout and the files' digests:
        an edited feature (a shape, the token ids' length) or file list is a fault, even
        with the manifest rewritten over it (``actstore.json`` itself is checked against
        the published summary and store id)."""
        source = self.files.url_of(SIDECAR)
        record = self.checks.read_json(SIDECAR)
        if not isinstance(record, dict):
            raise CorruptStoreError(f"{source} is not a JSON object; restore it or re-capture")
        layout = SaelensLayout.from_dict(record.get("layout"), source=source)
        if features != layout.features():
            raise CorruptStoreError(
                f"{self.files.url_of(INFO)}: its features "
                f"({_features_text(features)}) are not the ones {SIDECAR}'s layout gives "
                f"({_features_text(layout.features())}): the file was edited; restore it or "
                "re-capture"
            )
        manifest = self.checks.manifest
        if manifest is None:
            return
        try:
            digests = "".join(manifest.files[n].digest for n in self.arrow_files)
        except KeyError as err:
            raise CorruptStoreError(
                f"{self.files.url_of(STATE)} lists {err}, which the root manifest does not: "
                "the file was edited; restore it or re-capture"
            ) from None
        want: dict[str, Any] = {
            "_data_files": [{"filename": n} for n in self.arrow_files],
            "_fingerprint": xxhash.xxh3_64_hexdigest(digests.encode()),
            "_format_columns": None,
            "_format_kwargs": {},
            "_format_type": None,
            "_output_all_columns": False,
            "_split": None,
        }
        if self.checks.read_json(STATE) != want:
            raise CorruptStoreError(
                f"{self.files.url_of(STATE)} is not what the writer derives from the store's "
                "files (its fingerprint or fields differ): the file was edited; restore it or "
                "re-capture"
            )

    def _open_own(self) -> SaelensLayout:
        source = self.files.url_of(SIDECAR)
        record = self.checks.read_json(SIDECAR)
        layout = SaelensLayout.from_dict(
            Fields(record, source).obj("layout"), source=self.files.url_of(SIDECAR)
        )
        listed = Fields(record, source).obj_list("files")
        for k, entry in enumerate(listed):
            e = Fields(entry, f"{source}: files[{k}]")
            e.text("name")
            e.count("n_examples")
            e.count("bytes")
            at = e._get("values_at", False)
            if not isinstance(at, list) or not all(
                isinstance(a, list) and all(is_int(x) and 0 <= x <= MAX_COUNT for x in a)
                for a in at
            ):
                raise e.fault("values_at", "a list of lists of byte offsets", at)
        if tuple(layout.columns) != self.columns or [e.get("name") for e in listed] != list(
            self.arrow_files
        ):
            raise CorruptStoreError(
                f"{self.url}: {SIDECAR} does not match state.json/dataset_info.json "
                "(files or columns differ); restore the store or re-capture"
            )
        sizes = self.files.list()  # one listing, not a stat per file
        for e in listed:
            if sizes.get(e["name"]) != e.get("bytes"):
                raise CorruptStoreError(
                    f"{self.files.url_of(e['name'])} has {sizes.get(e['name'])} bytes, expected "
                    f"{e.get('bytes')} (truncated or replaced); restore it or re-capture"
                )
        shards = [e["n_examples"] for e in listed]
        want = [layout.shard_range(i)[1] - layout.shard_range(i)[0] for i in range(len(listed))]
        if shards != want or sum(shards) != layout.n_examples:
            raise CorruptStoreError(
                f"{self.url}: {SIDECAR} records {sum(shards)} examples in {shards}, its layout "
                f"{layout.n_examples} in {want}: it was edited; restore it or re-capture"
            )
        self.record, self.layout = record, layout
        return layout

    # ------------------------------------------------------------------ properties

    @property
    def verified(self) -> bool:
        """True for stores with actstore's manifest and statistics."""
        return self.layout is not None and self.checks.manifest is not None

    @property
    def sites(self) -> tuple[Site, ...]:
        return tuple(self._column_sites[c] for c in self.columns)

    def native_site(self, name: Any) -> Site | None:
        return self._column_sites.get(str(name))

    def native_name(self, site: Site) -> str:
        return self.column(site)

    @property
    def family(self) -> str:
        if self.record is not None:
            return str(self.record["plan"].get("family", "unknown"))
        return "unknown"

    def column(self, site: Any) -> str:
        """The column of ``site`` (any spelling, or the column's hook name)."""
        wanted = self.site(site)
        return next(c for c, s in self._column_sites.items() if s == wanted)

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

    def n_rows(self, site: Any) -> int:
        self.site(site)
        return self.n_examples * self.context_size

    def __repr__(self) -> str:
        return (
            f"SaelensReader({self.url!r}, columns={list(self.columns)}, "
            f"context_size={self.context_size}, d_in={self.d_model})"
        )

    # ------------------------------------------------------------------ files

    def _table(self, index: int) -> Any:
        """File ``index`` as a pyarrow Table (foreign caches and verify): memory-mapped on
        local disk, fetched whole from object storage."""
        import pyarrow as pa

        table = self._tables.get(index)
        if table is None:
            name = self.arrow_files[index]
            try:
                table = pa.ipc.open_stream(pa.py_buffer(self.files.map(name))).read_all()
            except (pa.ArrowInvalid, OSError) as err:
                raise CorruptStoreError(
                    f"{self.files.url_of(name)} is not a readable Arrow stream ({err})"
                ) from err
            missing = [c for c in self.columns if c not in table.column_names]
            if missing:
                raise CorruptStoreError(f"{self.files.url_of(name)} lacks the columns {missing}")
            table = self._tables.setdefault(index, table)
        return table

    def _rows(self) -> list[list[int]]:
        """Examples in each record batch of each file."""
        if self._batch_rows is None:
            if self.layout is not None:
                lay = self.layout
                out = []
                for index in range(len(self.arrow_files)):
                    start, stop = lay.shard_range(index)
                    n, per = stop - start, lay.examples_per_block
                    out.append([min(per, n - lo) for lo in range(0, n, per)])
            else:
                out = [
                    [len(b) for b in self._table(i).to_batches()]
                    for i in range(len(self.arrow_files))
                ]
            self._batch_rows = out
        return self._batch_rows

    def _values_at(self, index: int) -> list[list[int]]:
        """Byte offsets of each block column's values per record batch of file ``index``."""
        at = self.record["files"][index]["values_at"]  # type: ignore[index]
        if len(at) != len(self._rows()[index]) or any(
            len(a) != len(self.block_columns) for a in at
        ):
            raise CorruptStoreError(
                f"{self.files.url_of(SIDECAR)}: values_at of {self.arrow_files[index]} does not "
                "match its record batches; restore the store or re-capture"
            )
        entry = self.checks.entry(self.arrow_files[index])
        if entry is not None and entry.ranges is not None and self.layout is not None:
            # each block's values where the published blocks are, in the writer's order
            flat = [x for a in at for x in a]
            blocks = _ranges(at, self.layout, self.record["files"][index]["n_examples"])  # type: ignore[index]
            if flat != sorted(set(flat)) or not set(blocks) <= set(entry.ranges):
                raise CorruptStoreError(
                    f"{self.files.url_of(SIDECAR)}: values_at of {self.arrow_files[index]} "
                    "does not point at the blocks the root manifest publishes: it was edited; "
                    "restore it or re-capture"
                )
        return at

    def close(self) -> None:
        """Drop memory maps and fetched files (reopened on next use)."""
        self._tables = {}
        self.files.close()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tables": {}}

    # ------------------------------------------------------------------ blocks

    def site_blocks(self, site: Site) -> list[Block]:
        """Every row of ``site`` once, in storage order. A block is one record batch (split
        into runs of about 2 MiB in foreign caches, whose batches can be large);
        ``loc = (file, batch, first example in batch, n examples, column)``."""
        column = self.columns.index(self.column(site))
        t = self.context_size
        per = max(1, BLOCK_BYTES // (t * self.d_model * self.dtype.itemsize))
        out = []
        for f, rows in enumerate(self._rows()):
            for b, n in enumerate(rows):
                step = n if self.layout is not None else per
                for lo in range(0, n, step):
                    k = min(step, n - lo)
                    out.append(Block(site=site, n_rows=k * t, loc=(f, b, lo, k, column)))
        return out

    def _block_values(
        self, f: int, b: int, k_col: int, out: np.ndarray | None = None
    ) -> np.ndarray:
        """The values of block column ``k_col`` of record batch ``b`` of file ``f`` (in an
        actstore store: one ranged read, checked), as a flat array."""
        name = self.arrow_files[f]
        n = self._rows()[f][b]
        column = self.block_columns[k_col]
        if self.layout is None:
            chunk = self._table(f).column(column).chunk(b)
            if column == TOKENS:
                return chunk.flatten().to_numpy(zero_copy_only=False).astype(np.int32)
            return _chunk_values(chunk, self.context_size, self.d_model).reshape(-1)
        dtype = np.dtype("<i4") if column == TOKENS else self.dtype
        width = self.context_size if column == TOKENS else self.context_size * self.d_model
        if out is None:
            out = scratch(n, width, dtype).reshape(-1)
        start = self._values_at(f)[b][k_col]
        self.files.read_range(name, start, out.nbytes, out)
        self.checks.check(name, start, out)
        return out

    def block_extent(self, block: Block) -> Extent | None:
        """In a store actstore wrote, a block is one record batch's values of one column:
        raw rows at a known offset of its Arrow file (caches other tools wrote: None)."""
        f, b, lo, _, col = block.loc
        if self.layout is None or lo:
            return None
        dtype = torch.from_numpy(np.empty(0, dtype=self.dtype)).dtype
        return Extent(name=self.arrow_files[f], offset=self._values_at(f)[b][col], dtype=dtype)

    def read_block(self, block: Block, out: np.ndarray | None = None) -> np.ndarray:
        """Rows of ``block`` as ``[n_rows, D]`` in :attr:`dtype` (into ``out`` if given)."""
        f, b, lo, k, col = block.loc
        t, d = self.context_size, self.d_model
        if self.layout is not None:  # blocks are whole record batches: read into place
            if out is None:
                out = np.empty((block.n_rows, d), dtype=self.dtype)
            if out.flags.c_contiguous and out.dtype == self.dtype:
                self._block_values(f, b, col, out=out.reshape(-1))
                return out
        values = self._block_values(f, b, col).reshape(-1, d)[lo * t : (lo + k) * t]
        if out is None:
            return values.copy()
        np.copyto(out, values, casting="same_kind")
        return out

    # ------------------------------------------------------------------ random access

    def read_examples(
        self, examples: np.ndarray, sites: Sequence[Site], tokens: slice | np.ndarray
    ) -> np.ndarray:
        """Each record batch holding an example asked for is read (and checked) whole, every
        site of it in one ranged read."""
        columns = [self.columns.index(self.column(site)) for site in sites]
        t, d = self.context_size, self.d_model
        buf = np.empty((len(examples), len(columns), t, d), dtype=self.dtype)
        files, batches, rows = self._locate(examples)
        for fb in sorted(set(zip(files.tolist(), batches.tolist()))):
            mine = np.flatnonzero((files == fb[0]) & (batches == fb[1]))
            for j, values in enumerate(self._batch_columns(fb[0], fb[1], columns)):
                buf[mine, j] = values.reshape(-1, t, d)[rows[mine]]
        return buf[:, :, tokens]

    def _batch_columns(self, f: int, b: int, columns: list[int]) -> list[np.ndarray]:
        """The values of ``columns`` of record batch ``b`` of file ``f``: in an actstore
        store, one ranged read from the first column's values to the last's, checked whole
        (the Arrow buffers between them are manifest blocks too), so a row of every site
        costs one request."""
        if self.layout is None or len(columns) == 1:
            return [self._block_values(f, b, c) for c in columns]
        name, n = self.arrow_files[f], self._rows()[f][b]
        at = self._values_at(f)[b]
        size = n * self.context_size * self.d_model * self.dtype.itemsize
        lo = min(at[c] for c in columns)
        span = np.empty(max(at[c] for c in columns) + size - lo, dtype=np.uint8)
        self.files.read_range(name, lo, span.nbytes, span)
        self.checks.check(name, lo, span)
        return [span[at[c] - lo : at[c] - lo + size].view(self.dtype) for c in columns]

    def _locate(self, examples: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """File, record batch and row in it of each example."""
        if self._starts is None:
            spans = [(f, b, n) for f, rows in enumerate(self._rows()) for b, n in enumerate(rows)]
            self._spans = np.array([(f, b) for f, b, _ in spans], dtype=np.int64).reshape(-1, 2)
            self._starts = np.cumsum([0] + [n for _, _, n in spans])[:-1]
        k = np.searchsorted(self._starts, examples, side="right") - 1
        return self._spans[k, 0], self._spans[k, 1], examples - self._starts[k]

    # ------------------------------------------------------------------ statistics, tokens

    def stored_record(self) -> tuple[str, Any] | None:
        """``actstore.json`` less its file list: the writer's capture record."""
        if self.layout is None or not self.files.exists(SIDECAR):
            return None
        doc = self.files.read_json(SIDECAR)
        if not isinstance(doc, dict):
            return None
        return SIDECAR, {k: v for k, v in doc.items() if k != "files"}

    def statistics_record(self, site: Site) -> Any:
        if self.site_statistics(site) is None:
            return None
        return self._statistics["sites"][str(site)]  # type: ignore[index]

    def statistics_shards(self) -> list[int] | None:
        """Rows of each Arrow file (one writer shard each); None for a cache without
        actstore's statistics and manifest."""
        if self.layout is None or self.checks.manifest is None:
            return None
        if not self.files.exists(STATISTICS):
            return None
        return [sum(rows) * self.context_size for rows in self._rows()]

    def site_statistics(self, site: Site) -> RunningStats | None:
        """Exact statistics of ``site`` (None for caches without actstore's sidecars)."""
        if self.layout is None or not self.files.exists(STATISTICS):
            return None
        if self._statistics is None:
            self._statistics = self.checks.read_json(STATISTICS)
        try:
            return RunningStats.from_dict(self._statistics["sites"][str(site)])
        except (KeyError, TypeError) as err:
            raise CorruptStoreError(
                f"{self.files.url_of(STATISTICS)} has no statistics of {site}"
            ) from err

    @property
    def tokens(self) -> LazyRows | None:
        """Token ids ``[n_examples, context_size]`` (int32), read (and checked) by record
        batch as they are indexed, or None without that column."""
        if not self.has_tokens:
            return None
        return _TokenRows(self)

    # ------------------------------------------------------------------ conversion

    def capture_plan(self) -> CapturePlan:
        """The capture that produced the store (pieced together for foreign caches; a
        :class:`ConfigError` when a column names no actstore site, see :class:`ColumnSite`)."""
        if self.record is not None:
            try:
                plan = CapturePlan.from_json_dict(dict(self.record["plan"]))
                # a cache keeps activations and token ids, not class labels
                return dataclasses.replace(plan, has_labels=False, classes=None)
            except (KeyError, TypeError, ValueError) as err:
                raise CorruptStoreError(
                    f"{self.files.url_of(SIDECAR)}: bad plan record ({err})"
                ) from err
        unnamed = [str(s) for s in self.sites if isinstance(s, ColumnSite)]
        if unnamed:
            raise ConfigError(
                f"{self.url}: columns {unnamed} have no actstore site name (Hugging Face module "
                "names), so it cannot be converted; read them by name, or cache with "
                "TransformerLens hook names (blocks.L.hook_resid_post)"
            )
        return self._foreign_plan()

    def _foreign_plan(self) -> CapturePlan:
        """What is known of the capture behind a cache actstore did not write."""
        sites = self.sites
        named = [s.layer for s in sites if not isinstance(s, ColumnSite)]
        return CapturePlan(
            ckpt="unknown",
            family="unknown",
            modality="text",
            sites=sites,
            n_model_layers=max(named, default=0) + 1,
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
        """:meth:`ReaderBase.describe`; a foreign cache whose columns name no actstore site
        has no capture plan to convert from, but is described all the same."""
        if self.record is not None or not any(isinstance(s, ColumnSite) for s in self.sites):
            return super().describe()
        described = copy.copy(self)
        described.capture_plan = self._foreign_plan  # type: ignore[method-assign]
        return ReaderBase.describe(described)

    def describe_format(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": "SAELens activation cache (datasets save_to_disk)"
            + ("" if self.verified else ", not written by actstore: unverified"),
            "shape": (
                f"{self.n_examples} examples x {self.context_size} tokens x {self.d_model} dims "
                f"({self.dtype.name}) per site"
            ),
            "columns": list(self.columns),
            "n_examples": self.n_examples,
            "context_size": self.context_size,
        }
        if self.layout is not None:
            out["blocks"] = f"{self.layout.examples_per_block} examples per Arrow record batch"
        return out

    def scan_chunk(self, name: str, offset: int, data: memoryview) -> None:
        """Count non-finite activation values in the value ranges the chunk overlaps."""
        if self.layout is None or name not in self.arrow_files:
            return
        f = self.arrow_files.index(name)
        item = self.dtype.itemsize
        column_bytes = self.context_size * self.d_model * item
        scan = self.__dict__.setdefault("_scan", {"non_finite": 0})
        end = offset + len(data)
        for b, starts in enumerate(self._values_at(f)):
            size = self._rows()[f][b] * column_bytes
            for start in starts[: len(self.columns)]:
                lo, hi = max(start, offset), min(start + size, end)
                if hi > lo:
                    values = np.frombuffer(data[lo - offset : hi - offset], dtype=self.dtype)
                    scan["non_finite"] += int(values.size - np.count_nonzero(np.isfinite(values)))

    def verify_content(self, report: VerifyReport) -> None:
        """Row counts against the layout (and, for foreign caches, each file parsed); in
        actstore's caches, what the sidecar says of each Arrow file against the file."""
        scan = self.__dict__.pop("_scan", {"non_finite": 0})
        non_finite = scan["non_finite"]
        if self.layout is not None:
            report.faults += self._sidecar_faults()
        if self.layout is None:
            for f, name in enumerate(self.arrow_files):
                try:
                    table = self._table(f)
                    for column in self.columns:
                        for chunk in table.column(column).chunks:
                            values = _chunk_values(chunk, self.context_size, self.d_model)
                            non_finite += int(values.size - np.count_nonzero(np.isfinite(values)))
                except CorruptStoreError as err:
                    report.faults.append(str(err))
                report.files_checked += 1
                report.bytes_checked += self.files.require(name)
        elif not self.files.exists(STATISTICS):
            report.faults.append(
                f"{STATISTICS} is missing: actstore's writer stores every site's statistics; "
                "restore it or re-capture"
            )
        else:  # the statistics against the shapes
            try:
                for site in self.sites:
                    stats = self.site_statistics(site)
                    want = self.n_rows(site)
                    if stats is None or stats.count != want or stats.d != self.d_model:
                        raise CorruptStoreError(
                            f"{site} counts {stats and stats.count} rows of width "
                            f"{stats and stats.d}, expected {want} of {self.d_model}"
                        )
                    if stats.mean.shape != (stats.d,) or stats.m2.shape != (stats.d,):
                        raise CorruptStoreError(f"{site} has vectors of the wrong length")
            except (CorruptStoreError, KeyError, TypeError, AttributeError, ValueError) as err:
                report.faults.append(f"{STATISTICS} is malformed: {err}")
        if non_finite:
            report.notes.append(f"{non_finite} activation values are NaN or infinite")

    def _sidecar_faults(self) -> list[str]:
        """``actstore.json``'s ``values_at`` recomputed from each Arrow file with the
        writer's own code, and ``dataset_info.json``'s fields besides the features empty
        (as the writer leaves them)."""
        faults = []
        info = self.files.read_json(INFO)
        text = ("citation", "description", "homepage", "license")  # "" as datasets writes
        filled = sorted(
            k
            for k, v in info.items()
            if k != "features" and (v != "" if k in text else v not in ("", None, {}, []))
        )
        if filled:
            faults.append(
                f"{INFO}: {', '.join(filled)} {'is' if len(filled) == 1 else 'are'} set, where "
                "actstore's writer leaves them empty: the file was edited; restore it or "
                "re-capture"
            )
        import pyarrow as pa

        if self.layout is None or self.record is None:
            return faults
        for f, name in enumerate(self.arrow_files):
            try:
                got = _values_at_of(self.files.map(name), self.layout)
            except (pa.ArrowException, ValueError, OSError, KeyError, IndexError) as err:
                faults.append(f"{name} is not a readable Arrow stream ({err!r})")
                continue
            if got != self.record["files"][f]["values_at"]:
                faults.append(
                    f"{SIDECAR}: values_at of {name} is not where the file holds its values: "
                    "it was edited; restore it or re-capture"
                )
        return faults


class _TokenRows(LazyRows):
    """A saelens store's token ids, read by record batch as they are indexed."""

    def __init__(self, reader: SaelensReader) -> None:
        super().__init__("<i4", (reader.n_examples, reader.context_size))
        self.reader = reader

    def rows(self, index: np.ndarray) -> np.ndarray:
        r = self.reader
        out = np.empty((len(index), r.context_size), dtype=np.int32)
        files, batches, rows = r._locate(index)
        k_tok = r.block_columns.index(TOKENS)
        for fb in sorted(set(zip(files.tolist(), batches.tolist()))):
            mine = np.flatnonzero((files == fb[0]) & (batches == fb[1]))
            values = np.asarray(r._block_values(fb[0], fb[1], k_tok)).reshape(-1, r.context_size)
            out[mine] = values[rows[mine]]
        return out


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
