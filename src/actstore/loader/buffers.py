"""Memory the loader reuses: :class:`Buffers` (arrays handed out again only once nothing
refers to them), :class:`SharedSlots` (a DataLoader worker's batch slots in shared
memory, handed back by the main process), and how fresh memory is made.

A batch is a view of one of these arrays; the array is reused only once the batch (and
every view of it) is gone, so holding batches is always safe: it costs memory, never
values.

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
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from ..devicecopy import try_pin

#: numpy arrays that hold each output dtype (bfloat16 lives in uint16 arrays, viewed).
NUMPY_STORAGE = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.uint16}


class Buffers:
    """Arrays of one shape and dtype, reused only once no view of them is alive
    (``private``: no view ever leaves the pipeline, so an array is free once released)."""

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: np.dtype | type,
        *,
        allocate: Callable[[int, np.dtype], np.ndarray] | None = None,
        private: bool = False,
    ) -> None:
        self.shape, self.dtype = shape, np.dtype(dtype)
        self._private = private
        self._allocate = allocate or allocate_private
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

    def free(self, i: int) -> bool:
        """Whether array ``i`` is neither in use by the pipeline nor referenced."""
        if self._busy[i]:
            return False
        return self._private or sys.getrefcount(self._roots[i]) == self._idle_refs[i]

    def acquire(self, *, allocate: bool = True, wait: bool = True) -> int | None:
        """Index of a free array (allocating one if none is free and ``allocate``; with
        ``wait=False``, None rather than wait for a reserved array still being made)."""
        for i in range(len(self._arrays)):
            if self.free(i):
                self._busy[i] = True
                return i
        if not allocate or (self._reserved and not wait and not self._reserved[0].done()):
            return None
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

    def take(self) -> int:
        """A free array's index, allocating one when none is free."""
        i = self.acquire()
        assert i is not None  # allocate=True, wait=True always gives one
        return i

    def release(self, i: int) -> None:
        """The pipeline is done with array ``i`` (it is reused once its views are gone)."""
        self._busy[i] = False

    def __getitem__(self, i: int) -> np.ndarray:
        return self._arrays[i]

    def __len__(self) -> int:
        return len(self._arrays)

    @property
    def nbytes(self) -> int:
        """Bytes of every array made so far."""
        return sum(int(root.nbytes) for root in self._roots)


class SharedSlots:
    """A DataLoader worker's batch slots: shared-memory arrays the main process maps once
    and hands out as zero-copy views. ``flags[i]`` is 1 from the moment the worker fills
    slot ``i`` until the main process has dropped every view of the batch it sent there
    (it clears the flag), so a slot is refilled only once nobody can see it. Between
    iterations of persistent workers the main process marks the slots it still holds 2
    (:meth:`reclaim`)."""

    def __init__(self, flags: np.ndarray, shape: tuple[int, ...], dtype: np.dtype | type) -> None:
        self.flags, self.shape, self.dtype = flags, shape, np.dtype(dtype)
        self.storage: list[torch.Tensor] = []
        """Each slot's shared uint8 tensor (sent to the main process with its first batch)."""
        self._arrays: list[np.ndarray] = []
        self.sent: set[int] = set()
        """Slots whose storage the main process already has."""

    def take(self) -> np.ndarray:
        """A slot the main process does not hold (a new one while every slot is held),
        marked held, as an array of ``shape``."""
        while True:
            free = np.flatnonzero(self.flags[: len(self._arrays)] == 0)
            if len(free):
                i = int(free[0])
                break
            if len(self._arrays) < len(self.flags):
                i = self._new()
                break
            time.sleep(0.001)  # every slot held by the main process: wait for one
        self.flags[i] = 1
        return self._arrays[i]

    def reclaim(self) -> None:
        """As a persistent worker starts an iteration: slots filled for batches the main
        process never received (a DataLoader drops what is in flight when an iteration
        is left early) are free again; their memory goes with their next batch."""
        stale = np.flatnonzero(self.flags[: len(self._arrays)] == 1)
        self.flags[stale] = 0
        self.sent.difference_update(stale.tolist())

    def _new(self) -> int:
        count = int(np.prod(self.shape))
        # made shared directly (``empty().share_memory_()`` fills private pages, then copies)
        shared = torch.UntypedStorage._new_shared(max(count * self.dtype.itemsize, 1))
        storage = torch.empty(0, dtype=torch.uint8).set_(shared)
        populate(storage.data_ptr(), storage.numel())
        self.storage.append(storage)
        flat = np.frombuffer(storage.numpy().data, dtype=self.dtype, count=count)
        self._arrays.append(flat.reshape(self.shape))
        return len(self._arrays) - 1

    def locate(self, tensor: torch.Tensor) -> int | None:
        """The slot ``tensor`` (a batch) lies at the start of, else None."""
        ptr = tensor.data_ptr()
        for i, array in enumerate(self._arrays):
            if array.ctypes.data == ptr:
                return i
        return None


def _libc_madvise() -> Callable[..., int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


_MADVISE = _libc_madvise()
_MADV_POPULATE_WRITE = 23  # Linux 5.14+


def populate(address: int, nbytes: int) -> None:
    """Fault in the pages of a fresh shared mapping at once (as ``MAP_POPULATE`` does for
    private memory), off the GIL; where the kernel cannot, the first writes fault them."""
    if _MADVISE is not None and nbytes:
        _MADVISE(address, nbytes, _MADV_POPULATE_WRITE)


def allocate_private(count: int, dtype: np.dtype) -> np.ndarray:
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


def allocate_pinned(count: int, dtype: np.dtype) -> np.ndarray:
    """:func:`allocate_private`, registered with CUDA once (copies to the GPU read it by DMA)."""
    return try_pin(allocate_private(count, dtype))
