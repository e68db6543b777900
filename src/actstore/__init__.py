"""actstore: capture transformer activations, store them losslessly, stream them back.

Example:
    >>> import actstore
    >>> reader = actstore.open_store("actstore-data/3f1c...")  # doctest: +SKIP
    >>> reader[0, 5, 0]  # example 0, layer 5, token 0  # doctest: +SKIP
"""

from __future__ import annotations

import os

# Bitwise-identical captures (resume, distributed merge) need reproducible CPU math. MKL's
# results may differ from run to run unless its conditional numerical reproducibility is
# on and the thread count cannot change at run time (Intel's reproducibility conditions);
# STRICT keeps GEMM reproducible even if it does. Measured cost here: none beyond noise.
# These must be set before torch loads MKL; users can still override them.
for _name, _value in (
    ("MKL_CBWR", "AUTO,STRICT"),
    ("MKL_DYNAMIC", "FALSE"),
    ("OMP_DYNAMIC", "FALSE"),
):
    os.environ.setdefault(_name, _value)

from ._version import __version__
from .errors import ActstoreError
from .formats import open_store
from .loader import ActivationDataLoader, ActivationLoader
from .sites import Site
from .stats import RunningStats

__all__ = [
    "ActivationDataLoader",
    "ActivationLoader",
    "ActstoreError",
    "RunningStats",
    "Site",
    "__version__",
    "open_store",
]
