"""Where a consumer gathers a window's rows from, and how the window gets there.

A window (see :mod:`actstore.order`) is a set of units (blocks, or slabs of blocks) whose
rows are served in a permuted order. Batches are gathered from it row by row
(``torch.index_select``) into the batch's own buffer, so a window only has to be
*readable* where it lies, in any layout:

- :class:`MappedWindows` (local stores whose readers say where a block's rows lie raw,
  :meth:`~actstore.formats.base.ReaderBase.block_extent`): the store's files are mapped
  (:class:`~actstore.storage.mapped.MappedFiles`) and the window's rows are read where they
  lie in the page cache. Getting a window ready is faulting it in (which reads it from
  the disk when it is not cached) and checking each block against the store's manifest
  once per epoch, on the read threads while the previous window is gathered from.
- :class:`PooledWindows` (every other store: object storage, compressed or encoded
  formats): the window's units are read (checked, decoded) into a reused buffer in storage
  order, then gathered from like a mapped window.

Either way a window is described by ``src`` (a tensor of element-granular rows,
:meth:`MappedFiles.elements`) and ``order`` (the element offset of each served row of
each site, in serving order), so gathering is the same code for both.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..formats.blocks import Block, Extent
from ..formats.threads import StageClock
from ..order import EpochPlan
from ..storage.mapped import MappedFiles
from .buffers import Buffers


@dataclass(eq=False)
class Window:
    """One window made ready to gather from."""

    w: int
    src: torch.Tensor
    """Element-granular rows ``[*, D]`` (``index_select`` from it)."""
    order: Future
    """``(offsets, ids)``: int64 ``[R_w * n_sites]``, the element offset in ``src`` of served
    row ``p`` at site ``s`` at ``p * n_sites + s``, in serving order; and int64 ``[R_w]``,
    each served row's storage row (None unless ``return_index``)."""
    ready: list[Future] = field(default_factory=list)
    """Reads and checks that must finish before rows are gathered."""
    done: Callable[[], None] = lambda: None
    """Called once the last batch has been gathered from the window."""
    stop: threading.Event = field(default_factory=threading.Event)
    """Set for a window that will not be served: its reads end after the block at hand."""

    def wait(self) -> tuple[np.ndarray, np.ndarray | None]:
        """Block until the window can be gathered from (raising what a read raised);
        returns :attr:`order`'s result."""
        for future in self.ready:
            future.result()
        self.ready = []
        return self.order.result()


@dataclass(frozen=True, kw_only=True)
class Units:
    """The rows each unit of a layout serves: how windows are laid out."""

    n_blocks_rows: np.ndarray
    """int64 ``[n_blocks]``: rows of each block (served or not)."""
    first_row: np.ndarray
    """int64 ``[n_blocks]``: storage row of each block's first row."""
    mix: int
    rows_of: Callable[[int, int], np.ndarray]
    """``rows_of(block, slab)``: the block-local rows that unit serves (ascending)."""
    all_rows: bool
    """Every unit is a whole block serving all its rows (mix 1, nothing dropped)."""


class Windows(abc.ABC):
    """Makes the windows of one epoch plan ready, on ``io`` (the consumer's read threads)."""

    def __init__(
        self,
        units: Units,
        plan: EpochPlan,
        io: ThreadPoolExecutor,
        *,
        n_sites: int,
        d_model: int,
        return_index: bool,
        read_blocks: int,
        clock: StageClock | None = None,
    ) -> None:
        self.units, self.plan, self.io = units, plan, io
        self.n_sites, self.d_model = n_sites, d_model
        self.return_index = return_index
        self.read_blocks = max(1, read_blocks)
        #: CPU seconds per stage (``benchmarks/bench_read_stages.py``), when measuring
        self.clock = clock

    def timed(self, stage: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, its CPU time added to ``stage`` when measuring."""
        if self.clock is None:
            return fn(*args, **kwargs)
        return self.clock.timed(stage, lambda: fn(*args, **kwargs))

    @abc.abstractmethod
    def open(self, w: int, *, allocate: bool = True, wait: bool = True) -> Window | None:
        """Start getting window ``w`` ready; None when it needs memory that is not free now
        (``allocate=False``: none may be made; ``wait=False``: none is ready yet)."""

    def _pieces(self, w: int) -> list[tuple[int, np.ndarray | None]]:
        """``(block, local rows or None for all)`` of each unit of window ``w``, in
        window order."""
        units, out = self.units, []
        for u in self.plan.window_blocks(w).tolist():
            if units.mix == 1:
                out.append((u, None if units.all_rows else units.rows_of(u, 0)))
            else:
                i, slab = self.plan.unit(u)
                out.append((i, units.rows_of(i, slab)))
        return out

    def _runs(self, blocks: Sequence[int], *, once: bool = False) -> list[list[int]]:
        """Positions in ``blocks`` grouped into runs of consecutive blocks in storage order
        (at most ``read_blocks`` each): one sequential read each. ``once``: a block that
        appears again (another slab of it) is left out of the runs after its first place."""
        runs: list[list[int]] = []
        previous = -2
        for j in np.argsort(np.asarray(blocks), kind="stable").tolist():
            i = blocks[j]
            if once and i == previous:
                continue
            if i not in (previous, previous + 1) or len(runs[-1]) >= self.read_blocks:
                runs.append([])
            runs[-1].append(j)
            previous = i
        return runs

    def _order(
        self,
        w: int,
        pieces: list[tuple[int, np.ndarray | None]],
        starts: np.ndarray,
        *,
        packed: bool = False,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Served element offsets ``[R_w * n_sites]`` and storage rows of window ``w``:
        ``starts[s, j]`` is the element offset of unit ``j``'s row 0 at site ``s``, rows
        ``d_model`` elements apart; a unit's row ``r`` lies at its row ``r`` (its block
        read whole) or, ``packed``, at its row ``k`` for the ``k``-th row it serves."""
        d, units = self.d_model, self.units
        perm = self.plan.window_permutation(w)
        if units.all_rows:
            sizes = units.n_blocks_rows[[i for i, _ in pieces]]
            first = np.concatenate([[0], np.cumsum(sizes)[:-1]])
            local = np.arange(int(sizes.sum()), dtype=np.int64) - np.repeat(first, sizes)
            place = local
        else:
            rows = [
                np.arange(units.n_blocks_rows[i], dtype=np.int64) if r is None else r
                for i, r in pieces
            ]
            sizes = np.array([len(r) for r in rows], dtype=np.int64)
            local = np.concatenate(rows) if rows else np.empty(0, dtype=np.int64)
            if packed:
                first = np.concatenate([[0], np.cumsum(sizes)[:-1]])
                place = np.arange(len(local), dtype=np.int64) - np.repeat(first, sizes)
            else:
                place = local
        unit = np.repeat(np.arange(len(pieces)), sizes)[perm]
        order = starts[:, unit].T + (place[perm] * d)[:, None]
        ids = None
        if self.return_index:
            ids = units.first_row[[i for i, _ in pieces]][unit] + local[perm]
        return np.ascontiguousarray(order, dtype=np.int64).reshape(-1), ids


class MappedWindows(Windows):
    """Windows read where they lie: the store's files mapped, each window faulted in ahead
    of use and each block checked against the manifest (``check``) once per epoch.

    Each stretch of consecutive blocks of a window is one read task: fault it in
    (``MADV_POPULATE_READ``, which reads it from the disk when it is not in the page cache),
    then check its blocks while they are in cache; ``io_threads`` tasks run at once. The
    mapping is advised ``MADV_HUGEPAGE``, so the kernel reads and maps it in 2 MiB folios
    even with several tasks faulting one file (without it, concurrent faults thrash the
    file's readahead and land in 4 KiB pages: measured 5-10x the CPU to map and walk)."""

    def __init__(
        self,
        units: Units,
        plan: EpochPlan,
        io: ThreadPoolExecutor,
        *,
        region: MappedFiles,
        extents: Sequence[Sequence[Extent]],
        blocks: Sequence[Sequence[Block]],
        check: Callable[[str, int, memoryview], None] | None,
        **options,
    ) -> None:
        super().__init__(units, plan, io, **options)
        self.region, self.extents, self.blocks, self.check = region, extents, blocks, check
        dtype = extents[0][0].dtype if extents and extents[0] else torch.float32
        self.item = torch.empty(0, dtype=dtype).element_size()
        self.src = region.elements(dtype, self.d_model)
        self.row_bytes = self.d_model * self.item
        #: each block's first element in the region, ``[n_sites, n_blocks]``
        self.start = np.array(
            [[(region.offset(e.name) + e.offset) // self.item for e in site] for site in extents],
            dtype=np.int64,
        ).reshape(len(extents), -1)
        #: the task that checked each block checked this epoch: (site, block) -> its future
        self._checked: dict[tuple[int, int], Future] = {}

    def open(self, w: int, *, allocate: bool = True, wait: bool = True) -> Window:
        pieces = self._pieces(w)
        blocks = [i for i, _ in pieces]
        runs = [[blocks[j] for j in run] for run in self._runs(blocks, once=True)]
        ready: list[Future] = []
        spans: list[tuple[int, int]] = []
        for s in range(self.n_sites):
            for run in runs:
                jobs = [(i, self.check is not None and not self._checking(s, i)) for i in run]
                for name, offset, nbytes, mine in self._stretches(s, jobs):
                    future = self.io.submit(self._ready, s, name, offset, nbytes, mine)
                    ready.append(future)
                    self._checked.update({(s, i): future for i, check in mine if check})
                    spans.append((self.region.offset(name) + offset, nbytes))
                # blocks checked by an earlier window's task: served once that check is done
                ready.extend(self._checked[(s, i)] for i, _ in jobs if self._checking(s, i))
        order = self.io.submit(self.timed, "order", self._order, w, pieces, self.start[:, blocks])
        return Window(
            w=w,
            src=self.src,
            order=order,
            ready=list(dict.fromkeys(ready)),
            done=lambda: self._let_go(spans),
        )

    def _checking(self, s: int, i: int) -> bool:
        """Whether block ``i`` of site ``s`` is checked (or being checked) this epoch by
        a task that was not cancelled (a window let go unserved cancels its tasks)."""
        found = self._checked.get((s, i))
        return found is not None and not found.cancelled()

    def _stretches(
        self, s: int, jobs: list[tuple[int, bool]]
    ) -> list[tuple[str, int, int, list[tuple[int, bool]]]]:
        """``(file, byte offset, bytes, jobs)`` holding the blocks of ``jobs`` (``(block,
        whether to check it)``) of site ``s``, blocks adjacent in one file merged."""
        out: list[tuple[str, int, int, list[tuple[int, bool]]]] = []
        for i, check in jobs:
            e, nbytes = self.extents[s][i], self.blocks[s][i].n_rows * self.row_bytes
            if out and out[-1][0] == e.name and out[-1][1] + out[-1][2] == e.offset:
                name, offset, size, mine = out[-1]
                out[-1] = (name, offset, size + nbytes, [*mine, (i, check)])
            else:
                out.append((e.name, e.offset, nbytes, [(i, check)]))
        return out

    def _ready(
        self, s: int, name: str, offset: int, nbytes: int, jobs: list[tuple[int, bool]]
    ) -> None:
        """Fault a stretch of file ``name`` in, then check the blocks of it to check."""
        start = self.region.offset(name) + offset
        self.timed("fault-in", self.region.populate, name, start, nbytes)
        for i, check in jobs:
            if check and self.check is not None:
                e = self.extents[s][i]
                view = self.region.view(
                    start + e.offset - offset, self.blocks[s][i].n_rows * self.row_bytes
                )
                self.timed("verify", self.check, name, e.offset, view)

    def _let_go(self, spans: list[tuple[int, int]]) -> None:
        for start, nbytes in spans:
            self.timed("let-go", self.region.let_go, start, nbytes)


class PooledWindows(Windows):
    """Windows read into reused buffers (``pools``, ``[n_sites, rows, D]`` each) in storage
    order by the reader (``read_block``, or ``read_slabs_scatter`` for slabs), checked as
    they are read."""

    def __init__(
        self,
        units: Units,
        plan: EpochPlan,
        io: ThreadPoolExecutor,
        *,
        pools: Buffers,
        reader,
        blocks: Sequence[Sequence[Block]],
        **options,
    ) -> None:
        super().__init__(units, plan, io, **options)
        self.pools, self.reader, self.blocks = pools, reader, blocks
        self._src: dict[int, torch.Tensor] = {}

    def _pool_src(self, pool: int) -> torch.Tensor:
        found = self._src.get(pool)
        if found is None:
            flat = torch.from_numpy(self.pools[pool].reshape(-1))
            n = flat.numel()
            found = flat.as_strided((max(n - self.d_model + 1, 1), self.d_model), (1, 1))
            self._src[pool] = found
        return found

    def open(self, w: int, *, allocate: bool = True, wait: bool = True) -> Window | None:
        pool = self.pools.acquire(allocate=allocate, wait=wait)
        if pool is None:
            return None
        pieces = self._pieces(w)
        whole = self.units.mix == 1  # whole blocks read (dropped rows skipped when gathered)
        sizes = [
            int(self.units.n_blocks_rows[i]) if whole else len(rows)  # type: ignore[arg-type]
            for i, rows in pieces
        ]
        at = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        n_rows = self.pools.shape[1]
        ready: list[Future] = []
        out = self.pools[pool]
        stop = threading.Event()
        for s in range(self.n_sites):
            for run in self._runs([i for i, _ in pieces]):
                tasks = [(pieces[j][0], pieces[j][1], int(at[j])) for j in run]
                ready.append(
                    self.io.submit(self.timed, "read", self._read, s, tasks, out[s], whole, stop)
                )
        d = self.d_model
        starts = (np.arange(self.n_sites, dtype=np.int64)[:, None] * n_rows + at[None, :-1]) * d
        # whole blocks: a unit's row r at its row r; slabs: the rows read one after another
        order = self.io.submit(
            self.timed, "order", self._order, w, pieces, starts, packed=not whole
        )
        release = self.pools.release
        return Window(
            w=w,
            src=self._pool_src(pool),
            order=order,
            ready=ready,
            done=lambda: release(pool),
            stop=stop,
        )

    def _read(
        self,
        s: int,
        tasks: list[tuple[int, np.ndarray | None, int]],
        out: np.ndarray,
        whole: bool,
        stop: threading.Event,
    ) -> None:
        blocks = self.blocks[s]
        if whole:
            for i, _, at in tasks:
                if stop.is_set():  # a window left unserved: the rest is not read
                    return
                block = blocks[i]
                dest = out[at : at + block.n_rows]
                got = self.reader.read_block(block, dest)
                if got is not dest and (
                    not isinstance(got, np.ndarray) or got.ctypes.data != dest.ctypes.data
                ):
                    dest[...] = got
            return
        pieces = []
        for i, rows, at in tasks:
            assert rows is not None  # slabs always name their rows
            pieces.append((blocks[i], rows, at + np.arange(len(rows), dtype=np.int64)))
        self.reader.read_slabs_scatter(pieces, out)
