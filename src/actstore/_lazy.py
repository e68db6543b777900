"""Heavy modules imported on first use, so commands that never touch them (``actstore ls``,
``status``, ``inspect``, ``--help``) start in a fraction of a second.

Modules write::

    if TYPE_CHECKING:
        import torch
    else:
        from .._lazy import torch

and use ``torch`` as usual; the import happens at the first attribute read.

Example:
    >>> from actstore._lazy import LazyModule
    >>> LazyModule("json").dumps([1])
    '[1]'
"""

from __future__ import annotations

import importlib
import types
from typing import Any


class LazyModule(types.ModuleType):
    """Stands for module ``name`` and imports it when an attribute is first read."""

    def __getattr__(self, attr: str) -> Any:
        module = importlib.import_module(self.__name__)
        value = getattr(module, attr)
        setattr(self, attr, value)  # later reads skip __getattr__
        return value


torch = LazyModule("torch")
