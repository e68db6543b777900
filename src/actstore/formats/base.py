"""Contracts every storage format implements: :class:`Block`, :class:`ReaderBase`,
:class:`WriterBase`.

A *block* is a contiguous run of rows (one row = one token's vector at one site) that costs
one sequential read. Readers list blocks per site; the loader, conversion and verification
are written once against blocks. Blocks at the same position of ``blocks(site)`` for two
sites of one store cover the same tokens (so crosscoder batches can align sites), unless the
reader's :meth:`ReaderBase.aligned_on` says otherwise.

Sites are :class:`~actstore.sites.Site` keys everywhere: ``reader.sites`` lists them and
every method that takes a site takes any spelling :meth:`ReaderBase.site` resolves (``6``,
``"resid.6"``, ``"blocks.6.hook_resid_post"``, ``Site("resid", 6)``, ``-1`` for the model's
last block). A format's own naming (saev's layer ints, SAELens's hook columns, Activault's
module folders) stays inside its layout module.

Every byte a reader serves is checked against the store's root manifest
(:mod:`actstore.storage.manifest`) through :attr:`ReaderBase.checks`.

Required methods are abstract; every optional capability is declared here with a working
default, so callers never probe a reader or writer for a hook by name.

One module per contract, all importable from here: :mod:`.blocks` (:class:`Block`,
:class:`Extent`, scratch buffers, :func:`as_indices`), :mod:`.report` (:func:`summary_of`,
:class:`VerifyReport`), :mod:`.reading` (the reader contract and the read API,
:class:`~.reading.ReaderCore`), :mod:`.writerbase` (:class:`WriterBase`,
:class:`FormatWriter`); this module: :class:`ReaderBase`, the read API plus ``describe``
and ``verify`` written once.

Example:
    >>> Block(site=Site("resid", 3), n_rows=197, loc=(0, 5)).n_rows
    197
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from ..sites import Site
from ..stats import RunningStats
from .blocks import BLOCK_SLOT, PIECE_SLOT, Block, Extent, as_indices, place, scratch
from .reading import ReaderCore, SiteLike
from .report import VerifyReport, summary_of
from .writerbase import FormatWriter, WriterBase


class ReaderBase(ReaderCore):
    """Read side of a format. Implementations are cheap to pickle (they reopen lazily).

    ``read_block`` may be called from several threads of one process at once (the loader
    reads a window's blocks in parallel).

    Every reader is constructed the same way, here: ``Reader(location, *, verify_reads=True,
    cache_dir=None, cache_bytes=None, storage=None)`` sets :attr:`location`, :attr:`files` and
    :attr:`verify_reads`, calls the format's :meth:`open_index` (find the index, load the
    root manifest with :meth:`open_checks`, read and validate the index through
    :attr:`checks`), then :meth:`check_summary`. A reader that takes more keywords sets
    them and calls ``super().__init__(location, **kwargs)``.

    What a reader serves, written once here on top of the format's block reads:
    ``reader.shape`` (``(n_examples, n_sites, tokens_per_example, d_model)``),
    ``reader[example, site, token]`` (ints, slices or int arrays; site in any spelling or
    ``:``), ``len(reader)``, ``reader.statistics(site)``, ``reader.blocks(site)``.
    """

    # ------------------------------------------------------------------ describe / verify

    def describe(self) -> dict[str, Any]:
        """JSON-able summary for ``actstore inspect`` and ``actstore ls``: ``path``,
        ``format``, ``model``, ``dataset``, ``sites``, ``shape``, ``dtype``, ``d_model``,
        ``bytes``, ``files`` (how many), ``verified`` (a root manifest checks reads), then
        the format's own details."""
        plan = self.capture_plan()
        listing = self.files.list()
        own = self.describe_format()
        out: dict[str, Any] = {
            "path": self.url,
            "format": own.pop("format"),
            "model": f"{plan.ckpt} ({plan.family})",
            "dataset": plan.dataset_root,
            "sites": [str(s) for s in self.sites],
            "shape": own.pop("shape"),
            "dtype": self.stored_dtype(),
            "d_model": self.d_model,
            "bytes": sum(listing.values()),
            "files": own.pop("files", len(listing)),
            "verified": self.checks.manifest is not None,
        }
        out.update(own)
        tokens = self.tokens if "token_ids[0][:16]" not in out else None
        if tokens is not None and len(tokens):
            out["token_ids[0][:16]"] = np.asarray(tokens[0][:16]).tolist()
        if self.classes is not None:
            out["classes"] = self.classes
        return out

    def verify(self, *, progress: Callable[[int], None] | None = None) -> VerifyReport:
        """Full integrity check: every file's every block against the root manifest, the
        listing (missing, extra, resized files, symlinks), then the format's own checks
        (:meth:`verify_content`). Reports every fault found. ``progress(n_bytes)`` is
        called as data is read."""
        report = VerifyReport(self.url)
        n_files, n_bytes = self.checks.verify(
            report.faults, progress=progress, on_chunk=self.scan_chunk
        )
        report.files_checked, report.bytes_checked = n_files, n_bytes
        self.verify_content(report)
        self.verify_statistics(report)
        self.verify_record(report)
        return report

    def scan_chunk(self, name: str, offset: int, data: memoryview) -> None:
        """Sees every byte :meth:`verify` reads (formats count non-finite values here)."""

    def verify_content(self, report: VerifyReport) -> None:
        """The format's checks beyond the bytes (statistics consistent with shapes, padding,
        non-finite values seen by :meth:`scan_chunk`); add faults and notes to ``report``."""

    def stored_record(self) -> tuple[str, Any] | None:
        """``(file, record)``: the capture record the store's metadata holds (what the
        writer named the store by: its id is the record's digest), to check against the
        root manifest's store id; None (the default): the format keeps none to check."""
        return None

    def verify_record(self, report: VerifyReport) -> None:
        """The capture record the metadata holds gives the store id the root manifest
        records: metadata edited (model, dataset, layout) is a fault even when the manifest
        was rewritten over it."""
        from ..errors import CorruptStoreError, StoreNotFoundError
        from ..storage.manifest import store_id_of

        manifest = self.checks.manifest
        if manifest is None:
            return
        try:
            found = self.stored_record()
        except (CorruptStoreError, StoreNotFoundError) as err:
            if str(err) not in report.faults:
                report.faults.append(str(err))
            return
        if found is not None and store_id_of(found[1]) != manifest.store_id:
            report.faults.append(
                f"{found[0]}: the capture record it holds (model, dataset, layout) is not the "
                f"one the store was published with (its id is {store_id_of(found[1])}, the "
                f"manifest's {manifest.store_id}): the metadata was edited; restore it or "
                "re-create the store"
            )

    def statistics_shards(self) -> list[int] | None:
        """Rows of each writer shard, in storage order, when the stored statistics were
        folded per shard (:class:`~actstore.formats.shard.ShardStats`) and merged in shard
        order, as every :class:`~actstore.formats.writer.ShardedWriter` stores them; None
        (the default): :meth:`verify_statistics` has nothing to recompute."""
        return None

    #: The file :meth:`verify_statistics` names in its faults.
    statistics_file: ClassVar[str] = "statistics.json"

    def verify_statistics(self, report: VerifyReport) -> None:
        """Every site's stored statistics against those recomputed from the data with the
        writer's own code (:mod:`actstore.formats.recompute`), bit for bit: an edited
        value, or two sites' statistics swapped, is a fault even when the manifest was
        rewritten over the edit."""
        from ..errors import ActstoreError, CorruptStoreError, StoreNotFoundError
        from .recompute import recompute_into

        try:
            shards = self.statistics_shards() if self.sites else None
        except (CorruptStoreError, StoreNotFoundError) as err:
            report.faults.append(
                f"{self.statistics_file}: cannot be checked against the data: {err}"
            )
            return
        # folded as the bytes were read, when the format does and they all checked out;
        # else the data is read again (a damaged block is then not folded: its fault is
        # listed already)
        scanned = self.scanned_statistics() if shards is not None else None
        try:
            recompute_into(
                report.faults,
                self,
                shards,
                self.statistics_file,
                self.site_statistics,
                self.statistics_record,
                computed=scanned if not report.faults else None,
            )
        except ActstoreError as err:  # data that cannot be read: a fault, not a crash
            report.faults.append(
                f"{self.statistics_file}: cannot be recomputed from the data: {err}"
            )

    def scanned_statistics(self) -> dict[Site, RunningStats] | None:
        """Statistics :meth:`scan_chunk` folded from the data as :meth:`verify` read it,
        exactly as :meth:`verify_statistics` would recompute them, sparing it a second
        read of the store; None (the default): they are recomputed from a second read."""
        return None

    def statistics_record(self, site: Site) -> Any:
        """Stored ``site``'s statistics record as the file holds it (values derived from
        the exact ones included: the variance), for :meth:`verify_statistics` to compare
        whole; None (the default): only the exact values are compared."""
        return None

    def close(self) -> None:
        """Release open files (the reader reopens them lazily if used again)."""
        self.files.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    "BLOCK_SLOT",
    "PIECE_SLOT",
    "Block",
    "Extent",
    "FormatWriter",
    "ReaderBase",
    "SiteLike",
    "VerifyReport",
    "WriterBase",
    "as_indices",
    "place",
    "scratch",
    "summary_of",
]
