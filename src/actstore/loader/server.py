"""The server side of ``actstore serve``: :class:`Server` reads one
:class:`~actstore.loader.ActivationLoader` stream and writes it into the shared ring (see
:mod:`actstore.loader.serve` for the design); :func:`serve` and :func:`start_server` run
one in this or a new process.
"""

from __future__ import annotations

import json
import logging
import mmap
import multiprocessing
import os
import threading
import time
from dataclasses import replace
from typing import Any

import numpy as np

from ..errors import ConfigError, ServeError
from ..storage.lock import pid_alive
from .buffers import populate
from .config import LoaderConfig
from .dataset import ActivationLoader
from .pipeline import LoaderBatch
from .ring import (
    _FAILED,
    _FINISHED,
    _H_BATCH,
    _H_CONSUMERS,
    _H_END,
    _H_MAGIC,
    _H_MODE,
    _H_PER_EPOCH,
    _H_PID,
    _H_PRODUCED,
    _H_ROW,
    _H_SLOTS,
    _H_START,
    _H_STATUS,
    _H_TEXT,
    _HEADER,
    _MAGIC,
    _PER_CONSUMER,
    _PER_SLOT,
    _RUNNING,
    _TEXT_BYTES,
    MODES,
    ServeConfig,
    _Backoff,
    _paths,
    _Shared,
    ring_bytes,
)

log = logging.getLogger(__name__)


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
                "fewer slots or a smaller batch_size"
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
        os.rename(tmp_ring, self.ring_path)
        shared = _Shared(tmp_ctl, self.ring_path, settings=self._settings())
        # every slot's memory taken now, while consumers attach: not a page fault per page
        # while serving (the first pass over the ring cost warm one-epoch runs a quarter)
        populate(shared.ring.ctypes.data, shared.ring.nbytes)
        shared.text[: len(text)] = np.frombuffer(text, dtype=np.uint8)
        shared.slot[:, 0] = -1
        os.rename(tmp_ctl, self.ctl_path)  # consumers see the server only now, complete
        return shared

    def run(self) -> None:
        """Create the ring, wait for the K consumers, serve, and clean up when done."""
        shared = self.shared = self._create()
        self._taken = 0  # the next batch to be gathered (the loader gathers one ahead)
        self._stopping = threading.Event()  # set when serving ends with a gather waiting
        self.loader.deliver_into(lambda: self._slot(shared), cancel=self._stopping.set)
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
        g = self._taken = start
        loader = self.loader
        if per_epoch and (end < 0 or g < end):
            state = loader.state_dict()
            state.update(epoch=g // per_epoch, batches=g % per_epoch)
            loader.load_state_dict(state)
            while end < 0 or g < end:
                for batch in loader:  # gathered into slot g % slots (see _slot)
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

    def _slot(self, shared: _Shared) -> np.ndarray:
        """Ring slot ``g % slots`` of the next batch ``g`` to be gathered, once no live
        consumer needs the batch it holds (and one consumer is there), marked as being
        written: where batch ``g`` is gathered."""
        g = self._taken
        self._taken += 1
        r, s = shared.r, g % shared.r
        backoff = _Backoff()
        while True:
            pids, cursors = shared.consumer[:, 0], shared.consumer[:, 1]
            if pids.any() and not ((pids != 0) & (cursors <= g - r)).any():
                with shared.lock():  # again under the lock: a consumer may be registering
                    holders = (pids != 0) & (cursors <= g - r)
                    if pids.any() and not holders.any():
                        shared.slot[s, 0] = -1  # being written: a rejoining consumer sees it
                        break
            if self._stopping.is_set():  # Ctrl-C or a failure while this slot was awaited
                raise ServeError(f"server {self.config.name!r} stopped serving")
            if backoff.check():
                self._live(shared)
            backoff.sleep()
        return shared.acts[s].reshape(shared.batch, -1, int(self.loader.d_model))

    def _put(self, shared: _Shared, g: int, batch: LoaderBatch) -> None:
        """Publish batch ``g``, gathered into its ring slot (:meth:`_slot`)."""
        acts, rows = batch
        s, n = g % shared.r, len(rows)
        if acts.data_ptr() != shared.acts[s].ctypes.data:  # never publish another slot's
            raise ServeError(f"batch {g} was not gathered into its ring slot {s}")
        shared.ids[s, :n] = rows.numpy()
        shared.slot[s, 1] = n
        shared.slot[s, 0] = g
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
