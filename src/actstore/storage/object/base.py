"""The abstract object store and key helpers shared by every backend."""

from __future__ import annotations

import abc
import builtins
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ...errors import UnsupportedError
from ...forksafe import ForkSafeLock
from .config import MiB


@dataclass(frozen=True)
class ObjectInfo:
    """One listed object: its full key and size in bytes."""

    key: str
    size: int
    version: str = ""
    """Changes when the object is replaced: the ETag on S3 ("" where unknown)."""
    md5: str = ""
    """The MD5 of the object's bytes, hex, where the listing gives it
    (``capabilities.content_md5``: GCS's ``md5Hash``); "" elsewhere."""


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do beyond whole-object put, get, size and delete: callers ask
    these, never the backend's class.

    Example:
        >>> Capabilities(conditional_create=True).multipart
        False
    """

    writes: bool = True
    """``put``, ``delete`` and ``copy`` work: stores can be written here (a read-only HTTP
    backend sets False, and writers refuse it in one line)."""
    ranged_reads: bool = True
    """``get_range`` fetches only the bytes asked for (else the whole object is read)."""
    listing: bool = True
    """``list`` and ``list_dirs`` work (a read-only HTTP backend may have neither)."""
    conditional_create: bool = False
    """``put_if`` / ``delete_if`` / ``get_with_age`` work: a create that fails when the
    key exists and an update only while the version is unchanged (what the write lock
    needs)."""
    multipart: bool = False
    """Resumable uploads part by part (``create_upload``, ``upload_part``,
    ``complete_upload``, ``pending_upload``, ``abort_upload``): an interrupted copy of a
    large file resumes. Without it large objects go through ``put_chunks`` (still atomic)."""
    content_md5: bool = False
    """Listings give each object's :attr:`ObjectInfo.md5` (GCS): a copy or an upload that
    resumes compares local bytes with an object without reading it."""
    md5_etags: bool = False
    """``ObjectInfo.version`` of an object is S3's ETag: the MD5 of its bytes (of the
    parts' MD5s for multipart uploads), so a copy checks what landed without reading it."""


class ObjectStore(abc.ABC):
    """Bytes by key, one bucket (or directory) of one backend. Backends:
    :class:`~.s3_store.S3Store`, :class:`~.local_store.LocalStore` and the
    :mod:`~.obstore_store` ones (``gs://``, ``az://``); :mod:`~.registry` picks one by URL
    scheme. What a backend can do beyond the abstract methods is in :attr:`capabilities`;
    the optional methods below raise :class:`~actstore.errors.UnsupportedError` where it
    says no. :class:`actstore.testing.BackendSuite` is the contract as tests.
    """

    #: Human-readable root, e.g. ``s3://bucket`` or ``/data``.
    root_url: str
    #: The bucket's name ("" for a local directory).
    bucket_name: str = ""
    #: The URL scheme of the backend (``s3``, ``gs``, ``az``; ``file`` locally).
    scheme: ClassVar[str] = ""
    #: What the backend can do (see :class:`Capabilities`).
    capabilities: ClassVar[Capabilities] = Capabilities()

    @property
    def local_root(self) -> Path | None:
        """The directory on local disk holding the keys, or None for object storage."""
        return None

    @property
    def retries(self) -> int:
        """Transient faults retried by this store so far (0 where not counted)."""
        return 0

    @abc.abstractmethod
    def url(self, key: str) -> str:
        """The location of ``key`` as a user would write it."""

    @abc.abstractmethod
    def put(self, key: str, data: bytes | bytearray | memoryview) -> str:
        """Publish ``data`` under ``key`` atomically (whole object or nothing). Returns the
        new object's version as :meth:`list` will report it ("" where the backend does not
        say at once): an uploader that read the bytes it sent knows the object at that
        version holds them."""

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """The whole object."""

    @abc.abstractmethod
    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object."""

    def get_range_into(
        self, key: str, out: bytearray | memoryview, start: int, *, total: int | None = None
    ) -> None:
        """Fill ``out`` with bytes ``[start, start + len(out))`` of the object; ``total``: the
        object's expected size, checked where the backend can."""
        view = memoryview(out).cast("B")
        view[:] = self.get_range(key, start, start + len(view))

    def get_into(
        self,
        key: str,
        out: bytearray | memoryview,
        *,
        chunk_size: int = 8 * MiB,
        pool: ThreadPoolExecutor | None = None,
    ) -> None:
        """Fill ``out`` with the first ``len(out)`` bytes of the object, in chunks fetched
        concurrently on ``pool`` (sequentially without one). The object must be exactly
        ``len(out)`` bytes long, else :class:`~actstore.errors.CorruptStoreError`."""
        view = memoryview(out).cast("B")
        total = len(view)
        starts = range(0, total, chunk_size)
        if pool is None or len(starts) <= 1:
            for s in starts:
                self.get_range_into(key, view[s : s + chunk_size], s, total=total)
            return
        futures = [
            pool.submit(self.get_range_into, key, view[s : s + chunk_size], s, total=total)
            for s in starts
        ]
        errors = [f.exception() for f in futures]  # every chunk done before raising
        for err in errors:
            if err is not None:
                raise err

    @abc.abstractmethod
    def size(self, key: str) -> int | None:
        """Size of the object, or None if it does not exist."""

    @abc.abstractmethod
    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (string prefix, S3 semantics)."""

    @abc.abstractmethod
    def list_dirs(self, prefix: str) -> builtins.list[str]:
        """Names of the immediate "sub-directories" of ``prefix`` (``prefix/NAME/...``)."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key`` (no error if it is absent)."""

    @abc.abstractmethod
    def abort_incomplete(self, prefix: str) -> int:
        """Drop unfinished uploads under ``prefix`` (S3 multipart, local temp files)."""

    def check_bucket(self) -> None:
        """Fail early, in one line, when the bucket cannot be used (no-op locally)."""

    def clone(self) -> ObjectStore:
        """Another handle on the same store with its own connections (for a thread pool of
        its own, e.g. one uploader per hook)."""
        return self

    def copy(self, src: str, dst: str) -> None:
        """Make ``dst`` a copy of ``src`` without sending the bytes through this process
        where the backend can (a hard link locally, a server-side copy on S3)."""
        self.put(dst, self.get(src))

    def delete_tree(self, prefix: str) -> None:
        """Remove every object under ``prefix`` (and, locally, the empty folders)."""
        for obj in list(self.list(prefix.rstrip("/") + "/")):
            self.delete(obj.key)

    @abc.abstractmethod
    def acquire_lock(self, prefix: str, *, break_lock: bool = False) -> Any:
        """The write lock of the store at ``prefix`` (a lock file beside a local store, a
        lease object on S3): an object with ``release()``."""

    def put_chunks(self, key: str, chunks: Iterable[bytes | bytearray | memoryview]) -> str:
        """Publish the concatenation of ``chunks`` under ``key`` atomically (its version, as
        :meth:`put`); backends that can stream it (an upload completed at the end) override
        this."""
        return self.put(key, b"".join(bytes(c) for c in chunks))

    # Conditional requests (capabilities.conditional_create): the write lock's primitives.

    def _refuse(self, what: str) -> UnsupportedError:
        return UnsupportedError(f"{self.root_url} does not support {what}")

    def put_if(self, key: str, data: bytes, *, etag: str | None) -> str | None:
        """PUT ``data`` only if ``key`` does not exist (``etag=None``) or still has version
        ``etag``. The new version, or None when the condition does not hold."""
        raise self._refuse("conditional writes")

    def get_with_age(self, key: str) -> tuple[bytes, str, float] | None:
        """``(body, version, age_s)`` of ``key`` (age since last written), or None."""
        raise self._refuse("conditional writes")

    def delete_if(self, key: str, etag: str) -> bool:
        """Delete ``key`` only if its version is still ``etag``; False if it changed."""
        raise self._refuse("conditional writes")

    # Resumable multipart uploads (capabilities.multipart).

    def create_upload(self, key: str) -> str:
        """Start a multipart upload of ``key``; its upload id."""
        raise self._refuse("resumable multipart uploads")

    def upload_part(
        self, key: str, upload_id: str, number: int, data: Any, *, of: int | None = None
    ) -> str:
        """Send part ``number`` (1-based); its ETag."""
        raise self._refuse("resumable multipart uploads")

    def complete_upload(
        self, key: str, upload_id: str, etags: builtins.list[str], size: int
    ) -> None:
        """Publish ``key`` from its parts (ETags in part order)."""
        raise self._refuse("resumable multipart uploads")

    def abort_upload(self, key: str, upload_id: str) -> None:
        """Drop an unfinished upload."""
        raise self._refuse("resumable multipart uploads")

    def pending_upload(self, key: str) -> tuple[str, dict[int, tuple[str, int]]] | None:
        """The newest unfinished upload of ``key`` and its parts, or None."""
        raise self._refuse("resumable multipart uploads")

    def get_json(self, key: str) -> Any:
        """Parse the object as UTF-8 JSON (:class:`CorruptStoreError` if it is not, read
        twice: a body mangled in transit, seen under injected resets, is fetched again)."""
        from ...errors import CorruptStoreError
        from ..local import load_json

        for attempt in range(2):
            data = self.get(key)
            try:
                return load_json(data)
            except ValueError as err:
                if attempt == 0:
                    continue
                raise CorruptStoreError(
                    f"{self.url(key)} is not valid JSON ({err}); the store is damaged: restore "
                    "or re-create this file"
                ) from err
        raise AssertionError("unreachable")

    def put_json(self, key: str, obj: Any, *, indent: int | None = None) -> None:
        """Serialise ``obj`` as JSON and publish it atomically."""
        import json

        self.put(key, json.dumps(obj, indent=indent).encode("utf-8"))


def join_key(*parts: str) -> str:
    """Join key parts with single slashes, skipping empty parts.

    Example:
        >>> join_key("run", "", "models.layers.1.post/", "metadata.json")
        'run/models.layers.1.post/metadata.json'
    """
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


def parent_key(key: str) -> str:
    """``"a/b/c"`` -> ``"a/b"``; ``"c"`` -> ``""``."""
    return key.rstrip("/").rpartition("/")[0]


def base_name(key: str) -> str:
    """``"a/b/c"`` -> ``"c"``."""
    return key.rstrip("/").rpartition("/")[2]


#: Base name of the write lock object a capture keeps in the prefix of the store it writes
#: (:mod:`actstore.storage.object.s3lock`): never part of the store.
LOCK_NAME = ".actstore-lock.json"


def is_internal(name: str) -> bool:
    """Whether ``name`` (a key or a store-relative name) is actstore's bookkeeping beside a
    store's files (the S3 write lock), which listings of the store leave out.

    Example:
        >>> is_internal("acts/3f1c/.actstore-lock.json"), is_internal("acts000000.bin")
        (True, False)
    """
    return base_name(name) == LOCK_NAME


class ClientSlot:
    """The SDK client of one object store, made on first use in each process: a forked
    process or an unpickled copy makes its own (the slot pickles empty), and concurrent
    first uses make one."""

    def __init__(self) -> None:
        self._client: Any = None
        self._pid = os.getpid()
        self._lock = ForkSafeLock()

    def get(self, make: Callable[[], Any]) -> Any:
        """This process's client, made by ``make()`` the first time."""
        if self._client is None or self._pid != os.getpid():
            with self._lock:
                if self._client is None or self._pid != os.getpid():
                    self._client = make()
                    self._pid = os.getpid()
        return self._client

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
