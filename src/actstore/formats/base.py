"""Contracts every storage format implements: :class:`Block`, :class:`ReaderBase`,
:class:`WriterBase`.

A *block* is a contiguous run of rows (one row = one token's vector at one site) that costs
one sequential read. Readers list blocks per site; the loader, conversion and verification
are written once against blocks. Blocks at the same position of ``blocks(site)`` for two
sites of one store cover the same tokens (so crosscoder batches can align sites), unless the
reader's :meth:`ReaderBase.aligned_on` says otherwise.

Required methods are abstract; every optional capability is declared here with a working
default, so callers never probe a reader or writer for a hook by name.

Example:
    >>> Block(site=3, n_rows=197, loc=(0, 5)).n_rows
    197
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..sites import Site

if TYPE_CHECKING:
    import torch

    from ..batch import Batch, CapturePlan
    from ..stats import RunningStats


@dataclass(frozen=True)
class Block:
    """``n_rows`` contiguous rows of ``site``; ``loc`` is the format's own locator."""

    site: Hashable
    n_rows: int
    loc: tuple[int, ...]


@dataclass
class VerifyReport:
    """Outcome of ``Reader.verify()``: any ``faults`` make it fail; ``notes`` inform."""

    location: str | Path
    faults: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    files_checked: int = 0
    bytes_checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.faults


class _Scratch(threading.local):
    """A reusable per-thread buffer for the default scatter read."""

    buf: np.ndarray | None = None


_SCRATCH = _Scratch()


class ReaderBase(abc.ABC):
    """Read side of a format. Implementations are cheap to pickle (they reopen lazily).

    ``read_block`` may be called from several threads of one process at once (the loader
    reads a window's blocks in parallel).
    """

    # ------------------------------------------------------------------ required

    @property
    @abc.abstractmethod
    def sites(self) -> Sequence[Hashable]:
        """The sites stored, in the format's own naming (saev: layer ints)."""

    @property
    @abc.abstractmethod
    def d_model(self) -> int: ...

    @property
    @abc.abstractmethod
    def dtype(self) -> np.dtype:
        """numpy dtype of the rows :meth:`read_block` returns."""

    @abc.abstractmethod
    def blocks(self, site: Hashable) -> list[Block]:
        """Every row of ``site`` exactly once, as contiguous blocks, in storage order."""

    @abc.abstractmethod
    def read_block(self, block: Block, out: np.ndarray | None = None) -> np.ndarray:
        """Rows of ``block`` as ``[n_rows, D]`` (into ``out`` when given)."""

    @abc.abstractmethod
    def statistics(self, site: Hashable) -> RunningStats | None:
        """Stored running statistics for ``site``, if the store has them."""

    @abc.abstractmethod
    def describe(self) -> dict[str, Any]:
        """JSON-able summary for ``actstore inspect`` (format, model, shapes, sizes...)."""

    @abc.abstractmethod
    def verify(self, *, progress: Callable[[int], None] | None = None) -> VerifyReport:
        """Full integrity check (checksums, sizes, metadata); ``progress(n_bytes)``."""

    @abc.abstractmethod
    def capture_plan(self) -> CapturePlan:
        """The capture this store came from (model, sites, shapes, dataset description),
        so conversion rebuilds it without reading format internals."""

    # ------------------------------------------------------------------ optional

    tokens: np.ndarray | None = None
    """Per-example token ids ``[n_examples, T]`` (text stores that keep them)."""
    labels: np.ndarray | None = None
    """Per-example class labels (image folders with classes); ``[n, T]`` in saev."""
    classes: list[str] | None = None
    """Class names for ``labels``."""
    torch_dtype: torch.dtype | None = None
    """The stored torch dtype when :attr:`dtype` widens it (bfloat16 read as float32)."""

    def stored_dtype(self) -> str:
        """The dtype the values are stored in, e.g. ``"bfloat16"`` or ``"float32"``."""
        if self.torch_dtype is not None:
            return str(self.torch_dtype).removeprefix("torch.")
        return np.dtype(self.dtype).name

    def site_of(self, name: Hashable) -> Site:
        """The :class:`Site` a stored site name stands for (default: parse it, so layer
        ints are residual-stream layers)."""
        return name if isinstance(name, Site) else Site.parse(str(name))

    def read_block_scatter(self, block: Block, out: np.ndarray, rows: np.ndarray) -> None:
        """Write row ``i`` of ``block`` into ``out[rows[i]]``, skipping ``rows[i] < 0``.

        ``out`` is ``[n, D]`` of :attr:`dtype` with contiguous rows. The default reads the
        block into a per-thread scratch buffer and copies; formats that can read straight
        into place override it."""
        data = self._read_into_scratch(block)
        keep = rows >= 0
        out[rows[keep]] = data[keep]

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
        need = block.n_rows * int(self.d_model)
        dtype = np.dtype(self.dtype)
        scratch = _SCRATCH.buf
        if scratch is None or scratch.dtype != dtype or scratch.size < need:
            scratch = _SCRATCH.buf = np.empty(need, dtype=dtype)
        return self.read_block(block, scratch[:need].reshape(block.n_rows, -1))

    def read_slabs_scatter(
        self, pieces: Sequence[tuple[Block, np.ndarray, np.ndarray]], out: np.ndarray
    ) -> None:
        """:meth:`read_rows_scatter` of each ``(block, rows, dest)`` of ``pieces`` (one loader
        read task); the default reads them one by one, formats may read them together."""
        for block, rows, dest in pieces:
            self.read_rows_scatter(block, rows, out, dest)

    def example_rows(self, site: Hashable) -> int | None:
        """``T`` when every block of ``site`` holds whole examples of exactly ``T``
        contiguous rows in token order, so a loader slab (``mix`` > 1) can take a range of
        tokens of each example; None (the default): slabs are contiguous row ranges."""
        return None

    def cls_rows(self, block: Block) -> np.ndarray | None:
        """Rows of ``block`` that hold a CLS token (for the loader's ``drop_cls``), or
        None when the store keeps no CLS token."""
        return None

    def aligned_on(self, sites: Sequence[Hashable]) -> bool:
        """Whether block ``i`` of every one of ``sites`` holds the same tokens."""
        return True

    def example_batches(self, batch_size: int, start: int = 0) -> Iterator[Batch] | None:
        """The stored examples ``start, start + 1, ...`` as capture batches, when the
        format keeps more per example than blocks show (texts, ragged lengths); None
        lets conversion build batches from blocks, :attr:`tokens` and :attr:`labels`."""
        return None

    def close(self) -> None:
        """Release open files (the reader reopens them lazily if used again)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class WriterBase(abc.ABC):
    """Write side of a format. Nothing is visible to readers until :meth:`close` publishes.

    Use as a context manager to publish on success and abort on error.

    Example:
        >>> with SaevWriter(metadata, "out") as writer:  # doctest: +SKIP
        ...     writer.write(batch)
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
    def close(self) -> Any:
        """Finish, publish atomically, and return the location (format-specific)."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Stop without publishing; durable progress is kept for a later resume."""

    def sealed_files(self) -> list[tuple[str, Path]]:
        """Files that are durable and will never change again, for an uploader to send while
        the capture goes on: ``(name, path)`` pairs, ``name`` relative to the directory the
        writer was given, as the file will be named once published; ``path`` where it is
        now. Each call lists every sealed file so far (callers skip ones already sent). The
        default, none, means everything is uploaded when the store is published."""
        return []

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


#: Short names used in annotations across the package.
Reader = ReaderBase
Writer = WriterBase
