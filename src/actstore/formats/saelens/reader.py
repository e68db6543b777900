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

:class:`SaelensReader` is built in layers: :mod:`.index` (the index files, checked, and the
Arrow files), :mod:`.verify` (``verify``'s scan and content checks); this module adds
blocks, random access, statistics, token ids, conversion and ``describe``.

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
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ...batch import CapturePlan
from ...errors import ConfigError, CorruptStoreError
from ...sites import Site
from ...stats import RunningStats
from ..arrays import LazyRows
from ..base import ReaderBase
from ..blocks import Block, Extent, scratch
from .index import _chunk_values
from .layout import BLOCK_BYTES, FORMAT_TAG, INFO, SIDECAR, STATE, STATISTICS, TOKENS, ColumnSite
from .verify import SaelensVerify


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


class SaelensReader(SaelensVerify):
    """Read access to one cache, a directory or ``s3://bucket/prefix``; picklable.

    ``verify_reads``: check everything read against the root manifest. ``cache_dir`` /
    ``cache_bytes`` / ``s3``: the local cache tier and S3 settings of a remote store (see
    :func:`~actstore.storage.files.open_files`).
    """

    format_name = "saelens"

    def __repr__(self) -> str:
        return (
            f"SaelensReader({self.url!r}, columns={list(self.columns)}, "
            f"context_size={self.context_size}, d_in={self.d_model})"
        )

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
