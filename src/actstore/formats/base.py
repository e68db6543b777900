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

Example:
    >>> Block(site=Site("resid", 3), n_rows=197, loc=(0, 5)).n_rows
    197
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeAlias

import numpy as np
import numpy.typing as npt

from ..errors import ConfigError, IndexOutOfRangeError, InvalidIndexError, LayerNotStoredError
from ..sites import Site
from ..storage.integrity import Integrity
from ..storage.location import Location, refuse_partial

if TYPE_CHECKING:
    import os

    import torch

    from ..batch import Batch, CapturePlan
    from ..stats import RunningStats
    from ..storage.files import StoreFiles
    from ..storage.object import S3Config

#: Anything :meth:`ReaderBase.site` turns into a stored :class:`Site`.
SiteLike: TypeAlias = "Site | str | int"


@dataclass(frozen=True)
class Block:
    """``n_rows`` contiguous rows of ``site``; ``loc`` is the format's own locator."""

    site: Site
    n_rows: int
    loc: tuple[int, ...]


@dataclass(frozen=True)
class Extent:
    """Where a block's rows lie raw in one of the store's files: the block's ``n_rows``
    contiguous rows of ``d_model`` little-endian values of ``dtype`` from byte ``offset`` of
    file ``name``, covering whole blocks of the store's manifest (so they are checked where
    they lie)."""

    name: str
    offset: int
    dtype: torch.dtype


@dataclass
class VerifyReport:
    """Outcome of ``Reader.verify()``: any ``faults`` make it fail; ``notes`` inform."""

    location: str
    faults: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    files_checked: int = 0
    bytes_checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.faults


class _Scratch(threading.local):
    """Reusable buffers per thread (a block read, checked, then placed elsewhere): allocated
    once and reused, so reads do not fault in fresh pages."""

    def __init__(self) -> None:
        self.bufs: dict[int, np.ndarray] = {}


_SCRATCH = _Scratch()

#: Scratch slots: a block being assembled, and a file read into it piece by piece.
BLOCK_SLOT, PIECE_SLOT = 0, 1


def scratch(n: int, d: int, dtype: npt.DTypeLike, slot: int = BLOCK_SLOT) -> np.ndarray:
    """This thread's scratch buffer ``slot`` as ``[n, d]`` of ``dtype`` (valid until that
    slot's next use; a read that assembles a block from pieces reads them into another slot)."""
    dtype = np.dtype(dtype)
    need = n * d * dtype.itemsize
    buf = _SCRATCH.bufs.get(slot)
    if buf is None or buf.size < need:
        buf = _SCRATCH.bufs[slot] = np.empty(max(need, 1 << 16), dtype=np.uint8)
    return buf[:need].view(dtype).reshape(n, d)


def place(out: np.ndarray, rows: np.ndarray, data: np.ndarray) -> None:
    """Row ``i`` of ``data`` into ``out[rows[i]]``, skipping ``rows[i] < 0``."""
    keep = rows >= 0
    if keep.all():
        out[rows] = data
    else:
        out[rows[keep]] = data[keep]


class ReaderBase(abc.ABC):
    """Read side of a format. Implementations are cheap to pickle (they reopen lazily).

    ``read_block`` may be called from several threads of one process at once (the loader
    reads a window's blocks in parallel).

    Every reader is constructed the same way, here: ``Reader(location, *, verify_reads=True,
    cache_dir=None, cache_bytes=None, s3=None)`` sets :attr:`location`, :attr:`files` and
    :attr:`verify_reads`, calls the format's :meth:`open_index` (find the index, load the
    root manifest with :meth:`open_checks`, read and validate the index through
    :attr:`checks`), then :meth:`check_summary`. A reader that takes more keywords sets
    them and calls ``super().__init__(location, **kwargs)``.

    What a reader serves, written once here on top of the format's block reads:
    ``reader.shape`` (``(n_examples, n_sites, tokens_per_example, d_model)``),
    ``reader[example, site, token]`` (ints, slices or int arrays; site in any spelling or
    ``:``), ``len(reader)``, ``reader.statistics(site)``, ``reader.blocks(site)``.
    """

    #: The registry name of the format (``"saev"``...).
    format_name: ClassVar[str] = ""

    location: Location
    files: StoreFiles
    checks: Integrity
    verify_reads: bool = True

    def __init__(
        self,
        location: str | os.PathLike | Location,
        *,
        verify_reads: bool = True,
        cache_dir: str | os.PathLike | None = None,
        cache_bytes: int | str | None = None,
        s3: S3Config | None = None,
    ) -> None:
        self.location = Location.parse(location, s3=s3)
        refuse_partial(self.location)
        #: How the store's files are cached (``cache_dir``, ``cache_bytes``), for a format
        #: that opens more file sets (a run's stores, a hook folder's parent).
        self.cache_options: dict[str, Any] = {"cache_dir": cache_dir, "cache_bytes": cache_bytes}
        self.s3 = s3
        self.files = self.location.files(**self.cache_options)
        self.verify_reads = verify_reads
        self.checks = Integrity(self.files, None, enabled=False)
        self.open_index()
        self.check_summary()

    @abc.abstractmethod
    def open_index(self) -> None:
        """The format's part of opening: raise :class:`~actstore.errors.StoreNotFoundError`
        when :attr:`files` hold no index of the format, call :meth:`open_checks`, then read
        and validate the index through :attr:`checks` (``read_json``, ``read_bytes``), so a
        damaged index fails here naming the file."""

    def open_checks(self, *, ours: bool) -> None:
        """Load the root manifest and check the listing against it (see
        :meth:`Integrity.open`); ``ours``: the store's metadata says actstore wrote it."""
        self.checks = Integrity.open(
            self.files, ours=ours, verify_reads=self.verify_reads, format=self.format_name
        )

    def check_summary(self) -> None:
        """Compare what this reader parsed with what the writer published (the
        constructor's last step)."""
        self.checks.check_summary(self.trusted_summary())

    @property
    def url(self) -> str:
        return self.location.url

    @property
    def path(self) -> Path:
        """The store's directory on local disk (a one-line error for object storage)."""
        return self.location.path()

    # ------------------------------------------------------------------ required

    @property
    @abc.abstractmethod
    def sites(self) -> tuple[Site, ...]:
        """The sites stored, in storage order."""

    @property
    @abc.abstractmethod
    def d_model(self) -> int: ...

    @property
    @abc.abstractmethod
    def dtype(self) -> np.dtype:
        """numpy dtype of the rows :meth:`read_block` returns."""

    @abc.abstractmethod
    def site_blocks(self, site: Site) -> list[Block]:
        """Every row of stored ``site`` exactly once, as contiguous blocks, in storage order
        (:meth:`blocks` resolves the site first)."""

    @abc.abstractmethod
    def read_block(self, block: Block, out: np.ndarray | None = None) -> np.ndarray:
        """Rows of ``block`` as ``[n_rows, D]`` (into ``out`` when given), checked."""

    @abc.abstractmethod
    def site_statistics(self, site: Site) -> RunningStats | None:
        """Stored running statistics of stored ``site``, if the store has them."""

    @abc.abstractmethod
    def describe_format(self) -> dict[str, Any]:
        """The format's part of :meth:`describe`: at least ``format`` (a human name with
        version and dialect) and ``shape`` (a human description), plus any detail."""

    @abc.abstractmethod
    def capture_plan(self) -> CapturePlan:
        """The capture this store came from (model, sites, shapes, dataset description),
        so conversion rebuilds it without reading format internals."""

    # ------------------------------------------------------------------ sites

    @property
    def family(self) -> str:
        """The model family the store was captured from (``"gpt2"``, ``"bert"``...)."""
        return self._plan_cached().family

    @property
    def n_model_layers(self) -> int:
        """Blocks of the model the store was captured from (negative layers count from it)."""
        return self._plan_cached().n_model_layers

    def site(self, name: SiteLike) -> Site:
        """The stored :class:`Site` that ``name`` spells, in any spelling
        :meth:`Site.parse` takes; negative layers count from the model's end.

        Raises :class:`LayerNotStoredError` (naming the stored sites) when the store does
        not hold it, :class:`ConfigError` when the spelling has no meaning for this model."""
        if isinstance(name, Site) and name in self.sites:
            return name
        try:
            wanted = Site.parse(name)
        except ConfigError:
            native = self.native_site(name)
            if native is None:
                raise
            return native
        if wanted.layer < 0:
            wanted = wanted.resolve(self.n_model_layers)
        wanted = wanted.in_family(self.family)  # a TransformerLens name, as the family means it
        for stored in self.sites:
            if stored == wanted:
                return stored
        raise LayerNotStoredError(
            f"site {wanted} is not in this store; it holds {', '.join(map(str, self.sites))}"
        )

    def native_site(self, name: Any) -> Site | None:
        """The stored site a name in the format's own spelling stands for (an Activault
        hook folder...), or None; :meth:`site` asks when :meth:`Site.parse` cannot."""
        return None

    def native_name(self, site: Site) -> str:
        """The format's own name of stored ``site`` (a column, a hook folder...)."""
        return str(site)

    # ------------------------------------------------------------------ site-taking API

    def blocks(self, site: SiteLike) -> list[Block]:
        """Every row of ``site`` exactly once, as contiguous blocks, in storage order."""
        return self.site_blocks(self.site(site))

    def statistics(self, site: SiteLike) -> RunningStats | None:
        """Stored running statistics of ``site`` (exact mean, variance, mean norm), checked."""
        return self.site_statistics(self.site(site))

    def n_rows(self, site: SiteLike) -> int:
        """Rows ``site`` holds (what its blocks cover)."""
        return sum(b.n_rows for b in self.blocks(site))

    # ------------------------------------------------------------------ examples

    @property
    def n_examples(self) -> int:
        """Examples stored (default: the capture plan's)."""
        return self._plan_cached().n_examples

    @property
    def tokens_per_example(self) -> int | None:
        """Token positions of every example on ``reader[...]``'s token axis, or None when
        examples differ in length (default: the capture plan's)."""
        return self._plan_cached().tokens_per_example

    @property
    def shape(self) -> tuple[int, int, int | None, int]:
        """``(n_examples, n_sites, tokens_per_example, d_model)``: what ``reader[...]``
        indexes (``tokens_per_example`` None when examples differ in length)."""
        return (self.n_examples, len(self.sites), self.tokens_per_example, self.d_model)

    def __len__(self) -> int:
        return self.n_examples

    def _plan_cached(self) -> CapturePlan:
        """:meth:`capture_plan`, computed once."""
        plan = self.__dict__.get("_capture_plan")
        if plan is None:
            plan = self.__dict__["_capture_plan"] = self.capture_plan()
        return plan

    def __getitem__(self, key: Any) -> np.ndarray:
        """``reader[example, site, token]``: example and token take ints, slices or int
        arrays (negatives count from the end); site takes any spelling (``6``,
        ``"resid.6"``, ``-1``) or ``:`` for every site. Shapes follow numpy: an int drops
        its axis, so ``reader[12, 5, 0]`` is ``[d_model]`` and ``reader[0:8, 5]`` is
        ``[8, T, d_model]``. Every value is checked as it is read (:meth:`read_examples`)."""
        n_tokens = self.tokens_per_example
        if n_tokens is None:
            raise ConfigError(
                f"{self.url}: examples differ in length, so reader[example, site, token] has "
                "no token axis; read them through blocks(site) and read_block"
            )
        examples, site, token, scalar = self._split_key(key, self.n_examples, n_tokens)
        sites = list(self.sites) if site is None else [site]
        picked = np.array([token], dtype=np.int64) if isinstance(token, int) else token
        data = self.read_examples(examples, sites, picked)
        if isinstance(token, int):
            data = data[:, :, 0]
        if site is not None:
            data = data[:, 0]
        return data[0] if scalar else data

    def _split_key(
        self, key: Any, n_examples: int, n_tokens: int
    ) -> tuple[np.ndarray, Site | None, int | slice | np.ndarray, bool]:
        """``reader[example, site, token]`` parsed: ``(examples, site or None for all,
        token as an int (made non-negative), slice or int64 array, whether example was a
        scalar)``; examples as an int64 array."""
        parts: tuple[Any, ...] = key if isinstance(key, tuple) else (key,)
        if len(parts) > 3:
            raise InvalidIndexError("index as reader[example, site, token]")
        ex, site, token = [*parts] + [slice(None)] * (3 - len(parts))
        examples = as_indices(ex, n_examples, "example")
        if isinstance(site, slice):
            if site != slice(None):
                raise InvalidIndexError(
                    "sites are selected by name (reader[ex, 'resid.6']) or all (:)"
                )
            chosen = None
        else:
            chosen = self.site(site)
        if isinstance(token, (int, np.integer)):
            if not -n_tokens <= token < n_tokens:
                raise IndexOutOfRangeError(f"token {token} out of range (0..{n_tokens - 1})")
            token = int(token) % n_tokens
        elif not isinstance(token, slice):
            token = as_indices(token, n_tokens, "token")
        return examples, chosen, token, isinstance(ex, (int, np.integer))

    def read_examples(
        self, examples: np.ndarray, sites: Sequence[Site], tokens: slice | np.ndarray
    ) -> np.ndarray:
        """``[len(examples), len(sites), k, D]`` of :attr:`dtype`: token positions
        ``tokens`` (a slice, or an int64 array of non-negative positions) of ``examples``
        at stored ``sites``, checked: what ``reader[...]`` serves.

        The default reads the blocks holding them (each block once, checked like any
        :meth:`read_block`), for stores whose blocks of a site hold the examples in order,
        ``tokens_per_example`` rows each (the rows the conformance kit's round trip
        checks); formats override it where they can read less, or where an example's rows
        are laid out otherwise (zarr's prompt and response)."""
        n_tokens = int(self.tokens_per_example or 0)
        picked = np.arange(n_tokens)[tokens] if isinstance(tokens, slice) else tokens
        out = np.empty((len(examples), len(sites), len(picked), self.d_model), dtype=self.dtype)
        rows = examples[:, None] * n_tokens + picked[None, :]
        for j, site in enumerate(sites):
            blocks = self.site_blocks(site)
            ends = np.cumsum([b.n_rows for b in blocks], dtype=np.int64)
            held = int(ends[-1]) if len(ends) else 0
            if held != self.n_examples * n_tokens:
                raise ConfigError(self.example_axis_error(site, held))
            which = np.searchsorted(ends, rows, side="right")
            dest = out[:, j]
            for k in np.unique(which).tolist():
                mine = which == k
                first = int(ends[k]) - blocks[k].n_rows
                dest[mine] = self._read_into_scratch(blocks[k])[rows[mine] - first]
        return out

    def example_axis_error(self, site: Site, rows: int) -> str:
        """Why ``reader[...]`` cannot index examples of ``site``, whose blocks hold ``rows``
        rows (formats say what their layout lost)."""
        return (
            f"{self.url}: {site} holds {rows} rows, not {self.n_examples} examples x "
            f"{self.tokens_per_example} tokens, so reader[example, site, token] cannot place "
            "them; read them through blocks(site)"
        )

    # ------------------------------------------------------------------ optional

    @property
    def tokens(self) -> Any:
        """Per-example token ids ``[n_examples, T]`` (text stores that keep them), checked
        as they are read; None if the store has none."""
        return None

    @property
    def labels(self) -> Any:
        """Per-example class labels (image folders with classes); ``[n, T]`` in saev."""
        return None

    @property
    def token_mask(self) -> Any:
        """Bool ``[n_examples, T]``: the positions whose values the store holds, for a
        store that holds only some (Activault after token cleaning: ``reader[...]`` is NaN
        elsewhere, and its blocks hold the stored positions in order); None (the
        default): every position is stored."""
        return None

    @property
    def classes(self) -> list[str] | None:
        """Class names for ``labels``."""
        return None

    def stored_dtype(self) -> str:
        """The dtype the values are stored in, e.g. ``"bfloat16"`` or ``"float32"``
        (default: :attr:`dtype`'s; a format that widens what it stores, as Activault reads
        bfloat16 as float32, says what it stores)."""
        return np.dtype(self.dtype).name

    def trusted_summary(self) -> dict[str, Any]:
        """What the root manifest records of the metadata (see :func:`summary_of`)."""
        sites = self.sites
        return summary_of(
            sites=sites,
            d_model=self.d_model,
            dtype=self.stored_dtype(),
            rows=self.n_rows(sites[0]) if sites else 0,
        )

    def read_block_scatter(self, block: Block, out: np.ndarray, rows: np.ndarray) -> None:
        """Write row ``i`` of ``block`` into ``out[rows[i]]``, skipping ``rows[i] < 0``.

        ``out`` is ``[n, D]`` of :attr:`dtype` with contiguous rows. The default reads the
        block into a per-thread scratch buffer (checked there, while hot) and copies;
        formats that can read straight into place override it."""
        place(out, rows, self._read_into_scratch(block))

    def block_extent(self, block: Block) -> Extent | None:
        """Where ``block``'s rows lie raw in the store's files, so the loader can map them
        and gather rows from the page cache with no read (checked in place against the
        manifest); None (the default) when they do not lie raw (compressed, encoded,
        widened on the way): the loader then reads blocks with :meth:`read_block`."""
        return None

    def read_rows_scatter(
        self, block: Block, rows: np.ndarray, out: np.ndarray, dest: np.ndarray
    ) -> None:
        """Write row ``rows[i]`` of ``block`` (block-local, ascending) into ``out[dest[i]]``,
        skipping ``dest[i] < 0``: how the loader reads one slab of a block (``mix`` > 1).

        The default reads the whole block into a per-thread scratch buffer (checked like
        any :meth:`read_block`) and copies the rows asked for, so a slab costs a block's
        I/O; formats that can read the rows alone override it."""
        data = self._read_into_scratch(block)
        keep = dest >= 0
        out[dest[keep]] = data[rows[keep]]

    def _read_into_scratch(self, block: Block) -> np.ndarray:
        """``read_block`` into this thread's reused scratch buffer (valid until its next use)."""
        return self.read_block(block, scratch(block.n_rows, int(self.d_model), self.dtype))

    def read_slabs_scatter(
        self, pieces: Sequence[tuple[Block, np.ndarray, np.ndarray]], out: np.ndarray
    ) -> None:
        """:meth:`read_rows_scatter` of each ``(block, rows, dest)`` of ``pieces`` (one loader
        read task); the default reads them one by one, formats may read them together."""
        for block, rows, dest in pieces:
            self.read_rows_scatter(block, rows, out, dest)

    def example_rows(self, site: SiteLike) -> int | None:
        """``T`` when every block of ``site`` holds whole examples of exactly ``T``
        contiguous rows in token order, so a loader slab (``mix`` > 1) can take a range of
        tokens of each example; None (the default): slabs are contiguous row ranges."""
        return None

    def cls_rows(self, block: Block) -> np.ndarray | None:
        """Rows of ``block`` that hold a CLS token (token 0 of an example; for the
        loader's ``drop_cls``), or None when the store keeps no CLS token. The default
        places them from the block's position among its site's blocks, in stores whose
        blocks hold the examples in order, ``tokens_per_example`` rows each; None where
        the capture had no CLS or token positions are not kept."""
        plan = self._plan_cached()
        if not plan.has_cls:
            return None
        n_tokens = plan.tokens_per_example
        starts = self.__dict__.setdefault("_block_starts", {}).get(block.site)
        if starts is None:
            blocks = self.site_blocks(block.site)
            ends = np.cumsum([b.n_rows for b in blocks], dtype=np.int64)
            if not len(ends) or int(ends[-1]) != plan.n_examples * n_tokens:
                starts = {}
            else:
                starts = {b: int(e) - b.n_rows for b, e in zip(blocks, ends.tolist())}
            self.__dict__["_block_starts"][block.site] = starts
        first = starts.get(block)
        if first is None:
            return None
        return np.arange((-first) % n_tokens, block.n_rows, n_tokens, dtype=np.int64)

    def aligned_on(self, sites: Sequence[SiteLike]) -> bool:
        """Whether block ``i`` of every one of ``sites`` holds the same tokens."""
        return True

    def example_batches(self, batch_size: int, start: int = 0) -> Iterator[Batch] | None:
        """The stored examples ``start, start + 1, ...`` as capture batches, when the
        format keeps more per example than blocks show (texts, ragged lengths); None
        lets conversion build batches from blocks, :attr:`tokens` and :attr:`labels`."""
        return None

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
        try:
            recompute_into(
                report.faults,
                self,
                shards,
                self.statistics_file,
                self.site_statistics,
                self.statistics_record,
            )
        except ActstoreError as err:  # data that cannot be read: a fault, not a crash
            report.faults.append(
                f"{self.statistics_file}: cannot be recomputed from the data: {err}"
            )

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


def summary_of(
    *, sites: Sequence[Site | str], d_model: int, dtype: str, rows: int, **extra: Any
) -> dict[str, Any]:
    """What a root manifest records of a store's metadata and a reader checks on open:
    the sites in storage order, the row width, the stored dtype and the rows each site
    holds, plus any format facts in ``extra``.

    Example:
        >>> summary_of(sites=[Site("resid", 3)], d_model=8, dtype="float32", rows=12)
        {'sites': ['resid.3'], 'd_model': 8, 'dtype': 'float32', 'rows': 12}
    """
    return {
        "sites": [str(s) for s in sites],
        "d_model": int(d_model),
        "dtype": str(dtype),
        "rows": int(rows),
        **extra,
    }


def as_indices(index: Any, n: int, what: str) -> np.ndarray:
    """An int, slice or int array of positions in ``range(n)`` as an int64 array
    (negatives count from the end); :class:`IndexOutOfRangeError` past either end."""
    if isinstance(index, slice):
        return np.arange(n)[index]
    arr = np.asarray(index)
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
        raise InvalidIndexError(f"{what} index must be an int, slice or int array")
    arr = np.atleast_1d(arr).astype(np.int64)
    bad = (arr < -n) | (arr >= n)
    if bad.any():
        raise IndexOutOfRangeError(
            f"{what} {int(arr[bad][0])} out of range (0..{n - 1}; negatives count from the end)"
        )
    return np.where(arr < 0, arr + n, arr)


class WriterBase(abc.ABC):
    """What capture and convert drive: batches in, one atomic publication at :meth:`close`.
    Nothing is visible to readers until then. Use as a context manager to publish on
    success and abort on error. A format's own writer is a :class:`FormatWriter`; wrappers
    (uploading to S3, re-basing a slice) are plain writers around one.
    """

    resume_from: int = 0
    """Examples already durable (capture restarts at the batch holding this example)."""
    complete: bool = False
    """The store is already published: capture and convert only report it."""
    example_range: tuple[int, int] | None = None
    """``(start, stop)`` of the examples this writer owns (one slice of a distributed
    capture); None: all of them."""
    wants_texts: bool = False
    """The writer stores decoded text, so capture decodes each example's tokens."""

    @abc.abstractmethod
    def write(self, batch: Batch) -> None: ...

    @abc.abstractmethod
    def close(self) -> Path | str:
        """Finish, publish atomically, and return where the store is: its directory (a
        ``Path``) on local disk, its URL on object storage."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Stop without publishing; durable progress is kept for a later resume."""

    def sync(self) -> None:
        """Wait until everything written so far that the writer makes durable before
        publishing is durable (and :meth:`sealed_files` lists it). Default: nothing waits."""

    def sealed_files(self) -> list[tuple[str, os.PathLike]]:
        """Files that are durable and will never change again, for an uploader to send while
        the capture goes on: ``(name, path)`` pairs, ``name`` relative to the output
        location the writer was given, as the file will be named once published; ``path``
        where it is now. Each call lists every sealed file so far (callers skip ones
        already sent). The default, none, means everything is uploaded when the store is
        published."""
        return []

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class FormatWriter(WriterBase):
    """A format's own writer, built as ``Writer.from_plan(plan, location, options)``;
    constructing one creates nothing on disk (the first :meth:`write` does).

    Example:
        >>> import os, tempfile
        >>> from actstore.formats.saev import SaevOptions, SaevWriter
        >>> from actstore.testing import make_acts, make_batches, make_plan
        >>> plan, out = make_plan(), tempfile.TemporaryDirectory()
        >>> with SaevWriter.from_plan(plan, Location.parse(out.name), SaevOptions()) as w:
        ...     print(os.listdir(out.name))  # only its write lock so far  # doctest: +ELLIPSIS
        ...     for batch in make_batches(plan, make_acts(plan)):
        ...         w.write(batch)
        ['.3fc6....lock']
        >>> os.listdir(out.name) == [w.final.name]  # published as the block ended, unlocked
        True
    """

    @classmethod
    @abc.abstractmethod
    def from_plan(cls, plan: CapturePlan, location: Location, options: Any) -> FormatWriter:
        """The writer of capture ``plan`` for output ``location`` (what ``--out`` names)
        with the format's ``options``."""

    @classmethod
    def store_location(cls, plan: CapturePlan, location: Location, options: Any) -> Location:
        """Where the published store will be for output ``location`` (default: there)."""
        return location

    @classmethod
    def convert_options(cls, plan: CapturePlan, options: Any) -> Any:
        """The options a conversion into this format uses for ``plan`` (whole examples of
        ``tokens_per_example`` rows, no token cleaning), so the target keeps every row of
        the source: a format that stores fixed-size files (Activault) picks a size that
        divides the rows, or refuses in one line, before anything is written. Default:
        ``options`` unchanged (every row is kept)."""
        return options
