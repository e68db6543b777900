"""Contracts every storage format implements: :class:`Block`, :class:`Reader`, :class:`Writer`.

A *block* is a contiguous run of rows (one row = one token's vector at one site) that costs
one sequential read. Readers list blocks per site; the loader, conversion and verification
are written once against blocks. Blocks at the same position of ``blocks(site)`` for two
sites of one store cover the same tokens (so crosscoder batches can align sites), unless the
reader's optional ``aligned_on(sites)`` says otherwise.

Example:
    >>> Block(site=3, n_rows=197, loc=(0, 5)).n_rows
    197
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from ..batch import Batch
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


@runtime_checkable
class Reader(Protocol):
    """Read side of a format. Implementations are cheap to pickle (they reopen lazily).

    ``read_block`` may be called from several threads of one process at once (the loader
    reads a window's blocks in parallel). Optional hooks, found with ``getattr``:

    - ``cls_rows(block) -> int ndarray``: rows of ``block`` that hold a CLS token; needed
      for the loader's ``drop_cls``.
    - ``read_block_scatter(block, out, rows) -> None``: write row ``i`` of ``block`` into
      ``out[rows[i]]``, skipping rows where ``rows[i] < 0``; ``out`` is ``[n, D]`` of
      ``dtype`` with contiguous rows (possibly strided between rows). Without it the loader
      reads the block into a scratch buffer and copies each row into place.
    - ``aligned_on(sites) -> bool``: for stores that cannot guarantee the alignment above
      (e.g. Activault runs another tool wrote), whether block ``i`` of each of ``sites``
      holds the same tokens; the loader refuses ``sites=`` when it is False.
    """

    @property
    def sites(self) -> Sequence[Hashable]:
        """The sites stored, in the format's own naming (saev: layer ints)."""
        ...

    @property
    def d_model(self) -> int: ...

    @property
    def dtype(self) -> np.dtype:
        """numpy dtype of the rows :meth:`read_block` returns."""
        ...

    def blocks(self, site: Hashable) -> list[Block]:
        """Every row of ``site`` exactly once, as contiguous blocks, in storage order."""
        ...

    def read_block(self, block: Block, out: np.ndarray | None = None) -> np.ndarray:
        """Rows of ``block`` as ``[n_rows, D]`` (into ``out`` when given)."""
        ...

    def statistics(self, site: Hashable) -> RunningStats | None:
        """Stored running statistics for ``site``, if the store has them."""
        ...

    def describe(self) -> dict[str, Any]:
        """JSON-able summary for ``actstore inspect`` (format, model, shapes, sizes...)."""
        ...

    def verify(self, *, progress: Callable[[int], None] | None = None) -> VerifyReport:
        """Full integrity check (checksums, sizes, metadata); ``progress(n_bytes)``."""
        ...

    def close(self) -> None: ...


class WriterBase:
    """Context-manager behaviour shared by writers: publish on success, abort on error.

    Example:
        >>> with SaevWriter(metadata, "out") as writer:  # doctest: +SKIP
        ...     writer.write(batch)
    """

    def close(self) -> Any:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


@runtime_checkable
class Writer(Protocol):
    """Write side of a format. Nothing is visible to readers until :meth:`close` publishes."""

    def write(self, batch: Batch) -> None: ...

    def close(self) -> Any:
        """Finish, publish atomically, and return the manifest (format-specific)."""
        ...

    def abort(self) -> None:
        """Stop without publishing; durable progress is kept for a later resume."""
        ...
