"""The shared-memory protocol of ``actstore serve`` (used by :mod:`.server` and
:mod:`.served`): the control file's layout (header words, one row per consumer and per
slot, the settings as JSON), the ring of batch slots the server gathers batches into,
the lock that orders registrations, and the backoff of processes polling the counters.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..storage.lock import FileLock
from .buffers import NUMPY_STORAGE
from .config import OUT_DTYPES
from .dataset import ActivationLoader

log = logging.getLogger(__name__)

MODES = ("broadcast", "partition")
STATE_VERSION = 1
_MAGIC = 0x6163747365727633  # "actserv3"
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
) = range(13)
_HEADER = 16
_PER_CONSUMER = 3  # pid, cursor (oldest global batch still needed), next batch it asks for
_PER_SLOT = 2  # global batch held (-1: none, or being written), its rows
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
        storage = np.dtype(NUMPY_STORAGE[OUT_DTYPES[self.settings["dtype"]]])
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

    def lock(self) -> FileLock:
        """The lock that orders consumer registrations (an flock on the control file)."""
        return FileLock(self.fd)

    def message(self) -> str:
        size = int(self.words[_H_TEXT])
        raw = bytes(self.text[size:]).split(b"\0", 1)[0]
        return raw.decode(errors="replace") or "unknown error"


def ring_bytes(loader: ActivationLoader, slots: int) -> int:
    """Shared memory of a ring of ``slots`` batches of ``loader`` (activations + row ids)."""
    storage = np.dtype(NUMPY_STORAGE[loader.finish.out_dtype])
    acts_bytes = loader.batch_size * len(loader.sites) * loader.d_model * storage.itemsize
    return slots * (acts_bytes + loader.batch_size * 8)
