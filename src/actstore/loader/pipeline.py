"""One consumer's read path: windows read into reusable pools, batches served from them.

A window's blocks (with ``mix`` > 1: slabs of blocks, ``read_slabs_scatter``) are read by
a small thread pool straight into the rows where the
window's permutation puts them (``read_block_scatter`` when the reader has it), so the
pool holds the window in serving order and a batch is a contiguous slice of it, handed
out as a zero-copy tensor view. While one window is served the next is read into a
second pool. Pools and output buffers are reused only once nothing refers to them any
more (CPython reference counts), so a batch stays valid for as long as it is referenced.

Example:
    >>> buffers = Buffers((4, 2), np.float32)
    >>> i = buffers.acquire(); view = buffers[i][:2]; buffers.release(i)
    >>> buffers.acquire() == i  # still referenced by ``view``: a new array is made
    False
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections import deque
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from ..devicecopy import try_pin
from ..errors import ConfigError
from ..formats.base import Block
from ..order import EpochPlan, slab_bounds, slab_of, slab_rows

#: numpy arrays that hold each output dtype (bfloat16 lives in uint16 arrays, viewed).
_NUMPY_STORAGE = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.uint16}


class LoaderBatch(NamedTuple):
    """A batch with the storage row of each activation (``return_index=True``)."""

    acts: torch.Tensor
    """``[B, D]`` (one site) or ``[B, n_sites, D]``."""
    rows: torch.Tensor
    """int64 ``[B]``: each row's position in ``blocks(site)`` read in storage order (for a
    saev store ``example * T + token``; ``reader.gather(rows, layer)`` reads it again)."""


class RingBatch(NamedTuple):
    """What a DataLoader worker sends for one batch: where in its shared slots it lies."""

    worker: int
    slot: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    storage: torch.Tensor | None
    """The slot's (or pool's) shared uint8 tensor, sent once (the main process keeps it)."""
    rows: np.ndarray | None
    pool: int = -1
    """>= 0: the batch lies in the worker's window pool ``pool`` at byte ``offset`` (no
    copy was made; ``slot`` is unused)."""
    offset: int = 0


@dataclass(frozen=True)
class WorkerLink:
    """Shared memory through which :class:`~actstore.loader.ActivationDataLoader` (the main
    process) and the worker processes running its ActivationLoader coordinate (see
    ``ActivationLoader.attach_workers``)."""

    slot_flags: torch.Tensor
    """int8 ``[workers, slots]``: 1 while the main process still uses batch slot ``s`` of
    worker ``w`` (the worker copies a batch there when it is no slice of a window pool)."""
    pool_released: torch.Tensor
    """int64 ``[workers, pools]``: batches sent from window pool ``p`` of worker ``w`` that
    the main process has dropped (the worker reuses the pool once all are)."""
    position: torch.Tensor | None = None
    """int64 ``[3]`` (epoch, batches delivered, consumers), read by persistent workers at
    the start of every iteration; None when workers are made anew for each."""

    @classmethod
    def create(cls, workers: int, *, slots: int, pools: int, persistent: bool) -> WorkerLink:
        """Zeroed counters in shared memory for ``workers`` new worker processes."""
        flags = torch.zeros((workers, slots), dtype=torch.int8).share_memory_()
        released = torch.zeros((workers, pools), dtype=torch.int64).share_memory_()
        position = torch.zeros(3, dtype=torch.int64).share_memory_() if persistent else None
        return cls(slot_flags=flags, pool_released=released, position=position)


class Buffers:
    """Arrays of one shape and dtype, reused only once no view of them is alive (here, and,
    given ``held``, in another process: ``held(i)`` is true while it still uses array i)."""

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: np.dtype | type,
        *,
        allocate: Callable[[int, np.dtype], np.ndarray] | None = None,
        held: Callable[[int], bool] | None = None,
        limit: int | None = None,
        pause: Callable[[], None] | None = None,
    ) -> None:
        self.shape, self.dtype = shape, np.dtype(dtype)
        self._allocate = allocate or _allocate
        self._held = held
        #: at most this many arrays: at the limit, ``acquire`` waits (calling ``pause``)
        #: for one to come free instead of allocating
        self._limit, self._pause = limit, pause
        self._arrays: list[np.ndarray] = []
        self._roots: list[np.ndarray] = []  # the array every view's ``.base`` points to
        self._idle_refs: list[int] = []  # references to a root when no view is alive
        self._busy: list[bool] = []
        self._reserved: deque[Future] = deque()

    def reserve(self, count: int) -> None:
        """Start allocating ``count`` arrays on a background thread (fresh memory is slow to
        touch; the kernel does it there while the first reads run), for ``acquire``."""
        pool = ThreadPoolExecutor(1, thread_name_prefix="actstore-alloc")
        n = int(np.prod(self.shape))
        self._reserved.extend(pool.submit(self._allocate, n, self.dtype) for _ in range(count))
        pool.shutdown(wait=False)  # the thread ends once the arrays are made

    def acquire(self, *, allocate: bool = True, wait: bool = True) -> int | None:
        """Index of a free array (allocating one if none is free and ``allocate``; with
        ``wait=False``, None rather than wait for a reserved array still being made)."""
        while True:
            for i in range(len(self._arrays)):
                if (
                    not self._busy[i]
                    and sys.getrefcount(self._roots[i]) == self._idle_refs[i]
                    and not (self._held and self._held(i))
                ):
                    self._busy[i] = True
                    return i
            if not allocate or (self._reserved and not wait and not self._reserved[0].done()):
                return None
            if self._limit is None or len(self._arrays) < self._limit:
                break
            if self._pause is None:
                return None
            self._pause()  # every array in use and no more may be made: wait for one
        if self._reserved:
            root = self._reserved.popleft().result()
        else:
            root = self._allocate(int(np.prod(self.shape)), self.dtype)
        self._roots.append(root)
        self._arrays.append(root.reshape(self.shape))
        del root
        self._idle_refs.append(sys.getrefcount(self._roots[-1]))
        self._busy.append(True)
        return len(self._arrays) - 1

    def can_grow(self) -> bool:
        """Whether one more array may be made without waiting (below ``limit``)."""
        return self._limit is None or len(self._arrays) < self._limit

    def take(self) -> int:
        """:meth:`acquire` on buffers without a ``limit``: a free array's index, allocating
        one when none is free (so never None)."""
        i = self.acquire()
        if i is None:
            raise AssertionError("Buffers.take needs buffers without a limit")
        return i

    def release(self, i: int) -> None:
        """The pipeline is done with array ``i`` (it is reused once its views are gone)."""
        self._busy[i] = False

    def locate(self, array: np.ndarray | torch.Tensor) -> tuple[int, int] | None:
        """``(index, byte offset)`` of a contiguous ``array`` lying inside one of these
        arrays, else None."""
        if isinstance(array, torch.Tensor):
            if not array.is_contiguous():
                return None
            ptr, nbytes = array.data_ptr(), array.numel() * array.element_size()
        else:
            if not array.flags.c_contiguous:
                return None
            ptr, nbytes = array.ctypes.data, array.nbytes
        for i, root in enumerate(self._roots):
            offset = ptr - root.ctypes.data
            if 0 <= offset and offset + nbytes <= root.nbytes:
                return i, offset
        return None

    def __getitem__(self, i: int) -> np.ndarray:
        return self._arrays[i]

    def __len__(self) -> int:
        return len(self._arrays)


def _libc_madvise() -> Callable[..., int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


_MADVISE = _libc_madvise()
_MADV_POPULATE_WRITE = 23  # Linux 5.14+


def _populate(address: int, nbytes: int) -> None:
    """Fault in the pages of a fresh shared mapping at once (as ``MAP_POPULATE`` does for
    private memory), off the GIL; where the kernel cannot, the first reads fault them."""
    if _MADVISE is not None and nbytes:
        _MADVISE(address, nbytes, _MADV_POPULATE_WRITE)


def _allocate(count: int, dtype: np.dtype) -> np.ndarray:
    """``count`` items of private anonymous memory in small pages. Not ``np.empty``: numpy
    advises transparent huge pages for large arrays, and with the page cache full of
    activations the kernel then compacts memory on every fault (measured: the first epoch
    costs twice the CPU, later epochs 15% more)."""
    nbytes = max(count * dtype.itemsize, 1)
    # MAP_POPULATE: the kernel faults every page in at once, much cheaper than one trap
    # per page on first touch (measured: the first epoch paid ~2x the CPU per byte)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    memory = mmap.mmap(-1, nbytes, flags=flags)
    return np.frombuffer(memory, dtype=dtype, count=count)


def _allocate_pinned(count: int, dtype: np.dtype) -> np.ndarray:
    """:func:`_allocate`, registered with CUDA once (copies to the GPU read it by DMA)."""
    return try_pin(_allocate(count, dtype))


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


def pool_shape(layout: Layout, pool_blocks: int) -> tuple[int, int, int]:
    """``[rows, n_sites, d_model]`` of one window pool of ``pool_blocks`` blocks."""
    return (max(pool_blocks * layout.mix * layout.max_unit_rows, 1), layout.n_sites, layout.d_model)


class BufferSet:
    """The buffers of one consumer process, kept across epochs (fresh memory is slow to
    touch the first time): window pools, batches assembled across windows, a float32
    stage (normalising non-float32 rows) and the output dtype.

    ``pools``: window pools made by the caller (their shape: :func:`pool_shape`).
    ``released`` (a DataLoader worker's, set by :class:`ActivationDataLoader`): the window
    pools are shared memory, batches cut from them are sent to the main process without a
    copy (:attr:`pool_storage`), and a pool is reused only once ``released[i]`` (counted by
    the main process) catches up with :attr:`pool_sent` ``[i]``.
    ``pinned``: the window pools and the buffers batches are assembled in are registered
    with CUDA, so batches cut from them go to the GPU by DMA."""

    def __init__(
        self,
        layout: Layout,
        *,
        batch_size: int,
        pool_blocks: int,
        out_dtype: torch.dtype,
        released: np.ndarray | None = None,
        pools: Buffers | None = None,
        pinned: bool = False,
    ) -> None:
        shape = pool_shape(layout, pool_blocks)
        allocate = _allocate_pinned if pinned else _allocate
        self.pool_storage: list[torch.Tensor] = []
        self.pool_sent = np.zeros(0 if released is None else len(released), dtype=np.int64)
        if pools is not None:  # given by the owner of the memory (``actstore serve``)
            self.pools = pools
        elif released is None:
            self.pools = Buffers(shape, layout.dtype, allocate=allocate)
        else:
            self.pools = Buffers(
                shape,
                layout.dtype,
                allocate=self._allocate_shared,
                held=lambda i: bool(self.pool_sent[i] != released[i]),
            )
        if pools is None:
            self.pools.reserve(2)  # a window being served and the next one being read
        row_shape = (batch_size, layout.n_sites, layout.d_model)
        self.carry = Buffers(row_shape, layout.dtype, allocate=allocate)
        self.stage = Buffers(row_shape, np.float32, allocate=allocate)  # a batch, when float32
        self.out = Buffers(row_shape, _NUMPY_STORAGE[out_dtype], allocate=allocate)

    def _allocate_shared(self, count: int, dtype: np.dtype) -> np.ndarray:
        """A window pool in shared memory, its pages faulted in at once."""
        if len(self.pool_storage) >= len(self.pool_sent):
            raise ConfigError(
                f"more than {len(self.pool_sent)} window pools held at once in one worker: "
                "drop batches you no longer need"
            )
        # made shared directly (``empty().share_memory_()`` would fill private pages, then
        # copy them into shared ones: measured 2.5x the time for a fresh pool)
        shared = torch.UntypedStorage._new_shared(max(count * dtype.itemsize, 1))
        storage = torch.empty(0, dtype=torch.uint8).set_(shared)
        _populate(storage.data_ptr(), storage.numel())
        self.pool_storage.append(storage)
        # through a memoryview, so every view's ``.base`` is the array returned here
        return np.frombuffer(storage.numpy().data, dtype=dtype, count=count)

    def pool_of(self, acts: torch.Tensor) -> tuple[int, int] | None:
        """``(pool, byte offset)`` when ``acts`` is a contiguous slice of a shared pool."""
        return self.pools.locate(acts) if self.pool_storage else None


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
    ) -> None:
        self.layout, self.plan, self.finish = layout, plan, finish
        self.read_blocks = max(1, read_blocks)
        self.batch_size = batch_size
        self._pools, self._carry = buffers.pools, buffers.carry
        self._stage, self._out = buffers.stage, buffers.out
        self._slabs: dict[tuple[int, int], np.ndarray] = {}
        self._io = ThreadPoolExecutor(max(1, io_threads), thread_name_prefix="actstore-io")
        #: the first window of ``batches(start, stop)``, read ahead by :meth:`prime`:
        #: (start, stop, window, pool, permutation, read futures)
        self._primed: tuple[int, int, int, int, np.ndarray, list[Future]] | None = None
        #: called by :meth:`batches` once every window it serves is read or being read and
        #: a pool may be free, until it returns True (the loader primes the next epoch)
        self.on_read_all: Callable[[], bool] | None = None

    def close(self) -> None:
        if not sys.is_finalizing():  # at interpreter exit the threads are gone already
            self._io.shutdown(wait=True, cancel_futures=True)
        self._drop_primed()

    def _drop_primed(self) -> None:
        if self._primed is not None:
            *_, pool, _, futures = self._primed
            self._primed = None
            for future in futures:  # the reads write into the pool: done before it is reused
                if not future.cancel():
                    future.exception()
            self._pools.release(pool)

    def prime(self, start: int, stop: int) -> bool:
        """Start reading the first window of ``batches(start, stop)`` now, into a window
        pool that is free (no new memory is made), so that the first batch of that call
        (the next epoch's, while the trainer still works on this one's last batches)
        waits for no read. False when no pool is free or there is nothing to read."""
        plan = self.plan
        if self._primed is not None or start >= stop:
            return False
        first = plan.window_of(start)
        while first <= plan.window_of(stop - 1) and not plan.window_rows(first):
            first += 1
        if first > plan.window_of(stop - 1):
            return False
        pool = self._pools.acquire(allocate=False, wait=False)
        if pool is None:
            return False
        perm = plan.window_permutation(first)
        self._primed = (start, stop, first, pool, perm, self._submit(first, pool, perm))
        return True

    # ------------------------------------------------------------------ reading windows

    def _submit(self, w: int, pool: int, perm: np.ndarray) -> list[Future]:
        """Start reading window ``w`` into pool ``pool`` so that position ``p`` holds window
        row ``perm[p]``; returns the read futures. Blocks are read in storage order, one
        task per stretch of consecutive blocks (at most ``read_blocks`` of them): a task is
        one long sequential read, and several tasks are in flight."""
        plan, layout = self.plan, self.layout
        slot = np.empty_like(perm)
        slot[perm] = np.arange(len(perm))
        blocks = plan.window_blocks(w)
        if layout.mix > 1:
            return self._submit_units(blocks, pool, slot)
        offsets = np.concatenate([[0], np.cumsum(layout.kept_rows[blocks])])
        order = np.argsort(blocks, kind="stable")
        tasks: list[list[tuple[int, np.ndarray | None, np.ndarray]]] = []
        previous = -2
        for j in order.tolist():
            i = int(blocks[j])
            n_kept = int(layout.kept_rows[i])
            mask = layout.kept_mask(i)
            if mask is None:
                dest = slot[offsets[j] : offsets[j] + n_kept]
            else:
                dest = np.full(len(mask), -1, dtype=np.int64)
                dest[mask] = slot[offsets[j] : offsets[j] + n_kept]
            if i != previous + 1 or len(tasks[-1]) >= self.read_blocks:
                tasks.append([])
            tasks[-1].append((i, None, dest))
            previous = i
        return self._start(tasks, pool)

    def _submit_units(self, units: np.ndarray, pool: int, slot: np.ndarray) -> list[Future]:
        """:meth:`_submit` for ``mix`` > 1: each unit is one slab of a block, read with
        ``read_slabs_scatter``; units of one slab of consecutive blocks share a task."""
        layout = self.layout
        rows_of = layout.unit_row_counts.reshape(-1)
        offsets = np.concatenate([[0], np.cumsum(rows_of[units])]).tolist()
        tasks: list[list[tuple[int, np.ndarray | None, np.ndarray]]] = []
        previous = -2
        for j in np.argsort(units, kind="stable").tolist():
            u = int(units[j])
            i, sl = self.plan.unit(u)
            rows = self._slab(i, sl)
            if not len(rows):  # an empty slab (a block of fewer rows than mix)
                continue
            dest = slot[offsets[j] : offsets[j + 1]]
            if u != previous + 1 or len(tasks[-1]) >= self.read_blocks:
                tasks.append([])
            tasks[-1].append((i, rows, dest))
            previous = u
        return self._start(tasks, pool)

    def _slab(self, i: int, j: int) -> np.ndarray:
        """``layout.slab(i, j)``, shared by blocks of one size that serve all their rows."""
        layout = self.layout
        if layout.drop_cls:
            return layout.slab(i, j)
        key = (layout.blocks[0][i].n_rows, j)
        rows = self._slabs.get(key)
        if rows is None:
            rows = self._slabs[key] = layout.slab(i, j)
        return rows

    def _start(
        self, tasks: list[list[tuple[int, np.ndarray | None, np.ndarray]]], pool: int
    ) -> list[Future]:
        layout = self.layout
        futures = []
        for s in range(layout.n_sites):
            out = self._pools[pool][:, s, :]
            for task in tasks:
                futures.append(self._io.submit(self._read_run, s, task, out))
        return futures

    def _read_run(
        self, site: int, task: list[tuple[int, np.ndarray | None, np.ndarray]], out: np.ndarray
    ) -> None:
        blocks = self.layout.blocks[site]
        if self.layout.mix > 1:  # slabs: the reader may read the task's pieces together
            pieces = [(blocks[i], rows, dest) for i, rows, dest in task]
            self.layout.reader.read_slabs_scatter(pieces, out)
            return
        for i, _, dest in task:
            self._read(blocks[i], out, dest)

    def _read(self, block: Block, out: np.ndarray, dest: np.ndarray) -> None:
        self.layout.reader.read_block_scatter(block, out, dest)

    def _row_ids(self, w: int, perm: np.ndarray) -> np.ndarray:
        """Storage row of each served position of window ``w``."""
        layout, parts = self.layout, []
        for u in self.plan.window_blocks(w):
            if layout.mix > 1:
                i, sl = self.plan.unit(int(u))
                parts.append(layout.first_row[i] + self._slab(i, sl))
                continue
            i = int(u)
            local = np.arange(layout.blocks[0][i].n_rows, dtype=np.int64)
            mask = layout.kept_mask(i)
            parts.append(layout.first_row[i] + (local if mask is None else local[mask]))
        ids = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        return ids[perm]

    # ------------------------------------------------------------------ serving batches

    def batches(self, start: int, stop: int) -> Generator[Any, None, None]:
        """Batches of ``batch_size`` stream rows from ``start`` (the last one ends at
        ``stop`` and may be short)."""
        plan, size = self.plan, self.batch_size
        if start >= stop:
            return
        first, last = plan.window_of(start), plan.window_of(stop - 1)
        todo = deque(w for w in range(first, last + 1) if plan.window_rows(w))
        loaded: deque[tuple[int, int, np.ndarray, list[Future]]] = deque()
        if self._primed is not None:  # the first window, read ahead by prime()
            p_start, p_stop, w, pool, perm, futures = self._primed
            if (p_start, p_stop) == (start, stop) and todo and todo[0] == w:
                self._primed = None
                todo.popleft()
                loaded.append((w, pool, perm, futures))
            else:
                self._drop_primed()

        ahead = [self.on_read_all]  # the next epoch's read, started once a pool is free
        starved = [0]  # batches served while the next window waited for a free pool

        def prefetch() -> None:
            # Keep the window being served and the next one in pools. Two pools are made;
            # a third only if nothing is left to serve while the user still holds a batch
            # from both (it would otherwise be overwritten), or once the next window has
            # waited two batches for a pool the user still holds a batch of (e.g. the
            # last batch of the previous epoch, still bound to the loop's variable):
            # reading it only when this window is done would stall every window.
            if not todo:
                if ahead[0] is not None and len(loaded) < 2 and ahead[0]():
                    ahead[0] = None
                return
            while todo and len(loaded) < 2:
                # the first window waits for its pool; the next is read once its pool,
                # made in the background meanwhile, is ready
                grow = starved[0] >= 2 and self._pools.can_grow()  # never waits for one
                pool = self._pools.acquire(
                    allocate=not loaded or len(self._pools) < 2 or grow, wait=not loaded
                )
                if pool is None:
                    starved[0] += 1
                    return
                starved[0] = 0
                w = todo.popleft()
                perm = plan.window_permutation(w)
                loaded.append((w, pool, perm, self._submit(w, pool, perm)))

        carry: tuple[int, int] | None = None  # (carry buffer, rows filled)
        carry_ids: list[np.ndarray] = []
        prefetch()
        while loaded:
            w, pool, perm, futures = loaded[0]
            for future in futures:
                future.result()
            ids = self._row_ids(w, perm) if self.finish.return_index else None
            base = int(plan.row_starts[w])
            pos = max(start, base) - base
            end = min(stop, int(plan.row_starts[w + 1])) - base
            rows = self._pools[pool]
            while pos < end:
                prefetch()
                if carry is None and (end - pos >= size or base + end == stop):
                    n = min(size, end - pos)
                    batch_ids = None if ids is None else ids[pos : pos + n]
                    yield self._finish(rows[pos : pos + n], batch_ids)
                    pos += n
                    continue
                if carry is None:
                    carry = (self._carry.take(), 0)
                buf, filled = carry
                n = min(size - filled, end - pos)
                self._carry[buf][filled : filled + n] = rows[pos : pos + n]
                if ids is not None:
                    carry_ids.append(ids[pos : pos + n])
                pos, filled = pos + n, filled + n
                carry = (buf, filled)
                if filled == size or base + pos == stop:
                    batch_ids = np.concatenate(carry_ids) if ids is not None else None
                    yield self._finish(self._carry[buf][:filled], batch_ids)
                    self._carry.release(buf)
                    carry, carry_ids = None, []
            del rows
            loaded.popleft()
            self._pools.release(pool)
            prefetch()

    def _finish(self, rows: np.ndarray, ids: np.ndarray | None) -> Any:
        """Rows ``[n, S, D]`` (a pool or carry view) -> the batch in host memory (the
        loader moves it to ``finish.device``)."""
        fin, n = self.finish, len(rows)
        shape = (n, self.layout.d_model) if fin.single_site else rows.shape
        acts = torch.from_numpy(rows.reshape(shape))
        if fin.shift is not None or fin.scale is not None:
            if acts.dtype != torch.float32:
                stage = self._stage.take()
                staged = torch.from_numpy(self._stage[stage][:n].reshape(shape))
                self._stage.release(stage)
                acts = staged.copy_(acts)
            if fin.shift is not None:
                acts.sub_(fin.shift)
            if fin.scale is not None:
                acts.mul_(fin.scale)
        if acts.dtype != fin.out_dtype:
            out = self._out.take()
            target = torch.from_numpy(self._out[out][:n].reshape(shape))
            self._out.release(out)
            if fin.out_dtype == torch.bfloat16:
                target = target.view(torch.bfloat16)
            acts = target.copy_(acts)
        if not fin.return_index:
            return acts
        return LoaderBatch(acts, torch.from_numpy(np.ascontiguousarray(ids)))


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
