"""The write pipeline's threads, buffers and clock, shared by every writer (and the
loader's gather): the CPU and I/O pools and the settings that size them
(``ACTSTORE_WRITER_THREADS``, ``ACTSTORE_WRITER_STREAMS``), fresh large buffers backed by
huge pages, row copies spread over the pool, and :class:`StageClock`, the CPU seconds
each stage took."""

from __future__ import annotations

import contextlib
import functools
import math
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ConfigError
from ..forksafe import ForkSafeLock
from ..storage.manifest import manifest_key
from ..storage.writeback import direct_io_enabled, pool_size

if TYPE_CHECKING:
    import torch
else:
    from .._lazy import torch

#: Fresh buffers of at least this many bytes come from :func:`empty_bytes`' mapping.
HUGE_FROM = 4 << 20


def empty_bytes(nbytes: int) -> np.ndarray:
    """A fresh, uninitialised ``uint8`` buffer of ``nbytes`` for the writer's own large
    buffers (cast output, Activault's megabatches and upload buffers). From
    :data:`HUGE_FROM` bytes it is an anonymous mapping advised to use transparent huge
    pages where the system offers them: the first write to fresh memory then faults once
    per 2 MiB instead of once per 4 KiB (a first copy into it ran at 4.1 GB/s instead of
    1.3 on the 2-core machine); the system may still back it with small pages."""
    if nbytes < HUGE_FROM or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.empty(nbytes, np.uint8)
    mapped = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # advice only: a kernel without THP says no
        mapped.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(mapped, np.uint8)  # keeps the mapping alive while it is used


def empty_tensor(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """:func:`empty_bytes` as a C-contiguous CPU tensor of ``shape`` and ``dtype``; it
    owns exactly its storage (as ``torch.save`` needs)."""
    dims = tuple(int(n) for n in shape)
    nbytes = math.prod(dims) * dtype.itemsize
    if nbytes < HUGE_FROM:
        return torch.empty(dims, dtype=dtype)
    return torch.from_numpy(empty_bytes(nbytes)).view(dtype).view(dims)


class StageClock:
    """CPU seconds spent per pipeline stage (``cast``, ``encode``, ``statistics``,
    ``write``, ``hash``, ``commit``), summed over threads: where a writer's time goes
    (``benchmarks/bench_writers.py`` prints it). Stages nest: time a thread spends in a
    stage inside another (a stream's writes inside ``torch.save``'s encoding) counts once,
    for the inner stage."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._lock = threading.Lock()
        self._inner = threading.local()  # per thread: seconds of nested stages so far

    def add(self, stage: str, seconds: float) -> None:
        with self._lock:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds
        inner = getattr(self._inner, "seconds", None)
        if inner is not None:
            self._inner.seconds = inner + seconds

    def timed(self, stage: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, its thread's CPU time (less nested stages) added to ``stage``."""
        outer = getattr(self._inner, "seconds", None)
        self._inner.seconds = 0.0
        t0 = time.thread_time()
        try:
            return fn(*args)
        finally:
            spent = time.thread_time() - t0
            nested = self._inner.seconds
            self._inner.seconds = None
            self.add(stage, spent - nested)
            self._inner.seconds = None if outer is None else outer + spent


THREADS_ENV, STREAMS_ENV = "ACTSTORE_WRITER_THREADS", "ACTSTORE_WRITER_STREAMS"


def check_settings() -> None:
    """Refuse a bad ``ACTSTORE_WRITER_THREADS``, ``ACTSTORE_WRITER_STREAMS``,
    ``ACTSTORE_DIRECT_IO`` or an empty ``ACTSTORE_MANIFEST_KEY`` (one line, a
    :class:`~actstore.errors.ConfigError`): what a writer calls when it opens, before
    anything is written."""
    env_count(THREADS_ENV)
    env_count(STREAMS_ENV)
    direct_io_enabled()
    manifest_key()


def env_count(name: str) -> int | None:
    """A thread count set in environment variable ``name`` (None when unset).

    Example:
        >>> env_count("ACTSTORE_NOT_SET") is None
        True
    """
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"{name} must be a whole number of threads, at least 1, not {text!r}")
    return int(text)


def _one_torch_thread() -> None:
    """A pool thread's torch ops run on that thread alone: the pool is the parallelism.
    (OpenMP's workers otherwise spin after each op: on 2 cores a bfloat16 copy cost 0.97
    CPU s/GB with torch's 2 threads against 0.17 with one.) Under OpenMP a thread's count
    is its own once set; ``torch.set_num_threads`` also sets the default threads not yet
    started take, which is put back at once, so the caller's model keeps its threads."""
    with _THREADS_LOCK:
        if not _thread_count_is_per_thread():
            return
        before = torch.get_num_threads()  # the process-wide default (this thread is new)
        torch.set_num_threads(1)
        _on_new_thread(torch.set_num_threads, before)


_THREADS_LOCK = ForkSafeLock()  # the gather thread of a forked DataLoader worker takes it


def _on_new_thread(fn: Callable[..., Any], *args: Any) -> None:
    thread = threading.Thread(target=fn, args=args)
    thread.start()
    thread.join()


@functools.cache
def _thread_count_is_per_thread() -> bool:
    """Whether ``torch.set_num_threads`` on one thread leaves a running thread's count
    alone (OpenMP builds); else pool threads keep torch's count."""
    before = torch.get_num_threads()
    if before == 1:
        return False
    _on_new_thread(torch.set_num_threads, 1)
    own = torch.get_num_threads() == before
    _on_new_thread(torch.set_num_threads, before)
    torch.set_num_threads(before)
    return own


def cpu_pool(threads: int, name: str = "actstore-cpu") -> ThreadPoolExecutor:
    """A writer's pool of CPU workers, each running torch ops single-threaded."""
    return ThreadPoolExecutor(threads, thread_name_prefix=name, initializer=_one_torch_thread)


#: Bytes of one task of :func:`copy_rows`: enough to amortise a task, small enough to
#: spread a batch over the pool.
COPY_BYTES = 8 << 20


def copy_rows(
    pool: Executor,
    copies: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    clock: StageClock,
    stage: str = "cast",
) -> None:
    """Run ``dest.copy_(src)`` (``src.index_select(0, index)`` when an index is given,
    casting to ``dest``'s dtype) for every ``(dest, src, index)`` on ``pool``, in blocks
    of rows of about :data:`COPY_BYTES`, and wait for all of them (CPU time on ``clock``'s
    ``stage``)."""
    futures = []
    for dest, src, index in copies:
        n = dest.shape[0]
        row = max(1, dest[:1].numel() * max(dest.element_size(), src.element_size()))
        step = max(1, COPY_BYTES // row)
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            part = None if index is None else index[lo:hi]
            futures.append(
                pool.submit(clock.timed, stage, _copy_block, dest[lo:hi], src, part, lo, hi)
            )
    wait_all(futures)


def _copy_block(
    dest: torch.Tensor, src: torch.Tensor, index: torch.Tensor | None, lo: int, hi: int
) -> None:
    if index is None:
        dest.copy_(src[lo:hi])
    elif dest.dtype == src.dtype:
        torch.index_select(src, 0, index, out=dest)
    else:
        dest.copy_(src.index_select(0, index))


class Pools:
    """The writer's threads: ``cpu`` (statistics, hashing, encoding) and ``io`` (writes).

    ``threads``: CPU workers (default: ``ACTSTORE_WRITER_THREADS`` if set, else this
    process's CPUs); ``streams``: concurrent writes (default: ``ACTSTORE_WRITER_STREAMS``
    if set, else ``min(4, threads)``, at least 2, so a write blocked on the disk never
    stops the next one). The variables let a benchmark or a shared machine size every
    writer's pools (``benchmarks/bench_writers.py`` scales them from 1 to N)."""

    def __init__(
        self,
        threads: int | None = None,
        streams: int | None = None,
        clock: StageClock | None = None,
    ) -> None:
        self.clock = clock or StageClock()
        self.threads = int(threads or env_count(THREADS_ENV) or pool_size())
        self.streams = int(streams or env_count(STREAMS_ENV) or max(2, min(4, self.threads)))
        self.cpu = cpu_pool(self.threads)
        self.io = ThreadPoolExecutor(self.streams, thread_name_prefix="actstore-io")

    def shutdown(self) -> None:
        self.cpu.shutdown(wait=True)
        self.io.shutdown(wait=True)


def wait_all(futures: Sequence[Future]) -> None:
    """Wait for every one of ``futures``, then raise the first failure (if any)."""
    error: BaseException | None = None
    for fut in futures:
        try:
            fut.result()
        except BaseException as err:  # noqa: BLE001 - wait for every one, raise the first
            error = error or err
    if error is not None:
        raise error
