"""The files of one store directory, on local disk or under ``s3://bucket/prefix``, read by
byte range. Format readers get their bytes through this layer, so one reader serves both.

* :class:`LocalFiles` reads with ``pread`` (and exposes ``local_path`` so readers keep their
  memmaps);
* :class:`S3Files` lists the prefix once (names, sizes, ETags), then serves
  ``read_range`` with concurrent ranged GETs straight into the caller's buffer, and
  ``read_ranges`` by coalescing nearby ranges into few GETs. With a :class:`BlockCache`
  (``cache_dir=`` or ``$ACTSTORE_CACHE``) ranges fetched once are kept on local disk.

Example:
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()); _ = (d / "a.bin").write_bytes(b"0123456789")
    >>> files = open_files(d)
    >>> files.size("a.bin"), bytes(files.read_range("a.bin", 2, 3)), files.list()
    (10, b'234', {'a.bin': 10})
"""

from __future__ import annotations

import abc
import builtins
import ctypes
import errno
import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError, CorruptStoreError, StorageError, StoreNotFoundError
from .cache import BlockCache, parse_size
from .local import IO_CHUNK, parse_json
from .location import Location
from .object import MiB, S3Config, S3Store, is_internal, join_key

#: Ranges longer than this are split into parts fetched concurrently.
PART_BYTES = 8 * MiB
#: ``read_ranges`` merges ranges less than this many bytes apart into one GET.
MERGE_GAP = 256 << 10


class StoreFiles(abc.ABC):
    """Named files of one store directory (names are ``/``-separated, relative)."""

    #: The location as the user wrote it (a path or ``s3://bucket/prefix``).
    url: str
    #: The directory on local disk, or None for remote stores.
    local_path: Path | None = None

    @abc.abstractmethod
    def list(self) -> dict[str, int]:
        """Every file below the directory: name -> size in bytes, sorted by name."""

    @abc.abstractmethod
    def size(self, name: str) -> int | None:
        """Size of ``name`` in bytes, or None if it does not exist."""

    @abc.abstractmethod
    def read_range(
        self,
        name: str,
        offset: int,
        length: int,
        out: bytearray | memoryview | Any = None,
        *,
        cache: bool = True,
    ) -> memoryview:
        """Bytes ``[offset, offset + length)`` of ``name``, into ``out`` (any writable
        buffer of exactly ``length`` bytes, e.g. a numpy array) or a new buffer. ``cache``:
        keep the range in the local cache tier, if there is one."""

    def read_view(self, name: str, offset: int, length: int) -> memoryview:
        """Bytes ``[offset, offset + length)`` of ``name`` as a read-only buffer, for callers
        that place the bytes themselves: a mapped cache entry on a hit (no copy)."""
        return self.read_range(name, offset, length)

    def read_ranges(self, name: str, ranges: Sequence[tuple[int, Any]]) -> None:
        """Fill each ``(offset, out)`` buffer from ``name`` (no caching)."""
        for offset, out in ranges:
            view = _bytes_view(out)
            self.read_range(name, offset, len(view), view, cache=False)

    def read_rows(
        self, name: str, offsets: np.ndarray, row_bytes: int, out: np.ndarray, slots: np.ndarray
    ) -> None:
        """Read ``row_bytes`` at each of ``offsets`` (ascending, not overlapping) of ``name``
        into row ``slots[i]`` of ``out`` (``[n, ...]`` with contiguous rows of ``row_bytes``),
        skipping ``slots[i] < 0``: rows land in place, with no intermediate buffer where the
        backend allows (local files: vectored ``preadv``, nearby rows coalesced)."""
        keep = slots >= 0
        self.read_ranges(name, [(int(o), out[int(s)]) for o, s in zip(offsets[keep], slots[keep])])

    def map(self, name: str) -> memoryview:
        """The whole of ``name`` as a read-only buffer: a memory map on local disk (pages
        read as they are touched), the fetched bytes on object storage."""
        return memoryview(self.read_bytes(name))

    def read_exact(self, name: str, out: Any) -> bool:
        """Read the whole of ``name`` into ``out`` (a writable buffer of exactly its size),
        without keeping the file open (chunk stores hold millions of files). False if the
        file does not exist; :class:`CorruptStoreError` if it is not ``len(out)`` bytes."""
        view = _bytes_view(out)
        size = self.size(name)
        if size is None:
            return False
        if size != len(view):
            raise CorruptStoreError(
                f"{self.url_of(name)} has {size} bytes, expected {len(view)} "
                f"({'truncated' if size < len(view) else 'too long'}): restore it or re-create the store"
            )
        self.read_range(name, 0, len(view), view)
        return True

    def exists(self, name: str) -> bool:
        return self.size(name) is not None

    def symlinks(self) -> builtins.list[str]:
        """Names below the directory that are symbolic links (a store holds none)."""
        return []

    def outside_links(self, links: builtins.list[str] | None = None) -> builtins.list[str]:
        """Symbolic links below the directory (or of ``links``) that lead out of it."""
        return []

    def listing(self) -> tuple[dict[str, int], builtins.list[str]]:
        """:meth:`list` and :meth:`symlinks` at once (one walk of a local tree)."""
        return self.list(), self.symlinks()

    def read_bytes(self, name: str) -> bytes:
        """The whole of ``name``."""
        size = self.require(name)
        return bytes(self.read_range(name, 0, size, cache=False))

    def read_json(self, name: str) -> Any:
        """``name`` parsed as UTF-8 JSON (clear errors for missing or damaged files)."""
        return parse_json(self.read_bytes(name), self.url_of(name))

    def iter_chunks(self, name: str, chunk: int = IO_CHUNK) -> Iterator[memoryview]:
        """The bytes of ``name`` in order, ``chunk`` bytes at a time (one reused buffer)."""
        size = self.require(name)
        buf = _buffer(min(chunk, max(size, 1)))
        for start in range(0, size, chunk):
            n = min(chunk, size - start)
            yield self.read_range(name, start, n, buf[:n], cache=False)

    def require(self, name: str) -> int:
        """Size of ``name``; :class:`StoreNotFoundError` naming it if it is missing."""
        size = self.size(name)
        if size is None:
            raise StoreNotFoundError(f"{self.url_of(name)} does not exist")
        return size

    def url_of(self, name: str) -> str:
        return f"{self.url.rstrip('/')}/{name}"

    def version(self, name: str) -> str:
        """A string that changes when ``name`` is replaced (the ETag on S3)."""
        return ""

    def close(self) -> None:
        """Release file handles and threads (reopened on next use)."""


#: Gaps up to this many bytes between rows read together are read and discarded.
GAP_BYTES = 1 << 16
_TRASH = np.empty(GAP_BYTES, dtype=np.uint8)  # destination of discarded bytes (any thread)
_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.preadv.restype = ctypes.c_ssize_t
_LIBC.preadv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX"))


def _preadv(fd: int, iov: np.ndarray, offset: int, source: str) -> None:
    """Fill the ``(address, length)`` rows of ``iov`` (uint64 ``[n, 2]``, modified) from
    consecutive file bytes at ``offset``: libc ``preadv`` without the GIL, ``IOV_MAX`` at a
    time, resuming after short reads."""
    i = 0
    while i < len(iov):
        chunk = iov[i : i + _IOV_MAX]
        got = _LIBC.preadv(fd, chunk.ctypes.data, len(chunk), offset)
        if got < 0:
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            raise StorageError(f"reading {source} at byte {offset} failed: {os.strerror(err)}")
        if got == 0:
            raise CorruptStoreError(
                f"{source} ended at byte {offset}: the file is truncated; restore or re-create it"
            )
        offset += got
        if got == int(chunk[:, 1].sum()):
            i += len(chunk)
            continue
        ends = np.cumsum(chunk[:, 1])  # a short read: skip the iovecs filled, trim the next
        full = int(np.searchsorted(ends, got, side="right"))
        i += full
        done = got - (int(ends[full - 1]) if full else 0)
        iov[i, 0] += np.uint64(done)
        iov[i, 1] -= np.uint64(done)


def _buffer(n: int) -> memoryview:
    """A fresh writable buffer of ``n`` bytes, not zero-filled (every byte is read into)."""
    return np.empty(n, dtype=np.uint8).data


def _bytes_view(out: Any) -> memoryview:
    view = memoryview(out)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _open_error(url: str, err: OSError) -> CorruptStoreError | StorageError:
    """What opening a store file for reading failed with, as our error: a symlink
    (``ELOOP``) or a path through a file (``ENOTDIR``) is the store's fault; anything else is
    this machine's (permissions, descriptors), said with its fix."""
    if err.errno in (errno.ELOOP, errno.ENOTDIR):
        return CorruptStoreError(
            f"{url} cannot be opened ({err.strerror}): a symlink or not a file; a store's "
            "files must be regular files inside it: restore it or re-create the store"
        )
    code = errno.errorcode.get(err.errno or 0, str(err.errno))
    if err.errno in (errno.EMFILE, errno.ENFILE):
        fix = (
            "too many open files: raise the limit (`ulimit -n 65536`) or read fewer stores at once"
        )
    elif err.errno in (errno.EACCES, errno.EPERM):
        fix = "permission denied: make the store readable by this user (chmod)"
    else:
        fix = "check the disk or file system and retry"
    return StorageError(f"{url} cannot be opened ({code}: {err.strerror}); {fix}")


def _read_error(url: str, offset: int, err: OSError) -> StorageError:
    code = errno.errorcode.get(err.errno or 0, str(err.errno))
    return StorageError(
        f"reading {url} at byte {offset} failed ({code}: {err.strerror}); check the disk or "
        "file system and retry"
    )


class LocalFiles(StoreFiles):
    """A directory on local disk. File descriptors are kept open per process (loader
    threads read the same files over and over) until :meth:`close`."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.root = Path(path).expanduser()
        """The directory (``local_path`` too, except for :class:`PathFiles`)."""
        self.local_path = self.root
        self.url = str(self.root)
        self._fds: dict[str, int] = {}
        self._pid = os.getpid()
        self._fd_lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fds": {}, "_fd_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fd_lock = threading.Lock()

    def _path(self, name: str) -> Path:
        return self.root / name

    def _scan(self) -> tuple[dict[str, int], builtins.list[str]]:
        """One walk of the tree with ``os.scandir`` (file type from the directory entry, one
        ``stat`` per file): sizes of the files (symlinked files followed, as ``os.walk``
        would list them) and the symlinks, files or folders, not followed."""
        sizes: dict[str, int] = {}
        links: builtins.list[str] = []
        stack = [("", str(self.root))]
        while stack:
            prefix, folder = stack.pop()
            try:
                entries = list(os.scandir(folder))
            except (FileNotFoundError, NotADirectoryError):
                continue
            for entry in entries:
                rel = prefix + entry.name
                try:
                    if entry.is_symlink():
                        links.append(rel)
                        if entry.is_file():
                            sizes[rel] = entry.stat().st_size
                    elif entry.is_dir(follow_symlinks=False):
                        stack.append((rel + "/", entry.path))
                    elif entry.is_file(follow_symlinks=False):
                        sizes[rel] = entry.stat(follow_symlinks=False).st_size
                except FileNotFoundError:
                    continue  # removed while we listed (another process's temporary file)
        return dict(sorted(sizes.items())), sorted(links)

    def list(self) -> dict[str, int]:
        return self._scan()[0]

    def symlinks(self) -> builtins.list[str]:
        return self._scan()[1]

    def listing(self) -> tuple[dict[str, int], builtins.list[str]]:
        return self._scan()

    def outside_links(self, links: builtins.list[str] | None = None) -> builtins.list[str]:
        root = self.root.resolve()
        links = self.symlinks() if links is None else links
        return [n for n in links if not (self.root / n).resolve().is_relative_to(root)]

    def size(self, name: str) -> int | None:
        path = self._path(name)
        return path.stat().st_size if path.is_file() else None

    def version(self, name: str) -> str:
        st = self._path(name).stat()
        return f"{st.st_size}-{st.st_mtime_ns}"

    def fd(self, name: str) -> int:
        """An open read-only descriptor of ``name`` (kept until :meth:`close`)."""
        if self._pid != os.getpid():  # forked: the parent's descriptors are not ours to use
            self._fds, self._pid = {}, os.getpid()
        fd = self._fds.get(name)
        if fd is not None:
            return fd
        fd = self._open(name)
        with self._fd_lock:
            kept = self._fds.setdefault(name, fd)
        if kept != fd:
            os.close(fd)
        return kept

    def _open(self, name: str) -> int:
        """``os.open`` of ``name`` read-only, symlinks refused, errors as ours: a missing file
        :class:`StoreNotFoundError`, a symlink or a path through a file
        :class:`CorruptStoreError`, anything else (permissions, too many open files...)
        :class:`StorageError` saying what to do."""
        try:
            return os.open(self._path(name), os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError as err:
            raise StoreNotFoundError(f"{self.url_of(name)} does not exist") from err
        except OSError as err:
            raise _open_error(self.url_of(name), err) from err

    def read_range(self, name, offset, length, out=None, *, cache=True) -> memoryview:
        view = _buffer(length) if out is None else _bytes_view(out)
        if len(view) != length:
            raise ConfigError(f"out holds {len(view)} bytes, not {length}")
        fd = self.fd(name)
        done = 0
        while done < length:
            try:
                n = os.preadv(fd, [view[done:]], offset + done)
            except OSError as err:
                raise _read_error(self.url_of(name), offset + done, err) from err
            if n == 0:
                raise CorruptStoreError(
                    f"{self.url_of(name)} ended at byte {offset + done}, expected "
                    f"{offset + length}: the file is truncated; restore or re-create it"
                )
            done += n
        return view

    def map(self, name: str) -> memoryview:
        import mmap

        size = self.require(name)
        if size == 0:
            return memoryview(b"")
        return memoryview(mmap.mmap(self.fd(name), size, prot=mmap.PROT_READ))

    def read_exact(self, name: str, out: Any) -> bool:
        view = _bytes_view(out)
        try:
            fd = self._open(name)
        except StoreNotFoundError:
            return False
        try:
            size = os.fstat(fd).st_size
            if size != len(view):
                raise CorruptStoreError(
                    f"{self.url_of(name)} has {size} bytes, expected {len(view)} "
                    f"({'truncated' if size < len(view) else 'too long'}): restore it or "
                    "re-create the store"
                )
            done = 0
            while done < len(view):
                try:
                    got = os.preadv(fd, [view[done:]], done)
                except OSError as err:
                    raise _read_error(self.url_of(name), done, err) from err
                if got == 0:
                    raise CorruptStoreError(f"{self.url_of(name)} shrank while being read")
                done += got
        finally:
            os.close(fd)
        return True

    def read_rows(
        self, name: str, offsets: np.ndarray, row_bytes: int, out: np.ndarray, slots: np.ndarray
    ) -> None:
        """One vectored ``preadv`` per run of rows less than ``GAP_BYTES`` apart (the bytes
        between them, skipped rows included, land in a discard buffer), each row straight
        into its slot, without the GIL. Offsets out of order or overlapping are read one
        row at a time."""
        offsets = np.asarray(offsets, dtype=np.int64)
        slots = np.asarray(slots, dtype=np.int64)
        if len(offsets) != len(slots):
            raise ConfigError(f"{len(offsets)} offsets but {len(slots)} slots")
        keep = slots >= 0  # a skipped row is not read: it becomes part of a gap
        offsets, slots = offsets[keep], slots[keep]
        if not len(offsets):
            return
        row = out[0].nbytes if out.ndim and len(out) else 0
        if row != row_bytes or not out[0].flags.c_contiguous or int(slots.max()) >= len(out):
            raise ConfigError(
                f"read_rows needs out rows of {row_bytes} contiguous bytes and slots below "
                f"{len(out)} (out rows hold {row} bytes, largest slot {int(slots.max())})"
            )
        gaps = np.diff(offsets) - row_bytes
        if (gaps < 0).any():  # not ascending, or overlapping: no single pass reads them
            super().read_rows(name, offsets, row_bytes, out, slots)
            return
        addr = out.ctypes.data + slots * out.strides[0]
        new_run = np.ones(len(offsets), dtype=bool)
        new_run[1:] = gaps > GAP_BYTES  # so every gap read into _TRASH fits it
        starts = np.flatnonzero(new_run)
        fd = self.fd(name)
        for lo, hi in zip(starts.tolist(), [*starts[1:].tolist(), len(offsets)]):
            iov = np.zeros((2 * (hi - lo) - 1, 2), dtype=np.uint64)
            iov[0::2, 0] = addr[lo:hi]
            iov[0::2, 1] = row_bytes
            iov[1::2, 0], iov[1::2, 1] = _TRASH.ctypes.data, gaps[lo : hi - 1]
            _preadv(fd, iov[iov[:, 1] > 0], int(offsets[lo]), self.url_of(name))

    def close(self) -> None:
        if self._pid == os.getpid():
            for fd in self._fds.values():
                os.close(fd)
        self._fds = {}


class PathFiles(LocalFiles):
    """Local files listed by name, each at its own path (a writer's sealed files, named as
    they will be published but still in its staging directory). :meth:`add` names more."""

    def __init__(self, url: str = "sealed files") -> None:
        super().__init__(".")
        self.local_path = None
        self.url = url
        self._paths: dict[str, Path] = {}

    def add(self, name: str, path: Path) -> None:
        self._paths[name] = Path(path)

    def _path(self, name: str) -> Path:
        path = self._paths.get(name)
        if path is None:
            raise StoreNotFoundError(f"{name} is not among the {self.url}")
        return path

    def list(self) -> dict[str, int]:
        return {n: p.stat().st_size for n, p in sorted(self._paths.items())}

    def symlinks(self) -> builtins.list[str]:
        return []  # no directory to walk: each file has its own path

    def listing(self) -> tuple[dict[str, int], builtins.list[str]]:
        return self.list(), []

    def outside_links(self, links: builtins.list[str] | None = None) -> builtins.list[str]:
        return []

    def size(self, name: str) -> int | None:
        path = self._paths.get(name)
        return path.stat().st_size if path is not None and path.is_file() else None


class S3Files(StoreFiles):
    """The objects under ``s3://bucket/prefix/``: listed once, read with ranged GETs.

    Picklable (worker processes make their own client, threads and cache handle).
    """

    def __init__(
        self,
        store: S3Store,
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
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_pool": None, "_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

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
        return self._pool

    def read_range(self, name, offset, length, out=None, *, cache=True) -> memoryview:
        view = _buffer(length) if out is None else _bytes_view(out)
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
            view = _buffer(length)
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
        items = sorted(((int(o), _bytes_view(b)) for o, b in ranges), key=lambda r: r[0])
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
            buf = _buffer(stop - start)
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


def open_files(
    location: str | os.PathLike | Location,
    *,
    cache_dir: str | os.PathLike | None = None,
    cache_bytes: int | str | None = None,
    s3: S3Config | None = None,
    threads: int = 16,
    cache: bool = True,
) -> StoreFiles:
    """The files at ``location``: a local directory, ``file://`` URL or ``s3://bucket/prefix``.

    ``cache_dir`` (default ``$ACTSTORE_CACHE``) turns on the local cache tier for remote
    stores, capped at ``cache_bytes`` (default ``$ACTSTORE_CACHE_MAX`` or 10 GiB);
    ``cache=False``: no cache tier whatever the environment says.
    """
    loc = Location.parse(location, s3=s3)
    if loc.is_local:
        return LocalFiles(loc.path())
    store, prefix = loc.object_store()
    assert isinstance(store, S3Store)
    if not cache:
        return S3Files(store, prefix, threads=threads)
    tier: BlockCache | None
    if cache_dir is not None:
        cap = parse_size(cache_bytes) if isinstance(cache_bytes, str) else cache_bytes
        tier = BlockCache(cache_dir, cap) if cap else BlockCache(cache_dir)
    else:
        tier = BlockCache.from_env()
    return S3Files(store, prefix, cache=tier, threads=threads)
