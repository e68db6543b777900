"""actstore: capture transformer activations, store them losslessly, stream them back.

The names below load their modules on first use, so ``import actstore`` (and the
``actstore`` command) does not import torch until something needs it.

Example:
    >>> import actstore
    >>> reader = actstore.open_store("actstore-data/3f1c...")  # doctest: +SKIP
    >>> reader[0, 5, 0]  # example 0, layer 5, token 0  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from .formats import open_store
    from .loader import ActivationDataLoader, ActivationLoader, ServedLoader
    from .sites import Site
    from .stats import RunningStats

#: Public name -> the module that defines it (imported on first use).
_LAZY = {
    "ActivationDataLoader": "actstore.loader",
    "ActivationLoader": "actstore.loader",
    "RunningStats": "actstore.stats",
    "ServedLoader": "actstore.loader",
    "Site": "actstore.sites",
    "open_store": "actstore.formats",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'actstore' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [
    "ActivationDataLoader",
    "ActivationLoader",
    "ActstoreError",
    "RunningStats",
    "ServedLoader",
    "Site",
    "__version__",
    "open_store",
]
