"""Copy a whole store between local disk and object storage, either direction.

:func:`copy_store` reads the source through :mod:`actstore.storage.files` (ranged GETs or
``pread``) and writes parts concurrently: S3 multipart uploads (single PUTs for small
files), or a hidden temporary file filled with ``pwrite`` and renamed into place locally.
Every destination object appears whole or not at all, so:

* **resume**: running the same copy again keeps a file already at the destination only
  when its content matches the source's (its ETag, or the xxh3 of both local files; a
  same-size file with other bytes is sent again), and resumes a large file part by part:
  an unfinished multipart upload is continued (its parts listed, those whose MD5 matches
  the source kept), and an unfinished download continues in its partial file
  (``.NAME.partial.tmp``, with a journal of the parts already written, ``.NAME.parts.tmp``,
  valid while the source object is unchanged); the other temporary files a killed copy
  leaves (``.NAME.XXXXXXXX.tmp``) are removed first, and a destination holding files the
  source lacks is refused before anything is copied;
* **publish last**: the format's index files (``last``), then the root manifest
  (``actstore-manifest.json``, without which readers refuse a store of ours) are written
  after every other file is in, so a reader never opens a store whose copy is half done;
* **verify**: each object uploaded to S3 must carry the ETag of the bytes sent (MD5, or
  the MD5 of the part MD5s), and ``check_store`` (the format's full ``verify()``) runs on
  the destination when it is local, on the source when the copy is an upload (every
  object's ETag is then that of the checked bytes), and on the destination when both are
  remote.

Example:
    >>> import tempfile
    >>> from actstore.testing import FormatCase, make_acts, make_batches, make_plan
    >>> plan, out = make_plan(), tempfile.TemporaryDirectory()
    >>> store = FormatCase("saev").write(out.name, plan, make_batches(plan, make_acts(plan)))
    >>> copy_store(store, f"{out.name}/copy")  # or to s3://bucket/prefix  # doctest: +ELLIPSIS
    CopyReport(files=7, copied=7, skipped=0, bytes_copied=..., verified='7 sizes', parts_reused=0)
    >>> copy_store(store, f"{out.name}/copy").skipped  # a rerun sends only what is missing
    7
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from ..errors import (
    ConfigError,
    CopyFaultError,
    CorruptStoreError,
    StorageError,
    StoreNotFoundError,
)
from ..faults import point
from .files import StoreFiles, open_files
from .local import IO_CHUNK, atomic_write_bytes, fsync_dir
from .manifest import MANIFEST
from .object import MiB, ObjectStore, StorageOptions, is_internal, join_key, open_location

log = logging.getLogger(__name__)

#: Written after every other file by default: the root manifest, without which readers
#: refuse the store (callers that know the format pass its index files first in ``last=``).
PUBLISH_LAST = (MANIFEST,)
DEFAULT_PART_BYTES = 16 * MiB


@dataclass(frozen=True)
class CopyReport:
    """What :func:`copy_store` did."""

    files: int
    copied: int
    skipped: int
    bytes_copied: int
    verified: str
    """How the copy was checked, in words."""
    parts_reused: int = 0
    """Parts of interrupted copies found at the destination and not sent again."""


def _is_temp(name: str) -> bool:
    base = name.rpartition("/")[2]
    return base.startswith(".") and base.endswith(".tmp")


def _temp_owner(name: str) -> tuple[str, str]:
    """``(file, tag)`` of a copier's temporary file ``dir/.FILE.TAG.tmp``: the file it
    becomes (``dir/FILE``) and ``partial``, ``parts`` or mkstemp's random tag."""
    folder, _, base = name.rpartition("/")
    stem, _, tag = base[1 : -len(".tmp")].rpartition(".")
    return (f"{folder}/{stem}" if folder else stem), tag


def _local_temps(store: ObjectStore, prefix: str) -> list[str]:
    """The hidden temporary files (``.*.tmp``) below a local destination (listings leave
    them out); none for object storage, where unfinished uploads are not objects."""
    if store.local_root is None:
        return []
    root = Path(store.url(prefix))
    found = []
    for dirpath, _, names in os.walk(root):
        for n in names:
            if _is_temp(n):
                found.append((Path(dirpath) / n).relative_to(root).as_posix())
    return sorted(found)


def _refuse_others(
    url: str, listing: dict[str, int], landed: dict[str, Any], temps: list[str]
) -> None:
    """Refuse a destination holding files the source lacks (its verification, and readers,
    would refuse the copy for them): only the source's files and this copier's temporary
    files of them may be there."""
    others = [n for n in landed if n not in listing]
    others += [t for t in temps if _temp_owner(t)[0] not in listing]
    if others:
        shown = ", ".join(sorted(others)[:3]) + (f" and {len(others) - 3} more" * (len(others) > 3))
        raise ConfigError(
            f"{url} holds {len(others)} file(s) that are not in the source ({shown}): remove "
            "them, or copy into an empty directory"
        )


def _remove_leftovers(store: Any, prefix: str, temps: list[str], resumable: set[str]) -> None:
    """Remove the temporary files an interrupted copy left at a local destination, except
    the partial file and journal of a file about to be resumed part by part."""
    root = Path(store.url(prefix))
    for name in temps:
        owner, tag = _temp_owner(name)
        if owner in resumable and tag in ("partial", "parts"):
            continue
        log.info("removing %s, left by an interrupted copy", name)
        try:
            (root / name).unlink(missing_ok=True)
        except OSError as err:
            raise StorageError(
                f"cannot remove {root / name} ({err.strerror}), left by an interrupted copy; "
                "remove it yourself and rerun"
            ) from err


def _disk_error(target: Path | str, err: OSError) -> StorageError:
    """A local write of the copy failed: one line naming the file and what to do."""
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageError(
            f"disk full writing {target}; free space and rerun the same copy to resume"
        )
    code = errno.errorcode.get(err.errno or 0, str(err.errno))
    return StorageError(
        f"writing {target} failed ({code}: {err.strerror}); fix the cause and rerun the same "
        "copy to resume"
    )


def copy_store(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    s3: StorageOptions | None = None,
    threads: int = 16,
    part_bytes: int = DEFAULT_PART_BYTES,
    verify: bool = True,
    progress: Callable[[int], None] | None = None,
    check_store: Callable[[str], str] | None = None,
    sent: dict[str, str] | None = None,
    last: Sequence[str] = PUBLISH_LAST,
) -> CopyReport:
    """Copy every file of the store at ``src`` to ``dst`` (local paths or object storage
    URLs: ``s3://``, ``gs://``, ``az://``; ``s3``: the remote side's backend settings).

    ``progress(n_bytes)`` is called as bytes land. ``check_store(location)``, given, runs
    the format's own verification on the local side (raising on a fault) and returns
    what it checked (this layer knows no formats). ``sent``: ETags of files the caller
    already uploaded (a background uploader), checked with the rest. ``last``: file names
    (the part after the last ``/``) sent, in that order, only once every other file is in,
    so the destination is openable only when complete: the format's index files, then the
    root manifest (the default sends only the root manifest last).

    A local destination's leftovers of an interrupted copy (hidden ``.NAME.*.tmp`` files)
    are removed first, except the partial file and journal of a large file that is resumed;
    a destination holding any other file the source lacks is refused
    (:class:`ConfigError`) before anything is copied. A disk error writing locally raises
    :class:`StorageError` (rerun to resume). Raises :class:`CopyFaultError` (a
    :class:`CorruptStoreError`) if the verification after copying finds a difference (the
    copy is left in place to be resumed).
    """
    if threads < 1:
        raise ConfigError(f"threads must be >= 1, not {threads}")
    if part_bytes < 5 * MiB:
        raise ConfigError(f"part_bytes must be >= 5 MiB (an S3 limit), not {part_bytes}")
    source = open_files(src, s3=s3, threads=threads, cache=False)
    listing = {
        n: size for n, size in source.list().items() if not _is_temp(n) and not is_internal(n)
    }
    if not listing:
        raise StoreNotFoundError(f"{source.url} holds no files; check the source location")
    links = [n for n in source.symlinks() if not _is_temp(n) and not is_internal(n)]
    if links:  # a store's fault, found before anything is copied: listed as verify lists it
        raise CopyFaultError(
            f"{source.url_of(links[0])} is a symlink"
            + (f" (and {len(links) - 1} more)" if len(links) > 1 else "")
            + ": a store's files are regular files inside it, so it is not copied; restore "
            "the file (or the store) and copy again"
        )
    store, prefix = open_location(dst, s3)
    store.check_bucket()
    if str(src).rstrip("/") == str(dst).rstrip("/"):
        raise ConfigError("source and destination are the same location")
    base = prefix.rstrip("/") + "/" if prefix else ""
    landed = {o.key[len(base) :]: o for o in store.list(base) if not is_internal(o.key)}
    temps = _local_temps(store, prefix)
    _refuse_others(store.url(prefix), listing, landed, temps)
    todo = [n for n in listing if n not in landed or landed[n].size != listing[n]]
    trusted = ""
    if verify:  # a file already there with the right size is kept only if its bytes match
        kept = [n for n in listing if n not in todo]
        # a file the caller just sent (its ETag taken from the bytes it read, and the file
        # unchanged since) that landed with that ETag is not read and hashed again
        just_sent = {n for n in kept if sent and sent.get(n) == landed[n].version.strip('"')}
        check = [n for n in kept if n not in just_sent]
        versions = {n: landed[n].version for n in check}
        dest = open_files(dst, s3=s3, cache=False)
        both_remote = source.local_path is None and dest.local_path is None
        if both_remote or (_by_content(source) and _by_content(dest)):
            stale, trusted = _stale(source, dest, check, versions, part_bytes)
        else:  # a backend without MD5 ETags: both sides read and hashed
            stale, trusted = _stale_read_back(source, dest, check, threads)
        todo += stale
    resumable = {n for n in todo if listing[n] > part_bytes}  # copied part by part
    _remove_leftovers(store, prefix, temps, resumable)
    # the index files, then the root manifest, last and in that order: the destination is
    # openable only once everything is in
    rank = {name: i for i, name in enumerate(last)}
    order = {n: rank.get(n.rpartition("/")[2], -1) for n in todo}
    todo.sort(key=lambda n: (order[n], n))
    if progress is not None:  # files already there count as done
        progress(sum(listing.values()) - sum(listing[n] for n in todo))
    copier = FileCopier(source, store, prefix, part_bytes, progress, etags=verify)
    with ThreadPoolExecutor(threads, thread_name_prefix="actstore-cp") as pool:
        for step in range(-1, len(last)):
            copier.run(pool, [n for n in todo if order[n] == step], listing)
    verified = "not verified (--no-verify)"
    if verify:
        etags = {**(sent or {}), **copier.etags}
        try:
            verified = _verify(source, store, prefix, listing, etags, check_store) + trusted
        except (CorruptStoreError, StoreNotFoundError) as err:
            raise CopyFaultError(str(err)) from err
    return CopyReport(
        files=len(listing),
        copied=len(todo),
        skipped=len(listing) - len(todo),
        bytes_copied=sum(listing[n] for n in todo),
        verified=verified,
        parts_reused=copier.parts_reused,
    )


class FileCopier:
    """Copies files part by part on a shared pool; with ``etags`` it remembers the ETag each
    S3 object should have (an MD5 of every byte sent: CPU a verified copy pays for)."""

    def __init__(
        self,
        source: StoreFiles,
        store: ObjectStore,
        prefix: str,
        part_bytes: int,
        progress: Callable[[int], None] | None,
        *,
        etags: bool = True,
    ) -> None:
        self.source, self.store, self.prefix = source, store, prefix
        self.part_bytes, self.progress = part_bytes, progress
        self.hash = hashlib.md5 if etags and store.capabilities.md5_etags else None
        self.etags: dict[str, str] = {}
        self.parts_reused = 0
        """Parts of earlier, interrupted copies kept (not sent again)."""
        self._lock = threading.Lock()

    def run(self, pool: ThreadPoolExecutor, names: list[str], sizes: dict[str, int]) -> None:
        jobs = [(name, self._start(pool, name, sizes[name])) for name in names]
        errors: list[BaseException] = []
        for name, (futures, finish, abort) in jobs:
            try:
                results = [f.result() for f in futures]
                if errors:
                    raise errors[0]
                finish(results)
            except BaseException as err:  # noqa: BLE001 - abort this file, report the first
                for f in futures:  # no part may still write once its file is closed
                    f.cancel()
                wait(futures)
                abort()
                if not errors:
                    errors.append(err)
        if errors:
            raise errors[0]

    def _done(self, n: int) -> None:
        if self.progress is not None:
            with self._lock:
                self.progress(n)

    def _start(
        self, pool: ThreadPoolExecutor, name: str, size: int
    ) -> tuple[list[Future], Any, Any]:
        key = join_key(self.prefix, name)
        part = self.part_bytes
        offsets = list(range(0, size, part)) or [0]
        if self.store.local_root is not None:
            return self._start_local(pool, name, key, size, offsets)
        return self._start_remote(pool, name, key, size, offsets)

    def _start_remote(
        self, pool: ThreadPoolExecutor, name: str, key: str, size: int, offsets: list[int]
    ) -> tuple[list[Future], Any, Any]:
        store = self.store
        if len(offsets) > 1 and not store.capabilities.multipart:
            return self._start_streamed(pool, name, key, size, offsets)
        if len(offsets) == 1:  # one PUT

            def put() -> bytes:
                data = self.source.read_range(name, 0, size, cache=False)
                store.put(key, data)
                self._done(size)
                return self.hash(data).digest() if self.hash else b""

            def finish_put(digests: list[bytes]) -> None:
                if self.hash:
                    self.etags[name] = digests[0].hex()

            return [pool.submit(put)], finish_put, lambda: None

        upload_id, found = self._resumable(key, size, len(offsets))

        def send(number: int, offset: int) -> tuple[str, bytes]:
            data = self.source.read_range(
                name, offset, min(self.part_bytes, size - offset), cache=False
            )
            old = found.get(number)
            digest = hashlib.md5(data).digest() if old or self.hash else b""
            if old is not None and old.strip('"') == digest.hex():
                etag = old  # sent by an interrupted copy: keep it
                with self._lock:
                    self.parts_reused += 1
            else:
                etag = store.upload_part(key, upload_id, number, data, of=len(offsets))
            point("copy.part_sent")
            self._done(len(data))
            return etag, digest

        futures = [pool.submit(send, i, o) for i, o in enumerate(offsets, start=1)]

        def finish(results: list[tuple[str, bytes]]) -> None:
            store.complete_upload(key, upload_id, [e for e, _ in results], size)
            if self.hash:
                joined = self.hash(b"".join(d for _, d in results)).hexdigest()
                self.etags[name] = f"{joined}-{len(results)}"

        def keep() -> None:  # the parts sent stay for the next run to resume
            log.info("upload of %s left unfinished; run the same copy again to resume it", key)

        return futures, finish, keep

    def _start_streamed(
        self, pool: ThreadPoolExecutor, name: str, key: str, size: int, offsets: list[int]
    ) -> tuple[list[Future], Any, Any]:
        """A large file to a backend without resumable parts: read part by part and
        streamed into one upload that the backend completes atomically at the end."""

        def chunks() -> Any:
            for offset in offsets:
                data = self.source.read_range(
                    name, offset, min(self.part_bytes, size - offset), cache=False
                )
                yield data
                point("copy.part_sent")
                self._done(len(data))

        def send() -> None:
            self.store.put_chunks(key, chunks())

        return [pool.submit(send)], lambda _: None, lambda: None

    def _resumable(self, key: str, size: int, n_parts: int) -> tuple[str, dict[int, str]]:
        """An unfinished upload of ``key`` to continue, with the ETags of its parts that
        have the size this copy gives them; else a new upload and no parts."""
        store = self.store
        try:
            pending = store.pending_upload(key)
        except StorageError as err:  # e.g. no s3:ListBucketMultipartUploads permission
            log.debug("cannot list unfinished uploads of %s (%s); starting over", key, err)
            pending = None
        if pending is None:
            return store.create_upload(key), {}
        upload_id, parts = pending
        part = self.part_bytes
        keep = {
            n: etag
            for n, (etag, length) in parts.items()
            if 1 <= n <= n_parts and length == min(part, size - (n - 1) * part)
        }
        log.info("resuming the upload of %s: %d of %d parts are there", key, len(keep), n_parts)
        return upload_id, keep

    def _start_local(
        self, pool: ThreadPoolExecutor, name: str, key: str, size: int, offsets: list[int]
    ) -> tuple[list[Future], Any, Any]:
        target = Path(self.store.url(key))
        if len(offsets) > 1:
            return self._start_local_parts(pool, name, target, size, offsets)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        except OSError as err:
            raise _disk_error(target, err) from err
        files = _Open(fd)
        try:
            os.ftruncate(fd, size)
        except OSError as err:
            files.close()
            Path(tmp).unlink(missing_ok=True)
            raise _disk_error(target, err) from err

        def write(offset: int) -> None:
            data = self.source.read_range(
                name, offset, min(self.part_bytes, size - offset), cache=False
            )
            try:
                _pwrite_all(fd, data, offset)
            except OSError as err:
                raise _disk_error(target, err) from err
            self._done(len(data))

        futures = [pool.submit(write, o) for o in offsets] if size else []

        def finish(_: list[Any]) -> None:
            try:
                os.fsync(fd)
                files.close(check=True)
                os.chmod(tmp, 0o644)
                os.replace(tmp, target)
                fsync_dir(target.parent)
            except OSError as err:
                raise _disk_error(target, err) from err

        def abort() -> None:
            files.close()
            Path(tmp).unlink(missing_ok=True)

        return futures, finish, abort

    def _start_local_parts(
        self, pool: ThreadPoolExecutor, name: str, target: Path, size: int, offsets: list[int]
    ) -> tuple[list[Future], Any, Any]:
        """A large file, resumable: parts go into ``.NAME.partial.tmp`` and each finished
        part is appended to the journal ``.NAME.parts.tmp`` (headed by the source's size,
        version and the part size: a changed source or part size starts over)."""
        partial = target.parent / f".{target.name}.partial.tmp"
        journal = target.parent / f".{target.name}.parts.tmp"
        header = json.dumps(
            {"size": size, "version": self.source.version(name), "part": self.part_bytes}
        )
        done = _journaled(journal, header) if partial.exists() else set()
        files = _Open()
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            if not done:
                atomic_write_bytes(journal, (header + "\n").encode())
            fd = files.add(os.open(partial, os.O_RDWR | os.O_CREAT, 0o644))
            os.ftruncate(fd, size)
            jfd = files.add(os.open(journal, os.O_WRONLY | os.O_APPEND))
        except OSError as err:
            files.close()
            raise _disk_error(target, err) from err
        if done:
            log.info(
                "resuming the download of %s: %d of %d parts are there",
                target,
                len(done),
                len(offsets),
            )

        def write(offset: int) -> None:
            length = min(self.part_bytes, size - offset)
            if offset in done:
                with self._lock:
                    self.parts_reused += 1
                self._done(length)
                return
            data = self.source.read_range(name, offset, length, cache=False)
            try:
                _pwrite_all(fd, data, offset)
                os.write(jfd, f"{offset}\n".encode())  # one small append: whole or absent
            except OSError as err:
                raise _disk_error(target, err) from err
            point("copy.part_sent")
            self._done(len(data))

        futures = [pool.submit(write, o) for o in offsets]

        def finish(_: list[Any]) -> None:
            try:
                os.fsync(fd)
                files.close(check=True)
                os.replace(partial, target)
                journal.unlink(missing_ok=True)
                fsync_dir(target.parent)
            except OSError as err:
                raise _disk_error(target, err) from err

        def keep() -> None:  # the partial file and its journal stay for the next run
            files.close()

        return futures, finish, keep


class _Open:
    """File descriptors of one file being copied, each closed once (a second ``close``
    could otherwise close a number another thread has opened since)."""

    def __init__(self, *fds: int) -> None:
        self.fds = list(fds)

    def add(self, fd: int) -> int:
        self.fds.append(fd)
        return fd

    def close(self, *, check: bool = False) -> None:
        """Close them all; ``check``: raise the first error (else ignored)."""
        first: OSError | None = None
        fds, self.fds = self.fds, []
        for fd in fds:
            try:
                os.close(fd)
            except OSError as err:
                first = first or err
        if check and first is not None:
            raise first


def _pwrite_all(fd: int, data: memoryview | bytes, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def _journaled(journal: Path, header: str) -> set[int]:
    """Offsets of the parts a journal lists, if it belongs to this source (else none)."""
    try:
        lines = journal.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return set()
    if not lines or lines[0] != header:
        return set()
    return {int(line) for line in lines[1:] if line.isdigit()}


def multipart_etag(path: str | os.PathLike, etag: str, part_bytes: int | None = None) -> str:
    """The ETag S3 gives the bytes of local file ``path`` uploaded the way ``etag`` (an
    existing object's ETag) says: the MD5, or for ``<md5>-<n>`` the MD5 of the MD5s of
    ``n`` equal parts (part size: ``part_bytes`` when it gives ``n`` parts, else guessed
    from common sizes; "" if none fits).

    Example:
        >>> import tempfile; f = tempfile.NamedTemporaryFile(delete=False); _ = f.write(b"x")
        >>> f.close(); multipart_etag(f.name, "anything")
        '9dd4e461268c8034f5c8564e155c67a6'
    """
    size = os.path.getsize(path)
    n = int(etag.rpartition("-")[2]) if "-" in etag and etag.rpartition("-")[2].isdigit() else 0
    if n == 0:
        part = max(size, 1)
    else:
        fits = [
            p
            for p in (part_bytes, DEFAULT_PART_BYTES, 32 * MiB, 8 * MiB, 5 * MiB, 64 * MiB)
            if p and -(-size // p) == n
        ]
        if not fits:
            return ""
        part = fits[0]
    digests: list[bytes] = []
    with open(path, "rb") as f:
        while True:
            block = f.read(part)
            if not block and digests:
                break
            digests.append(hashlib.md5(block).digest())
            if len(block) < part:
                break
    if n == 0:
        return digests[0].hex()
    return f"{hashlib.md5(b''.join(digests)).hexdigest()}-{len(digests)}"


def _content_tag(files: StoreFiles, name: str, like: str, part_bytes: int | None = None) -> str:
    """What identifies the bytes of ``name`` in ``files`` comparably with ``like``: the S3
    ETag they would have when ``like`` is one (uploaded in the same number of parts, of
    ``part_bytes`` first guessed), else their xxh3-128."""
    if files.local_path is None:
        return files.version(name).strip('"')
    path = files.local_path / name
    if like and len(like.rpartition("-")[0] or like) == 32:  # an MD5-based ETag
        return multipart_etag(path, like, part_bytes)
    hasher = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(IO_CHUNK):
            hasher.update(chunk)
    return hasher.hexdigest()


def _by_content(files: StoreFiles) -> bool:
    """Whether the bytes of ``files`` can be compared without reading both sides: local
    files (hashed), or objects whose version is an MD5 ETag (S3)."""
    return files.local_path is not None or files.md5_versions


def _read_hash(files: StoreFiles, name: str) -> str:
    """The xxh3-128 of the bytes of ``name``, read through ``files``."""
    hasher = xxhash.xxh3_128()
    for chunk in files.iter_chunks(name):
        hasher.update(chunk)
    return hasher.hexdigest()


def _stale_read_back(
    source: StoreFiles, dest: StoreFiles, names: list[str], threads: int
) -> tuple[list[str], str]:
    """Which of ``names``, already at the destination with the source's size, hold other
    bytes, where one side's versions say nothing of the bytes (``gs://``, ``az://``): both
    sides read and hashed (a read instead of a copy). Returns them and a note."""
    if not names:
        return [], ""

    def differs(name: str) -> bool:
        return _read_hash(source, name) != _read_hash(dest, name)

    with ThreadPoolExecutor(threads, thread_name_prefix="actstore-cp-check") as pool:
        stale = [n for n, bad in zip(names, pool.map(differs, names)) if bad]
    for name in stale:
        log.warning("%s at the destination holds other bytes than the source; copying it", name)
    return stale, f"; {len(names) - len(stale)} files already there matched by content (read back)"


def _stale(
    source: StoreFiles,
    dest: StoreFiles,
    names: list[str],
    versions: dict[str, str],
    part_bytes: int | None = None,
) -> tuple[list[str], str]:
    """Which of ``names``, already at the destination with the source's size, hold other
    bytes (an interrupted copy, a stale or forged object): compared by content, not size
    (a multipart ETag recomputed with the copy's ``part_bytes`` first). Returns them and a
    note for the report."""
    if not names:
        return [], ""
    if source.local_path is None and dest.local_path is None:
        return [], f"; {len(names)} files already there compared by size only (both remote)"
    stale = []
    for name in names:
        if dest.local_path is not None and source.local_path is not None:
            same = _content_tag(source, name, "") == _content_tag(dest, name, "")
        elif dest.local_path is None:  # upload: the object's ETag against the local bytes
            theirs = versions[name].strip('"')
            same = bool(theirs) and _content_tag(source, name, theirs, part_bytes) == theirs
        else:  # download: the local bytes against the source object's ETag
            theirs = source.version(name).strip('"')
            same = bool(theirs) and _content_tag(dest, name, theirs, part_bytes) == theirs
        if not same:
            log.warning("%s at the destination holds other bytes than the source; copying it", name)
            stale.append(name)
    return stale, f"; {len(names) - len(stale)} files already there matched by content"


def _verify(
    source: StoreFiles,
    store: ObjectStore,
    prefix: str,
    listing: dict[str, int],
    etags: dict[str, str],
    check_store: Callable[[str], str] | None,
) -> str:
    """Check the destination against the source: sizes, the ETags of what was uploaded,
    and the format's own checksums on the local side. Returns what was checked."""
    base = prefix.rstrip("/") + "/" if prefix else ""
    landed = {o.key[len(base) :]: o for o in store.list(base)}
    md5 = store.capabilities.md5_etags
    faults = []
    for name, size in listing.items():
        obj = landed.get(name)
        if obj is None or obj.size != size:
            faults.append(
                f"{name}: {'missing' if obj is None else f'{obj.size} bytes'} at the "
                f"destination, {size} at the source"
            )
        elif md5 and name in etags and obj.version and obj.version != etags[name]:
            faults.append(f"{name}: the stored ETag {obj.version} is not that of the bytes sent")
    if faults:
        raise CorruptStoreError(
            f"copy to {store.url(prefix)} differs from the source: {'; '.join(faults[:5])}; "
            "run the same copy again to resume"
        )
    done = f"{len(listing)} sizes"
    if md5:
        done += f", {len(etags)} ETags"
    if check_store is None:
        return done
    # the destination's own checks on local disk; for an upload, the source's (its ETags
    # match the bytes checked); both remote: the destination's, read back
    checked = source.url if source.local_path is not None else store.url(prefix)
    if store.local_root is not None or not md5:  # no ETags vouch for an upload: read it back
        checked = store.url(prefix)
    return done + ", " + check_store(checked)
