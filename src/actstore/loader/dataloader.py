""":class:`ActivationDataLoader`: a torch ``DataLoader`` over an :class:`ActivationLoader`
that counts the batches it delivers, so ``state_dict()`` is exact with worker processes.

Example:
    >>> import tempfile
    >>> from actstore.testing import FormatCase, make_acts, make_batches, make_plan
    >>> plan, out = make_plan(), tempfile.TemporaryDirectory()  # 138 rows per site
    >>> store = FormatCase("saev").write(out.name, plan, make_batches(plan, make_acts(plan)))
    >>> data = ActivationDataLoader(ActivationLoader(store, site=3, batch_size=32), num_workers=2)
    >>> sum(len(acts) for acts in data)  # one epoch, read by two worker processes
    138
    >>> checkpoint = {"data": data.state_dict()}  # with the model's state
"""

from __future__ import annotations

import os
import sys
from collections.abc import Generator, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from ..devicecopy import Staging, copies_for, try_pin
from ..errors import ConfigError
from .dataset import ActivationLoader
from .device import to_device
from .pipeline import LoaderBatch, RingBatch, WorkerLink

#: Batch slots each worker may have in use at once (only batches you hold use more than
#: a few; each costs one batch of shared memory).
MAX_SLOTS = 1024
#: Where torch keeps shared memory (its ``file_descriptor`` strategy).
SHM = "/dev/shm"
#: Batch slots a worker fills in turn while you hold none: the one you use, the one
#: being sent, the DataLoader's prefetch, the one being gathered and the one ahead.
WORKER_SLOTS = 5

_FIXED = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last", "collate_fn")


class ActivationDataLoader(DataLoader):
    """Runs an :class:`ActivationLoader` in ``num_workers`` worker processes.

    Each worker reads its own contiguous run of the rank's batches (with its own
    ``io_threads``) and gathers each batch straight into one of its shared-memory slots;
    this process hands the slot out as a zero-copy view. The DataLoader interleaves the
    workers round-robin, which this class counts to give an exact :meth:`state_dict`.
    Pinning and the move to ``device`` happen in the main process: the workers' slots are
    registered with CUDA once (no pinning copy) and each batch is copied to the device on
    a side stream while the previous one is in use; slots that cannot be pinned are copied
    through a pinned staging buffer.
    Batching, shuffling and ``drop_last`` belong to the ActivationLoader.
    With ``persistent_workers=True`` (the default here, unlike torch's DataLoader) the
    workers outlive an epoch with their mapped files, slots and threads, and each reads
    its next epoch's first window while the last batches are used; each new iteration
    tells them the current position through shared memory. Fresh workers every epoch
    (``persistent_workers=False``) start from nothing: where batches are pinned or go to
    CUDA, each slot is then registered and released again every epoch (measured 0.75 of
    the CPU loader's rate on an H200).
    """

    def __init__(self, dataset: ActivationLoader, *, num_workers: int = 0, **kwargs: Any) -> None:
        if not isinstance(dataset, ActivationLoader):
            raise ConfigError(
                f"ActivationDataLoader wraps an ActivationLoader, not {type(dataset).__name__}"
            )
        fixed = [k for k in _FIXED if k in kwargs]
        if fixed:
            raise ConfigError(
                f"{fixed} are set on the ActivationLoader (batch_size, "
                "drop_last, seed), not on the DataLoader"
            )
        finish = dataset.finish
        pinned = kwargs.pop("pin_memory", False)
        if num_workers > 0:  # workers never pin or move: this process does
            pinned = pinned or finish.pin_memory
            kwargs.setdefault("persistent_workers", True)  # see the class docstring
        elif finish.pin_memory or finish.device is not None:  # the loader already does
            pinned = False
        # with workers, batches arrive in shared slots: this process pins them itself
        super().__init__(
            dataset,
            batch_size=None,
            num_workers=num_workers,
            pin_memory=pinned and num_workers == 0,
            **kwargs,
        )
        self._pin = pinned and num_workers > 0
        if self._pin and not torch.cuda.is_available():
            raise ConfigError("pin_memory needs CUDA, which is not available")
        self._device = finish.device if num_workers > 0 else None
        self._link: WorkerLink | None = None
        # the main process's side of the workers' batch slots: (worker, slot) -> (the
        # slot as a numpy array, its reference count when no batch refers to it)
        self._slots: dict[tuple[int, int], tuple[np.ndarray, int]] = {}
        self._delivered: list[tuple[int, int]] = []
        if num_workers > 0:
            _check_shared_memory(dataset, num_workers)
            self._new_ring(dataset)
        else:
            dataset.attach_workers(None)

    def _new_ring(self, loader: ActivationLoader) -> None:
        """Fresh slot flags for a new set of worker processes (batches still held keep
        their memory)."""
        self._link = WorkerLink.create(
            self.num_workers, slots=MAX_SLOTS, persistent=bool(self.persistent_workers)
        )
        loader.attach_workers(self._link)
        self._slots, self._delivered = {}, []

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        loader: ActivationLoader = self.dataset  # type: ignore[assignment]
        if self.num_workers == 0:  # the loader runs here and counts its own batches
            yield from super().__iter__()
            return
        if not self.persistent_workers or self._iterator is None:
            self._new_ring(loader)  # new worker processes
        else:  # persistent workers start the epoch with the slots you no longer hold
            self._hand_back()
            assert self._link is not None
            for worker, slot in self._delivered:  # held: kept by the workers' reclaim()
                self._link.slot_flags[worker, slot] = 2
        loader.begin(self.num_workers)  # persistent workers read the position it publishes
        epoch = loader.epoch
        batches = self._received(super().__iter__())
        if self._device is not None:  # the next batch's copy runs while this one is used
            staging = Staging(self._device)  # for slots that could not be pinned
            batches = to_device(batches, copies_for(self._device), staging)
        try:
            for batch in batches:
                loader.count_batch()
                yield batch
                del batch
        finally:
            batches.close()
        loader.end_iteration(epoch)

    def _received(self, messages: Iterator[RingBatch]) -> Generator[Any, None, None]:
        for message in messages:
            batch = self._receive(message)
            del message
            yield batch
            del batch

    def _receive(self, message: RingBatch) -> Any:
        """The batch in a worker's slot, as a zero-copy view; slots whose batches are no
        longer referenced are handed back to their workers first."""
        self._hand_back()
        key = (message.worker, message.slot)
        if message.storage is not None:
            root = self._pinned(message.storage.numpy())
            self._slots[key] = (root, sys.getrefcount(root))
        self._delivered.append(key)
        view = self._slots[key][0][: message.nbytes]
        acts = torch.from_numpy(view).view(getattr(torch, message.dtype))
        acts = acts.view(message.shape)
        del view
        if message.rows is None:
            return acts
        return LoaderBatch(acts, torch.as_tensor(message.rows))

    def _pinned(self, root: np.ndarray) -> np.ndarray:
        """A worker's shared slot, registered with CUDA when batches are pinned or go to a
        CUDA device (once: it serves many batches)."""
        return try_pin(root) if self._pin else root

    def _hand_back(self) -> None:
        """Give workers back the slots of batches nobody refers to any more."""
        link = self._link
        assert link is not None, "batches arrive from workers only"
        flags = link.slot_flags
        kept = []
        for key in self._delivered:
            root, idle = self._slots[key]
            if sys.getrefcount(root) == idle:
                flags[key[0], key[1]] = 0
            else:
                kept.append(key)
        self._delivered = kept

    def host_bytes(self) -> int:
        """Bytes of the workers' batch slots this process maps now (each registered with
        CUDA once when batches are pinned or go to CUDA)."""
        return sum(int(root.nbytes) for root, _ in self._slots.values())

    def state_dict(self) -> dict[str, Any]:
        """The loader's position counted in batches delivered by this DataLoader."""
        return self.dataset.state_dict()  # type: ignore[attr-defined]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` was taken (same options and ``num_workers``)."""
        self.dataset.load_state_dict(state)  # type: ignore[attr-defined]


def _check_shared_memory(loader: ActivationLoader, num_workers: int) -> None:
    """Workers gather batches into slots in shared memory (``/dev/shm``): refuse at once,
    not with a bus error mid-epoch, when it cannot hold the slots they fill in turn."""
    need = num_workers * WORKER_SLOTS * loader.batch_bytes
    try:
        vfs = os.statvfs(SHM)
    except OSError:
        return  # no /dev/shm to measure: torch reports what it finds
    free = vfs.f_bavail * vfs.f_frsize
    if need > free:
        raise ConfigError(
            f"{num_workers} DataLoader workers hand batches over in {SHM}: they need "
            f"{need / 2**20:.0f} MiB but {free / 2**20:.0f} MiB is free; enlarge it (docker: "
            "--shm-size), use fewer workers or a smaller batch_size"
        )
