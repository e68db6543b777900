"""The files of one store directory on local disk, read by byte range: :class:`LocalFiles`
(``pread``, vectored ``preadv`` of scattered rows, memory maps, a bounded set of open
descriptors) and :class:`PathFiles` (files listed by name, each at its own path).

Example:
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()); _ = (d / "a.bin").write_bytes(b"0123456789")
    >>> with LocalFiles(d) as files:
    ...     files.size("a.bin"), bytes(files.read_range("a.bin", 2, 3)), files.list()
    (10, b'234', {'a.bin': 10})
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import errno
import os
import resource
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError, CorruptStoreError, StorageError, StoreNotFoundError
from .storefiles import StoreFiles, bytes_view, new_buffer

#: Open descriptors one :class:`LocalFiles` keeps at most by default: 64, or a sixteenth of
#: the process's descriptor limit where that is lower (at least 4).
DEFAULT_MAX_OPEN = 64


def default_max_open() -> int:
    """:data:`DEFAULT_MAX_OPEN`, bounded by a sixteenth of ``RLIMIT_NOFILE`` (soft)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return DEFAULT_MAX_OPEN
    return max(4, min(DEFAULT_MAX_OPEN, soft // 16))


@dataclass
class _Open:
    fd: int
    users: int = 0
    retired: bool = False  # evicted or closed while in use: closed by its last user


class Descriptors:
    """Open read-only descriptors by file name, shared by the threads of one process, at
    most ``limit`` kept open: the least recently used one is closed when another is opened
    (one in use is closed when its last user is done with it, so a descriptor number is
    never closed under a read). In a forked child every set starts empty (its copies of
    the parent's descriptors closed, a fresh lock: a parent's thread may have held it).

    Example:
        >>> import tempfile, os
        >>> d = tempfile.mkdtemp(); _ = [open(f"{d}/{i}", "w").close() for i in range(3)]
        >>> fds = Descriptors(limit=2)
        >>> for i in range(3):
        ...     with fds.use(str(i), lambda n: os.open(f"{d}/{n}", os.O_RDONLY)) as fd:
        ...         pass
        >>> len(fds), fds.close(), len(fds)
        (2, None, 0)
    """

    def __init__(self, limit: int | None = None) -> None:
        self.limit = default_max_open() if limit is None else max(1, int(limit))
        self._open: OrderedDict[str, _Open] = OrderedDict()
        self._lock = threading.Lock()
        _ALL.add(self)

    @classmethod
    def for_owner(cls, owner: object, limit: int | None = None) -> Descriptors:
        """Descriptors closed when ``owner`` is garbage collected (``weakref.finalize``)."""
        fds = cls(limit)
        weakref.finalize(owner, fds.close)
        return fds

    def __len__(self) -> int:
        return len(self._open)

    @contextlib.contextmanager
    def use(self, name: str, opener: Callable[[str], int]) -> Iterator[int]:
        """The descriptor of ``name`` (``opener(name)`` opens it if it is not open) for the
        duration of the block."""
        entry = self._take(name, opener)
        try:
            yield entry.fd
        finally:
            with self._lock:
                entry.users -= 1
                done = entry.retired and entry.users == 0
            if done:
                os.close(entry.fd)

    def _take(self, name: str, opener: Callable[[str], int]) -> _Open:
        with self._lock:
            entry = self._open.get(name)
            if entry is not None:
                self._open.move_to_end(name)
                entry.users += 1
                return entry
        fd = opener(name)  # outside the lock: opening may block (network file systems)
        with self._lock:
            entry = self._open.get(name)
            if entry is None:
                entry = self._open[name] = _Open(fd)
                fd = -1
                evicted = self._evict()
            else:  # another thread opened it meanwhile
                self._open.move_to_end(name)
                evicted = []
            entry.users += 1
        if fd >= 0:
            os.close(fd)
        for old in evicted:
            os.close(old)
        return entry

    def _evict(self) -> list[int]:
        """Drop the least recently used entries above the limit (under the lock); the
        descriptors to close now (those not in use)."""
        closing = []
        while len(self._open) > self.limit:
            _, old = self._open.popitem(last=False)
            old.retired = True
            if old.users == 0:
                closing.append(old.fd)
        return closing

    def _forked(self) -> None:
        """In a forked child (one thread): close the copies, start empty."""
        self._lock = threading.Lock()
        for entry in self._open.values():
            with contextlib.suppress(OSError):
                os.close(entry.fd)
        self._open.clear()

    def close(self) -> None:
        """Close every descriptor (those in use when their last user is done)."""
        with self._lock:
            entries = list(self._open.values())
            self._open.clear()
            closing = []
            for entry in entries:
                entry.retired = True
                if entry.users == 0:
                    closing.append(entry.fd)
        for fd in closing:
            os.close(fd)


#: Every live :class:`Descriptors`, reset in a forked child (``os.register_at_fork``).
_ALL: weakref.WeakSet[Descriptors] = weakref.WeakSet()


def _reset_after_fork() -> None:
    for fds in list(_ALL):
        fds._forked()


os.register_at_fork(after_in_child=_reset_after_fork)


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


def _pread_all(fd: int, view: memoryview, offset: int, url: str, expected_end: int) -> None:
    """Fill ``view`` from the file at ``offset``, resuming after short reads; a file that
    ends first is :class:`CorruptStoreError` (truncated), a failed read :class:`StorageError`."""
    done = 0
    while done < len(view):
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as err:
            raise _read_error(url, offset + done, err) from err
        if n == 0:
            raise CorruptStoreError(
                f"{url} ended at byte {offset + done}, expected {expected_end}: the file is "
                "truncated; restore or re-create it"
            )
        done += n


class LocalFiles(StoreFiles):
    """A directory on local disk. Descriptors of the files read are kept open (loader
    threads read the same files over and over), at most ``max_open`` at once, the least
    recently used closed first (:class:`Descriptors`); :meth:`close`, or dropping the
    object, closes them all."""

    mappable = True

    def __init__(self, path: str | os.PathLike, *, max_open: int | None = None) -> None:
        self.root = Path(path).expanduser()
        """The directory (``local_path`` too, except for :class:`PathFiles`)."""
        self.local_path = self.root
        self.url = str(self.root)
        self.max_open = max_open
        self._fds = Descriptors.for_owner(self, max_open)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_fds"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fds = Descriptors.for_owner(self, self.max_open)

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

    def descriptor(self, name: str) -> contextlib.AbstractContextManager[int]:
        """``with files.descriptor(name) as fd``: an open read-only descriptor of ``name``,
        valid until the block ends (kept open after it, while it is among the most recently
        used)."""
        return self._fds.use(name, self._open)

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

    def open_read(self, name: str) -> int:
        return self._open(name)

    def read_range(self, name, offset, length, out=None, *, cache=True) -> memoryview:
        view = new_buffer(length) if out is None else bytes_view(out)
        if len(view) != length:
            raise ConfigError(f"out holds {len(view)} bytes, not {length}")
        with self.descriptor(name) as fd:
            _pread_all(fd, view, offset, self.url_of(name), offset + length)
        return view

    def map(self, name: str) -> memoryview:
        import mmap

        size = self.require(name)
        if size == 0:
            return memoryview(b"")
        with self.descriptor(name) as fd:  # the map holds its own descriptor
            return memoryview(mmap.mmap(fd, size, prot=mmap.PROT_READ))

    def read_exact(self, name: str, out: Any) -> bool:
        view = bytes_view(out)
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
            _pread_all(fd, view, 0, self.url_of(name), len(view))
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
        with self.descriptor(name) as fd:
            for lo, hi in zip(starts.tolist(), [*starts[1:].tolist(), len(offsets)]):
                iov = np.zeros((2 * (hi - lo) - 1, 2), dtype=np.uint64)
                iov[0::2, 0] = addr[lo:hi]
                iov[0::2, 1] = row_bytes
                iov[1::2, 0], iov[1::2, 1] = _TRASH.ctypes.data, gaps[lo : hi - 1]
                _preadv(fd, iov[iov[:, 1] > 0], int(offsets[lo]), self.url_of(name))

    def close(self) -> None:
        self._fds.close()


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
