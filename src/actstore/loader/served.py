"""The consumer side of ``actstore serve``: :class:`ServedLoader` iterates the batches a
server shares (zero-copy views of the ring, or copied to a device), and keeps an exact,
resumable position.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from collections.abc import Generator, Iterator
from typing import Any

import numpy as np
import torch

from ..devicecopy import Staging, can_pin_files_under, copies_for, is_pinned, try_pin
from ..errors import ConfigError, ServeError
from ..storage.lock import pid_alive
from .device import to_device
from .pipeline import LoaderBatch
from .ring import (
    _FAILED,
    _FINISHED,
    _H_END,
    _H_MAGIC,
    _H_PER_EPOCH,
    _H_PID,
    _H_PRODUCED,
    _H_START,
    _H_STATUS,
    _MAGIC,
    _STARTING,
    STATE_VERSION,
    _Backoff,
    _paths,
    _Shared,
)


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
            n = int(shared.slot[s, 1])
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
            if self._held and self._held[0][0] <= g - shared.r:
                raise ServeError(
                    f"this consumer holds {len(self._held)} batches: the server cannot write "
                    f"the next one (its ring has {shared.r} slots); clone() batches you keep, "
                    "or start the server with more slots"
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
