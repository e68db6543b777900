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

import hashlib
import json
import logging
import math
import os
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from ..devicecopy import Staging, copies_for
from ..errors import ConfigError, StorageError
from ..formats import open_store
from ..formats.blocks import Extent
from ..formats.reading import SiteLike
from ..formats.threads import StageClock
from ..order import EpochPlan, batches_done_by_worker, plan_epoch, rank_span, worker_span
from ..sites import Site
from ..storage.mapped import available as can_map
from .buffers import NUMPY_STORAGE, SharedSlots
from .device import to_device
from .pipeline import (
    BufferSet,
    Consumer,
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

log = logging.getLogger(__name__)

#: Bytes of one shuffle window when ``pool_blocks`` is not given.
DEFAULT_POOL_BYTES = 256 << 20
#: Bytes of one run of consecutive blocks (one sequential read) when ``run_blocks`` is not given.
DEFAULT_RUN_BYTES = 16 << 20
NORMALIZE = ("standardize", "mean_norm")
OUT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
STATE_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class LoaderConfig:
    """Options of :class:`ActivationLoader` (all keyword-only)."""

    site: SiteLike | None = None
    """The site to read, in any spelling :meth:`actstore.sites.Site.parse` takes (``5``,
    ``"resid.5"``, ``"blocks.5.hook_resid_post"``, ``-1``) or the reader's own name. None:
    the store's only site. Batches are ``[B, D]``."""
    sites: tuple[SiteLike, ...] | None = None
    """Several sites aligned on the same tokens (crosscoders): batches ``[B, len(sites), D]``."""
    batch_size: int = 4096
    pool_blocks: int | None = None
    """Blocks per shuffle window (K). None: as many as fit in 256 MiB. Memory is about
    ``2 x K x block bytes x n_sites`` per consumer (one window served, one being read)."""
    run_blocks: int | None = None
    """Blocks are shuffled in runs of this many consecutive blocks (read as one sequential
    stretch). None: as many as fit in 16 MiB, at most ``pool_blocks``. 1 shuffles single
    blocks. Runs do not change how many examples a window mixes."""
    mix: int = 1
    """Split every block into this many slabs and fill a window with ``pool_blocks * mix``
    slabs of as many blocks: the same memory, rows from ``mix`` times as many examples per
    window (a batch's same-example pair rate drops about ``mix``-fold) at the cost of
    ``mix`` times smaller reads. On a store whose blocks hold whole examples of ``T``
    tokens (saev) slab ``j`` is tokens ``[j*T//mix, (j+1)*T//mix)`` of each example, so
    ``mix`` may be at most ``T``; elsewhere a slab is one of ``mix`` contiguous row ranges.
    1: whole blocks (the order of earlier versions). See :mod:`actstore.order`."""
    seed: int = 0
    epoch: int = 0
    """The epoch to start at (see :meth:`ActivationLoader.set_epoch`)."""
    drop_cls: bool = False
    """Leave out CLS-token rows (needs a reader that marks them, e.g. saev ViT stores)."""
    drop_last: bool = False
    """Serve only full batches; every rank then serves the same number of batches."""
    dtype: str = "float32"
    """Output dtype: ``float32``, ``bfloat16`` or ``float16``."""
    normalize: str | None = None
    """None, ``"standardize"`` (``(x - mean) / std`` per dimension, stored statistics) or
    ``"mean_norm"`` (every row times ``sqrt(D) / mean L2 norm``, so the mean norm is sqrt(D))."""
    rank: int | None = None
    """This process's rank; None: ``torch.distributed``'s if initialised, else 0."""
    world_size: int | None = None
    """Number of ranks; None: ``torch.distributed``'s if initialised, else 1."""
    io_threads: int = 4
    """Threads reading blocks in parallel (per consumer process)."""
    return_index: bool = False
    """Yield :class:`LoaderBatch` ``(acts, rows)`` with each row's storage index."""
    pin_memory: bool = False
    """Yield batches in pinned memory (needs CUDA): the batch buffers are registered with
    CUDA once, so batches are still views of them (no copy)."""
    device: str | None = None
    """Move batches there (``"cuda"``): pinned as above, each batch is copied on a side
    stream while the previous one is in use (see :mod:`actstore.loader.device`). Any other
    device: copied there on a background thread."""

    def __post_init__(self) -> None:
        if self.site is not None and self.sites is not None:
            raise ConfigError("give site (one) or sites (several), not both")
        if self.sites is not None:
            sites = tuple(self.sites)
            if not sites or len(set(sites)) != len(sites):
                raise ConfigError(f"sites must be distinct and non-empty, not {list(sites)}")
            object.__setattr__(self, "sites", sites)
        for name in ("batch_size", "io_threads", "mix"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, not {getattr(self, name)}")
        for name in ("pool_blocks", "run_blocks"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, not {getattr(self, name)}")
        if self.seed < 0 or self.epoch < 0:
            raise ConfigError("seed and epoch must be >= 0")
        if self.dtype not in OUT_DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(OUT_DTYPES)}, not {self.dtype!r}")
        if self.normalize is not None and self.normalize not in NORMALIZE:
            raise ConfigError(
                f"normalize must be None or one of {NORMALIZE}, not {self.normalize!r}"
            )
        if (
            self.pin_memory or (self.device and torch.device(self.device).type == "cuda")
        ) and not torch.cuda.is_available():
            raise ConfigError("pin_memory and device='cuda' need CUDA, which is not available")


class ActivationLoader(IterableDataset):
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
        # the next epoch's consumer, its first window already being read: (pid, what it
        # serves: epoch, worker, consumers, rows, buffers; the consumer); never pickled
        self._next: tuple[int, tuple[Any, ...], Consumer] | None = None

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

    # ------------------------------------------------------------------ epochs and state

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning at the next iteration."""
        if epoch < 0:
            raise ConfigError(f"epoch must be >= 0, not {epoch}")
        self.epoch, self._batches_done, self._saved_workers = int(epoch), 0, None

    def state_dict(self) -> dict[str, Any]:
        """Where this rank stands: epoch and batches served, plus what the order depends on.

        Under worker processes take the state from :class:`ActivationDataLoader` (it
        counts the batches the workers delivered); a plain ``DataLoader`` cannot."""
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "batches": self._batches_done,
            "num_workers": self._saved_workers or 1,
            **self.fingerprint(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where ``state`` was taken (O(1): no reads are replayed)."""
        if not isinstance(state, dict) or not {"version", "epoch", "batches"} <= set(state):
            keys = sorted(state)[:6] if isinstance(state, dict) else type(state).__name__
            raise ConfigError(
                f"this is not an ActivationLoader state ({keys}); pass what "
                "ActivationLoader.state_dict() or ActivationDataLoader.state_dict() "
                "returned"
            )
        if state.get("version") != STATE_VERSION:
            raise ConfigError(
                f"loader state version {state.get('version')!r} is not "
                f"{STATE_VERSION}: another actstore version saved it"
            )
        # states saved before runs and slabs existed: single whole blocks
        mine = self.fingerprint()
        # states saved before the store was part of it belong to this one
        state = {"run_blocks": 1, "mix": 1, "store": mine["store"], **state}
        wrong = [
            f"{k}={state.get(k)!r} (this loader: {v!r})"
            for k, v in mine.items()
            if state.get(k) != v
        ]
        if wrong:
            raise ConfigError(
                "the saved state belongs to a different order: "
                + "; ".join(wrong)
                + ". Build the loader with the same options"
            )
        if not 0 <= state["batches"] <= len(self):
            raise ConfigError(f"state says {state['batches']} batches served of {len(self)}")
        self.epoch, self._batches_done = int(state["epoch"]), int(state["batches"])
        self._saved_workers = int(state["num_workers"])

    def fingerprint(self) -> dict[str, Any]:
        """What this loader's order depends on (part of :meth:`state_dict`): a saved
        position continues only on a loader with the same fingerprint."""
        cfg = self.config
        sizes = self.layout.kept_rows.astype("<i8").tobytes()
        return {
            "seed": cfg.seed,
            "batch_size": cfg.batch_size,
            "pool_blocks": self.pool_blocks,
            "run_blocks": self.run_blocks,
            "mix": self.layout.mix,
            "world_size": self.world_size,
            "drop_last": cfg.drop_last,
            "drop_cls": cfg.drop_cls,
            "sites": [str(s) for s in self.sites],
            "blocks": hashlib.sha256(sizes).hexdigest()[:16],
            "store": _store_key(self.reader),
        }

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
            **dict.fromkeys(("_buffers", "_slots", "_filling", "_next", "clock")),
        }

    # ------------------------------------------------------------------ the seam used by
    # ActivationDataLoader (main process) and serve

    def attach_workers(self, link: WorkerLink | None) -> None:
        """Run under :class:`~actstore.loader.ActivationDataLoader`'s worker processes,
        which coordinate with it through ``link``'s shared memory: workers send batches as
        places in shared memory, and pinning and the move to the device happen in the
        main process. None: detach (the loader runs in its own process again)."""
        self._link = link

    def begin(self, num_consumers: int) -> None:
        """Main process, before ``num_consumers`` consumers (worker processes, or 1: this
        process) start an iteration: check that the saved position was reached with as
        many, move on to the next epoch if the last one was served completely, and
        publish the position to persistent workers."""
        self._check_workers(num_consumers)
        if self._batches_done >= len(self) > 0:  # the last epoch was served completely
            self.set_epoch(self.epoch + 1)
        self._saved_workers = num_consumers
        if self._link is not None and self._link.position is not None:
            position = [self.epoch, self._batches_done, num_consumers]
            self._link.position.copy_(torch.tensor(position, dtype=torch.int64))

    def count_batch(self) -> None:
        """Main process: one more batch of this iteration reached the user."""
        self._batches_done += 1

    def end_iteration(self, epoch: int) -> None:
        """Main process: the iteration over epoch ``epoch`` served its last batch; the next
        one starts the following epoch (unless :meth:`set_epoch` chose another)."""
        if self.epoch == epoch:
            self.set_epoch(epoch + 1)

    def _read_position(self) -> None:
        """Worker process: take the position the main process published."""
        if self._link is not None and self._link.position is not None:
            epoch, batches, workers = self._link.position.tolist()
            self.epoch, self._batches_done, self._saved_workers = epoch, batches, workers or None

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

    def _check_workers(self, num_workers: int) -> None:
        if self._batches_done and self._saved_workers not in (None, num_workers):
            raise ConfigError(
                f"this position was reached with {self._saved_workers} consumer(s) and cannot "
                f"continue with {num_workers}: the order of batches depends on the number of "
                "DataLoader workers (num_workers=0 counts as 1); resume with the same number"
            )

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
        primed, self._next = self._next, None
        if primed is not None and primed[0] == os.getpid():
            primed[2].close()
        buffers, self._buffers = self._buffers, None
        if buffers is not None and buffers[0] == os.getpid():
            buffers[1].close()

    @property
    def read_ahead(self) -> int | None:
        """The epoch whose first window this process is reading ahead (an epoch iterated to
        its end starts the next one's read at once), or None."""
        primed = self._next
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
        primed, self._next = self._next, None
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
        if self._next is not None and self._next[0] == os.getpid() and self._next[1] == key:
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
        if self._next is not None and self._next[0] == os.getpid():
            self._next[2].close()
        self._next = (os.getpid(), key, consumer)
        return True


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


def _store_key(reader: Any) -> str:
    """Which store a position belongs to: its manifest's store id (the same for a copy of
    it), else a digest of its file names and sizes (stores other tools wrote)."""
    manifest = reader.checks.manifest
    if manifest is not None:
        return str(manifest.store_id)
    listing = json.dumps(reader.files.list(), sort_keys=True).encode()
    return hashlib.sha256(listing).hexdigest()[:16]


def _moves(finish: Finish) -> tuple[bool, str | None]:
    """What a consumer's ``finish`` does with batches beyond the loader's fixed options."""
    return finish.pin_memory, None if finish.device is None else str(finish.device)


def _rank_and_world(config: LoaderConfig) -> tuple[int, int]:
    rank, world = config.rank, config.world_size
    if rank is None or world is None:
        dist = torch.distributed
        initialised = dist.is_available() and dist.is_initialized()
        if rank is None:
            rank = dist.get_rank() if initialised else 0
        if world is None:
            world = dist.get_world_size() if initialised else 1
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world}")
    return rank, world
