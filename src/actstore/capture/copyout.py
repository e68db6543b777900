"""Activations off the model's device without stalling it: the copy-out stage of capture.

The forward loop hands each batch's activations (still on the model's device) to a
:class:`CopyOut` with a ``build`` function; once they are in host memory, ``build(host
acts)`` makes the :class:`~actstore.batch.Batch` and it goes to ``sink`` (the writer
thread), always in the order the batches were put.

- :class:`SyncCopyOut`: ``tensor.to("cpu")`` in the forward loop, then ``sink`` at once.
  CPU captures use it (there ``.to("cpu")`` is the tensor itself: nothing changes), and
  so does a CUDA capture with ``copy_slots=0``.
- :class:`RingCopyOut`: a ring of up to ``slots`` batches in flight. Each batch's copies
  are issued on a dedicated stream after an event on the compute stream, into pinned host
  memory (:class:`~actstore.devicecopy.CudaCopies`); a batch goes to ``sink`` once its
  copies have finished, and the forward loop waits only when all ``slots`` are in flight
  (back-pressure) or the writer's queue is full.

Where the cast to the stored dtype happens is the caller's choice (``dtype``): None copies
the compute dtype and the writer casts on the host; ``torch.float32`` casts on the device
before the copy (twice the bytes over PCIe for a bfloat16 model, no cast on the writer
thread). A widening cast is exact, so either way the stored values are the same.

Example:
    >>> out = open_copyout(writer_thread.put, device=model.device, slots=4)  # doctest: +SKIP
    >>> with out:  # doctest: +SKIP
    ...     out.put(recorder.run(inputs), lambda acts: Batch(acts=acts, example_ids=ids))
    ...     out.close()
"""

from __future__ import annotations

import abc
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Self

import torch

from ..batch import Batch
from ..devicecopy import Copies, Transfer, copies_for
from ..errors import CaptureError, DeviceError

#: Makes the batch from its activations in host memory (``site name -> [B, T, D]``).
Build = Callable[[dict[str, torch.Tensor]], Batch]
#: Where finished batches go (the writer thread's ``put``).
Sink = Callable[[Batch], None]


class CopyOut(abc.ABC):
    """Moves batches' activations to host memory and hands the batches to ``sink`` in order.

    Use as a context manager: on an error inside it, :meth:`abort` hands the writer every
    batch whose copies finished and drops the others; call :meth:`close` on success."""

    #: Seconds the forward loop waited for copies to finish (ring full, or at close).
    waited_s: float = 0.0

    @abc.abstractmethod
    def put(self, acts: Mapping[str, torch.Tensor], build: Build) -> None:
        """Start moving ``acts`` to host memory; ``build(host_acts)`` then goes to the sink."""

    @abc.abstractmethod
    def close(self) -> None:
        """Hand every batch still in flight to the sink (waiting for its copies)."""

    def abort(self) -> None:
        """After an error: hand over the batches already in host memory, drop the rest."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


class SyncCopyOut(CopyOut):
    """Copies in the forward loop (``tensor.to("cpu")``): the path CPU captures take."""

    def __init__(self, sink: Sink, *, dtype: torch.dtype | None = None) -> None:
        self.sink, self.dtype = sink, dtype

    def put(self, acts: Mapping[str, torch.Tensor], build: Build) -> None:
        if self.dtype is None:
            host = {name: a.to("cpu") for name, a in acts.items()}
        else:
            host = {name: a.to(self.dtype).to("cpu") for name, a in acts.items()}
        self.sink(build(host))

    def close(self) -> None:
        pass


@dataclass
class _Flight:
    """One batch whose copies are under way: per device, the sites and their transfer."""

    parts: list[tuple[list[str], Transfer]]
    build: Build

    def done(self) -> bool:
        return all(transfer.done() for _, transfer in self.parts)


class RingCopyOut(CopyOut):
    """Up to ``slots`` batches in flight, each copied by ``copies_for(device)`` (one
    :class:`~actstore.devicecopy.Copies` per device its activations lie on)."""

    def __init__(
        self,
        sink: Sink,
        copies_for: Callable[[torch.device], Copies],
        *,
        slots: int = 4,
        dtype: torch.dtype | None = None,
    ) -> None:
        if slots < 1:
            raise CaptureError(f"a copy ring needs at least one slot, not {slots}")
        self.sink, self.slots, self.dtype = sink, slots, dtype
        self._copies_for = copies_for
        self._copies: dict[torch.device, Copies] = {}
        self._flights: deque[_Flight] = deque()
        self.waited_s = 0.0

    @property
    def in_flight(self) -> int:
        """Batches whose copies were started and which have not reached the sink yet."""
        return len(self._flights)

    def put(self, acts: Mapping[str, torch.Tensor], build: Build) -> None:
        self._deliver_finished()
        while len(self._flights) >= self.slots:  # back-pressure: wait for the oldest
            self._deliver_oldest()
        by_device: dict[torch.device, list[str]] = {}
        for name, tensor in acts.items():
            by_device.setdefault(tensor.device, []).append(name)
        parts = []
        for device, names in by_device.items():
            copies = self._copies.get(device)
            if copies is None:
                copies = self._copies[device] = self._copies_for(device)
            parts.append((names, copies.to_host([acts[n] for n in names], self.dtype)))
        self._flights.append(_Flight(parts, build))

    def _deliver_finished(self) -> None:
        while self._flights and self._flights[0].done():
            self._deliver_oldest()

    def _deliver_oldest(self) -> None:
        flight = self._flights[0]
        start = time.perf_counter()
        host: dict[str, torch.Tensor] = {}
        for names, transfer in flight.parts:
            host.update(zip(names, transfer.wait()))
        self.waited_s += time.perf_counter() - start
        self._flights.popleft()
        self.sink(flight.build(host))

    def close(self) -> None:
        while self._flights:
            self._deliver_oldest()
        self._release()

    def abort(self) -> None:
        try:
            self._deliver_finished()
        except (DeviceError, CaptureError):
            pass  # the error being handled already says what went wrong
        finally:
            self._flights.clear()
            self._release()

    def _release(self) -> None:
        for copies in self._copies.values():
            copies.close()
        self._copies.clear()


def open_copyout(
    sink: Sink, *, device: torch.device, slots: int, dtype: torch.dtype | None = None
) -> CopyOut:
    """The copy-out for activations computed on ``device``: a :class:`RingCopyOut` of
    ``slots`` on CUDA (``slots=0``: synchronous), :class:`SyncCopyOut` anywhere else."""
    if device.type == "cuda" and slots > 0:
        # a model spread over devices may keep some sites on the CPU: copied on a thread
        return RingCopyOut(sink, copies_for, slots=slots, dtype=dtype)
    return SyncCopyOut(sink, dtype=dtype)


def device_failure(err: BaseException) -> CaptureError:
    """The one error a capture reports when its GPU runs out of memory or a copy fails."""
    cause = err.__cause__ if isinstance(err, DeviceError) and err.__cause__ else err
    if isinstance(cause, torch.OutOfMemoryError):
        what, hint = "ran out of GPU memory", " with a smaller --batch-size"
    else:
        what, hint = f"failed on the device ({type(cause).__name__}: {cause})", ""
    return CaptureError(
        f"capture {what}; the shards finished so far are kept: rerun the same command "
        f"to resume{hint}"
    )
