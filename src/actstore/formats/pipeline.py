"""The write pipeline every sharded writer shares: a format's :class:`ShardSink` only
encodes, this module writes.

A sink hands :class:`ShardOutput` named byte buffers at known offsets of named files
(:meth:`ShardOutput.write`), or a file-like stream for encoders that write through one
(:meth:`ShardOutput.stream`: gzip, Arrow), or small files whole (:meth:`ShardOutput.put`:
zarr's chunks). The pipeline owns everything else, once for
every format:

* **threads** (:mod:`~actstore.formats.threads`): a pool of CPU workers
  (:func:`~actstore.storage.writeback.pool_size`: this process's CPUs) for statistics,
  hashing and a format's own encoding work (:meth:`ShardOutput.submit`); a pool of I/O
  streams for positional writes (``pwritev``), several at once where one stream does not
  reach the disk;
* **hashing**: block-aligned writes are digested on the I/O thread that writes them, in
  parallel (a block's keyed digest depends only on its bytes and its place); streams are
  digested in order as they are written;
* **direct I/O**: where the file system offers it, aligned writes go around the page
  cache (:class:`~actstore.storage.writeback.DirectFile`): the disk reads the writer's
  buffers, no CPU copies them into the kernel; streams are staged and written a whole
  buffer at a time (:class:`~actstore.storage.writeback.Appender`);
* **rolling writeback**: every other range written is handed to the kernel's writeback at
  once (:func:`~actstore.storage.writeback.start_writeback`), so a shard's ``fsync`` waits
  only for its tail;
* **commit**: the writer's commit stage (:mod:`~actstore.formats.writer`) runs on its own
  thread: it waits for the shard's writes, makes its files durable, and records it (the
  writer's journal), in shard order, while the next shard is being written.

No format module opens, writes, fsyncs or hashes a shard file itself.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from ..errors import CaptureError
from ..storage.manifest import (
    BlockHasher,
    FileEntry,
    block_digests,
    digest_blocks,
    file_entry,
    hash_file_blocks,
    hash_ranges,
    present_digest,
)
from ..storage.writeback import (
    SYNCFS_ABOVE,
    Appender,
    DirectFile,
    pwrite_all,
    start_writeback,
    sync_files,
    sync_paths,
)
from .threads import Pools, wait_all

#: Buffers the sinks hand over: anything exposing the buffer protocol.
Buffer = Any


#: A file put whole is handed to the kernel's writeback at once from this size; smaller
#: ones (zarr's 256 KiB chunks) are left to the commit's flush: one small disk write per
#: file had zarr's writer at 0.71 of the raw write on the 2-core machine's disk, 0.83
#: without.
PUT_WRITEBACK_FROM = 1 << 20

#: Bytes of one positional write task: a large write is split into tasks of about this
#: size, so the I/O streams write it at once (with direct I/O, each waits for the disk).
WRITE_BYTES = 8 << 20
PAGE = mmap.PAGESIZE


@dataclass
class _File:
    """A file of the shard being written: its descriptor, size and digests so far."""

    name: str
    path: Path
    fd: int
    unit: int
    listed: bool
    size: int = 0
    #: aligned writes: block index -> digest, filled by the I/O threads
    blocks: dict[int, np.ndarray] = field(default_factory=dict)
    #: streamed (or one-block) files: digests fed in order
    hasher: BlockHasher | None = None
    zero_from: int = -1  # size before a sparse extension (zero blocks hashed at commit)
    #: blocks known only once the file is whole: hashed at commit from its bytes
    ranges: Callable[[memoryview], Sequence[tuple[int, int]]] | None = None
    #: where its writes go (around the page cache where they can)
    io: DirectFile | None = None
    #: a stream's writes, staged for direct I/O (finished at commit)
    appender: Appender | None = None


class ShardOutput:
    """The files of one shard, written through the pipeline. A sink calls :meth:`declare`
    (or :meth:`stream`) once per file, then :meth:`write`; buffers must stay unchanged
    until the writer returns from the batch (the pipeline waits for them there)."""

    def __init__(self, directory: Path, store_id: str, pools: Pools) -> None:
        self.directory, self.store_id, self.pools = directory, store_id, pools
        self.files: dict[str, _File] = {}
        self._batch: list[Future] = []  # must finish before the batch is the caller's again
        self._later: list[Future] = []  # must finish before the shard is committed
        self._lock = threading.Lock()
        self._adopted: dict[str, tuple[int, bool]] = {}
        self._order: list[str] = []  # every file, in the order the sink named them

    # ------------------------------------------------------------------ for sinks

    def declare(self, name: str, *, unit: int = 0, listed: bool = True) -> None:
        """Create file ``name`` (relative to the store) for this shard. ``unit``: its
        manifest block size (writes must then cover whole blocks at block offsets, the
        file's last block excepted; 0: one block, written in order). ``listed=False``: a
        file the format checks through digests of its own (zarr's chunks): written and
        made durable, not listed in the manifest."""
        if name in self.files:
            raise CaptureError(f"shard file {name} declared twice")
        path = self.directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        f = _File(name, path, fd, unit, listed, io=DirectFile(path, fd))
        self._order.append(name)
        if listed and not unit:
            f.hasher = BlockHasher(self.store_id, name, 0)
        self.files[name] = f

    def write(self, name: str, data: Buffer | Sequence[Buffer], offset: int | None = None) -> None:
        """Write ``data`` (one buffer, or several that follow each other) at ``offset``
        of file ``name`` (None: after everything written to it so far)."""
        f = self.files[name]
        views = [_bytes_view(b) for b in (data if isinstance(data, (list, tuple)) else [data])]
        nbytes = sum(len(v) for v in views)
        at = f.size if offset is None else int(offset)
        f.size = max(f.size, at + nbytes)
        if f.hasher is not None:
            if at != f.hasher.size:
                raise CaptureError(f"{name} is hashed in order; write at {f.hasher.size}")
            for v in views:
                f.hasher.update(v)
        elif f.listed and f.unit and (at % f.unit or (nbytes % f.unit and at + nbytes < f.size)):
            raise CaptureError(f"{name}: writes must cover whole blocks of {f.unit} bytes")
        for part, start, size in _split(views, at, f.unit):
            released: Future = Future()  # the views are no longer needed (copied or written)
            task = self.pools.io.submit(self._write, f, part, start, size, released)
            with self._lock:
                self._batch.append(released)
                self._later.append(task)

    def stream(
        self,
        name: str,
        *,
        unit: int = 0,
        ranges: Callable[[memoryview], Sequence[tuple[int, int]]] | None = None,
    ) -> io.RawIOBase:
        """A write-only file object appending to a new file ``name`` (for encoders that
        write through one, such as gzip or Arrow). Its writes are synchronous: the caller
        may reuse a buffer once ``write`` returns. Blocks: ``unit`` bytes each (0: one),
        digested as written; or ``ranges``, a function of the whole file's bytes giving its
        read units (an Arrow file's value buffers), digested at commit from the page
        cache."""
        self.declare(name, unit=unit)
        f = self.files[name]
        assert f.io is not None
        if ranges is not None:  # hashed from the page cache at commit: kept there
            f.ranges, f.hasher = ranges, None
            f.io.close()
        elif f.unit:
            f.hasher = BlockHasher(self.store_id, name, f.unit)
        f.appender = Appender(f.io)
        return _Stream(self, f)

    def extend(self, name: str, size: int) -> None:
        """Grow file ``name`` to ``size`` bytes with zeros, allocated lazily (a sparse
        file: the same bytes when read, no disk used for them)."""
        f = self.files[name]
        if size <= f.size:
            return
        if f.hasher is None and f.unit and f.size % f.unit:
            raise CaptureError(f"{name}: a sparse extension must start on a block boundary")
        f.zero_from = f.size
        f.size = size
        os.ftruncate(f.fd, size)

    def adopt(self, name: str, *, unit: int = 0, listed: bool = True) -> None:
        """File ``name``, written by a library through its own I/O (zarr-python's store),
        belongs to this shard: at commit the pipeline makes it durable and, ``listed``,
        digests it from its bytes (blocks of ``unit``; 0: one)."""
        if name in self.files or name in self._adopted:
            raise CaptureError(f"shard file {name} declared twice")
        self._adopted[name] = (unit, listed)
        self._order.append(name)

    def put(
        self, name: str, data: Buffer, *, ident: str | None = None, skip_zero: bool = False
    ) -> int:
        """Write file ``name`` whole, in one go, on an I/O thread (created, written,
        closed: no descriptor is held for the thousands of small files of a zarr shard;
        writeback started from :data:`PUT_WRITEBACK_FROM` bytes). Made durable at commit
        with the shard's other files; not listed in the manifest: returns its keyed digest
        as block 0 of ``ident`` (default ``name``; never 0,
        :func:`~actstore.storage.manifest.present_digest`), which the format keeps in its
        own index and hands back on resume (:meth:`ShardedWriter.put_files`), where the
        pipeline checks it. ``skip_zero``: a buffer of only zero bits is not written (a
        chunk left to its fill value) and 0 is returned. Hashed on the caller's thread (a
        sink puts from the CPU pool, :meth:`map`); ``data`` must stay unchanged until the
        writer returns from the batch."""
        view = _bytes_view(data)
        t0 = time.thread_time()
        plain = xxhash.xxh3_64_intdigest(view)
        if skip_zero and plain == _zero_digest(len(view)) and not np.frombuffer(view, "u1").any():
            self.pools.clock.add("hash", time.thread_time() - t0)
            return 0
        digest = present_digest(self.store_id, name if ident is None else ident, view, plain=plain)
        self.pools.clock.add("hash", time.thread_time() - t0)
        with self._lock:
            if name in self.files or name in self._adopted:
                raise CaptureError(f"shard file {name} declared twice")
            self._adopted[name] = (0, False)  # durable at commit like an adopted file
            self._order.append(name)
            self._batch.append(self.pools.io.submit(self._put, self.directory / name, view))
        return digest

    def map(self, fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
        """``[fn(item) for item in items]``, run on the CPU pool (a format's per-sample
        encoding, which may :meth:`put` files): the caller's thread hands the batch over
        in a few tasks instead of thousands of small calls, each of which would wait for
        the GIL and a core again on a busy machine."""
        futures = [self.pools.cpu.submit(self.pools.clock.timed, "encode", fn, i) for i in items]
        wait_all(futures)
        return [f.result() for f in futures]

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` on the CPU pool (a format's encoding work); the shard is
        committed only after it finishes (its writes included)."""
        fut = self.pools.cpu.submit(self.pools.clock.timed, "encode", fn, *args)
        with self._lock:
            self._later.append(fut)
        return fut

    # ------------------------------------------------------------------ for the writer

    def _write(
        self, f: _File, views: list[memoryview], at: int, nbytes: int, released: Future
    ) -> None:
        """Digest and write one task's views; ``released`` is set once they are no longer
        read (copied for a direct write, else written), or to the error."""
        try:
            self._digest(f, views, at, nbytes)
            t0 = time.thread_time()
            assert f.io is not None
            f.io.write(views, at, released=lambda: released.set_result(None))
            self.pools.clock.add("write", time.thread_time() - t0)
        except BaseException as err:
            if not released.done():
                released.set_exception(err)
            raise
        if not released.done():
            released.set_result(None)

    def _digest(self, f: _File, views: list[memoryview], at: int, nbytes: int) -> None:
        clock = self.pools.clock
        t1 = time.thread_time()
        if f.listed and f.hasher is None and f.unit:
            unit = f.unit
            if nbytes and all(len(v) % unit == 0 for v in views[:-1]):
                # each view starts on a block: digest its blocks where they lie, all of
                # the write's blocks keyed in one call (a saev slab is often one block)
                blocks = [v[o : o + unit] for v in views for o in range(0, len(v), unit)]
                found = digest_blocks(self.store_id, f.name, blocks, at // unit)
            else:
                joined = memoryview(b"".join(views))
                found = block_digests(self.store_id, f.name, joined, unit, at // unit)
            with self._lock:
                f.blocks[at // unit] = found
        clock.add("hash", time.thread_time() - t1)

    def _put(self, path: Path, view: memoryview) -> None:
        t0 = time.thread_time()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except FileNotFoundError:  # a chunk key with "/" separators: nested directories
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            pwrite_all(fd, [view], 0)
            if len(view) >= PUT_WRITEBACK_FROM:
                start_writeback(fd, 0, len(view))
        finally:
            os.close(fd)
        self.pools.clock.add("write", time.thread_time() - t0)

    def settle(self) -> None:
        """Wait for the writes of the current batch (re-raising the first failure)."""
        with self._lock:
            pending, self._batch = self._batch, []
        wait_all(pending)

    def close_files(self, also: Sequence[int] = ()) -> dict[str, tuple[FileEntry, np.ndarray]]:
        """After every write finished: make the files durable (with the descriptors
        ``also``: the writer's side files), each ``fsync`` on its own I/O stream so the file
        system can commit them together, and close them; returns the manifest entry and
        block digests of every listed file."""
        self._drain()
        for f in self.files.values():
            if f.appender is not None:
                self.pools.clock.timed("write", f.appender.finish)
        fds = [f.fd for f in self.files.values()] + list(also)
        if len(fds) > 1 and len(fds) <= SYNCFS_ABOVE:
            wait_all(
                [self.pools.io.submit(self.pools.clock.timed, "commit", os.fsync, fd) for fd in fds]
            )
        else:
            self.pools.clock.timed("commit", sync_files, fds)
        adopted = [self.directory / n for n in self._adopted]
        self.pools.clock.timed("commit", sync_paths, adopted, self.directory)
        for f in self.files.values():
            self._close(f)
        out = {}
        for name in self._order:
            declared = self.files.get(name)
            if declared is not None and declared.listed:
                out[name] = self.pools.clock.timed("hash", self._entry, declared)
            elif declared is None and self._adopted[name][1]:
                unit, path = self._adopted[name][0], self.directory / name
                out[name] = self.pools.clock.timed(
                    "hash", hash_file_blocks, self.store_id, path, name, unit
                )
        return out

    def _entry(self, f: _File) -> tuple[FileEntry, np.ndarray]:
        if f.ranges is not None:
            with open(f.path, "rb") as fh:
                data = memoryview(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ))
            try:
                return hash_ranges(self.store_id, f.name, data, f.ranges(data))
            finally:
                data.release()
        if f.hasher is not None:
            if f.zero_from >= 0:
                f.hasher.update(bytes(f.size - f.zero_from))
            return f.hasher.entry()
        parts = [f.blocks[k] for k in sorted(f.blocks)]
        have = sum(len(p) for p in parts)
        n_blocks = max(1, -(-f.size // f.unit))
        if f.zero_from >= 0 and have < n_blocks:
            parts.append(
                block_digests(
                    self.store_id, f.name, None, f.unit, have, size=f.size - have * f.unit
                )
            )
        digests = np.concatenate(parts) if parts else np.zeros(0, "<u8")
        if len(digests) != n_blocks:
            raise CaptureError(f"{f.name}: {len(digests)} of {n_blocks} blocks were written")
        return file_entry(f.size, digests, unit=f.unit), digests

    def abort(self) -> None:
        """Wait for writes in flight (their errors are the caller's), close the files."""
        with contextlib.suppress(Exception):  # the caller is already failing
            self._drain()
        for f in self.files.values():
            self._close(f)

    def _drain(self) -> None:
        """Wait for every write and piece of submitted work, and the writes that work
        made meanwhile (re-raising the first failure once all are done)."""
        error: BaseException | None = None
        while True:
            with self._lock:
                pending, self._batch, self._later = [*self._batch, *self._later], [], []
            if not pending:
                break
            try:
                wait_all(pending)
            except BaseException as err:  # noqa: BLE001 - wait for the rest, raise the first
                error = error or err
        if error is not None:
            raise error

    @staticmethod
    def _close(f: _File) -> None:
        if f.io is not None:
            f.io.close()
        if f.fd >= 0:
            os.close(f.fd)
            f.fd = -1


class _Stream(io.RawIOBase):
    """Appends to one shard file, synchronously, hashing in order."""

    def __init__(self, out: ShardOutput, f: _File) -> None:
        self._out, self._f = out, f

    def writable(self) -> bool:
        return True

    def write(self, data: Buffer) -> int:  # type: ignore[override]
        view = _bytes_view(data)
        f = self._f
        assert f.appender is not None
        f.appender.write(view)
        if f.hasher is not None:
            f.hasher.update(view)
        f.size += len(view)
        return len(view)

    def tell(self) -> int:
        return self._f.size

    def flush(self) -> None:
        pass

    def close(self) -> None:  # the pipeline closes the descriptor at commit
        super().close()


def _split(views: list[memoryview], at: int, unit: int) -> list[tuple[list[memoryview], int, int]]:
    """``views`` written from ``at`` as tasks of about :data:`WRITE_BYTES` each (split
    between views only, where the offset is a multiple of ``unit`` and of a page), so
    several I/O streams write one large write at once: ``(views, offset, bytes)``."""
    step = math.lcm(unit or 1, PAGE)
    parts: list[tuple[list[memoryview], int, int]] = []
    group: list[memoryview] = []
    start, size = at, 0
    for v in views:
        if size >= WRITE_BYTES and not (start + size) % step:
            parts.append((group, start, size))
            start, size, group = start + size, 0, []
        group.append(v)
        size += len(v)
    parts.append((group, start, size))
    return parts


@functools.lru_cache(maxsize=16)
def _zero_digest(nbytes: int) -> int:
    """The unkeyed xxh3-64 of ``nbytes`` zero bytes (a buffer hashing to it is checked for
    zero bits)."""
    return xxhash.xxh3_64_intdigest(bytes(nbytes))


def put_intact(path: Path, store_id: str, ident: str, digest: int) -> bool:
    """On resume: file ``path``, put as ``ident`` (:meth:`ShardOutput.put`), holds what its
    recorded ``digest`` says: the same bytes, or absent where the digest is 0 (a chunk
    left to its fill value)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return digest == 0
    except OSError:
        return False
    return digest != 0 and present_digest(store_id, ident, data) == digest


def _bytes_view(data: Buffer) -> memoryview:
    if isinstance(data, np.ndarray) and not data.flags.c_contiguous:
        data = np.ascontiguousarray(data)
    return memoryview(data).cast("B")
