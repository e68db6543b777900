"""Load pickles of activation data without running code: a restricted unpickler.

A pickle names the callables that rebuild its objects, and plain :func:`pickle.load` calls
whatever it names, so a crafted file can run any code. :func:`load` admits only what
activation shards are made of: numpy arrays and scalars of numeric dtypes, and plain
containers and scalars (dict, list, tuple, set, str, bytes, int, float, complex, bool,
None). Any other class or function named in the stream raises
:class:`~actstore.errors.UnsafeDataError` naming it, before anything is called. Arrays
of object (or any non-numeric) dtype are refused however the stream builds them: through
``numpy.dtype``, a dtype string passed to ``numpy.ndarray(...)`` or ``_reconstruct``, and
a final walk over the result. ``max_bytes`` bounds what the stream may hold and what it
may allocate: reading past it, or a call in the stream that would allocate more (an array
of a huge shape, ``bytearray(4_000_000_000)``), raises
:class:`~actstore.errors.CorruptStoreError` before the memory is taken (a small file
cannot expand into a huge allocation).

Example:
    >>> import io, pickle, numpy as np
    >>> data = pickle.dumps({"layer_3": [{"activation": np.ones((2, 4), np.float32)}]})
    >>> load(io.BytesIO(data))["layer_3"][0]["activation"].shape
    (2, 4)
    >>> class Evil:
    ...     def __reduce__(self):
    ...         return (print, ("pwned",))
    >>> load(io.BytesIO(pickle.dumps(Evil())))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    actstore.errors.UnsafeDataError: refusing to unpickle builtins.print: ...
"""

from __future__ import annotations

import _compat_pickle
import io
import pickle
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from .errors import CorruptStoreError, UnsafeDataError

#: dtype kinds an array may have: bool, integers, floats, complex (no objects, no records).
_NUMERIC_KINDS = frozenset("biufc")


def _checked_dtype(*args: Any) -> np.dtype:
    dtype = np.dtype(*args)
    if dtype.kind not in _NUMERIC_KINDS or dtype.fields is not None:
        raise UnsafeDataError(
            f"refusing to unpickle an array of dtype {dtype!s}: only numeric arrays are "
            "allowed in activation data"
        )
    return dtype


def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    """What protocol 2 pickles call to rebuild ``bytes`` (``_codecs.encode``)."""
    if encoding not in ("latin1", "latin-1"):
        raise UnsafeDataError(f"refusing _codecs.encode with encoding {encoding!r}")
    return text.encode("latin1")


def _checked_ndarray(shape: Any, dtype: Any = float, *args: Any, **kwargs: Any) -> np.ndarray:
    """``numpy.ndarray(shape, dtype, ...)`` called by a pickle: numeric dtypes only."""
    return np.ndarray(shape, _checked_dtype(dtype), *args, **kwargs)


def _checked_reconstruct(subtype: Any, shape: Any, dtype: Any) -> np.ndarray:
    """numpy's ``_reconstruct``: plain ndarrays of numeric dtypes only."""
    if subtype is not _checked_ndarray:
        raise UnsafeDataError(f"refusing to reconstruct an array of type {subtype!r}")
    return np.ndarray.__new__(np.ndarray, shape, _checked_dtype(dtype))


def _numpy_allowed() -> dict[tuple[str, str], Callable[..., Any]]:
    from numpy._core import multiarray, numeric  # the names numpy >= 2 pickles refer to

    rebuild: dict[str, Callable[..., Any]] = {
        "_reconstruct": _checked_reconstruct,
        "scalar": multiarray.scalar,
    }
    out: dict[tuple[str, str], Callable[..., Any]] = {
        ("numpy", "ndarray"): _checked_ndarray,
        ("numpy", "dtype"): _checked_dtype,
    }
    for module in ("numpy._core.multiarray", "numpy.core.multiarray"):
        for name, fn in rebuild.items():
            out[(module, name)] = fn
    for module in ("numpy._core.numeric", "numpy.core.numeric"):
        # a private numpy helper (pickles of some arrays name it), absent from numpy's stubs
        out[(module, "_frombuffer")] = numeric._frombuffer  # type: ignore[attr-defined]
    return out


_ALLOWED: dict[tuple[str, str], Callable[..., Any]] = {
    **_numpy_allowed(),
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "complex"): complex,
    ("builtins", "bytearray"): bytearray,
    ("builtins", "bytes"): bytes,
    ("_codecs", "encode"): _latin1_encode,
}


class RestrictedUnpickler(pickle.Unpickler):
    """An :class:`pickle.Unpickler` whose ``find_class`` admits only :data:`_ALLOWED`, each
    allocating call charged against ``budget`` bytes (None: unbounded)."""

    def __init__(self, file: Any, *, budget: int | None = None) -> None:
        super().__init__(file)
        self.budget = budget

    def charge(self, n: int, what: str) -> None:
        """Refuse an allocation of ``n`` bytes past the budget, before it is made."""
        if self.budget is None:
            return
        if n < 0 or n > self.budget:
            raise CorruptStoreError(
                f"the pickle asks for {what} of {n} bytes, more than the {self.budget} its "
                "metadata allows (a crafted or damaged file); refusing it"
            )
        self.budget -= n

    def _guarded(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        if fn is _checked_ndarray:

            def ndarray(shape: Any, dtype: Any = float, *args: Any, **kwargs: Any) -> Any:
                self.charge(_array_bytes(shape, dtype), "an array")
                return _checked_ndarray(shape, dtype, *args, **kwargs)

            ndarray.is_ndarray = True  # type: ignore[attr-defined]
            return ndarray
        if fn is _checked_reconstruct:

            def reconstruct(subtype: Any, shape: Any, dtype: Any) -> Any:
                self.charge(_array_bytes(shape, dtype), "an array")
                plain = getattr(subtype, "is_ndarray", False)
                return _checked_reconstruct(_checked_ndarray if plain else subtype, shape, dtype)

            return reconstruct
        if fn in (bytearray, bytes):

            def buffer(*args: Any) -> Any:
                if args and isinstance(args[0], int):
                    self.charge(args[0], fn.__name__)
                return fn(*args)

            return buffer
        return fn

    def find_class(self, module: str, name: str) -> Any:
        # Python 2 names (protocol 0-2 pickles, e.g. __builtin__.set), mapped as pickle does
        module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        allowed = _ALLOWED.get((module, name))
        if allowed is not None:
            return self._guarded(allowed)
        if allowed is None:
            raise UnsafeDataError(
                f"refusing to unpickle {module}.{name}: activation shards may hold only numpy "
                "arrays, plain containers and scalars, and loading other objects can run "
                "arbitrary code. If you trust this file and need the object, load it with "
                "the pickle module yourself"
            )
        return allowed

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeDataError("refusing a pickle with persistent ids (not activation data)")


class BinaryReader(Protocol):
    """What :func:`load` reads: a binary file (``open(path, "rb")``, ``io.BytesIO``,
    ``gzip.GzipFile``...)."""

    def read(self, n: int = -1, /) -> bytes: ...

    def readinto(self, buffer: Any, /) -> int: ...

    def readline(self, limit: int = -1, /) -> bytes: ...


class _Bounded:
    """A read-only file view that refuses to read past ``limit`` bytes in total."""

    def __init__(self, raw: BinaryReader, limit: int) -> None:
        self.raw, self.left, self.limit = raw, limit, limit
        self.name = getattr(raw, "name", "")

    def _take(self, n: int) -> int:
        if n < 0 or n > self.left:
            raise CorruptStoreError(
                f"{self.name or 'the pickle stream'} holds more than the {self.limit} bytes its "
                "metadata declares (a decompression bomb or a damaged file); refusing it"
            )
        return n

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            data = self.raw.read(self.left + 1)
        else:
            data = self.raw.read(self._take(n))
        self.left -= self._take(len(data))
        return data

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        got = self.raw.readinto(view[: self._take(len(view))])
        self.left -= got
        return got

    def readline(self, limit: int = -1) -> bytes:
        data = self.raw.readline(self.left + 1 if limit < 0 else self._take(limit))
        self.left -= self._take(len(data))
        return data


def _array_bytes(shape: Any, dtype: Any) -> int:
    """Bytes an array of ``shape`` and ``dtype`` takes (a malformed shape counts as huge)."""
    try:
        dims = [int(shape)] if isinstance(shape, (int, np.integer)) else [int(x) for x in shape]
        size = 1
        for d in dims:
            if d < 0:
                return -1
            size *= d
        return size * _checked_dtype(dtype).itemsize
    except (TypeError, ValueError):
        return -1


def _check_arrays(obj: Any) -> None:
    """Refuse non-numeric arrays anywhere in an unpickled result (iteratively: a crafted
    stream may nest containers deeper than Python's recursion limit)."""
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, np.ndarray):
            _checked_dtype(item.dtype)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)


def load(file: BinaryReader, *, max_bytes: int | None = None) -> Any:
    """Unpickle one object from a binary file object, refusing anything but plain data.

    Raises :class:`UnsafeDataError` for disallowed objects and :class:`CorruptStoreError`
    for a truncated or malformed stream, or one longer than ``max_bytes``.
    """
    source = file if max_bytes is None else _Bounded(file, max_bytes)
    try:
        result = RestrictedUnpickler(source, budget=max_bytes).load()
        _check_arrays(result)
        return result
    except (UnsafeDataError, CorruptStoreError):
        raise
    except (
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        TypeError,
        AttributeError,
        IndexError,
        KeyError,
        OverflowError,
        MemoryError,
    ) as err:
        name = getattr(file, "name", "") or "the pickle stream"
        raise CorruptStoreError(
            f"{name} is not a readable pickle ({type(err).__name__}: {err}); the file is "
            "damaged or truncated: restore it or re-create the store"
        ) from err


def loads(data: bytes | bytearray | memoryview) -> Any:
    """:func:`load` from bytes.

    Example:
        >>> loads(pickle.dumps([1, (2.5, "x"), {"k": None}]))
        [1, (2.5, 'x'), {'k': None}]
    """
    return load(io.BytesIO(data))
