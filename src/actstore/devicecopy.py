"""Copies between host memory and a CUDA device that run beside the computation.

- :class:`Copies` starts copies on their own stream and returns a :class:`Transfer` to
  wait on: ``to_host`` (ordered after the work already queued on the current stream, e.g.
  the forward pass that produced the tensors) into pinned host memory from torch's pinned
  memory cache, and ``to_device`` (allocated and copied on the side stream, so the copy of
  the next batch overlaps the work on this one).
- :class:`CudaCopies` is the CUDA implementation (one dedicated stream, events);
  :class:`ThreadCopies` keeps the same contract for any other device by copying on one
  thread (so what is built on :class:`Copies` runs, and is tested, on the CPU);
  :func:`copies_for` picks one for a device.
- :func:`pin` registers host memory that the caller owns (a batch buffer, a shared-memory
  batch slot, the ``serve`` ring) with the CUDA runtime once, so copies from it run at the DMA
  engine's rate with no staging copy; the registration ends when the array is freed.
  :func:`can_pin_files_under` tells whether files mapped from a directory can be pinned at
  all (Linux pins only memory-backed files: tmpfs, hugetlbfs).
- :class:`Staging`: where host memory cannot be pinned (``ulimit -l``, a ring on a disk
  file system, ``ACTSTORE_PIN=0``), batches are first copied into a few reused staging
  buffers that are (pinned on CUDA), then copied to the device from there.

Example:
    >>> copies = ThreadCopies()
    >>> transfer = copies.to_host([torch.arange(4.0)], torch.float16)
    >>> transfer.wait()[0].dtype, transfer.done()
    (torch.float16, True)
    >>> copies.close()
"""

from __future__ import annotations

import abc
import ctypes
import logging
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from .errors import DeviceError

log = logging.getLogger(__name__)
# ---------------------------------------------------------------------- registered memory

_PINNED: dict[int, int] = {}  # address -> bytes of every live registration made here
_PINNED_LOCK = threading.Lock()
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.0f} MiB" if nbytes >= 2**20 else f"{nbytes:,} bytes"


def pinning_enabled() -> bool:
    """False when ``ACTSTORE_PIN=0``: no host memory is registered with CUDA, and copies to
    the GPU go through :class:`Staging` buffers (for machines with a small locked-memory
    limit, and to run the staging path on purpose)."""
    return os.environ.get("ACTSTORE_PIN", "1").strip().lower() not in ("0", "off", "false", "no")


def pin(array: np.ndarray) -> np.ndarray:
    """Register ``array``'s memory with CUDA (``cudaHostRegister``), once; returns ``array``.

    ``array`` must own a contiguous mapping that outlives every view of it (views' ``.base``
    is ``array``): the registration is dropped by a finalizer when ``array`` is freed, so
    it never outlives the memory. Registering again, or an empty array, is a no-op."""
    address, nbytes = int(array.ctypes.data), int(array.nbytes)
    if nbytes == 0:  # cudaHostRegister rejects zero bytes (cudaErrorInvalidValue)
        return array
    if not pinning_enabled():
        raise DeviceError("ACTSTORE_PIN=0: host memory is not pinned")
    with _PINNED_LOCK:
        if address in _PINNED:
            return array
        code = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, _HOST_REGISTER_PORTABLE))
        if code != 0:
            _clear_cuda_error()  # else the next CUDA call (a copy) reports it as its own
            raise DeviceError(
                f"cannot pin {_size(nbytes)} of host memory for copies to CUDA "
                f"(cudaHostRegister error {code}); raise the locked-memory limit (ulimit -l), "
                "or leave device unset and move batches yourself"
            )
        _PINNED[address] = nbytes
    finalizer = weakref.finalize(array, _unpin, address)
    finalizer.atexit = False  # at exit the driver releases everything anyway
    return array


def try_pin(array: np.ndarray) -> np.ndarray:
    """:func:`pin` where pinning only makes copies faster: if the memory cannot be pinned,
    say so once (copies from it then go through :class:`Staging`: correct, slower)."""
    global _WARNED
    try:
        return pin(array)
    except DeviceError as err:
        if not _WARNED and pinning_enabled():
            _WARNED = True
            log.warning("%s; copies to the GPU go through a staging buffer instead", err)
        return array


_WARNED = False


def is_pinned(array: np.ndarray) -> bool:
    """Whether ``array``'s memory was registered by :func:`pin` (and still is)."""
    with _PINNED_LOCK:
        return int(array.ctypes.data) in _PINNED


def _cudart_function(name: str) -> Callable[..., int] | None:
    """``name`` from the CUDA runtime torch loaded (torch binds only a few of them)."""
    bound = getattr(torch.cuda.cudart(), name, None)
    if bound is not None:
        return bound  # type: ignore[no-any-return]
    try:
        maps = open("/proc/self/maps").read().split()  # noqa: SIM115 - read at once
    except OSError:
        maps = []
    candidates = [None, *sorted({m for m in maps if "libcudart.so" in m})]
    for library in candidates:
        try:
            fn = getattr(ctypes.CDLL(library), name)
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        return fn  # type: ignore[no-any-return]
    return None


def _clear_cuda_error() -> None:
    """Reset the runtime's last error after a failed call whose failure was handled."""
    clear = _cudart_function("cudaGetLastError")
    if clear is not None:
        clear()


#: file systems whose mapped files Linux lets a device pin for long (``FOLL_LONGTERM``):
#: memory-backed ones; pages of disk files (ext4, xfs, ...) are refused (EFAULT, which CUDA
#: reports as cudaErrorInvalidValue)
PINNABLE_FILE_SYSTEMS = ("tmpfs", "hugetlbfs", "ramfs")


def can_pin_files_under(directory: str | os.PathLike[str]) -> bool:
    """Whether memory mapped from files in ``directory`` can be pinned (its file system, per
    /proc/mounts, is memory-backed)."""
    path = os.path.realpath(directory)
    best, kind = "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount = fields[1].replace("\\040", " ")
                inside = path == mount or path.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, kind = mount, fields[2]
    except OSError:
        return True  # cannot tell: try, and fall back if the registration fails
    return kind in PINNABLE_FILE_SYSTEMS


def _unpin(address: int) -> None:
    with _PINNED_LOCK:
        if _PINNED.pop(address, None) is not None:
            torch.cuda.cudart().cudaHostUnregister(address)


def pinned_bytes() -> int:
    """Bytes of host memory registered by :func:`pin` and not yet released."""
    with _PINNED_LOCK:
        return sum(_PINNED.values())


# ---------------------------------------------------------------------- copies


class Transfer(abc.ABC):
    """Copies started by :class:`Copies`; their results are ``outputs`` once finished."""

    outputs: list[torch.Tensor]

    @abc.abstractmethod
    def done(self) -> bool:
        """Whether the copies have finished (never blocks; a failed copy counts as done)."""

    @abc.abstractmethod
    def wait(self) -> list[torch.Tensor]:
        """Block this thread until the copies have finished; the outputs (raises
        :class:`~actstore.errors.DeviceError` if a copy failed)."""

    @abc.abstractmethod
    def use(self) -> list[torch.Tensor]:
        """The outputs, safe for the work queued next on the current stream (CUDA: that
        stream waits for the copies; the host does not)."""


class Copies(abc.ABC):
    """Starts copies between the host and one device that run beside the computation."""

    device: torch.device

    @abc.abstractmethod
    def to_host(
        self, sources: Sequence[torch.Tensor], dtype: torch.dtype | None = None
    ) -> Transfer:
        """Copy ``sources`` (on the device, computed by work already queued on the current
        stream) into fresh host tensors (pinned on CUDA), cast to ``dtype`` on the device
        first when given."""

    @abc.abstractmethod
    def to_device(self, sources: Sequence[torch.Tensor]) -> Transfer:
        """Copy host ``sources`` to the device. The sources must stay unchanged until the
        transfer is done (it keeps a reference to them until then)."""

    def close(self) -> None:
        """Release what the copies own (they may not be used afterwards)."""


def _fail(err: BaseException) -> DeviceError:
    """One line: the first line of the runtime's message (CUDA's run on for lines) and
    what to do."""
    oom = isinstance(err, torch.OutOfMemoryError)
    kind = "ran out of memory" if oom else "failed"
    first = (str(err).strip().splitlines() or [""])[0].strip()
    return DeviceError(
        f"a copy between host and device {kind} ({type(err).__name__}: {first}); "
        "use a smaller batch_size, or free GPU memory (other processes, tensors you hold)"
        + ("" if oom else ", and check the device with nvidia-smi")
    )


class _CudaTransfer(Transfer):
    def __init__(
        self,
        outputs: list[torch.Tensor],
        event: torch.cuda.Event,
        device: torch.device,
        keep: Sequence[torch.Tensor],
    ) -> None:
        self.outputs, self._event, self._device = outputs, event, device
        self._keep: Sequence[torch.Tensor] = keep  # sources the copies still read

    def done(self) -> bool:
        try:
            finished = bool(self._event.query())
        except RuntimeError:
            return True  # wait() raises the error
        if finished:
            self._keep = ()
        return finished

    def wait(self) -> list[torch.Tensor]:
        try:
            self._event.synchronize()
        except RuntimeError as err:
            raise _fail(err) from err
        self._keep = ()
        return self.outputs

    def use(self) -> list[torch.Tensor]:
        current = torch.cuda.current_stream(self._device)
        current.wait_event(self._event)
        for out in self.outputs:
            if out.is_cuda:  # allocated on the copy stream: freed only after this work
                out.record_stream(current)
        return self.outputs


class CudaCopies(Copies):
    """Copies on one dedicated CUDA stream of ``device``, ordered by events."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)

    def to_host(
        self, sources: Sequence[torch.Tensor], dtype: torch.dtype | None = None
    ) -> Transfer:
        try:
            computed = torch.cuda.Event()
            computed.record(torch.cuda.current_stream(self.device))
            self.stream.wait_event(computed)  # the copies start once the sources exist
            outputs = []
            with torch.cuda.stream(self.stream):
                for source in sources:
                    source.record_stream(self.stream)  # not reused before the copy reads it
                    data = source if dtype is None else source.to(dtype)
                    out = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
                    outputs.append(out.copy_(data, non_blocking=True))
            copied = torch.cuda.Event()
            copied.record(self.stream)
        except RuntimeError as err:
            raise _fail(err) from err
        return _CudaTransfer(outputs, copied, self.device, keep=())

    def to_device(self, sources: Sequence[torch.Tensor]) -> Transfer:
        try:
            with torch.cuda.stream(self.stream):
                outputs = [s.to(self.device, non_blocking=True) for s in sources]
            copied = torch.cuda.Event()
            copied.record(self.stream)
        except RuntimeError as err:
            raise _fail(err) from err
        return _CudaTransfer(outputs, copied, self.device, keep=tuple(sources))


class _ThreadTransfer(Transfer):
    def __init__(self, future: Future[list[torch.Tensor]]) -> None:
        self._future = future
        self.outputs: list[torch.Tensor] = []

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> list[torch.Tensor]:
        try:
            self.outputs = self._future.result()
        except (RuntimeError, NotImplementedError) as err:
            raise _fail(err) from err
        return self.outputs

    def use(self) -> list[torch.Tensor]:
        return self.wait()


class ThreadCopies(Copies):
    """The :class:`Copies` contract without CUDA: each transfer is a copy into fresh tensors
    (``to_host``: on the CPU; ``to_device``: on ``device``) on one background thread, in
    submission order."""

    def __init__(
        self, device: torch.device | str = "cpu", *, before: Callable[[], None] | None = None
    ) -> None:
        self.device = torch.device(device)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="actstore-copy")
        self._before = before  # run on the copy thread before each transfer (tests: delay)

    def _submit(
        self, sources: Sequence[torch.Tensor], dtype: torch.dtype | None, device: torch.device
    ) -> Transfer:
        def copy() -> list[torch.Tensor]:
            if self._before is not None:
                self._before()
            return [
                torch.empty(s.shape, dtype=dtype or s.dtype, device=device).copy_(s)
                for s in sources
            ]

        return _ThreadTransfer(self._pool.submit(copy))

    def to_host(
        self, sources: Sequence[torch.Tensor], dtype: torch.dtype | None = None
    ) -> Transfer:
        return self._submit(sources, dtype, torch.device("cpu"))

    def to_device(self, sources: Sequence[torch.Tensor]) -> Transfer:
        return self._submit(sources, None, self.device)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class Staging:
    """Host buffers that batches are copied into before they go to ``device``, where their
    own memory cannot be pinned (on CUDA the buffers are pinned by torch's allocator, so
    the copy to the device is still a DMA that overlaps the computation).

    ``always``: stage every batch (else only tensors not in pinned memory, on CUDA). A
    staged batch no longer refers to its source, which may be reused at once. ``slots``
    buffers are used in turn; each grows to the largest batch seen. :func:`to_device`
    waits for a batch's copy before it stages the one after the next, so two suffice.

    Example:
        >>> staging = Staging("cpu", always=True)
        >>> x = torch.arange(4.0)
        >>> (staged,) = staging.stage([x])
        >>> torch.equal(staged, x), staged.data_ptr() != x.data_ptr(), staging.staged
        (True, True, 1)
    """

    def __init__(self, device: torch.device | str, *, always: bool = False, slots: int = 2) -> None:
        self.device = torch.device(device)
        self.always = always
        self._pinned = self.device.type == "cuda"
        self._buffers: list[torch.Tensor] = [torch.empty(0, dtype=torch.uint8)] * slots
        self._next = 0
        #: batches staged so far
        self.staged = 0

    def needed(self, source: torch.Tensor) -> bool:
        """Whether ``source`` must be staged before its copy to the device."""
        if self.always:
            return True
        return self._pinned and source.device.type == "cpu" and not source.is_pinned()

    def stage(self, sources: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``sources`` (host tensors) copied into the next staging buffer, when any needs
        it; else ``sources`` as they are."""
        if not any(self.needed(s) for s in sources):
            return list(sources)
        sizes = [s.numel() * s.element_size() for s in sources]
        align = 64
        total = sum(-(-n // align) * align for n in sizes)
        i = self._next
        self._next = (i + 1) % len(self._buffers)
        buffer = self._buffers[i]
        if buffer.numel() < total:
            buffer = torch.empty(total, dtype=torch.uint8, pin_memory=self._pinned)
            self._buffers[i] = buffer
        out, at = [], 0
        for source, n in zip(sources, sizes):
            data = source.contiguous()
            target = buffer[at : at + n].view(data.dtype)
            out.append(target.view(data.shape).copy_(data))  # releases the GIL while it copies
            at += -(-n // align) * align
        self.staged += 1
        return out


def copies_for(device: torch.device | str) -> Copies:
    """:class:`CudaCopies` for a CUDA device, :class:`ThreadCopies` for any other."""
    device = torch.device(device)
    return CudaCopies(device) if device.type == "cuda" else ThreadCopies(device)
