"""One disk pass, many trainers: one server reads a store once per epoch and feeds K
consumer processes on the same machine through a shared-memory ring of batches.

- **broadcast**: every consumer sees the same shuffled stream (K SAEs with different
  hyperparameters trained on the same data);
- **partition**: consumer ``c`` of ``K`` gets stream batches ``c, c + K, c + 2K, ...`` of
  each epoch: disjoint parts, together every row once (data parallel).

The stream is exactly :class:`~actstore.loader.ActivationLoader`'s (same options, same
seed: same batches), numbered globally ``g = epoch * M + k`` (``M`` batches per epoch).
Batch ``g`` lives in ring slot ``g % slots`` until every live consumer that needs it has
moved past it, so a slow consumer stalls the others only once it is ``slots`` batches
behind. Each consumer publishes its cursor (the oldest batch it still uses) and its pid;
the server skips consumers whose process has gone, so a dead consumer does not stop the
others, and a new process can take its place from its ``state_dict``.

Two files under ``directory`` (``/dev/shm``: memory, not disk) make up a server:
``actstore-serve-<name>.ctl`` (counters, one row per consumer and per slot, the server's
settings as JSON) and ``actstore-serve-<name>.ring`` (the batch slots). The server removes
them when it ends; consumers that still map them keep working until they are done.

Example:
    >>> # one process (or `actstore serve STORE --name sae --consumers 2`):
    >>> serve("acts/3f1c...", name="sae", consumers=2, epochs=3, batch_size=4096)  # doctest: +SKIP
    >>> # each trainer process:
    >>> stream = ServedLoader("sae", consumer=0)  # doctest: +SKIP
    >>> for epoch in range(3):  # doctest: +SKIP
    ...     for acts in stream: sae.step(acts)
"""

from __future__ import annotations

import fcntl
import json
import logging
import mmap
import multiprocessing
import os
import sys
import time
from collections import deque
from collections.abc import Generator, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..devicecopy import Staging, can_pin_files_under, copies_for, is_pinned, try_pin
from ..errors import ConfigError, ServeError
from ..storage.lock import pid_alive
from .dataset import OUT_DTYPES, ActivationLoader, LoaderConfig
from .device import to_device
from .pipeline import _NUMPY_STORAGE, Buffers, LoaderBatch, pool_shape

log = logging.getLogger(__name__)

MODES = ("broadcast", "partition")
STATE_VERSION = 1
_MAGIC = 0x6163747365727632  # "actserv2"
# header fields of the control file (int64 each)
(
    _H_MAGIC,
    _H_CONSUMERS,
    _H_MODE,
    _H_SLOTS,
    _H_BATCH,
    _H_ROW,
    _H_PER_EPOCH,
    _H_END,
    _H_PRODUCED,
    _H_PID,
    _H_STATUS,
    _H_START,
    _H_TEXT,
    _H_POOL_WAIT,
) = range(14)
_HEADER = 16
_PER_CONSUMER = 3  # pid, cursor (oldest global batch still needed), next batch it asks for
_PER_SLOT = 4  # global batch held, its rows, its window pool (-1: the slot), byte offset
_POOLS = 3  # window pools shared with consumers: served, being read, one more for lag
_TEXT_BYTES = 16384  # settings (JSON), then the failure message
_STARTING, _RUNNING, _FINISHED, _FAILED = range(4)
_POLL_S = 0.0002  # first wait between polls; it doubles up to _POLL_MAX_S
_POLL_MAX_S = 0.002
_CHECK_S = 0.1  # how often a waiting process checks that the others are alive


class _Backoff:
    """Sleeps between polls of shared counters: short at first, then longer (waiting
    processes must not take the CPU the server needs); ``check()`` is true every
    ``_CHECK_S`` seconds, when it is time to look for processes that are gone."""

    def __init__(self) -> None:
        self.delay, self.last = _POLL_S, time.monotonic()

    def sleep(self) -> None:
        time.sleep(self.delay)
        self.delay = min(2 * self.delay, _POLL_MAX_S)

    def check(self) -> bool:
        now = time.monotonic()
        if now - self.last < _CHECK_S:
            return False
        self.last = now
        return True


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """How a server shares its stream (the stream itself is a :class:`LoaderConfig`)."""

    name: str
    """Consumers find the server by this name."""
    consumers: int
    """K: the server starts once all K consumer slots are taken."""
    mode: str = "broadcast"
    """``broadcast`` (every consumer gets every batch) or ``partition`` (consumer ``c``
    gets batches ``c, c + K, ...`` of each epoch)."""
    slots: int | None = None
    """Batches the ring holds: how far the fastest consumer may run ahead of the slowest
    (memory: ``slots x batch bytes`` of shared memory). None: 8 (broadcast) or K + 8
    (partition). A consumer keeps its last batch while it asks for the next, so broadcast
    needs at least 2 and partition more than K."""
    epochs: int | None = 1
    """Serve until the end of this epoch count (epochs ``0..epochs-1``; a resumed server
    serves what is left). None: until stopped."""
    directory: str = "/dev/shm"
    """Where the control and ring files live (a memory file system)."""

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ConfigError(f"a server name must be non-empty without '/', not {self.name!r}")
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, not {self.mode!r}")
        if self.consumers < 1:
            raise ConfigError(f"consumers must be >= 1, not {self.consumers}")
        least = 2 if self.mode == "broadcast" else self.consumers + 1
        if self.slots is None:
            object.__setattr__(self, "slots", 8 if self.mode == "broadcast" else self.consumers + 8)
        elif self.slots < least:
            raise ConfigError(
                f"slots must be >= {least} in {self.mode} mode with {self.consumers} consumers "
                "(a consumer holds its last batch while it waits for the next), not "
                f"{self.slots}"
            )
        if self.epochs is not None and self.epochs < 1:
            raise ConfigError(f"epochs must be >= 1 or None, not {self.epochs}")


def _paths(directory: str | os.PathLike, name: str) -> tuple[Path, Path]:
    base = Path(directory) / f"actstore-serve-{name}"
    return base.with_suffix(".ctl"), base.with_suffix(".ring")


class _Shared:
    """The mapped control and ring files, as numpy views (used by server and consumers)."""

    def __init__(self, ctl: Path, ring: Path, *, settings: dict[str, Any] | None = None) -> None:
        self.fd = os.open(ctl, os.O_RDWR)
        self.ctl_map = mmap.mmap(self.fd, 0)
        self.words = np.frombuffer(self.ctl_map, dtype=np.int64, count=_HEADER)
        k, r = int(self.words[_H_CONSUMERS]), int(self.words[_H_SLOTS])
        self.k, self.r = k, r
        self.consumer = np.frombuffer(
            self.ctl_map, dtype=np.int64, count=k * _PER_CONSUMER, offset=_HEADER * 8
        ).reshape(k, _PER_CONSUMER)
        self.slot = np.frombuffer(
            self.ctl_map,
            dtype=np.int64,
            count=r * _PER_SLOT,
            offset=(_HEADER + k * _PER_CONSUMER) * 8,
        ).reshape(r, _PER_SLOT)
        text_at = (_HEADER + k * _PER_CONSUMER + r * _PER_SLOT) * 8
        self.text = np.frombuffer(self.ctl_map, dtype=np.uint8, count=_TEXT_BYTES, offset=text_at)
        size = int(self.words[_H_TEXT])
        self.settings = settings or json.loads(bytes(self.text[:size]).decode())
        self.batch, self.row = int(self.words[_H_BATCH]), int(self.words[_H_ROW])
        storage = np.dtype(_NUMPY_STORAGE[OUT_DTYPES[self.settings["dtype"]]])
        ring_fd = os.open(ring, os.O_RDWR)
        try:
            self.ring_map = mmap.mmap(ring_fd, 0)
        finally:
            os.close(ring_fd)
        #: the whole ring file (registered with CUDA by a consumer that moves batches there)
        self.ring = np.frombuffer(self.ring_map, dtype=np.uint8)
        acts_bytes = self.batch * self.row * storage.itemsize
        # one array per slot (not views of one array): a slot is free once no batch
        # refers to its array, which reference counts tell (see Buffers)
        self.acts = [
            np.frombuffer(
                self.ring_map, dtype=storage, count=self.batch * self.row, offset=s * acts_bytes
            )
            for s in range(r)
        ]
        self.ids = np.frombuffer(
            self.ring_map, dtype=np.int64, count=r * self.batch, offset=r * acts_bytes
        ).reshape(r, self.batch)
        # the server's window pools, when batches are sent as slices of them (zero copy)
        pool_bytes, at = int(self.settings["pool_bytes"]), _pools_at(r, self.batch, acts_bytes)
        self.pools = [
            np.frombuffer(
                self.ring_map,
                dtype=storage,
                count=pool_bytes // storage.itemsize,
                offset=at + i * pool_bytes,
            )
            for i in range(int(self.settings["pools"]))
        ]

    def lock(self) -> _Lock:
        return _Lock(self.fd)

    def message(self) -> str:
        size = int(self.words[_H_TEXT])
        raw = bytes(self.text[size:]).split(b"\0", 1)[0]
        return raw.decode(errors="replace") or "unknown error"


class _Lock:
    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __enter__(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)


def ring_bytes(loader: ActivationLoader, slots: int) -> int:
    """Shared memory of a ring of ``slots`` batches of ``loader`` (activations + row ids),
    plus the window pools it shares when its batches need no conversion."""
    storage = np.dtype(_NUMPY_STORAGE[loader.finish.out_dtype])
    acts_bytes = loader.batch_size * len(loader.sites) * loader.d_model * storage.itemsize
    at = _pools_at(slots, loader.batch_size, acts_bytes)
    return at + _POOLS * _pool_bytes(loader) if _zero_copy(loader) else at


def _pools_at(slots: int, batch: int, acts_bytes: int) -> int:
    """Byte offset of the window pools in the ring file (page-aligned)."""
    end = slots * (acts_bytes + batch * 8)
    return -(-end // mmap.PAGESIZE) * mmap.PAGESIZE


def _zero_copy(loader: ActivationLoader) -> bool:
    """Whether the loader's batches are its windows' rows as stored (no dtype change or
    normalisation), so the server can share its windows instead of copying batches."""
    finish = loader.finish
    same = np.dtype(_NUMPY_STORAGE[finish.out_dtype]) == loader.layout.dtype
    return same and finish.shift is None and finish.scale is None


def _pool_bytes(loader: ActivationLoader) -> int:
    shape = pool_shape(loader.layout, loader.pool_blocks)
    return int(np.prod(shape)) * loader.layout.dtype.itemsize


class Server:
    """Reads one :class:`ActivationLoader` stream and shares it with K consumers.

    Example:
        >>> Server("acts/3f1c...", ServeConfig(name="sae", consumers=2), batch_size=4096).run()  # doctest: +SKIP
    """

    def __init__(
        self,
        source: Any,
        config: ServeConfig,
        loader_config: LoaderConfig | None = None,
        **loader_options: Any,
    ) -> None:
        if loader_config is None:
            loader_config = LoaderConfig(**loader_options)
        elif loader_options:
            raise ConfigError("pass a LoaderConfig or keyword options, not both")
        if loader_config.pin_memory or loader_config.device is not None:
            raise ConfigError("pin_memory/device act in each consumer: move batches there yourself")
        if (loader_config.rank or 0) != 0 or (loader_config.world_size or 1) != 1:
            raise ConfigError("a server streams the whole store: leave rank and world_size unset")
        self.config = config
        self.loader = ActivationLoader(
            source, replace(loader_config, return_index=True, rank=0, world_size=1)
        )
        self.ctl_path, self.ring_path = _paths(config.directory, config.name)
        self.shared: _Shared | None = None

    @property
    def batches_per_epoch(self) -> int:
        return len(self.loader)

    def _settings(self) -> dict[str, Any]:
        loader = self.loader
        return {
            "name": self.config.name,
            "mode": self.config.mode,
            "consumers": self.config.consumers,
            "dtype": loader.config.dtype,
            "sites": [str(s) for s in loader.sites],
            "single_site": loader.config.sites is None,
            "d_model": loader.d_model,
            "n_rows": loader.n_rows,
            "fingerprint": loader.fingerprint(),
            "pools": _POOLS if _zero_copy(loader) else 0,
            "pool_bytes": _pool_bytes(loader),
        }

    def _create(self) -> _Shared:
        cfg, loader = self.config, self.loader
        if self.ctl_path.exists():
            try:
                old = _Shared(self.ctl_path, self.ring_path)
                pid = int(old.words[_H_PID])
            except (OSError, ValueError, KeyError):
                pid = 0
            if pid != os.getpid() and pid_alive(pid):
                raise ServeError(
                    f"a server named {cfg.name!r} is running (pid {pid}); choose another name"
                )
            for path in (self.ctl_path, self.ring_path):
                path.unlink(missing_ok=True)
        text = json.dumps(self._settings()).encode()
        if len(text) > _TEXT_BYTES // 2:
            raise ConfigError("server settings too long (site names?)")
        k, r = cfg.consumers, cfg.slots
        assert r is not None  # ServeConfig.__post_init__ sets it
        ctl_bytes = (_HEADER + k * _PER_CONSUMER + r * _PER_SLOT) * 8 + _TEXT_BYTES
        need = ring_bytes(loader, r) + ctl_bytes
        try:
            vfs = os.statvfs(cfg.directory)
            free = vfs.f_bavail * vfs.f_frsize
        except OSError:
            free = need  # cannot tell: creating the files says what is wrong
        if need > free:  # the files are sparse: a full file system would fail mid-epoch
            raise ServeError(
                f"the ring needs {need / 2**20:.0f} MiB under {cfg.directory} but "
                f"{free / 2**20:.0f} MiB is free; free some, pass a larger directory, or use "
                "fewer slots or a smaller pool_blocks"
            )
        tmp_ring = self.ring_path.with_suffix(f".ring.{os.getpid()}")
        tmp_ctl = self.ctl_path.with_suffix(f".ctl.{os.getpid()}")
        try:
            with open(tmp_ring, "wb") as f:
                f.truncate(ring_bytes(loader, r))
            with open(tmp_ctl, "wb") as f:
                f.truncate(ctl_bytes)
        except OSError as err:
            raise ServeError(f"cannot create the ring under {cfg.directory}: {err}") from err
        fd = os.open(tmp_ctl, os.O_RDWR)
        try:
            words = np.frombuffer(mmap.mmap(fd, 0), dtype=np.int64, count=_HEADER)
        finally:
            os.close(fd)
        words[_H_MAGIC] = _MAGIC
        words[_H_CONSUMERS], words[_H_SLOTS] = k, r
        words[_H_MODE] = MODES.index(cfg.mode)
        words[_H_BATCH] = loader.batch_size
        words[_H_ROW] = len(loader.sites) * loader.d_model
        words[_H_PER_EPOCH] = len(loader)
        words[_H_END] = -1 if cfg.epochs is None else cfg.epochs * len(loader)
        words[_H_PID] = os.getpid()
        words[_H_TEXT] = len(text)
        words[_H_POOL_WAIT] = -1
        os.rename(tmp_ring, self.ring_path)
        shared = _Shared(tmp_ctl, self.ring_path, settings=self._settings())
        shared.text[: len(text)] = np.frombuffer(text, dtype=np.uint8)
        shared.slot[:, 0] = -1
        os.rename(tmp_ctl, self.ctl_path)  # consumers see the server only now, complete
        return shared

    def run(self) -> None:
        """Create the ring, wait for the K consumers, serve, and clean up when done."""
        shared = self.shared = self._create()
        self._pool_last = np.full(len(shared.pools), -1, dtype=np.int64)
        self._pools: Buffers | None = None
        if shared.pools:
            self._share_windows(shared)
        log.info(
            "serving %s as %r to %d consumers (%s), ring of %d batches (%s)",
            self.loader.reader,
            self.config.name,
            self.config.consumers,
            self.config.mode,
            shared.r,
            f"{ring_bytes(self.loader, shared.r) / 2**20:.0f} MiB",
        )
        try:
            self._serve(shared)
        except BaseException as err:
            message = f"server {self.config.name!r} failed: {type(err).__name__}: {err}"
            raw = message.encode()[: _TEXT_BYTES // 2 - 1]
            at = int(shared.words[_H_TEXT])
            shared.text[at : at + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
            shared.words[_H_STATUS] = _FAILED
            raise
        finally:
            for path in (self.ctl_path, self.ring_path):
                path.unlink(missing_ok=True)

    def _share_windows(self, shared: _Shared) -> None:
        """Make the loader read its windows into the ring's pools, so ``_put`` sends a
        batch as (pool, offset) with no copy. A pool is reused once every live consumer
        has moved past the last batch sent from it."""
        loader = self.loader
        made = iter(shared.pools)
        backoff = _Backoff()

        def pause() -> None:  # every pool still read by a consumer: wait for one
            # consumers holding a batch this old are what the server waits for
            shared.words[_H_POOL_WAIT] = int(self._pool_last.min())
            if backoff.check():
                self._live(shared)
            backoff.sleep()

        self._pools = Buffers(
            pool_shape(loader.layout, loader.pool_blocks),
            loader.layout.dtype,
            allocate=lambda count, dtype: next(made)[:count],
            held=lambda i: self._pool_held(shared, i),
            limit=len(shared.pools),
            pause=pause,
        )
        loader.use_pools(self._pools)

    def _pool_held(self, shared: _Shared, i: int) -> bool:
        last = int(self._pool_last[i])
        pids, cursors = shared.consumer[:, 0], shared.consumer[:, 1]
        return last >= 0 and bool(((pids != 0) & (cursors <= last)).any())

    def _live(self, shared: _Shared) -> np.ndarray:
        """Consumers whose process is registered and alive (gone ones are deregistered;
        a warning names those that left before the end of what is served)."""
        end = int(shared.words[_H_END])
        for c, pid in enumerate(shared.consumer[:, 0].tolist()):
            if pid and not pid_alive(pid):
                with shared.lock():
                    if shared.consumer[c, 0] == pid:
                        finished = 0 <= end <= int(shared.consumer[c, 2])
                        # a consumer that took its last batch and exited is a normal end
                        log.log(
                            logging.DEBUG if finished else logging.WARNING,
                            "consumer %d (pid %d) is gone%s",
                            c,
                            pid,
                            " after its last batch" if finished else "",
                        )
                        shared.consumer[c, 0] = 0
        return shared.consumer[:, 0] != 0

    def _serve(self, shared: _Shared) -> None:
        words, k = shared.words, shared.k
        while True:  # every consumer slot taken: start where the earliest one wants
            live = self._live(shared)
            if live.all():
                break
            time.sleep(0.01)
        per_epoch = int(words[_H_PER_EPOCH])
        start = int(shared.consumer[:, 1].min())
        end = int(words[_H_END])
        words[_H_START] = words[_H_PRODUCED] = start
        words[_H_STATUS] = _RUNNING
        log.info("%d consumers attached; serving from batch %d", k, start)
        g = start
        loader = self.loader
        if per_epoch and (end < 0 or g < end):
            state = loader.state_dict()
            state.update(epoch=g // per_epoch, batches=g % per_epoch)
            loader.load_state_dict(state)
            while end < 0 or g < end:
                for batch in loader:
                    self._put(shared, g, batch)
                    g += 1
                    if g == end:
                        break
        words[_H_STATUS] = _FINISHED
        while True:  # wait until every live consumer has received its last batch
            live = self._live(shared)
            if not (live & (shared.consumer[:, 2] < g)).any():
                return
            time.sleep(0.01)

    def _put(self, shared: _Shared, g: int, batch: LoaderBatch) -> None:
        r, s = shared.r, g % shared.r
        backoff = _Backoff()
        while True:  # wait until no live consumer needs the slot's batch (and one exists)
            pids, cursors = shared.consumer[:, 0], shared.consumer[:, 1]
            if pids.any() and not ((pids != 0) & (cursors <= g - r)).any():
                with shared.lock():  # again under the lock: a consumer may be registering
                    holders = (pids != 0) & (cursors <= g - r)
                    if pids.any() and not holders.any():
                        shared.slot[s, 0] = -1  # being written: registering consumers see it
                        break
            if backoff.check():
                self._live(shared)
            backoff.sleep()
        acts, rows = batch
        n = len(rows)
        place = None if self._pools is None else self._pools.locate(acts)
        if place is not None:  # a slice of a shared window: send where it lies
            self._pool_last[place[0]] = g
            shared.slot[s, 2], shared.slot[s, 3] = place
        else:
            data = acts.view(torch.uint16) if acts.dtype == torch.bfloat16 else acts
            shared.acts[s][: n * shared.row] = data.reshape(-1).numpy()
            shared.slot[s, 2] = -1
        shared.ids[s, :n] = rows.numpy()
        shared.slot[s, 1] = n
        shared.slot[s, 0] = g
        shared.words[_H_POOL_WAIT] = -1
        shared.words[_H_PRODUCED] = g + 1


def serve(source: Any, *, name: str, consumers: int, **options: Any) -> None:
    """Run a server in this process until it is done (see :class:`Server`): ``options``
    are :class:`ServeConfig`'s (``mode``, ``slots``, ``epochs``, ``directory``) and
    :class:`LoaderConfig`'s (``batch_size``, ``seed``, ``site``, ...)."""
    serve_keys = {"mode", "slots", "epochs", "directory"}
    config = ServeConfig(
        name=name, consumers=consumers, **{k: v for k, v in options.items() if k in serve_keys}
    )
    loader_options = {k: v for k, v in options.items() if k not in serve_keys}
    Server(source, config, **loader_options).run()


def start_server(
    source: Any, *, name: str, consumers: int, context: str = "spawn", **options: Any
) -> multiprocessing.process.BaseProcess:
    """:func:`serve` in a new process (started; ``join()`` it or let it end by itself)."""
    ctx = multiprocessing.get_context(context)
    # every start method's context has Process; typeshed's BaseContext (for a str) does not
    process = ctx.Process(  # type: ignore[attr-defined]
        target=serve,
        args=(source,),
        kwargs={"name": name, "consumers": consumers, **options},
        name=f"actstore-serve-{name}",
    )
    process.start()
    return process


class ServedLoader:
    """Consumer ``consumer`` of the server named ``name``: iterate it like an
    :class:`ActivationLoader` (each ``for`` loop is one epoch from the current position).

    Batches are zero-copy views of the shared ring, valid for as long as you hold them; a
    consumer that holds ``slots`` batches at once stalls the server (an error says so).
    With ``device="cuda"`` the ring is registered with CUDA once and each batch is copied
    to the GPU on a side stream while the previous one is in use (see
    :mod:`actstore.loader.device`); any other ``device``: copied there on a thread.
    Where the ring cannot be pinned (its directory is on a disk file system, ``ulimit -l``,
    ``ACTSTORE_PIN=0``) or with ``staging=True``, each batch is first copied out of the
    ring into a (pinned) staging buffer, and its slot is let go at once.
    ``state_dict()`` / ``load_state_dict()`` resume this consumer exactly, also with a
    restarted server (the server starts at the earliest position its consumers ask for).
    """

    def __init__(
        self,
        name: str,
        consumer: int,
        *,
        directory: str = "/dev/shm",
        return_index: bool = False,
        timeout_s: float = 60.0,
        device: str | torch.device | None = None,
        staging: bool | None = None,
    ) -> None:
        self.name, self.consumer, self.return_index = name, int(consumer), return_index
        self.device = None if device is None else torch.device(device)
        cuda = self.device is not None and self.device.type == "cuda"
        if cuda and not torch.cuda.is_available():
            raise ConfigError("device='cuda' needs CUDA, which is not available")
        if staging and self.device is None:
            raise ConfigError("staging=True copies batches on their way to a device: set device")
        self.ctl_path, self.ring_path = _paths(directory, name)
        self.shared = self._attach(directory, timeout_s)
        words = self.shared.words
        if not 0 <= self.consumer < self.shared.k:
            raise ConfigError(
                f"consumer must lie in 0..{self.shared.k - 1} (the server has "
                f"{self.shared.k} consumers), not {consumer}"
            )
        settings = self.shared.settings
        self.mode: str = settings["mode"]
        self.per_epoch = int(words[_H_PER_EPOCH])
        self._shape = (
            (self.shared.row,)
            if settings["single_site"]
            else (len(settings["sites"]), settings["d_model"])
        )
        self._bf16 = settings["dtype"] == "bfloat16"
        if cuda and not staging and can_pin_files_under(directory):
            try_pin(self.shared.ring)  # batches go to the GPU by DMA, with no staging copy
        #: batches are copied out of the ring into a staging buffer on their way to the
        #: device (where the ring is not pinned, or with ``staging=True``)
        self.staging = bool(staging) or (cuda and not is_pinned(self.shared.ring))
        self._stager = None if not self.staging else Staging(self.device or "cpu", always=True)
        self.epoch, self._batches = 0, 0
        self._registered = False
        # (global batch, its array, references to it when dropped) per batch handed out
        self._held: deque[tuple[int, np.ndarray, int]] = deque()

    @property
    def staged_batches(self) -> int:
        """Batches copied out of the ring into a staging buffer so far (see ``staging``)."""
        return 0 if self._stager is None else self._stager.staged

    def _attach(self, directory: str, timeout_s: float) -> _Shared:
        """The running server's files. Files a dead server left behind are not attached
        to (its successor replaces them, and a consumer registered there would be lost):
        wait for the live server's, up to ``timeout_s``."""
        deadline, gone = time.monotonic() + timeout_s, None
        while True:
            shared = None
            if self.ctl_path.exists():
                try:
                    shared = _Shared(self.ctl_path, self.ring_path)
                except (OSError, ValueError, KeyError):  # being replaced: look again
                    shared = None
            if shared is not None:
                if int(shared.words[_H_MAGIC]) != _MAGIC:
                    raise ServeError(f"{self.ctl_path} is not an actstore server of this version")
                pid = int(shared.words[_H_PID])
                if pid_alive(pid):
                    return shared
                os.close(shared.fd)
                gone = pid
            if time.monotonic() > deadline:
                found = f" (only the files of server pid {gone}, which is gone)" if gone else ""
                raise ServeError(
                    f"no server named {self.name!r} runs under {directory} after "
                    f"{timeout_s:.0f} s{found}; start one with `actstore serve STORE --name "
                    "NAME` (or actstore.loader.serve)"
                )
            time.sleep(0.01)

    # ------------------------------------------------------------------ positions

    def __len__(self) -> int:
        """Batches this consumer gets per epoch."""
        if self.mode == "broadcast":
            return self.per_epoch
        return len(range(self.consumer, self.per_epoch, self.shared.k))

    def _global(self, epoch: int, batch: int) -> int:
        if self.mode == "broadcast":
            return epoch * self.per_epoch + batch
        return epoch * self.per_epoch + self.consumer + batch * self.shared.k

    def state_dict(self) -> dict[str, Any]:
        """This consumer's position (epoch, batches it received) and the stream's identity."""
        return {
            "version": STATE_VERSION,
            "served": self.mode,
            "consumers": self.shared.k,
            "consumer": self.consumer,
            "epoch": self.epoch,
            "batches": self._batches,
            **self.shared.settings["fingerprint"],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (taken from a consumer of the same number and stream)."""
        if not isinstance(state, dict) or state.get("served") is None:
            raise ConfigError("this is not a ServedLoader state (see ServedLoader.state_dict)")
        if state.get("version") != STATE_VERSION:
            raise ConfigError(
                f"served state version {state.get('version')!r} is not {STATE_VERSION}"
            )
        mine = self.state_dict()
        wrong = [
            f"{k}={state.get(k)!r} (this consumer: {mine[k]!r})"
            for k in mine
            if k not in ("epoch", "batches", "version") and state.get(k) != mine[k]
        ]
        if wrong:
            raise ConfigError("the saved state belongs to another stream: " + "; ".join(wrong))
        if not 0 <= state["batches"] <= len(self):
            raise ConfigError(f"state says {state['batches']} batches of {len(self)}")
        self.epoch, self._batches = int(state["epoch"]), int(state["batches"])

    def _register(self, g: int) -> None:
        """Claim this consumer's row with cursor ``g`` (the server keeps ``g`` from then on)."""
        shared, c = self.shared, self.consumer
        with shared.lock():
            pid = int(shared.consumer[c, 0])
            if pid not in (0, os.getpid()) and pid_alive(pid):
                raise ServeError(f"consumer {c} of server {self.name!r} is in use by process {pid}")
            status = int(shared.words[_H_STATUS])
            if status != _STARTING:
                produced, start = int(shared.words[_H_PRODUCED]), int(shared.words[_H_START])
                s = g % shared.r
                if g < start or (g < produced and int(shared.slot[s, 0]) != g):
                    raise ServeError(
                        f"batch {g} (epoch {g // max(self.per_epoch, 1)}) is no longer held by "
                        f"server {self.name!r} (it is at batch {produced}); restart the server "
                        "and its consumers from their saved states"
                    )
            shared.consumer[c, 1] = shared.consumer[c, 2] = g
            shared.consumer[c, 0] = os.getpid()
        self._registered = True

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[Any]:
        if self._batches >= len(self) > 0:
            self.epoch, self._batches = self.epoch + 1, 0
        end = int(self.shared.words[_H_END])
        epoch = self.epoch
        if end >= 0 and self._global(epoch, 0) >= end:
            raise ServeError(
                f"server {self.name!r} serves {end // max(self.per_epoch, 1)} epochs; this "
                f"consumer asks for epoch {epoch} (start the server with more --epochs)"
            )
        self._register(self._global(epoch, self._batches))
        return self._generate(epoch)

    def _generate(self, epoch: int) -> Iterator[Any]:
        batches = self._host_batches(epoch, self._batches)
        if self.device is not None:  # the next batch's copy runs while this one is used
            batches = to_device(batches, copies_for(self.device), self._stager)
        try:
            for batch in batches:
                self._batches += 1
                yield batch
                del batch
        finally:
            batches.close()
        self._release(self._global(epoch + 1, 0))
        self.epoch, self._batches = epoch + 1, 0

    def _host_batches(self, epoch: int, start: int) -> Generator[Any, None, None]:
        """Batches ``start, start + 1, ...`` of ``epoch``, as views of the shared ring."""
        shared = self.shared
        for b in range(start, len(self)):
            g = self._global(epoch, b)
            s = self._wait(g)
            n, pool = int(shared.slot[s, 1]), int(shared.slot[s, 2])
            if pool >= 0:  # rows of a server window, in place
                at = int(shared.slot[s, 3]) // shared.pools[pool].itemsize
                view = shared.pools[pool][at : at + n * shared.row]
            else:
                view = shared.acts[s][: n * shared.row]
            idle = sys.getrefcount(view)  # one name + the argument, as in _release
            acts = torch.from_numpy(view).view(n, *self._shape)
            if self._bf16:
                acts = acts.view(torch.bfloat16)
            self._held.append((g, view, idle))
            del view
            if self.return_index:
                yield LoaderBatch(acts, torch.from_numpy(shared.ids[s, :n].copy()))
            else:
                yield acts
            del acts

    def _release(self, upto: int) -> None:
        """Publish the oldest batch still needed: handed-out batches nobody refers to any
        more are done; ``upto`` is the next one this consumer will ask for."""
        shared, held = self.shared, self._held
        while held and sys.getrefcount(held[0][1]) == held[0][2]:
            held.popleft()
        shared.consumer[self.consumer, 1] = held[0][0] if held else upto
        shared.consumer[self.consumer, 2] = upto

    def _wait(self, g: int) -> int:
        """Slot of batch ``g`` once the server has written it."""
        shared, words = self.shared, self.shared.words
        self._release(g)
        s = g % shared.r
        backoff = _Backoff()
        while int(words[_H_PRODUCED]) <= g:
            status = int(words[_H_STATUS])
            if status == _FAILED:
                raise ServeError(shared.message())
            if status == _FINISHED:
                raise ServeError(f"server {self.name!r} finished before batch {g}")
            if backoff.check() and not pid_alive(int(words[_H_PID])):
                raise ServeError(f"server {self.name!r} (pid {int(words[_H_PID])}) is gone")
            need = int(words[_H_POOL_WAIT])  # the server waits for its windows to be let go
            if self._held and (self._held[0][0] <= g - shared.r or self._held[0][0] <= need):
                raise ServeError(
                    f"this consumer holds {len(self._held)} batches: the server cannot write "
                    f"the next one (its ring has {shared.r} slots, {len(shared.pools)} shared "
                    "windows); clone() batches you keep, or start the server with more slots"
                )
            self._release(g)
            backoff.sleep()
        if int(shared.slot[s, 0]) != g:
            raise ServeError(f"batch {g} was overwritten before this consumer read it")
        return s

    def close(self) -> None:
        """Give up this consumer's row (the server stops waiting for it)."""
        if self._registered:
            with self.shared.lock():
                if int(self.shared.consumer[self.consumer, 0]) == os.getpid():
                    self.shared.consumer[self.consumer, 0] = 0
            self._registered = False
