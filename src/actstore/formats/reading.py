"""The reader contract and the read API written once on it (:class:`ReaderCore`): the
one constructor every reader shares, the abstract methods a format implements, site
resolution, ``shape``, ``reader[example, site, token]``, blocks and scatter reads, and every
optional capability with its working default. :class:`~actstore.formats.base.ReaderBase`
adds ``describe`` and ``verify`` on top; formats subclass it."""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeAlias

import numpy as np

from ..errors import ConfigError, IndexOutOfRangeError, InvalidIndexError, LayerNotStoredError
from ..sites import Site
from ..storage.integrity import Integrity
from ..storage.location import Location, refuse_partial
from .blocks import Block, Extent, as_indices, place, scratch
from .report import summary_of

if TYPE_CHECKING:
    import os

    from ..batch import Batch, CapturePlan
    from ..stats import RunningStats
    from ..storage.files import StoreFiles
    from ..storage.object import StorageOptions

#: Anything :meth:`ReaderBase.site` turns into a stored :class:`Site`.
SiteLike: TypeAlias = "Site | str | int"


class ReaderCore(abc.ABC):
    """The reader contract and the read API of :class:`~actstore.formats.base.ReaderBase`
    (which see)."""

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
        storage: StorageOptions | None = None,
    ) -> None:
        self.location = Location.parse(location, storage=storage)
        refuse_partial(self.location)
        #: How the store's files are cached (``cache_dir``, ``cache_bytes``), for a format
        #: that opens more file sets (a run's stores, a hook folder's parent).
        self.cache_options: dict[str, Any] = {"cache_dir": cache_dir, "cache_bytes": cache_bytes}
        self.storage = storage
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
