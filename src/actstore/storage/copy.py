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

import hashlib
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
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
from .filecopy import FileCopier
from .files import StoreFiles, open_files
from .local import IO_CHUNK
from .manifest import MANIFEST
from .object import MiB, ObjectStore, StorageOptions, is_internal, open_location

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


def copy_store(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    storage: StorageOptions | None = None,
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
    source = open_files(src, storage=storage, threads=threads, cache=False)
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
    store, prefix = open_location(dst, storage)
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
        dest = open_files(dst, storage=storage, cache=False)
        both_remote = source.local_path is None and dest.local_path is None
        if both_remote or (_by_content(source) and _by_content(dest)):
            stale, trusted = _stale(source, dest, check, versions, part_bytes)
        elif source.local_path is not None and store.capabilities.content_md5:
            # an upload to a backend whose listing gives each object's MD5 (GCS)
            md5s = {n: landed[n].md5 for n in check}
            stale, trusted = _stale(source, dest, check, md5s, part_bytes)
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
