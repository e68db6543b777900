"""A local directory as an :class:`~.base.ObjectStore`."""

from __future__ import annotations

import builtins
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ...errors import ConfigError, StorageError, StoreNotFoundError
from ..local import atomic_write
from ..lock import StoreLock
from .base import ObjectInfo, ObjectStore, base_name, parent_key


class LocalStore(ObjectStore):
    """A directory treated as a bucket: keys are ``/``-separated relative paths.

    ``put`` writes a hidden temp file (``.NAME.*.tmp``) in the target directory, fsyncs and
    renames it into place; listings skip such temp files, like S3 hides unfinished
    multipart uploads, and :meth:`abort_incomplete` removes them.
    """

    scheme = "file"

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.root_url = str(self.root)

    @property
    def local_root(self) -> Path:
        return self.root

    def clone(self) -> LocalStore:
        return LocalStore(self.root)

    def copy(self, src: str, dst: str) -> None:
        """A hard link (a copy across file systems)."""
        target = self._path(dst)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.unlink(missing_ok=True)
        try:
            os.link(self._path(src), target)
        except OSError:
            shutil.copyfile(self._path(src), target)

    def delete_tree(self, prefix: str) -> None:
        """Remove everything under ``prefix`` (never the whole root: an empty prefix is
        refused)."""
        if not prefix.strip("/"):
            raise ConfigError(
                f"refusing to delete the whole of {self.root_url}: delete_tree needs a prefix "
                "below the root"
            )
        shutil.rmtree(self._path(prefix.strip("/")), ignore_errors=True)

    def acquire_lock(self, prefix: str, *, break_lock: bool = False) -> Any:
        return StoreLock.acquire(self._path(prefix), break_lock=break_lock)

    def _path(self, key: str) -> Path:
        return self.root / key if key else self.root

    def url(self, key: str) -> str:
        return str(self._path(key))

    def put(self, key: str, data: bytes | bytearray | memoryview) -> str:
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_write(path) as f:
                f.write(data)
        except OSError as err:
            raise StorageError(f"cannot write {path}: {err}") from err
        return ""

    def _open(self, key: str):
        try:
            return open(self._path(key), "rb", buffering=0)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as err:
            raise StoreNotFoundError(f"{self._path(key)} does not exist") from err

    def get(self, key: str) -> bytes:
        with self._open(key) as f:
            return f.read()

    def get_range(self, key: str, start: int, end: int) -> bytes:
        with self._open(key) as f:
            return os.pread(f.fileno(), end - start, start)

    def get_range_into(
        self, key: str, out: bytearray | memoryview, start: int, *, total: int | None = None
    ) -> None:
        from ...errors import CorruptStoreError

        view = memoryview(out).cast("B")
        with self._open(key) as f:
            size = os.fstat(f.fileno()).st_size
            if total is not None and size != total:
                raise CorruptStoreError(
                    f"{self._path(key)} is {size} bytes, expected {total}: the file was "
                    "truncated or replaced; re-create it"
                )
            done = 0
            while done < len(view):
                n = os.preadv(f.fileno(), [view[done:]], start + done)
                if n == 0:
                    raise CorruptStoreError(f"{self._path(key)} ended at byte {start + done}")
                done += n

    def size(self, key: str) -> int | None:
        try:
            st = self._path(key).stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        return st.st_size if self._path(key).is_file() else None

    @staticmethod
    def _is_temp(name: str) -> bool:
        return name.startswith(".") and name.endswith(".tmp")

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        # Only the entries of the prefix's directory that start with its last component are
        # walked (never the whole root), then everything below them.
        top_key, stem = (
            (prefix, "") if prefix.endswith("/") else (parent_key(prefix), base_name(prefix))
        )
        top = self._path(top_key.strip("/"))
        if not top.is_dir():
            return
        out = []

        def add(path: Path) -> None:
            try:
                out.append(ObjectInfo(path.relative_to(self.root).as_posix(), path.stat().st_size))
            except FileNotFoundError:  # a dangling symlink, or removed while we listed
                pass

        for entry in top.iterdir():
            if not entry.name.startswith(stem) or self._is_temp(entry.name):
                continue
            if entry.is_file():
                add(entry)
                continue
            for dirpath, _, filenames in os.walk(entry):
                for name in filenames:
                    if not self._is_temp(name):
                        add(Path(dirpath) / name)
        yield from sorted(out, key=lambda o: o.key)

    def list_dirs(self, prefix: str) -> builtins.list[str]:
        directory = self._path(prefix.strip("/"))
        if not directory.is_dir():
            return []
        return sorted(p.name for p in directory.iterdir() if p.is_dir())

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def abort_incomplete(self, prefix: str) -> int:
        directory = self._path(prefix.strip("/"))
        if not directory.is_dir():
            return 0
        n = 0
        for dirpath, _, filenames in os.walk(directory):
            for name in filenames:
                if self._is_temp(name):
                    (Path(dirpath) / name).unlink(missing_ok=True)
                    n += 1
        return n
