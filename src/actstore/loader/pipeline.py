"""One consumer's read path: windows made ready ahead, batches gathered from them.

A window's rows are never copied into a window buffer in serving order: each batch is
gathered (``torch.index_select``, off the GIL, on a gather thread of its own running one
batch ahead with one torch thread) straight from where the
rows lie (the page cache, for a mapped store; a reused read buffer otherwise: see
:mod:`.windows`) into the batch's own buffer, with the dtype cast and the normalisation
done chunk by chunk on the way (:meth:`Consumer._gather`). While one window is gathered
from, the next one is read, faulted in and checked on the read threads.

Where a batch lands is the caller's choice (``take``): a reused buffer of this process
(:class:`~.buffers.Buffers`, reused once the batch is dropped), a DataLoader worker's
shared slot, or a ``serve`` ring slot, so a batch crosses a process boundary without a copy.
"""

from __future__ import annotations

import logging
import sys
from collections import deque
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from ..errors import ConfigError, StorageError
from ..formats.base import ReaderBase
from ..formats.blocks import Block, Extent
from ..formats.threads import StageClock, cpu_pool
from ..order import EpochPlan, slab_bounds, slab_of, slab_rows
from ..storage.mapped import MappedFiles
from .buffers import NUMPY_STORAGE, Buffers, allocate_pinned, allocate_private
from .windows import MappedWindows, PooledWindows, Units, Window, Windows

log = logging.getLogger(__name__)

#: Bytes of float32 rows gathered per step when batches are cast or normalised on the way
#: (a cache-sized piece: gathered, converted and written out while it is hot).
CHUNK_BYTES = 1 << 20


class LoaderBatch(NamedTuple):
    """A batch with the storage row of each activation (``return_index=True``)."""

    acts: torch.Tensor
    """``[B, D]`` (one site) or ``[B, n_sites, D]``."""
    rows: torch.Tensor
    """int64 ``[B]``: each row's position in ``blocks(site)`` read in storage order (for a
    saev store ``example * T + token``; ``reader.gather(rows, layer)`` reads it again)."""


class RingBatch(NamedTuple):
    """What a DataLoader worker sends for one batch: the shared slot it was gathered into."""

    worker: int
    slot: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    storage: torch.Tensor | None
    """The slot's shared uint8 tensor, sent with its first batch (the main process keeps it)."""
    rows: np.ndarray | None


@dataclass(frozen=True)
class WorkerLink:
    """Shared memory through which :class:`~actstore.loader.ActivationDataLoader` (the main
    process) and the worker processes running its ActivationLoader coordinate (see
    ``ActivationLoader.attach_workers``)."""

    slot_flags: torch.Tensor
    """int8 ``[workers, slots]``: 1 from when worker ``w`` gathers a batch into its slot
    ``s`` until the main process has dropped every view of that batch."""
    position: torch.Tensor | None = None
    """int64 ``[3]`` (epoch, batches delivered, consumers), read by persistent workers at
    the start of every iteration; None when workers are made anew for each."""

    @classmethod
    def create(cls, workers: int, *, slots: int, persistent: bool) -> WorkerLink:
        """Zeroed counters in shared memory for ``workers`` new worker processes."""
        flags = torch.zeros((workers, slots), dtype=torch.int8).share_memory_()
        position = torch.zeros(3, dtype=torch.int64).share_memory_() if persistent else None
        return cls(slot_flags=flags, position=position)


@dataclass(frozen=True, kw_only=True)
class Layout:
    """What a consumer reads: per-site blocks and how many rows each block serves."""

    reader: Any
    blocks: tuple[Sequence[Block], ...]
    """``blocks[s][i]``: block ``i`` of site ``s`` (aligned across sites)."""
    kept_rows: np.ndarray
    """int64 ``[n_blocks]``: rows block ``i`` serves (its rows minus dropped CLS rows)."""
    first_row: np.ndarray
    """int64 ``[n_blocks]``: storage row of block ``i``'s first row."""
    drop_cls: bool
    d_model: int
    dtype: np.dtype
    mix: int = 1
    """Slabs per block (see :mod:`actstore.order`)."""
    period: int | None = None
    """Rows of one example when blocks hold whole examples (slabs are token ranges)."""
    unit_rows: np.ndarray | None = None
    """int64 ``[mix, n_blocks]``: rows unit (block ``i``, slab ``j``) serves (None: mix 1)."""
    extents: tuple[Sequence[Extent], ...] | None = None
    """``extents[s][i]``: where block ``i`` of site ``s`` lies raw in the store's files, when
    the store can be mapped (None: windows are read into buffers)."""

    @property
    def n_sites(self) -> int:
        return len(self.blocks)

    @property
    def unit_row_counts(self) -> np.ndarray:
        """Rows per unit of the epoch order: :attr:`kept_rows` with ``mix`` 1, else
        :attr:`unit_rows` (``[mix, n_blocks]``)."""
        if self.mix == 1:
            return self.kept_rows
        if self.unit_rows is None:
            raise ConfigError(f"a layout with mix {self.mix} needs unit_rows")
        return self.unit_rows

    @property
    def max_unit_rows(self) -> int:
        """Rows of the largest unit (the largest block with ``mix`` 1)."""
        if self.mix == 1 or self.unit_rows is None:
            return max((b.n_rows for b in self.blocks[0]), default=0)
        return int(self.unit_rows.max(initial=0))

    def slab(self, i: int, j: int) -> np.ndarray:
        """Block-local rows of block ``i`` that slab ``j`` serves (ascending)."""
        rows = slab_rows(self.blocks[0][i].n_rows, self.period, self.mix, j)
        mask = self.kept_mask(i)
        return rows if mask is None else rows[mask[rows]]

    def units(self) -> Units:
        """How windows of this layout are made of blocks' rows."""
        n_rows = np.fromiter((b.n_rows for b in self.blocks[0]), dtype=np.int64)
        every = self.mix == 1 and bool((self.kept_rows == n_rows).all())

        def rows_of(i: int, j: int) -> np.ndarray:
            if self.mix > 1:
                return self.slab(i, j)
            mask = self.kept_mask(i)
            return np.arange(n_rows[i], dtype=np.int64) if mask is None else np.flatnonzero(mask)

        return Units(
            n_blocks_rows=n_rows,
            first_row=self.first_row,
            mix=self.mix,
            rows_of=rows_of,
            all_rows=every,
        )

    def kept_mask(self, i: int) -> np.ndarray | None:
        """Rows of block ``i`` that are served (None: all of them)."""
        block = self.blocks[0][i]
        if not self.drop_cls or self.kept_rows[i] == block.n_rows:
            return None
        mask = np.ones(block.n_rows, dtype=bool)
        mask[self.reader.cls_rows(block)] = False
        return mask


@dataclass(frozen=True, kw_only=True)
class Finish:
    """How a float batch becomes what the user gets (dtype, normalisation, device)."""

    out_dtype: torch.dtype
    shift: torch.Tensor | None
    """Subtracted first (None: nothing): ``[D]`` for one site, ``[n_sites, D]`` for several."""
    scale: torch.Tensor | None
    """Multiplied after the shift (None: nothing): per dimension like ``shift``, or one
    factor per site (``[1]`` or ``[n_sites, 1]``)."""
    single_site: bool
    """Batches are ``[B, D]`` (else ``[B, n_sites, D]``)."""
    pin_memory: bool
    """The buffers batches are cut from are pinned (registered with CUDA)."""
    device: torch.device | None
    """Batches are moved there (``actstore.loader.device.to_device``); None: kept."""
    return_index: bool


def window_shape(layout: Layout, pool_blocks: int) -> tuple[int, int, int]:
    """``[n_sites, rows, d_model]`` of one window buffer of ``pool_blocks`` blocks (windows
    read into buffers: whole blocks, or ``pool_blocks * mix`` slabs)."""
    rows = max(pool_blocks * layout.mix * layout.max_unit_rows, 1)
    return (layout.n_sites, rows, layout.d_model)


class BufferSet:
    """The memory of one consumer process, kept across epochs (fresh memory is slow to
    touch the first time): the batch buffers of this process, and either the mapped store
    (:class:`~actstore.storage.mapped.MappedFiles`) or the window buffers windows are read
    into. ``pinned``: batch buffers are registered with CUDA (batches go to the GPU by DMA)."""

    def __init__(
        self,
        layout: Layout,
        *,
        batch_size: int,
        pool_blocks: int,
        out_dtype: torch.dtype,
        pinned: bool = False,
    ) -> None:
        allocate = allocate_pinned if pinned else allocate_private
        shape = (batch_size, layout.n_sites, layout.d_model)
        self.batches = Buffers(shape, NUMPY_STORAGE[out_dtype], allocate=allocate)
        self.region: MappedFiles | None = None
        self.pools: Buffers | None = None
        if layout.extents is not None:
            reader = layout.reader
            names = dict.fromkeys(e.name for site in layout.extents for e in site)
            try:
                self.region = MappedFiles(reader.files, {n: _file_size(reader, n) for n in names})
            except StorageError as err:  # no address space for it (ulimit -v): read instead
                if not _warned_unmapped:  # once per process, not per worker or epoch
                    log.warning("%s; reading windows into buffers instead", err)
                    _warned_unmapped.append(True)
        if self.region is None:
            # batches are gathered out of them: no view of a window buffer leaves this process
            self.pools = Buffers(window_shape(layout, pool_blocks), layout.dtype, private=True)
            self.pools.reserve(2)  # a window being served and the next one being read

    def take(self) -> np.ndarray:
        """A batch buffer nobody refers to (a new one if every one is held)."""
        i = self.batches.take()
        out = self.batches[i][:]  # referenced until the batch cut from it is dropped
        self.batches.release(i)
        return out

    @property
    def nbytes(self) -> int:
        """Private bytes held now: batch buffers and window buffers."""
        return self.batches.nbytes + (0 if self.pools is None else self.pools.nbytes)

    def close(self) -> None:
        if self.region is not None:
            self.region.close()


def _file_size(reader: ReaderBase, name: str) -> int:
    """The size ``name`` must have: the manifest's where there is one, else as listed."""
    entry = reader.checks.entry(name) if reader.checks.manifest is not None else None
    return entry.size if entry is not None else reader.files.require(name)


class Consumer:
    """Serves stream rows ``[start, stop)`` of one epoch plan in batches; owns its read
    threads for the duration of one iteration."""

    def __init__(
        self,
        layout: Layout,
        plan: EpochPlan,
        buffers: BufferSet,
        *,
        batch_size: int,
        io_threads: int,
        finish: Finish,
        read_blocks: int = 1,
        clock: StageClock | None = None,
    ) -> None:
        self.layout, self.plan, self.finish = layout, plan, finish
        self.batch_size = batch_size
        self.clock = clock
        self._io = ThreadPoolExecutor(max(1, io_threads), thread_name_prefix="actstore-io")
        #: gathers batches one ahead, on one torch thread: its intra-op threads only
        #: contend with the read threads for the cores (measured: 2 threads gathered
        #: slower than 1 and spent 0.3 CPU s/GB more)
        self._gatherer = cpu_pool(1, name="actstore-gather")
        options = {
            "n_sites": layout.n_sites,
            "d_model": layout.d_model,
            "return_index": finish.return_index,
            "read_blocks": read_blocks,
            "clock": clock,
        }
        self.windows: Windows
        if buffers.region is not None and layout.extents is not None:
            checks = layout.reader.checks
            self.windows = MappedWindows(
                layout.units(),
                plan,
                self._io,
                region=buffers.region,
                extents=layout.extents,
                blocks=layout.blocks,
                check=checks.check if checks.enabled else None,
                **options,
            )
        else:
            assert buffers.pools is not None
            self.windows = PooledWindows(
                layout.units(),
                plan,
                self._io,
                pools=buffers.pools,
                reader=layout.reader,
                blocks=layout.blocks,
                **options,
            )
        self._steps: dict[torch.dtype, torch.Tensor] = {}
        #: the first window of ``batches(start, stop)``, made ready by :meth:`prime`
        self._primed: tuple[int, int, Window] | None = None
        #: called by :meth:`batches` once every window it serves is open and one more
        #: could be, until it returns True (the loader primes the next epoch)
        self.on_read_all: Callable[[], bool] | None = None

    def close(self) -> None:
        self._drop_primed()
        if not sys.is_finalizing():  # at interpreter exit the threads are gone already
            self._gatherer.shutdown(wait=True, cancel_futures=True)
            self._io.shutdown(wait=True, cancel_futures=True)

    def _drop_primed(self) -> None:
        if self._primed is not None:
            window = self._primed[2]
            self._primed = None
            _settle(window)

    def prime(self, start: int, stop: int) -> bool:
        """Start getting the first window of ``batches(start, stop)`` ready now, without
        making new memory, so that the first batch of that call (the next epoch's, while
        the trainer still works on this one's last batches) waits for no read. False when
        no window buffer is free or there is nothing to read."""
        plan = self.plan
        if self._primed is not None or start >= stop:
            return False
        first = plan.window_of(start)
        while first <= plan.window_of(stop - 1) and not plan.window_rows(first):
            first += 1
        if first > plan.window_of(stop - 1):
            return False
        window = self.windows.open(first, allocate=False, wait=False)
        if window is None:
            return False
        self._primed = (start, stop, window)
        return True

    # ------------------------------------------------------------------ serving batches

    def batches(
        self,
        start: int,
        stop: int,
        take: Callable[[], np.ndarray],
        cancel: Callable[[], None] | None = None,
    ) -> Generator[Any, None, None]:
        """Batches of ``batch_size`` stream rows from ``start`` (the last one ends at
        ``stop`` and may be short), each gathered into an array ``take()`` gives
        (``[batch_size, n_sites, D]`` of the output dtype's storage). ``cancel()`` is
        called when batches are left unserved while a ``take()`` may still wait: it must
        make that ``take()`` raise."""
        plan, size = self.plan, self.batch_size
        if start >= stop:
            return
        first, last = plan.window_of(start), plan.window_of(stop - 1)
        todo = deque(w for w in range(first, last + 1) if plan.window_rows(w))
        ready: deque[Window] = deque()
        if self._primed is not None:  # the first window, made ready by prime()
            p_start, p_stop, window = self._primed
            if (p_start, p_stop) == (start, stop) and todo and todo[0] == window.w:
                self._primed = None
                todo.popleft()
                ready.append(window)
            else:
                self._drop_primed()
        ahead = [self.on_read_all]

        def prefetch(need: int = 2, *, wait: bool = False) -> None:
            # keep the window being served and the next one ready (more only while one
            # batch spans them: a window a batch needs now is made at once, in a new
            # buffer where windows are read into buffers and none is free)
            while todo and len(ready) < need:
                window = self.windows.open(todo[0], wait=wait or not ready)
                if window is None:
                    return
                todo.popleft()
                ready.append(window)
            if not todo and ahead[0] is not None and len(ready) < 2 and ahead[0]():
                ahead[0] = None

        # batches being gathered (on the gather thread), each with the windows it finishes:
        # one is gathered ahead while the caller uses the one before
        pending: deque[tuple[Future, list[Window]]] = deque()

        def finishing() -> int:
            return sum(len(done) for _, done in pending)

        try:
            prefetch()
            at = start
            while at < stop or pending:
                if at < stop:
                    end = min(at + size, stop)
                    parts: list[tuple[Window, int, int]] = []
                    pos, j = at, 0
                    while pos < end:
                        if j == len(ready):
                            prefetch(j + 1, wait=True)
                        window = ready[j]
                        base = int(plan.row_starts[window.w])
                        stop_w = int(plan.row_starts[window.w + 1])
                        hi = min(end, stop_w)
                        parts.append((window, pos - base, hi - base))
                        pos = hi
                        if hi == stop_w:
                            j += 1
                    done = [ready.popleft() for _ in range(j)]  # windows this batch finishes
                    # the next window is read while this batch is gathered (windows still
                    # being gathered from count: their buffers are not free yet)
                    prefetch(2 - finishing() - len(done))
                    # the buffer is taken on the gather thread too: a serve ring slot may
                    # only come free once the batch before it has been handed out
                    future = self._gatherer.submit(self._gather, parts, take, end - at)
                    pending.append((future, done))
                    at = end
                    del parts, window
                    if len(pending) < 2 and at < stop:
                        continue  # gather one batch ahead before handing one out
                future, done = pending.popleft()
                try:
                    batch = future.result()
                except BaseException:
                    ready.extendleft(reversed(done))  # settled below with the rest
                    raise
                for window in done:
                    window.done()
                del done
                yield batch
                del batch
        finally:
            if cancel is not None and any(not f.done() for f, _ in pending):
                cancel()  # a destination that waits for room (serve's ring) stops waiting
            for future, done in pending:
                future.exception()  # gathers read window buffers: finished before they go
                ready.extendleft(reversed(done))
            for window in ready:
                _settle(window)

    def _gather(
        self, parts: list[tuple[Window, int, int]], take: Callable[[], np.ndarray], n: int
    ) -> Any:
        """Rows of ``parts`` (``(window, first, end)`` served positions) gathered into
        ``take()`` (``[B, S, D]`` storage of the output dtype): the batch of ``n`` rows."""
        fin, layout = self.finish, self.layout
        n_sites, d = layout.n_sites, layout.d_model
        acts = torch.from_numpy(take())
        if fin.out_dtype == torch.bfloat16:
            acts = acts.view(torch.bfloat16)
        flat = acts.view(-1, d)
        ids = []
        at = 0
        for window, lo, hi in parts:
            offsets, rows = window.wait()
            index = torch.from_numpy(offsets[lo * n_sites : hi * n_sites])
            self.windows.timed(
                "gather", self._copy_rows, window.src, index, flat[at : at + len(index)]
            )
            at += len(index)
            if rows is not None:
                ids.append(rows[lo:hi])
        batch = acts[:n]
        if fin.single_site:
            batch = batch.view(n, d)
        if not fin.return_index:
            return batch
        return LoaderBatch(batch, torch.from_numpy(np.concatenate(ids)))

    def _copy_rows(self, src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
        """``out[k] = finish(src[index[k]])``: one ``index_select`` when nothing changes on
        the way, else cache-sized pieces gathered, cast and normalised while hot."""
        fin = self.finish
        if src.dtype == out.dtype and fin.shift is None and fin.scale is None:
            torch.index_select(src, 0, index, out=out)
            return
        n_sites, d = self.layout.n_sites, self.layout.d_model
        step = max(n_sites, CHUNK_BYTES // (4 * d) // n_sites * n_sites)
        for lo in range(0, len(index), step):
            part = index[lo : lo + step]
            k = len(part)
            target = out[lo : lo + k]
            if src.dtype != out.dtype:
                rows = torch.index_select(src, 0, part, out=self._step(src.dtype)[:k])
            else:
                rows = torch.index_select(src, 0, part, out=target)
            if fin.shift is not None or fin.scale is not None:
                if rows.dtype != torch.float32:
                    rows = self._step(torch.float32)[:k].copy_(rows)
                view = rows.view(k // n_sites, n_sites, d) if n_sites > 1 else rows
                if fin.shift is not None:
                    view.sub_(fin.shift)
                if fin.scale is not None:
                    view.mul_(fin.scale)
            if rows.data_ptr() != target.data_ptr():
                target.copy_(rows)

    def _step(self, dtype: torch.dtype) -> torch.Tensor:
        """A reused cache-sized buffer of ``dtype`` rows (one per dtype)."""
        found = self._steps.get(dtype)
        if found is None:
            d = self.layout.d_model
            rows = max(self.layout.n_sites, CHUNK_BYTES // (4 * d))
            found = self._steps[dtype] = torch.empty((rows + self.layout.n_sites, d), dtype=dtype)
        return found


_warned_unmapped: list[bool] = []


def _settle(window: Window) -> None:
    """Let a window go that will not be served: its reads stopped (after the block at hand)
    and finished (they write into its buffer), then the buffer released."""
    window.stop.set()
    for future in [*window.ready, window.order]:
        if not future.cancel():
            future.exception()
    window.done()


def first_rows(blocks: Sequence[Block]) -> np.ndarray:
    """Storage row of each block's first row (blocks listed in storage order)."""
    sizes = np.fromiter((b.n_rows for b in blocks), dtype=np.int64, count=len(blocks))
    return np.concatenate([[0], np.cumsum(sizes)])[:-1].astype(np.int64)


def kept_rows(
    blocks: Sequence[Block], cls_rows: Callable[[Block], np.ndarray | None] | None
) -> np.ndarray:
    """Rows each block serves: all of them, or (given ``cls_rows``) all but its CLS rows."""
    if cls_rows is None:
        return np.fromiter((b.n_rows for b in blocks), dtype=np.int64, count=len(blocks))
    out = np.empty(len(blocks), dtype=np.int64)
    for i, block in enumerate(blocks):
        cls = cls_rows(block)
        out[i] = block.n_rows - (0 if cls is None else len(cls))
    return out


def unit_rows(
    blocks: Sequence[Block],
    period: int | None,
    mix: int,
    cls_rows: Callable[[Block], np.ndarray | None] | None,
) -> np.ndarray:
    """int64 ``[mix, n_blocks]``: rows each slab of each block serves (``cls_rows``
    given: its CLS rows left out)."""
    n = np.fromiter((b.n_rows for b in blocks), dtype=np.int64, count=len(blocks))
    if period:
        out = np.diff(slab_bounds(period, mix))[:, None] * (n // period)[None]
    else:
        out = np.diff(np.arange(mix + 1, dtype=np.int64)[:, None] * n[None] // mix, axis=0)
    if cls_rows is not None:
        for i, block in enumerate(blocks):
            cls = cls_rows(block)
            if cls is not None and len(cls):
                out[:, i] -= np.bincount(slab_of(cls, block.n_rows, period, mix), minlength=mix)
    return out.astype(np.int64)
