"""Reading the next epoch's first window while the current epoch ends, so a trainer's next
epoch starts without waiting for a read (:class:`ReadAhead`, a mixin of
:class:`~actstore.loader.ActivationLoader`; ``ACTSTORE_READ_AHEAD=0`` turns it off)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from torch.utils.data import get_worker_info

from ..formats.threads import StageClock
from ..order import EpochPlan, Span, worker_span
from .config import LoaderConfig
from .pipeline import BufferSet, Consumer, Finish, Layout, WorkerLink


class ReadAhead:
    """The consumer of the next epoch, its first window already being read (a mixin: the
    attributes below are :class:`~actstore.loader.ActivationLoader`'s)."""

    config: LoaderConfig
    layout: Layout
    run_blocks: int
    clock: StageClock | None
    _buffers: tuple[int, BufferSet] | None
    _link: WorkerLink | None
    _ahead: Primed

    if TYPE_CHECKING:

        @property
        def batch_size(self) -> int: ...

        def plan(self, epoch: int) -> EpochPlan: ...

        def _rank_span(self) -> Span: ...

    @property
    def read_ahead(self) -> int | None:
        """The epoch whose first window this process is reading ahead (an epoch iterated to
        its end starts the next one's read at once), or None."""
        primed = self._ahead.value
        return None if primed is None or primed[0] != os.getpid() else int(primed[1][0])

    def _consumer(self, plan: EpochPlan, buffers: BufferSet, finish: Finish) -> Consumer:
        cfg = self.config
        return Consumer(
            self.layout,
            plan,
            buffers,
            batch_size=cfg.batch_size,
            io_threads=cfg.io_threads,
            finish=finish,
            read_blocks=self.run_blocks,
            clock=self.clock,
        )

    def _primed_consumer(self, key: tuple[Any, ...]) -> Consumer | None:
        """The consumer :meth:`_prime_next_epoch` made, if it serves exactly ``key``."""
        primed, self._ahead.value = self._ahead.value, None
        if primed is None:
            return None
        pid, primed_key, consumer = primed
        if pid == os.getpid() and primed_key == key:
            return consumer
        if pid == os.getpid():
            consumer.close()
        return None

    def _prime_next_epoch(
        self, epoch: int, num_workers: int, buffers: BufferSet, finish: Finish
    ) -> bool:
        """Start reading ``epoch``'s first window now (into a free pool: no memory is
        added), so the trainer's next epoch starts without waiting for a read. True once
        it is being read (or reading ahead is off); False while no pool is free."""
        if os.environ.get("ACTSTORE_READ_AHEAD", "1") == "0":  # to measure without it
            return True
        if self._buffers is None or self._buffers[1] is not buffers:
            return True  # closed (close() inside the loop): nothing is read ahead
        info = get_worker_info()
        if info is not None and (self._link is None or self._link.position is None):
            return True  # a worker that ends with its epoch: a window read ahead is lost
        worker = 0 if info is None else info.id  # a new epoch starts at the DataLoader's worker 0
        span = worker_span(
            self._rank_span(), worker=worker, num_workers=num_workers, batch_size=self.batch_size
        )
        key = (epoch, worker, num_workers, span.start, span.stop, id(buffers), _moves(finish))
        ahead = self._ahead.value
        if ahead is not None and ahead[0] == os.getpid() and ahead[1] == key:
            return True  # already being read
        if span.start >= span.stop:
            return True  # nothing to read
        if buffers.pools is not None and not any(
            buffers.pools.free(i) for i in range(len(buffers.pools))
        ):
            return False  # every window buffer still in use: again after the next batch
        consumer = self._consumer(self.plan(epoch), buffers, finish)
        if not consumer.prime(span.start, span.stop):
            consumer.close()
            return buffers.pools is None  # no window with rows, or no buffer after all
        self._ahead.close()
        self._ahead.value = (os.getpid(), key, consumer)
        return True


class Primed:
    """The next epoch's consumer while its first window is read ahead: ``value`` is (pid,
    what it serves, the consumer). :meth:`close` stops it; the loader calls it when it is
    closed, and when it is garbage-collected (a loader dropped after its last epoch must
    not go on reading a window nobody will take)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: tuple[int, tuple[Any, ...], Consumer] | None = None

    def close(self) -> None:
        primed, self.value = self.value, None
        if primed is not None and primed[0] == os.getpid():
            primed[2].close()


def _moves(finish: Finish) -> tuple[bool, str | None]:
    """What a consumer's ``finish`` does with batches beyond the loader's fixed options."""
    return finish.pin_memory, None if finish.device is None else str(finish.device)
