"""actstore: capture transformer activations, store them losslessly, stream them back.

Example:
    >>> import actstore
    >>> reader = actstore.open_store("actstore-data/3f1c...")  # doctest: +SKIP
    >>> reader[0, 5, 0]  # example 0, layer 5, token 0  # doctest: +SKIP
"""

from __future__ import annotations

from .errors import ActstoreError
from .formats import open_store
from .loader import ActivationDataLoader, ActivationLoader
from .sites import Site
from .stats import RunningStats

__version__ = "0.1.0"

__all__ = [
    "ActivationDataLoader",
    "ActivationLoader",
    "ActstoreError",
    "RunningStats",
    "Site",
    "__version__",
    "open_store",
]
