""":class:`ActivationLoader`: shuffled, resumable batches of activation rows from any store.

Example:
    >>> import tempfile
    >>> from actstore.testing import FormatCase, make_acts, make_batches, make_plan
    >>> plan, out = make_plan(), tempfile.TemporaryDirectory()  # 23 x 6 rows of width 8
    >>> store = FormatCase("saev").write(out.name, plan, make_batches(plan, make_acts(plan)))
    >>> loader = ActivationLoader(store, site=3, batch_size=32, seed=0)
    >>> [tuple(acts.shape) for acts in loader]  # float32 [32, d_model], one epoch
    [(32, 8), (32, 8), (32, 8), (32, 8), (10, 8)]
    >>> state = loader.state_dict()  # later: loader.load_state_dict(state)
"""

from __future__ import annotations

import logging
import math
import os
import weakref
from collections.abc import Callable, Generator, Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from ..devicecopy import Staging, copies_for
from ..errors import ConfigError, StorageError
from ..formats import open_store
from ..formats.blocks import Extent
from ..formats.threads import StageClock
from ..order import batches_done_by_worker, plan_epoch, rank_span, worker_span
from ..sites import Site
from ..storage.mapped import available as can_map
from .buffers import NUMPY_STORAGE, SharedSlots
from .config import (
    DEFAULT_POOL_BYTES,
    DEFAULT_RUN_BYTES,
    OUT_DTYPES,
    LoaderConfig,
    _rank_and_world,
)
from .device import to_device
from .pipeline import (
    BufferSet,
    Finish,
    Layout,
    LoaderBatch,
    RingBatch,
    WorkerLink,
    first_rows,
    kept_rows,
    unit_rows,
    window_shape,
)
from .position import LoaderPosition
from .readahead import Primed, ReadAhead, _moves

log = logging.getLogger(__name__)


class ActivationLoader(LoaderPosition, ReadAhead, IterableDataset):
    """Uniformly shuffled batches of activation rows, at sequential-read speed.

    Reads whole blocks (one sequential read each) in a shuffled order and shuffles rows
    within a window of ``pool_blocks`` blocks; the order is a pure function of (block
    sizes, seed, epoch), so it is reproducible, splits exactly across ranks and DataLoader
    workers, and resumes in O(1) from :meth:`state_dict`. Works with any reader of the
    :class:`~actstore.formats.base.ReaderBase` contract.

    Iterate it directly (it reads with ``io_threads`` background threads), or wrap it in
    :class:`~actstore.loader.ActivationDataLoader` for worker processes. Iteration always
    continues from the current position: one epoch ends after its last batch and the next
    iteration starts the next epoch.

    Batches are views of the loader's buffers and stay valid for as long as you hold them
    (buffers are reused only once unreferenced).

    Example:
        >>> import tempfile
        >>> from actstore.testing import FormatCase, make_acts, make_batches, make_plan
        >>> plan, out = make_plan(), tempfile.TemporaryDirectory()  # d_model 8
        >>> path = FormatCase("saev").write(out.name, plan, make_batches(plan, make_acts(plan)))
        >>> loader = ActivationLoader(path, site=3, batch_size=16, seed=0)
        >>> next(iter(loader)).shape
        torch.Size([16, 8])
    """

    def __init__(self, source: Any, config: LoaderConfig | None = None, **options: Any) -> None:
        if config is None:
            config = LoaderConfig(**options)
        elif options:
            raise ConfigError("pass a LoaderConfig or keyword options, not both")
        self.config = config
        if isinstance(source, (list, tuple)):
            raise ConfigError(
                f"ActivationLoader reads one store, not a {type(source).__name__} of "
                f"{len(source)}; convert the stores into one (actstore convert), or make "
                "one loader per store and alternate their batches"
            )
        self.reader = open_store(source) if isinstance(source, (str, os.PathLike)) else source
        reader = self.reader
        if config.sites is not None:
            self.sites: tuple[Site, ...] = tuple(reader.site(s) for s in config.sites)
            if len(set(self.sites)) != len(self.sites):
                raise ConfigError(f"sites {list(config.sites)} name one stored site twice")
        elif config.site is not None:
            self.sites = (reader.site(config.site),)
        elif len(reader.sites) == 1:
            self.sites = (reader.sites[0],)
        else:
            raise ConfigError(
                f"this store holds several sites {list(reader.sites)}; choose one "
                "with site=... (or several with sites=[...])"
            )
        blocks = tuple(reader.blocks(site) for site in self.sites)
        sizes = [b.n_rows for b in blocks[0]]
        for site, other in zip(self.sites[1:], blocks[1:]):
            if [b.n_rows for b in other] != sizes:
                raise ConfigError(f"blocks of site {site!r} do not align with {self.sites[0]!r}")
        if len(self.sites) > 1 and not reader.aligned_on(self.sites):
            raise ConfigError(
                f"sites {[str(s) for s in self.sites]} are not aligned in this store: block i of "
                "one holds other tokens than block i of another, so rows would pair different "
                "tokens; load one site at a time (site=...)"
            )
        if config.drop_cls and blocks[0] and reader.cls_rows(blocks[0][0]) is None:
            raise ConfigError(
                f"drop_cls needs a store that keeps CLS tokens; {type(reader).__name__} marks none"
            )
        cls = reader.cls_rows if config.drop_cls else None
        mix, period = config.mix, None
        if mix > 1:
            period = reader.example_rows(self.sites[0])
            if period is not None and mix > period:
                raise ConfigError(
                    f"mix={mix} splits each example's {period} tokens into more slabs than "
                    f"tokens; use mix between 1 and {period}"
                )
        self.layout = Layout(
            reader=reader,
            blocks=blocks,
            drop_cls=config.drop_cls,
            kept_rows=kept_rows(blocks[0], cls),
            first_row=first_rows(blocks[0]),
            d_model=int(reader.d_model),
            dtype=np.dtype(reader.dtype),
            mix=mix,
            period=period,
            unit_rows=unit_rows(blocks[0], period, mix, cls) if mix > 1 else None,
            extents=_extents(reader, blocks),
        )
        if config.pool_blocks is not None:
            pool_blocks = config.pool_blocks
        else:
            block_bytes = max(sizes, default=1) * reader.d_model * self.layout.dtype.itemsize
            pool_blocks = max(1, DEFAULT_POOL_BYTES // max(block_bytes * len(self.sites), 1))
        # a window never holds more than the whole store (the order is the same either way)
        self.pool_blocks = min(pool_blocks, max(len(sizes), 1))
        if config.run_blocks is not None:
            run_blocks = config.run_blocks
        else:
            block_bytes = max(sizes, default=1) * reader.d_model * self.layout.dtype.itemsize
            run_blocks = max(1, DEFAULT_RUN_BYTES // max(block_bytes, 1))
        self.run_blocks = min(run_blocks, self.pool_blocks)
        self.rank, self.world_size = _rank_and_world(config)
        if config.drop_last and self.n_rows and not len(self):
            raise ConfigError(
                f"drop_last=True serves no batch: {self.n_rows} rows over {self.world_size} "
                f"rank(s) is less than one batch of {config.batch_size} per rank; use a "
                "smaller batch_size or drop_last=False"
            )
        self._finish = self._make_finish()
        self.epoch = config.epoch
        self._batches_done = 0
        self._saved_workers: int | None = None  # consumers the position was counted with
        self._buffers: tuple[int, BufferSet] | None = None  # (pid, buffers), never pickled
        # set by ActivationDataLoader (attach_workers): its workers send batches through
        # shared memory (see _fill_ring), and pinning and the device act in its process
        self._link: WorkerLink | None = None
        self._slots: tuple[int, SharedSlots] | None = None  # (pid, this worker's batch slots)
        self._filling: Generator[RingBatch, None, None] | None = None  # a worker's iteration
        # where batches are gathered when the caller owns that memory (``actstore serve``)
        self._destination: Callable[[], np.ndarray] | None = None
        self._cancel: Callable[[], None] | None = None
        #: set to a :class:`~actstore.formats.threads.StageClock` to sum the CPU time of
        #: each stage of the read path in this process (``benchmarks/bench_read_stages.py``)
        self.clock: StageClock | None = None
        # the next epoch's consumer, its first window already being read (never pickled)
        self._watch_read_ahead()

    # ------------------------------------------------------------------ sizes

    @property
    def n_rows(self) -> int:
        """Rows in one epoch of all ranks (CLS rows excluded with ``drop_cls``)."""
        return int(self.layout.kept_rows.sum())

    @property
    def d_model(self) -> int:
        return self.layout.d_model

    @property
    def batch_size(self) -> int:
        return self.config.batch_size

    def __len__(self) -> int:
        """Batches this rank serves per epoch."""
        return self._rank_span().n_batches

    @property
    def mapped(self) -> bool:
        """Whether batches are gathered straight from the store's mapped files (local
        stores whose format stores rows raw), rather than from windows read into buffers
        (as where the files cannot be mapped: no address space left under ``ulimit -v``)."""
        if self.layout.extents is None:
            return False
        return self._buffers is None or self._buffers[1].region is not None

    @property
    def batch_bytes(self) -> int:
        """Bytes of one batch buffer (``[batch_size, n_sites, D]`` of the output dtype)."""
        item = torch.empty(0, dtype=self._finish.out_dtype).element_size()
        return self.batch_size * len(self.sites) * self.d_model * item

    @property
    def memory_bytes(self) -> int:
        """Private memory one consumer holds, about: four batch buffers (the batch you
        hold, the one gathered ahead, the one being gathered, one more while the loop
        variable still holds the last), plus,
        where windows are read into buffers (not :attr:`mapped`), two windows of the
        largest blocks (``pool_blocks * mix`` of the largest slabs). Batches you keep
        add one buffer each."""
        windows = 0
        if not self.mapped:
            shape = window_shape(self.layout, self.pool_blocks)
            windows = 2 * int(np.prod(shape)) * self.layout.dtype.itemsize
        return windows + 4 * self.batch_bytes

    def plan(self, epoch: int):
        """The order of epoch ``epoch`` (see :mod:`actstore.order`)."""
        layout = self.layout
        return plan_epoch(
            layout.unit_row_counts,
            pool_blocks=self.pool_blocks,
            seed=self.config.seed,
            epoch=epoch,
            run_blocks=self.run_blocks,
            mix=layout.mix,
        )

    def _rank_span(self):
        return rank_span(
            self.n_rows,
            rank=self.rank,
            world_size=self.world_size,
            batch_size=self.config.batch_size,
            drop_last=self.config.drop_last,
        )

    # ------------------------------------------------------------------ normalisation

    def _make_finish(self) -> Finish:
        cfg = self.config
        shift = scale = None
        if cfg.normalize is not None:
            found = [self.reader.statistics(site) for site in self.sites]
            missing = [site for site, s in zip(self.sites, found) if s is None]
            stats = [s for s in found if s is not None]
            if missing:
                raise ConfigError(
                    f"normalize={cfg.normalize!r} needs stored statistics, and "
                    f"sites {missing} have none; use normalize=None"
                )
            if cfg.normalize == "standardize":
                shift = torch.tensor(np.stack([s.mean for s in stats]), dtype=torch.float32)
                std = np.stack([np.sqrt(s.var) for s in stats])
                scale = torch.tensor(1.0 / np.maximum(std, 1e-6), dtype=torch.float32)
            else:
                factors = [math.sqrt(self.d_model) / max(s.norm_mean, 1e-12) for s in stats]
                scale = torch.tensor(factors, dtype=torch.float32).reshape(-1, 1)
            if cfg.sites is None:  # batches [B, D]: drop the site axis
                shift = None if shift is None else shift[0]
                scale = scale[0]
        device = torch.device(cfg.device) if cfg.device is not None else None
        pin = cfg.pin_memory or (device is not None and device.type == "cuda")
        return Finish(
            out_dtype=OUT_DTYPES[cfg.dtype],
            shift=shift,
            scale=scale,
            single_site=cfg.sites is None,
            pin_memory=pin,
            device=device,
            return_index=cfg.return_index,
        )

    @property
    def normalization(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(shift, scale)`` applied as ``(x - shift) * scale``, shaped to broadcast over a
        batch (None where unused); invert with ``x / scale + shift``."""
        return self._finish.shift, self._finish.scale

    @property
    def finish(self) -> Finish:
        """How stored rows become the batches this loader yields (output dtype,
        normalisation, pinning, device)."""
        return self._finish

    def __repr__(self) -> str:
        return (
            f"ActivationLoader(sites={list(self.sites)}, rows={self.n_rows}, "
            f"batch_size={self.batch_size}, pool_blocks={self.pool_blocks}, "
            f"{f'mix={self.layout.mix}, ' if self.layout.mix > 1 else ''}"
            f"seed={self.config.seed}, epoch={self.epoch}, "
            f"rank={self.rank}/{self.world_size})"
        )

    # ------------------------------------------------------------------ iteration

    def _buffer_set(self) -> BufferSet:
        """This process's buffers, made on first use and kept across epochs."""
        if self._buffers is None or self._buffers[0] != os.getpid():
            self._buffers = (os.getpid(), self._new_buffers())
        return self._buffers[1]

    def deliver_into(
        self, take: Callable[[], np.ndarray] | None, cancel: Callable[[], None] | None = None
    ) -> None:
        """Gather each batch into the array ``take()`` returns (``[batch_size, n_sites,
        D]`` of the output dtype's storage; memory the caller owns and shares, e.g.
        ``actstore serve``'s ring slots) in this process; None: into its own buffers.
        ``take()`` may wait for room; ``cancel()`` must then make it raise (called when
        an iteration ends with a batch still being gathered)."""
        self._destination = take
        self._cancel = cancel

    def _new_buffers(self) -> BufferSet:
        # pinned where batches are pinned or moved to CUDA in this process: never in a
        # DataLoader worker (the main process pins what workers send)
        return BufferSet(
            self.layout,
            batch_size=self.batch_size,
            pool_blocks=self.pool_blocks,
            out_dtype=self._finish.out_dtype,
            pinned=self._finish.pin_memory and get_worker_info() is None,
        )

    def __getstate__(self) -> dict[str, Any]:
        return {
            **self.__dict__,
            **dict.fromkeys(("_buffers", "_slots", "_filling", "_ahead", "clock")),
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._watch_read_ahead()

    def _watch_read_ahead(self) -> None:
        """A fresh :class:`~actstore.loader.readahead.Primed`, closed when this loader is
        garbage-collected."""
        self._ahead = Primed()
        weakref.finalize(self, self._ahead.close).atexit = False

    # ------------------------------------------------------------------ the seam used by
    # ActivationDataLoader (main process) and serve

    def attach_workers(self, link: WorkerLink | None) -> None:
        """Run under :class:`~actstore.loader.ActivationDataLoader`'s worker processes,
        which coordinate with it through ``link``'s shared memory: workers send batches as
        places in shared memory, and pinning and the move to the device happen in the
        main process. None: detach (the loader runs in its own process again)."""
        self._link = link

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        if info is None:
            return self._iterate(worker=0, num_workers=1, count=True)
        self._read_position()
        # The DataLoader's round-robin starts at worker 0; after k delivered batches the
        # next one belongs to run k % N, so DataLoader worker i serves run (i + k) % N.
        n = info.num_workers
        batches = self._iterate(
            worker=(info.id + self._batches_done) % n, num_workers=n, count=False
        )
        if self._link is None:
            return batches
        previous, self._filling = self._filling, None
        self._filling = self._fill_ring(batches, self._link, info.id, previous)
        return self._filling

    def _fill_ring(
        self,
        batches: Iterator[Any],
        link: WorkerLink,
        worker: int,
        previous: Generator[RingBatch, None, None] | None,
    ) -> Generator[RingBatch, None, None]:
        """Worker process: each batch was gathered into one of this worker's shared slots
        (:meth:`_worker_slots`); send where it lies (the slot's memory itself only with its
        first batch), never the data. The main process clears ``link.slot_flags[worker,
        s]`` once it has dropped the batch, and the slot is filled again only then."""
        slots = self._worker_slots(link, worker)
        if previous is not None:  # a persistent worker's last iteration, perhaps left
            previous.close()  # early: its gathers end, and the slots of batches the
            slots.reclaim()  # main process never received are free again
        for batch in batches:
            acts, rows = (
                (batch.acts, batch.rows) if isinstance(batch, LoaderBatch) else (batch, None)
            )
            del batch
            s = slots.locate(acts)
            if s is None:  # never send a place that does not hold this batch
                raise StorageError("a worker's batch was not gathered into its shared slots")
            fresh = s not in slots.sent
            slots.sent.add(s)
            message = RingBatch(
                worker=worker,
                slot=s,
                nbytes=acts.numel() * acts.element_size(),
                shape=tuple(acts.shape),
                dtype=str(acts.dtype).removeprefix("torch."),
                storage=slots.storage[s] if fresh else None,
                rows=None if rows is None else rows.numpy().copy(),
            )
            del acts, rows
            yield message

    def _worker_slots(self, link: WorkerLink, worker: int) -> SharedSlots:
        """This worker process's batch slots (made on first use, kept across epochs)."""
        if self._slots is None or self._slots[0] != os.getpid():
            shape = (self.batch_size, len(self.sites), self.d_model)
            storage = NUMPY_STORAGE[self._finish.out_dtype]
            flags = link.slot_flags[worker].numpy()
            self._slots = (os.getpid(), SharedSlots(flags, shape, storage))
        return self._slots[1]

    def _iterate(self, *, worker: int, num_workers: int, count: bool) -> Iterator[Any]:
        """This consumer's batches from the current position (``count``: advance it)."""
        if count:
            self.begin(num_workers)
        else:
            self._check_workers(num_workers)
        return self._generate(worker, num_workers, count)

    def _generate(self, worker: int, num_workers: int, count: bool) -> Iterator[Any]:
        cfg, epoch = self.config, self.epoch
        plan = self.plan(epoch)
        span = worker_span(
            self._rank_span(), worker=worker, num_workers=num_workers, batch_size=cfg.batch_size
        )
        skip = batches_done_by_worker(self._batches_done, worker=worker, num_workers=num_workers)
        start = min(span.start + skip * cfg.batch_size, span.stop)
        finish = self._finish
        if get_worker_info() is not None and (finish.pin_memory or finish.device is not None):
            if self._link is None:
                raise ConfigError(
                    "pin_memory/device act in the main process: wrap the loader "
                    "in ActivationDataLoader, or use DataLoader(pin_memory=True)"
                )
            finish = replace(finish, pin_memory=False, device=None)
        buffers = self._buffer_set()
        take = self._destination or buffers.take
        info = get_worker_info()
        if info is not None and self._link is not None:
            take = self._worker_slots(self._link, info.id).take
        key = (epoch, worker, num_workers, start, span.stop, id(buffers), _moves(finish))
        consumer = self._primed_consumer(key)
        if consumer is None:
            consumer = self._consumer(plan, buffers, finish)
        # once this epoch's last windows are read, read the next epoch's first one (into
        # a pool that comes free), so the next epoch starts without waiting for a read
        consumer.on_read_all = lambda: self._prime_next_epoch(
            epoch + 1, num_workers, buffers, finish
        )
        log.debug(
            "epoch %d, worker %d/%d: rows %d..%d", epoch, worker, num_workers, start, span.stop
        )
        batches = consumer.batches(start, span.stop, take, self._cancel)
        if finish.device is not None:  # the next batch's copy runs while this one is used
            # batches from memory that could not be pinned go through a staging buffer
            batches = to_device(batches, copies_for(finish.device), Staging(finish.device))
        try:
            for batch in batches:
                if count:
                    self._batches_done += 1
                yield batch
                del batch
            if count:
                self.end_iteration(epoch)
            self._prime_next_epoch(epoch + 1, num_workers, buffers, finish)  # if not yet
        finally:
            batches.close()
            consumer.close()

    def close(self) -> None:
        """Stop reading ahead and let go of this process's buffers and mapped files (made
        again if the loader is iterated later)."""
        self._ahead.close()
        buffers, self._buffers = self._buffers, None
        if buffers is not None and buffers[0] == os.getpid():
            buffers[1].close()


def _extents(reader: Any, blocks: tuple[list[Any], ...]) -> tuple[list[Extent], ...] | None:
    """Where every block lies raw, when the store's files can be mapped here and its
    format says (``block_extent``); None: windows are read into buffers."""
    if not can_map(reader.files):
        return None
    out = []
    for site_blocks in blocks:
        found = [reader.block_extent(b) for b in site_blocks]
        if any(e is None for e in found):
            return None
        items = [torch.empty(0, dtype=e.dtype).element_size() for e in found]
        if len({e.dtype for e in found}) > 1 or any(e.offset % n for e, n in zip(found, items)):
            return None  # rows of several dtypes, or not aligned to their values
        out.append(found)
    if len({site[0].dtype for site in out if site}) > 1:
        return None  # sites stored in different dtypes: windows gather one dtype
    return tuple(out)
