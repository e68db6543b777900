"""Batches onto the training device while the trainer works on the previous one.

:func:`to_device` takes host batches (tensors, or :class:`~actstore.loader.LoaderBatch`)
and yields them on the device. The copy of the next batch is started on a side stream
(:class:`~actstore.devicecopy.CudaCopies`) before the current one is handed out, so it
runs while the trainer computes; the trainer's stream waits for a batch's copy only when
it uses the batch, and the host never waits except to let go of a batch's host memory
once its copy is finished (usually long before). Host batches that lie in pinned memory
(the loader's batch buffers, workers' shared slots and the ``serve`` ring, registered
with :func:`~actstore.devicecopy.pin`) are copied by DMA with no staging copy.

At most two batches are held in host memory at once, and a host batch is released only
after its copy finished, so a batch buffer is never reused under a copy. Batches whose
memory could not be pinned (``ulimit -l``, a ring on a disk file system,
``ACTSTORE_PIN=0``) are first copied into a :class:`~actstore.devicecopy.Staging` buffer
(pinned), and their host memory is released at once.

Example:
    >>> for acts in to_device(ActivationLoader(store, site=6), copies_for("cuda")):  # doctest: +SKIP
    ...     loss = sae.step(acts)
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterable
from typing import TypeVar

import torch

from ..devicecopy import Copies, Staging, Transfer
from .pipeline import LoaderBatch

Item = TypeVar("Item", torch.Tensor, LoaderBatch)


def _start(
    item: torch.Tensor | LoaderBatch, copies: Copies, staging: Staging | None
) -> tuple[Transfer, bool]:
    indexed = isinstance(item, LoaderBatch)
    sources = [item.acts, item.rows] if isinstance(item, LoaderBatch) else [item]
    if staging is not None:
        sources = staging.stage(sources)
    return copies.to_device(sources), indexed


def to_device(
    batches: Iterable[Item], copies: Copies, staging: Staging | None = None
) -> Generator[Item, None, None]:
    """``batches`` on ``copies.device``, in order, one copy running ahead; closes
    ``copies`` when done. ``staging``: batches it says need it are copied into its
    buffers first (and their host memory let go at once)."""
    source = iter(batches)
    pending: tuple[Transfer, bool] | None = None
    try:
        item = next(source, None)
        pending = None if item is None else _start(item, copies, staging)
        del item
        while pending is not None:
            transfer, indexed = pending
            transfer.wait()  # its host rows (or staging buffer) may be reused from now on
            item = next(source, None)
            pending = None if item is None else _start(item, copies, staging)
            del item
            out = transfer.use()
            del transfer
            yield LoaderBatch(out[0], out[1]) if indexed else out[0]  # type: ignore[misc]
            del out
    finally:
        if pending is not None:  # closed early: the copy started ahead still reads its
            with contextlib.suppress(Exception):  # host rows, which are reused once we return
                pending[0].wait()
        copies.close()
