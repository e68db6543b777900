"""actstore: capture transformer activations, store them losslessly, stream them back.

Example:
    >>> import actstore
    >>> reader = actstore.open_store("actstore-data/3f1c...")  # doctest: +SKIP
    >>> reader[0, 5, 0]  # example 0, layer 5, token 0  # doctest: +SKIP
"""

from __future__ import annotations

import os

# MKL's default CPU code paths may differ from run to run (its "conditional numerical
# reproducibility" is off by default), which breaks bitwise-identical captures on resume.
# AUTO keeps the fast code path and makes it reproducible; it must be set before torch's
# first MKL call. Users can still override it.
os.environ.setdefault("MKL_CBWR", "AUTO")

from .errors import ActstoreError  # noqa: E402
from .formats import open_store  # noqa: E402
from .loader import ActivationDataLoader, ActivationLoader  # noqa: E402
from .sites import Site  # noqa: E402
from .stats import RunningStats  # noqa: E402

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
