"""The training read path: one shuffled, resumable, multi-worker loader over blocks.

- :class:`ActivationLoader` (a torch ``IterableDataset``): batches of rows of one site or
  several aligned sites, shuffled within windows of whole blocks, exact across ranks and
  workers, resumable with ``state_dict()``.
- :class:`ActivationDataLoader`: runs it in DataLoader worker processes and counts what
  they deliver, so ``state_dict()`` stays exact.
- :mod:`actstore.order`: the order as pure functions (plan, windows, splits).
- :mod:`actstore.loader.serve`: one server reads a store once per epoch and feeds K
  trainer processes through shared memory (:func:`serve`, :class:`ServedLoader`).

Example:
    >>> from actstore.loader import ActivationLoader
    >>> loader = ActivationLoader("acts/3f1c...", site=6, batch_size=4096)  # doctest: +SKIP
    >>> for acts in loader: ...  # doctest: +SKIP
"""

from __future__ import annotations

from .config import DEFAULT_POOL_BYTES, LoaderConfig
from .dataloader import ActivationDataLoader
from .dataset import ActivationLoader
from .pipeline import LoaderBatch
from .serve import ServedLoader, serve, start_server

__all__ = [
    "DEFAULT_POOL_BYTES",
    "ActivationDataLoader",
    "ActivationLoader",
    "LoaderBatch",
    "LoaderConfig",
    "ServedLoader",
    "serve",
    "start_server",
]
