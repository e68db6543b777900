"""A local disk cache of byte ranges fetched from object storage.

Each cached range is one file ``<dir>/<2 hex>/<40 hex>.blk`` holding the bytes followed by
their 16-byte xxh3-128 digest, which is checked on every hit (a damaged entry is dropped
and fetched again). Entries are written to a temporary name and renamed into place, so a
reader in another process sees a whole entry or none (:func:`~.local.atomic_write`, without
fsyncs: an entry need not survive a crash, its digest catches a damaged one). The least
recently used entries (by file mtime, refreshed on each hit) are evicted under an exclusive
``flock`` on ``<dir>/.lock`` (:class:`~.lock.FileLock`) whenever this process has added an
eighth of the cap since its last sweep: several processes on one machine share one cache
directory safely.

Example:
    >>> import tempfile
    >>> cache = BlockCache(tempfile.mkdtemp(), max_bytes=1 << 20)
    >>> cache.put("s3://b/run/acts000000.bin@0+4", b"abcd")
    >>> out = bytearray(4); cache.get_into("s3://b/run/acts000000.bin@0+4", out), bytes(out)
    (True, b'abcd')
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import xxhash

from ..errors import ConfigError
from ..forksafe import ForkSafeLock
from .local import atomic_write
from .lock import FileLock

log = logging.getLogger(__name__)

#: Environment variables: the cache directory and its cap (bytes, or with K/M/G/T suffix).
CACHE_ENV = "ACTSTORE_CACHE"
CACHE_MAX_ENV = "ACTSTORE_CACHE_MAX"
DEFAULT_MAX_BYTES = 10 << 30
_DIGEST = 16
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"512M"`` -> 536870912; plain numbers are bytes.

    Example:
        >>> parse_size("2G"), parse_size("1000")
        (2147483648, 1000)
    """
    match = _SIZE.match(str(text))
    if match is None:
        raise ConfigError(f"cache size {text!r} is not a size; write e.g. 20G, 512M or 1000000")
    scale = 1 << (10 * "kmgt".find(match.group(2).lower()) + 10) if match.group(2) else 1
    return int(float(match.group(1)) * scale)


@dataclass
class CacheStats:
    """Counters of one process's use of a cache."""

    hits: int = 0
    misses: int = 0
    stores: int = 0
    evicted: int = 0
    damaged: int = 0


class BlockCache:
    """Byte ranges by key on local disk, capped at ``max_bytes``, shared between processes."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes < 1:
            raise ConfigError(f"cache size must be >= 1 byte, not {max_bytes}")
        self.directory = Path(directory).expanduser()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigError(f"cannot create the cache directory {self.directory}: {err}") from err
        self.max_bytes = int(max_bytes)
        self.stats = CacheStats()
        self._lock = ForkSafeLock()
        self._added = self.max_bytes  # sweep after the first store

    @classmethod
    def open(
        cls, directory: str | os.PathLike | None = None, max_bytes: int | str | None = None
    ) -> BlockCache | None:
        """The cache in ``directory``, capped at ``max_bytes`` (bytes, or a size such as
        ``"20G"``; default 10 GiB); without a directory, the one ``$ACTSTORE_CACHE`` names
        (:meth:`from_env`), or None."""
        if directory is None:
            return cls.from_env()
        cap = parse_size(max_bytes) if isinstance(max_bytes, str) else max_bytes
        return cls(directory, cap or DEFAULT_MAX_BYTES)

    @classmethod
    def from_env(cls) -> BlockCache | None:
        """The cache named by ``$ACTSTORE_CACHE`` (cap ``$ACTSTORE_CACHE_MAX``), or None."""
        directory = os.environ.get(CACHE_ENV)
        if not directory:
            return None
        cap = os.environ.get(CACHE_MAX_ENV)
        return cls(directory, parse_size(cap) if cap else DEFAULT_MAX_BYTES)

    def __getstate__(self) -> dict:
        return {"directory": self.directory, "max_bytes": self.max_bytes}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["directory"], state["max_bytes"])  # type: ignore[misc]

    def path(self, key: str) -> Path:
        """Where the entry of ``key`` lives."""
        digest = hashlib.sha1(key.encode("utf-8")).hexdigest()
        return self.directory / digest[:2] / f"{digest[2:]}.blk"

    def get_into(self, key: str, out: bytearray | memoryview) -> bool:
        """Fill ``out`` from the entry of ``key``; False (and ``out`` undefined) on a miss."""
        view = memoryview(out).cast("B")
        path = self.path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                n = f.readinto(view)
                digest = f.read(_DIGEST + 1)
        except FileNotFoundError:
            self._count("misses")
            return False
        if n != len(view) or digest != xxhash.xxh3_128(view).digest():
            self._drop_damaged(path)
            return False
        _touch(path)
        self._count("hits")
        return True

    def view(self, key: str, size: int) -> memoryview | None:
        """The entry of ``key`` (``size`` bytes), checked, as a read-only memory-mapped view:
        no copy for callers that scatter the bytes themselves; None on a miss."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                whole = os.fstat(f.fileno()).st_size == size + _DIGEST
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if whole else None
        except FileNotFoundError:
            self._count("misses")
            return None
        if mapped is None:
            self._drop_damaged(path)
            return None
        data = memoryview(mapped)[:size]
        if mapped[size:] != xxhash.xxh3_128(data).digest():
            self._drop_damaged(path)
            return None
        _touch(path)
        self._count("hits")
        return data

    def _drop_damaged(self, path: Path) -> None:
        log.warning("cache entry %s is damaged; fetching it again", path)
        path.unlink(missing_ok=True)
        self._count("damaged")
        self._count("misses")

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Keep ``data`` as the entry of ``key`` (entries larger than the cap are not kept)."""
        view = memoryview(data).cast("B")
        size = len(view) + _DIGEST
        if size > self.max_bytes:
            return
        path = self.path(key)
        try:
            path.parent.mkdir(exist_ok=True)
            with atomic_write(path, durable=False) as f:  # a damaged entry is found by its digest
                f.write(view)
                f.write(xxhash.xxh3_128(view).digest())
            _touch(path)
        except OSError as err:  # a full or read-only cache disk must not stop training
            log.warning("cannot write cache entry %s: %s", path, err)
            return
        with self._lock:
            self.stats.stores += 1
            self._added += size
            sweep = self._added >= self.max_bytes // 8
            if sweep:
                self._added = 0
        if sweep:
            self.evict()

    def usage(self) -> tuple[int, int]:
        """(entries, bytes) currently in the cache directory."""
        entries = self._entries()
        return len(entries), sum(size for _, size, _ in entries)

    def evict(self, max_bytes: int | None = None) -> int:
        """Remove least recently used entries until at most ``max_bytes`` (default: the cap)
        remain; returns how many were removed. Holds the cache's ``flock`` meanwhile."""
        cap = self.max_bytes if max_bytes is None else max_bytes
        with FileLock(self.directory / ".lock"):
            entries = self._entries()
            total = sum(size for _, size, _ in entries)
            removed = 0
            for path, size, _ in sorted(entries, key=lambda e: e[2]):
                if total <= cap:
                    break
                path.unlink(missing_ok=True)
                total -= size
                removed += 1
        with self._lock:
            self.stats.evicted += removed
        return removed

    def _entries(self) -> list[tuple[Path, int, int]]:
        out = []
        for sub in os.scandir(self.directory):
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub.path):
                if entry.name.endswith(".blk"):
                    with contextlib.suppress(FileNotFoundError):
                        st = entry.stat()
                        out.append((Path(entry.path), st.st_size, st.st_mtime_ns))
        return out

    def _count(self, name: str) -> None:
        with self._lock:
            setattr(self.stats, name, getattr(self.stats, name) + 1)


def _touch(path: Path) -> None:
    """Set ``path``'s mtime, the LRU clock, to now at full resolution (the kernel's own file
    times are coarse: entries written within a few ms would tie)."""
    now = time.time_ns()
    with contextlib.suppress(FileNotFoundError):
        os.utime(path, ns=(now, now))
