"""The read side of the root manifest (:mod:`.manifest`): what a reader checks.

:class:`Integrity`, opened with the store's files it checks, without
reading data, that the manifest is whole (its own digest, and an HMAC when
``ACTSTORE_MANIFEST_KEY`` is set), that the listing matches it (sizes, nothing missing,
nothing extra, no symlinks) and, when a reader reads its metadata through
:meth:`Integrity.read_bytes`/:meth:`~Integrity.read_json`, that each metadata file is the one
published. Readers then pass every range they read to :meth:`Integrity.check`.

Example:
    >>> import tempfile, pathlib
    >>> from actstore.storage.files import open_files
    >>> from actstore.storage.manifest import ManifestBuilder, store_id_of
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / "data.bin").write_bytes(bytes(range(256)) * 16)
    >>> builder = ManifestBuilder(format="doc", store_id=store_id_of({"a": 1}), record={"a": 1})
    >>> builder.add_file(d, "data.bin", unit=1024)
    >>> builder.write(d, summary={"rows": 4})
    >>> checks = Integrity.open(open_files(d))
    >>> checks.check("data.bin", 1024, (d / "data.bin").read_bytes()[1024:2048])
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from ..errors import CorruptStoreError, StoreNotFoundError
from ..forksafe import ForkSafeLock
from .digests import KeyedHasher, block_keys, digest_ranges, file_digest
from .local import parse_json
from .rootmanifest import (
    BLOCKS,
    BLOCKS_MAGIC,
    MANIFEST,
    OWN_FILES,
    WHOLE_BLOCKS_BYTES,
    FileEntry,
    RootManifest,
    jsonable,
    skipped,
)

if TYPE_CHECKING:
    from .files import StoreFiles

log = logging.getLogger(__name__)


class Integrity:
    """A store's checks against its root manifest, for a reader (see the module doc).

    ``manifest`` is None for a store without one (a foreign store, read unverified after
    one warning; with ``verify_reads=False`` one of ours whose manifest is missing) and,
    with ``verify_reads=False``, for a store whose manifest cannot be read (damaged,
    edited, of another store): its data is then read unchecked after one warning, and
    :attr:`problem` says why. Picklable: digests reload per process.
    """

    def __init__(
        self,
        files: StoreFiles,
        manifest: RootManifest | None,
        *,
        enabled: bool,
        problem: str = "",
    ) -> None:
        self.files = files
        self.manifest = manifest
        self.enabled = enabled and manifest is not None
        self.problem = problem
        """Why the store's root manifest was not used ("" when it was, or there is none)."""
        self._digests: dict[str, np.ndarray] = {}
        self._plain: dict[str, np.ndarray] = {}
        self._all: np.ndarray | None = None
        self._lock = ForkSafeLock()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_digests": {}, "_plain": {}, "_all": None, "_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = ForkSafeLock()

    @classmethod
    def open(
        cls,
        files: StoreFiles,
        *,
        ours: bool = True,
        verify_reads: bool = True,
        format: str | None = None,
    ) -> Integrity:
        """Load and check the manifest of the store ``files`` holds, and its listing.

        ``ours``: the store says actstore wrote it, so a missing manifest is an error
        (unless ``verify_reads=False``); otherwise one warning and unverified reads."""
        listing = files.listing()
        outside = files.outside_links(listing[1])
        if outside:
            raise CorruptStoreError(
                f"{files.url_of(outside[0])} is a symlink out of the store; a store's files must "
                "lie inside it: copy the file in or re-create the store"
            )
        if files.size(MANIFEST) is None and ours:
            # never called missing on one listing: a listing over a faulty network can
            # come back short (seen under injected resets); list once more first
            files.refresh()
            listing = files.listing()
        if files.size(MANIFEST) is None:
            if ours and verify_reads:
                raise CorruptStoreError(
                    f"{files.url} was written by actstore but its root manifest ({MANIFEST}) "
                    "is missing: its contents cannot be checked. Restore the file or "
                    "re-create the store; open it with verify_reads=False to read it unchecked"
                )
            if verify_reads:
                _warn_once(
                    files.url,
                    f"{files.url} has no actstore manifest (written by another tool): its "
                    "contents cannot be verified",
                )
            return cls(files, None, enabled=False)
        try:
            manifest = RootManifest.from_bytes(files.read_bytes(MANIFEST), files.url_of(MANIFEST))
            if format is not None and manifest.format != format:
                raise CorruptStoreError(
                    f"{files.url_of(MANIFEST)} describes a {manifest.format} store, but the "
                    f"files are a {format} store: the manifest belongs to another store"
                )
        except CorruptStoreError as err:
            if verify_reads:
                raise
            # unchecked reads of a damaged store: what someone recovering its data asks for
            _warn_once(files.url, f"{err}; reading {files.url} unchecked (verify_reads=False)")
            return cls(files, None, enabled=False, problem=str(err))
        checks = cls(files, manifest, enabled=verify_reads)
        if verify_reads:
            problems = checks.listing_faults(listing)
            missing = [p for p in problems if p.endswith((" is missing", " are missing"))]
            if missing:
                raise StoreNotFoundError(
                    f"{files.url}: {missing[0]}"
                    + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                    + "; restore it, finish the copy (actstore cp) or re-create the store"
                )
            if problems:
                raise CorruptStoreError(
                    f"{files.url} does not match its root manifest: {problems[0]}"
                    + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
                    + "; run actstore verify for the full list, restore the files or re-create it"
                )
        return checks

    # ------------------------------------------------------------------ open checks

    def listing_faults(self, listing: tuple[dict[str, int], list[str]] | None = None) -> list[str]:
        """Differences between the files present (``listing``: sizes and symlinks, as
        :meth:`StoreFiles.listing` gives them; default: listed now) and the manifest:
        missing, extra, wrong size, symlinks (O(files), no data read)."""
        m = self.manifest
        if m is None:
            return []
        sizes, links = listing if listing is not None else self.files.listing()
        faults = [f"{name} is a symlink" for name in links]
        present: dict[str, int] = {}
        counted = {folder: [0, 0] for folder in m.skip}
        for n, s in sizes.items():
            folder = skipped(n, m.skip)
            if folder:
                counted[folder][0] += 1
                counted[folder][1] += s
            elif n not in OWN_FILES and not any(n.startswith(f) for f in m.nested):
                present[n] = s
        for folder, (count, size) in m.skip.items():
            got, got_bytes = counted[folder]
            if got < count:
                faults.append(
                    f"{folder.rstrip('/')} holds {got} of the {count} chunk files: "
                    f"{count - got} {'is' if count - got == 1 else 'are'} missing"
                )
            elif (got, got_bytes) != (count, size):
                faults.append(
                    f"{folder.rstrip('/')} holds {got} chunk files of {got_bytes} bytes, the "
                    f"manifest says {count} of {size}"
                )
        for name, entry in m.files.items():
            have = present.get(name)
            if have is None:
                faults.append(f"{name} is missing")
            elif have != entry.size:
                faults.append(f"{name} has {have} bytes, the manifest says {entry.size}")
        faults += [
            f"{name} is not listed in the manifest" for name in sorted(set(present) - set(m.files))
        ]
        if m.blocks and self.files.size(BLOCKS) is None:
            faults.append(f"{BLOCKS} is missing")
        return faults

    def small_file_faults(self, max_bytes: int = 1 << 20) -> list[str]:
        """The one-block files up to ``max_bytes`` (metadata and indexes) whose bytes differ
        from the manifest: a cheap check of everything but the data."""
        faults = []
        for name, entry in (self.manifest.files if self.manifest else {}).items():
            if entry.at >= 0 or entry.size > max_bytes:
                continue
            try:
                data = self.files.read_bytes(name)
                keys = block_keys(self.manifest.store_id, name, 0, 1)  # type: ignore[union-attr]
                if digest_ranges(memoryview(data), [(0, len(data))], keys)[0] != int(
                    entry.single, 16
                ):
                    faults.append(f"{name} differs from the manifest (edited)")
            except (CorruptStoreError, StoreNotFoundError) as err:
                faults.append(str(err))
        return faults

    def check_summary(self, summary: dict[str, Any]) -> None:
        """Raise unless what a reader parsed from metadata equals what was published."""
        if not self.enabled:
            return
        got, want = jsonable(summary), self.manifest.summary  # type: ignore[union-attr]
        if got != want:
            keys = sorted(k for k in {*got, *want} if got.get(k) != want.get(k))
            raise CorruptStoreError(
                f"{self.files.url}: the metadata reads differently from what was published "
                f"({', '.join(f'{k}: {got.get(k)!r}, published {want.get(k)!r}' for k in keys[:3])}): "
                "metadata files were edited; restore them or re-create the store"
            )

    # ------------------------------------------------------------------ checked reads

    def entry(self, name: str) -> FileEntry | None:
        return None if self.manifest is None else self.manifest.files.get(name)

    def read_bytes(self, name: str) -> bytes:
        """The whole of file ``name``, checked."""
        data = self.files.read_bytes(name)
        self.check(name, 0, data)
        return data

    def read_json(self, name: str) -> Any:
        """File ``name`` parsed as JSON, checked before it is parsed."""
        return parse_json(self.read_bytes(name), self.files.url_of(name))

    def digests(self, name: str) -> np.ndarray:
        """The block digests of ``name`` (loaded once, checked against its file digest)."""
        found = self._digests.get(name)
        if found is not None:
            return found
        entry = self._require(name)
        if entry.at < 0:
            digests = np.array([int(entry.single, 16)], dtype="<u8")
        else:
            n = entry.n_blocks
            every = self._every_digest()
            if every is not None:
                digests = every[entry.at : entry.at + n]
            else:
                raw = self.files.read_range(
                    BLOCKS, len(BLOCKS_MAGIC) + 8 * entry.at, 8 * n, cache=False
                )
                digests = np.frombuffer(bytes(raw), dtype="<u8")
            if len(digests) != n or file_digest(digests) != entry.digest:
                raise CorruptStoreError(
                    f"{self.files.url_of(BLOCKS)}: the block digests of {name} do not match the "
                    "manifest; restore the file or re-create the store"
                )
        with self._lock:
            return self._digests.setdefault(name, digests)

    def _unkeyed(self, name: str) -> np.ndarray:
        """The digests of ``name``'s blocks with their keys taken off (computed once per
        file): a block's bytes hash to exactly this, so a check is one xxh3 per block."""
        found = self._plain.get(name)
        if found is None:
            digests = self.digests(name)
            keys = block_keys(self.manifest.store_id, name, 0, len(digests))  # type: ignore[union-attr]
            with self._lock:
                found = self._plain.setdefault(name, digests ^ keys)
        return found

    def _every_digest(self) -> np.ndarray | None:
        """All of ``actstore-blocks.xxh3`` (one read, checked whole) when it is at most
        ``WHOLE_BLOCKS_BYTES``: one request on object storage instead of one per file."""
        if self._all is None:
            size = self.files.size(BLOCKS)
            if size is None:
                raise StoreNotFoundError(
                    f"{self.files.url_of(BLOCKS)} is missing, so the block digests of the "
                    "store's files cannot be checked: restore it, finish the copy (rerun "
                    "actstore cp) or re-create the store; verify_reads=False reads it unchecked"
                )
            if size > WHOLE_BLOCKS_BYTES:
                return None
            data = bytes(self.files.read_range(BLOCKS, 0, size, cache=False))
            if xxhash.xxh3_128_hexdigest(data) != self.manifest.blocks:  # type: ignore[union-attr]
                raise CorruptStoreError(
                    f"{self.files.url_of(BLOCKS)} does not match the root manifest; restore it "
                    "or re-create the store"
                )
            self._all = np.frombuffer(data, dtype="<u8", offset=len(BLOCKS_MAGIC))
        return self._all

    def _require(self, name: str) -> FileEntry:
        entry = self.entry(name)
        if entry is None:
            raise CorruptStoreError(
                f"{self.files.url_of(name)} is not listed in the store's root manifest; "
                "restore the store or re-create it"
            )
        return entry

    def block_index(self, name: str, offset: int, length: int) -> tuple[int, int]:
        """``(first, count)`` of the blocks exactly covering bytes ``[offset, offset+length)``."""
        entry = self._require(name)
        end = offset + length
        if entry.ranges is not None:
            starts = entry.starts
            i = int(np.searchsorted(starts, offset))
            j = int(np.searchsorted(starts, end)) - 1 if length else i
            if i >= len(starts) or starts[i] != offset or j < i or sum(entry.ranges[j]) != end:
                raise CorruptStoreError(
                    f"{self.files.url_of(name)}: bytes {offset}-{end} are not whole blocks"
                )
            return i, j - i + 1
        unit = entry.unit or max(entry.size, 1)
        first, misaligned = divmod(offset, unit)
        if misaligned or (end % unit and end != entry.size) or end > entry.size:
            raise CorruptStoreError(
                f"{self.files.url_of(name)}: bytes {offset}-{end} are not whole blocks of "
                f"{unit} bytes within its {entry.size} bytes"
            )
        return first, max(1, math.ceil((end - offset) / unit)) if length else 0

    def check(
        self, name: str, offset: int, data: bytes | bytearray | memoryview | np.ndarray
    ) -> None:
        """Raise :class:`CorruptStoreError` unless ``data``, read from ``name`` at byte
        ``offset``, is exactly the published bytes of the blocks it covers."""
        if not self.enabled:
            return
        # numpy's stubs declare ndarray.__buffer__ (PEP 688) only for Python >= 3.12
        view = memoryview(data).cast("B")  # type: ignore[arg-type]
        entry = self._require(name)
        unit = entry.unit
        one = (
            entry.ranges is None
            and unit
            and not offset % unit
            and len(view) == unit
            and offset + unit <= entry.size  # else the general way names what is wrong
        )
        # one whole block (what the loader checks): one hash, one comparison; a mismatch
        # goes the general way, which names the block
        if one and xxhash.xxh3_64_intdigest(view) == int(self._unkeyed(name)[offset // unit]):
            return
        first, count = self.block_index(name, offset, len(view))
        bounds = [(o - offset, n) for o, n in entry.bounds(first, count)]
        want = self._unkeyed(name)[first : first + count]
        got = digest_ranges(view, bounds, np.zeros(count, dtype="<u8"))
        bad = np.flatnonzero(got != want)
        if len(bad):
            block = first + int(bad[0])
            ((o, n),) = entry.bounds(block, 1)
            raise CorruptStoreError(
                f"{self.files.url_of(name)}: block {block} (bytes {o}-{o + n}) is not the "
                "block published there (changed, damaged, moved or from another store); "
                "restore the file or re-create the store (verify_reads=False reads it anyway)"
            )

    def read_pieces(self, name: str, piece_bytes: int = 16 << 20) -> Iterator[bytes]:
        """File ``name`` in checked pieces of whole blocks, each about ``piece_bytes`` (or
        one block, when a block is larger): a large file streamed, never held whole."""
        bounds = self._require(name).bounds()
        i = 0
        while i < len(bounds):
            start, j = bounds[i][0], i + 1
            while j < len(bounds) and sum(bounds[j]) - start <= piece_bytes:
                j += 1
            end = sum(bounds[j - 1])
            data = bytes(self.files.read_range(name, start, end - start, cache=False))
            self.check(name, start, data)
            yield data
            i = j

    # ------------------------------------------------------------------ full verify

    def verify(
        self,
        faults: list[str],
        *,
        progress: Callable[[int], None] | None = None,
        on_chunk: Callable[[str, int, memoryview], None] | None = None,
    ) -> tuple[int, int]:
        """Check every byte of every listed file (one sequential read each) and the listing;
        append every fault found to ``faults``. ``on_chunk(name, offset, bytes)`` sees the
        data as it passes (formats scan values there). Returns (files, bytes) checked."""
        m = self.manifest
        if m is None:
            faults.append(
                self.problem
                or f"no root manifest ({MANIFEST}): the contents cannot be verified (deleted, "
                "or a store written by another tool)"
            )
            return 0, 0
        sizes, links = self.files.listing()
        faults += self.listing_faults((sizes, links))
        linked = set(links)  # each reported above; never read (a store holds no symlinks)
        n_files, n_bytes = 1, self.files.size(MANIFEST) or 0  # the manifest checked itself
        if MANIFEST not in linked:
            try:
                layout = RootManifest.layout_fault(
                    self.files.read_bytes(MANIFEST), str(self.files.url_of(MANIFEST))
                )
            except (CorruptStoreError, StoreNotFoundError) as err:
                layout = str(err)
            if layout:
                faults.append(layout)
        if m.blocks and self.files.size(BLOCKS) is not None and BLOCKS not in linked:
            try:
                data = self.files.read_bytes(BLOCKS)
            except (CorruptStoreError, StoreNotFoundError) as err:
                faults.append(str(err))
                data = b""
            n_files, n_bytes = n_files + 1, n_bytes + len(data)
            if data and xxhash.xxh3_128_hexdigest(data) != m.blocks:
                faults.append(f"{BLOCKS} does not match the manifest (damaged)")
        todo: list[tuple[str, FileEntry, np.ndarray]] = []
        for name, entry in sorted(m.files.items()):
            if name in linked or sizes.get(name) != entry.size:
                continue  # a symlink, missing or resized: reported by listing_faults
            try:
                todo.append((name, entry, self.digests(name)))
            except (CorruptStoreError, StoreNotFoundError) as err:
                if str(err) not in faults:  # one missing blocks file fails every file
                    faults.append(str(err))
        lock = threading.Lock()  # the callbacks run one at a time, whatever the thread

        def locked(fn: Callable[..., None] | None) -> Callable[..., None] | None:
            if fn is None:
                return None

            def call(*args: Any) -> None:
                with lock:
                    fn(*args)

            return call

        def check(job: tuple[str, FileEntry, np.ndarray]) -> str | None:
            name, entry, want = job
            try:
                got = self._scan(name, entry, locked(progress), locked(on_chunk))
            except (CorruptStoreError, StoreNotFoundError) as err:
                return str(err)  # replaced or removed while verify ran: a fault, listed
            if file_digest(got) == entry.digest and np.array_equal(got, want):
                return None
            bad = np.flatnonzero(got != want) if len(got) == len(want) else [0]
            first = int(bad[0]) if len(bad) else 0
            o, n = entry.bounds()[first]
            return (
                f"{name}: {len(bad)} block(s) differ from the manifest, first block {first} "
                f"(bytes {o}-{o + n}): the file was changed, damaged or replaced"
            )

        # several files at once: one stream rarely reaches a disk's (or S3's) rate
        with ThreadPoolExecutor(VERIFY_STREAMS, thread_name_prefix="actstore-verify") as pool:
            for fault in pool.map(check, todo):  # in name order, whatever finishes first
                if fault is not None:
                    faults.append(fault)
        n_files += len(todo)
        n_bytes += sum(entry.size for _, entry, _ in todo)
        return n_files, n_bytes

    def _scan(
        self,
        name: str,
        entry: FileEntry,
        progress: Callable[[int], None] | None,
        on_chunk: Callable[[str, int, memoryview], None] | None,
    ) -> np.ndarray:
        """Block digests of ``name`` recomputed from one sequential read."""
        bounds = entry.bounds()
        keys = block_keys(self.manifest.store_id, name, 0, len(bounds))  # type: ignore[union-attr]
        out = np.empty(len(bounds), dtype="<u8")
        hashers: list[KeyedHasher | None] = [None] * len(bounds)
        pos, b = 0, 0
        for chunk in self.files.iter_chunks(name) if entry.size else [memoryview(b"")]:
            if on_chunk is not None:
                on_chunk(name, pos, chunk)
            end = pos + len(chunk)
            while b < len(bounds):
                o, n = bounds[b]
                if o >= end and n:
                    break
                h = hashers[b] or KeyedHasher(int(keys[b]))
                lo, hi = max(o, pos), min(o + n, end)
                if hi > lo:
                    h.update(chunk[lo - pos : hi - pos])
                if o + n <= end:
                    out[b] = h.intdigest()
                    hashers[b] = None
                    b += 1
                else:
                    hashers[b] = h
                    break
            pos = end
            if progress is not None:
                progress(len(chunk))
        for i in range(b, len(bounds)):  # the file ended early (reported by size)
            out[i] = 0
        return out


#: Files ``verify`` reads at once.
VERIFY_STREAMS = 4

_WARNED: set[str] = set()
_WARN_LOCK = ForkSafeLock()


def _warn_once(url: str, message: str) -> None:
    with _WARN_LOCK:
        if url in _WARNED:
            return
        _WARNED.add(url)
    log.warning("%s", message)


__all__ = ["Integrity"]
