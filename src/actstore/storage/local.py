"""Local files with crash-safe publication.

Every file a reader may trust is written to a temporary name in the same directory,
flushed and fsynced, then renamed over its final name; directories are published the same
way. A crash leaves either the old state or the new one, never a half-written file under
a final name.

Example:
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> atomic_write_json(d / "x.json", {"a": 1})
    >>> read_json(d / "x.json")
    {'a': 1}
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from ..errors import ConfigError, CorruptStoreError, StoreNotFoundError

#: Read size for hashing and copying: large enough for sequential disk speed.
IO_CHUNK = 8 << 20


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory entry (after a rename or create) to disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


#: Permissions of new files: what open() would give (mkstemp alone gives 0600).
_FILE_MODE = 0o666 & ~_umask()


class AtomicFile:
    """A new file published whole or not at all: a temporary file beside ``path`` (named
    ``.<name>.<random>.tmp``, with the permissions ``open`` would give), written through
    :attr:`fd` (or :attr:`file`), then :meth:`commit` (flushed, fsynced, renamed over
    ``path``, the directory fsynced) or :meth:`discard` (removed). ``durable=False`` skips
    the fsyncs (a cache entry: the rename alone keeps readers from seeing half a file).
    The one temp-file-and-rename of actstore: :func:`atomic_write` is built on it.

    Example:
        >>> import tempfile, pathlib, os
        >>> target = pathlib.Path(tempfile.mkdtemp()) / "x.bin"
        >>> out = AtomicFile(target); _ = os.write(out.fd, b"abc"); out.commit()
        >>> target.read_bytes()
        b'abc'
    """

    def __init__(self, path: str | os.PathLike, *, durable: bool = True) -> None:
        self.path = Path(path)
        self.durable = durable
        fd, tmp = tempfile.mkstemp(
            prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent
        )
        self.fd, self.tmp = fd, Path(tmp)
        self._file: BinaryIO | None = None
        try:
            os.fchmod(fd, _FILE_MODE)
        except BaseException:
            self.discard()
            raise

    @property
    def file(self) -> BinaryIO:
        """A buffered binary file object on :attr:`fd` (closed by commit or discard)."""
        if self._file is None:
            self._file = os.fdopen(self.fd, "wb", closefd=False)
        return self._file

    def commit(self) -> None:
        """Publish: the bytes reach the disk (``durable``), then the name."""
        try:
            if self._file is not None:
                self._file.flush()
            if self.durable:
                os.fsync(self.fd)
            self._close()
            os.replace(self.tmp, self.path)
        except BaseException:
            self.discard()
            raise
        if self.durable:
            fsync_dir(self.path.parent)

    def discard(self) -> None:
        """Remove the temporary file (idempotent); ``path`` is left as it was."""
        with contextlib.suppress(OSError):
            self._close()
        self.tmp.unlink(missing_ok=True)

    def _close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            file.close()
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, *, durable: bool = True) -> Iterator[BinaryIO]:
    """Open a temporary file beside ``path`` for writing; on success it is flushed, fsynced
    and renamed over ``path`` (then the directory is fsynced); on error it is removed
    (an :class:`AtomicFile`; ``durable=False``: no fsyncs).

    Example:
        >>> import tempfile, pathlib
        >>> target = pathlib.Path(tempfile.mkdtemp()) / "x.bin"
        >>> with atomic_write(target) as f:
        ...     _ = f.write(b"abc")
        >>> target.read_bytes()
        b'abc'
    """
    out = AtomicFile(path, durable=durable)
    try:
        yield out.file
    except BaseException:
        out.discard()
        raise
    out.commit()


def atomic_write_bytes(path: str | os.PathLike, data: bytes | memoryview) -> None:
    """Write ``data`` to ``path`` atomically (temp file + fsync + rename + dir fsync)."""
    with atomic_write(path) as f:
        f.write(data)


def atomic_write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = 2) -> None:
    """Serialise ``obj`` as UTF-8 JSON and write it atomically."""
    text = json.dumps(obj, indent=indent, ensure_ascii=False)
    atomic_write_bytes(path, (text + "\n").encode("utf-8"))


#: The bounds of every JSON document actstore parses from a store, a journal, a lock or an
#: input file (:func:`load_json`, the one parser): many times what actstore's own files need,
#: far below what would exhaust memory or the interpreter's stack.
JSON_MAX_BYTES = 256 << 20
JSON_MAX_DEPTH = 64
JSON_MAX_DIGITS = 64

#: A JSON string literal (to leave out of the bracket and digit counts).
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_JSON_LONG_NUMBER = re.compile(rb"[0-9]{%d}" % (JSON_MAX_DIGITS + 1))
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def load_json(data: bytes | memoryview | str) -> Any:
    """``data`` parsed as UTF-8 JSON within :data:`JSON_MAX_BYTES`, :data:`JSON_MAX_DEPTH`
    levels of nesting and numbers of :data:`JSON_MAX_DIGITS` digits: every JSON actstore
    parses from a file goes through here, so hostile nesting or a 5,000-digit number is a
    ``ValueError`` saying which bound, never a ``RecursionError`` or a number too large to
    convert. Callers turn the ``ValueError`` into their own one-line error.

    Example:
        >>> load_json(b'{"a": [1, 2.5]}')
        {'a': [1, 2.5]}
        >>> load_json(b"[" * 100 + b"]" * 100)
        Traceback (most recent call last):
        ...
        ValueError: nested more than 64 levels deep (actstore's limit)
        >>> load_json(b"1" * 5000)
        Traceback (most recent call last):
        ...
        ValueError: holds a number of more than 64 digits (actstore's limit)
    """
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    if len(raw) > JSON_MAX_BYTES:
        raise ValueError(
            f"is {len(raw)} bytes, more than the {JSON_MAX_BYTES} a JSON file actstore reads "
            "may hold"
        )
    text = raw.decode("utf-8") if not isinstance(data, str) else data
    opens = raw.count(b"[") + raw.count(b"{")
    long_number = _JSON_LONG_NUMBER.search(raw) is not None
    if opens > JSON_MAX_DEPTH or long_number:
        bare = _JSON_STRING.sub(b'""', raw)  # brackets and digits inside strings are text
        if long_number and _JSON_LONG_NUMBER.search(bare):
            raise ValueError(
                f"holds a number of more than {JSON_MAX_DIGITS} digits (actstore's limit)"
            )
        if (
            opens > JSON_MAX_DEPTH
            and _json_depth(bare.translate(None, _NOT_BRACKETS)) > JSON_MAX_DEPTH
        ):
            raise ValueError(f"nested more than {JSON_MAX_DEPTH} levels deep (actstore's limit)")
    try:
        return json.loads(text)
    except RecursionError as err:  # not reached within the depth bound; kept as a fault
        raise ValueError("nested too deeply to parse") from err


def _json_depth(brackets: bytes) -> int:
    """The deepest nesting of a run of JSON brackets (``[{]}`` only), in pieces, stopping
    once it passes :data:`JSON_MAX_DEPTH`."""
    import numpy as np

    depth, deepest, piece = 0, 0, 1 << 20
    for start in range(0, len(brackets), piece):
        b = np.frombuffer(brackets, np.uint8, count=min(piece, len(brackets) - start), offset=start)
        steps = np.where((b == ord("[")) | (b == ord("{")), 1, -1).cumsum() + depth
        deepest = max(deepest, int(steps.max()))
        depth = int(steps[-1])
        if deepest > JSON_MAX_DEPTH:
            break
    return deepest


def parse_json(data: bytes | memoryview, source: object) -> Any:
    """``data`` (a store file's bytes, from ``source``) parsed by :func:`load_json`; bad
    bytes, or JSON past its bounds, are :class:`CorruptStoreError` naming the file and what
    to do."""
    try:
        return load_json(data)
    except ValueError as err:
        raise CorruptStoreError(
            f"{source} is not valid JSON ({err}); the store is damaged: restore this file "
            "or re-create the store"
        ) from err


def read_json(path: str | os.PathLike) -> Any:
    """Read a JSON file (through :func:`load_json`), turning a missing file or bad JSON into
    actstore errors."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError as err:
        raise StoreNotFoundError(f"{path} does not exist") from err
    try:
        return load_json(data)
    except ValueError as err:
        raise CorruptStoreError(
            f"{path} is not valid JSON ({err}); the store is damaged: re-create it or restore "
            "this file"
        ) from err


class _Hash(Protocol):
    def update(self, data: bytes | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


class FileHasher:
    """Incremental digest, by algorithm name ("sha256" or "xxh128").

    Example:
        >>> h = FileHasher("sha256"); h.update(b"abc"); h.hexdigest()[:8]
        'ba7816bf'
    """

    def __init__(self, algorithm: str = "sha256") -> None:
        self._h: _Hash
        if algorithm == "sha256":
            self._h = hashlib.sha256()
        elif algorithm == "xxh128":
            import xxhash

            self._h = xxhash.xxh3_128()
        else:
            raise ConfigError(f"unknown checksum algorithm {algorithm!r}; use sha256 or xxh128")
        self.algorithm = algorithm

    def update(self, data: bytes | memoryview) -> None:
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def read_chunks(path: str | os.PathLike, chunk: int = IO_CHUNK) -> Iterator[memoryview]:
    """The bytes of the file at ``path`` in order, up to ``chunk`` bytes at a time, into
    one reused buffer (each view is valid until the next is asked for).

    Example:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "x"; _ = p.write_bytes(b"abcde")
        >>> [bytes(v) for v in read_chunks(p, 2)]
        [b'ab', b'cd', b'e']
    """
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            yield view[:n]


def hash_file(path: str | os.PathLike, algorithm: str = "sha256") -> str:
    """Hex digest of a file's bytes, read in large sequential chunks."""
    hasher = FileHasher(algorithm)
    for data in read_chunks(path):
        hasher.update(data)
    return hasher.hexdigest()


def remove_tree(path: str | os.PathLike) -> None:
    """Delete a directory tree, read-only files (a published store's) included."""

    def writable(func: Any, target: str, _: Any) -> None:
        os.chmod(os.path.dirname(target), stat.S_IRWXU)
        os.chmod(target, stat.S_IRUSR | stat.S_IWUSR)
        func(target)

    if sys.version_info >= (3, 12):  # onerror is deprecated there
        shutil.rmtree(path, onexc=writable)
    else:
        shutil.rmtree(path, onerror=writable)


def make_tree_read_only(directory: str | os.PathLike[str]) -> None:
    """Remove write permission from every file below ``directory`` (symlinks left alone):
    one ``stat`` and one ``chmod`` a file (a zarr store has thousands)."""
    mask = ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)
    folders = [os.fspath(directory)]
    while folders:
        with os.scandir(folders.pop()) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    folders.append(entry.path)
                elif entry.is_file(follow_symlinks=False):
                    mode = entry.stat(follow_symlinks=False).st_mode
                    if mode & ~mask:
                        os.chmod(entry.path, mode & mask)


def link_or_copy(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Hard-link ``src`` as ``dst`` (its folder made), or copy it across file systems."""
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
