"""The files of one store under ``s3://bucket/prefix`` (or any object store's URL), read by
byte range: :class:`ObjectFiles` (also called :class:`S3Files`) lists the prefix once (names, sizes, ETags), then serves ``read_range``
with concurrent ranged GETs straight into the caller's buffer, and ``read_ranges`` by
coalescing nearby ranges into few GETs. With a :class:`~actstore.storage.cache.BlockCache`
(``cache_dir=`` or ``$ACTSTORE_CACHE``) ranges fetched once are kept on local disk.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import ConfigError, CorruptStoreError
from ..forksafe import ForkSafeLock
from .cache import BlockCache
from .object import MiB, ObjectStore, is_internal, join_key
from .storefiles import StoreFiles, bytes_view, new_buffer

#: Ranges longer than this are split into parts fetched concurrently.
PART_BYTES = 8 * MiB
#: ``read_ranges`` merges ranges less than this many bytes apart into one GET.
MERGE_GAP = 256 << 10


class ObjectFiles(StoreFiles):
    """The objects under ``SCHEME://bucket/prefix/`` of any :class:`ObjectStore`: listed
    once, read with ranged GETs.

    Picklable (worker processes make their own client, threads and cache handle).
    """

    def __init__(
        self,
        store: ObjectStore,
        prefix: str,
        *,
        cache: BlockCache | None = None,
        threads: int = 16,
        part_bytes: int = PART_BYTES,
    ) -> None:
        self.store, self.prefix = store, prefix.strip("/")
        self.url = store.url(self.prefix)
        self.cache = cache
        self.threads, self.part_bytes = threads, part_bytes
        self._listing: dict[str, tuple[int, str]] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = os.getpid()
        self._lock = ForkSafeLock()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_pool": None, "_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = ForkSafeLock()

    @property
    def md5_versions(self) -> bool:  # type: ignore[override]
        return self.store.capabilities.md5_etags

    def key(self, name: str) -> str:
        return join_key(self.prefix, name)

    def _objects(self) -> dict[str, tuple[int, str]]:
        if self._listing is None:
            base = self.prefix + "/" if self.prefix else ""
            self._listing = {
                o.key[len(base) :]: (o.size, o.version)
                for o in self.store.list(base)
                if not is_internal(o.key)
            }
        return self._listing

    def refresh(self) -> None:
        """Forget the listing (after the prefix changed)."""
        self._listing = None

    def list(self) -> dict[str, int]:
        return {name: size for name, (size, _) in sorted(self._objects().items())}

    def size(self, name: str) -> int | None:
        entry = self._objects().get(name)
        return None if entry is None else entry[0]

    def version(self, name: str) -> str:
        entry = self._objects().get(name)
        return "" if entry is None else entry[1]

    def _pool_(self) -> ThreadPoolExecutor:
        """This process's GET threads (a forked worker must not use its parent's)."""
        if self._pool is None or self._pool_pid != os.getpid():
            with self._lock:
                if self._pool is None or self._pool_pid != os.getpid():
                    self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="actstore-get")
                    self._pool_pid = os.getpid()
                    weakref.finalize(self, self._pool.shutdown, wait=False)
        return self._pool

    def read_range(self, name, offset, length, out=None, *, cache=True) -> memoryview:
        view = new_buffer(length) if out is None else bytes_view(out)
        if len(view) != length:
            raise ConfigError(f"out holds {len(view)} bytes, not {length}")
        size = self.require(name)
        if offset + length > size:
            raise CorruptStoreError(
                f"{self.url_of(name)} is {size} bytes, a read of bytes {offset}..{offset + length}"
                " goes past its end: the object is truncated; re-create it"
            )
        cache_key = None
        if cache and self.cache is not None:
            cache_key = self._cache_key(name, offset, length)
            if self.cache.get_into(cache_key, view):
                return view
        self._fetch(name, offset, view, size)
        if cache_key is not None:
            self.cache.put(cache_key, view)  # type: ignore[union-attr]
        return view

    def _cache_key(self, name: str, offset: int, length: int) -> str:
        """The object's URL and ETag (a replaced object never hits) and the range."""
        return f"{self.url_of(name)}#{self._objects()[name][1]}@{offset}+{length}"

    def read_view(self, name: str, offset: int, length: int) -> memoryview:
        if self.cache is not None and name in self._objects():
            hit = self.cache.view(self._cache_key(name, offset, length), length)
            if hit is not None:
                return hit
            view = new_buffer(length)
            self._fetch(name, offset, view, self.require(name))
            self.cache.put(self._cache_key(name, offset, length), view)
            return view
        return self.read_range(name, offset, length)

    def _fetch(self, name: str, offset: int, view: memoryview, size: int) -> None:
        """Ranged GETs of ``view``'s bytes, ``part_bytes`` each, run concurrently."""
        key, part = self.key(name), self.part_bytes
        if len(view) <= part:
            self.store.get_range_into(key, view, offset, total=size)
            return
        pool = self._pool_()
        futures = [
            pool.submit(self.store.get_range_into, key, view[s : s + part], offset + s, total=size)
            for s in range(0, len(view), part)
        ]
        for f in futures:
            f.result()

    def read_ranges(self, name: str, ranges: Sequence[tuple[int, Any]]) -> None:
        """Nearby ranges (gaps under ``MERGE_GAP``, spans up to ``part_bytes``) become one GET;
        the GETs run concurrently; each range lands in its own buffer."""
        if not ranges:
            return
        size = self.require(name)
        items = sorted(((int(o), bytes_view(b)) for o, b in ranges), key=lambda r: r[0])
        groups: list[list[tuple[int, memoryview]]] = []
        end = 0
        for offset, view in items:
            if (
                groups
                and offset - end <= MERGE_GAP
                and offset + len(view) - groups[-1][0][0] <= self.part_bytes
            ):
                groups[-1].append((offset, view))
                end = max(end, offset + len(view))
            else:
                groups.append([(offset, view)])
                end = offset + len(view)
        key = self.key(name)

        def fetch(group: list[tuple[int, memoryview]]) -> None:
            if len(group) == 1:
                self.store.get_range_into(key, group[0][1], group[0][0], total=size)
                return
            start = group[0][0]
            stop = max(o + len(v) for o, v in group)
            buf = new_buffer(stop - start)
            self.store.get_range_into(key, buf, start, total=size)
            for o, v in group:
                v[:] = buf[o - start : o - start + len(v)]

        if len(groups) == 1:
            fetch(groups[0])
            return
        for f in [self._pool_().submit(fetch, g) for g in groups]:
            f.result()

    def close(self) -> None:
        if self._pool is not None and self._pool_pid == os.getpid():
            self._pool.shutdown(wait=False)
        self._pool = None


#: The name it had when S3 was the only object store.
S3Files = ObjectFiles
