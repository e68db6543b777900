"""Where an :class:`~actstore.loader.ActivationLoader` stands: its epoch and the batches
served, saved and restored (:meth:`~LoaderPosition.state_dict`,
:meth:`~LoaderPosition.load_state_dict`) against the fingerprint of what the order depends
on, and the position kept with :class:`~actstore.loader.ActivationDataLoader` and serve."""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ConfigError
from ..sites import Site
from .config import LoaderConfig
from .pipeline import Layout, WorkerLink

STATE_VERSION = 1


class LoaderPosition:
    """The epoch and batches served of :class:`~actstore.loader.ActivationLoader` (a mixin:
    the attributes below are the loader's)."""

    config: LoaderConfig
    reader: Any
    sites: tuple[Site, ...]
    layout: Layout
    pool_blocks: int
    run_blocks: int
    world_size: int
    epoch: int
    _batches_done: int
    _saved_workers: int | None
    _link: WorkerLink | None

    if TYPE_CHECKING:

        def __len__(self) -> int: ...

    # ------------------------------------------------------------------ epochs and state

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning at the next iteration."""
        if epoch < 0:
            raise ConfigError(f"epoch must be >= 0, not {epoch}")
        self.epoch, self._batches_done, self._saved_workers = int(epoch), 0, None

    def state_dict(self) -> dict[str, Any]:
        """Where this rank stands: epoch and batches served, plus what the order depends on.

        Under worker processes take the state from :class:`ActivationDataLoader` (it
        counts the batches the workers delivered); a plain ``DataLoader`` cannot."""
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "batches": self._batches_done,
            "num_workers": self._saved_workers or 1,
            **self.fingerprint(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where ``state`` was taken (O(1): no reads are replayed)."""
        if not isinstance(state, dict) or not {"version", "epoch", "batches"} <= set(state):
            keys = sorted(state)[:6] if isinstance(state, dict) else type(state).__name__
            raise ConfigError(
                f"this is not an ActivationLoader state ({keys}); pass what "
                "ActivationLoader.state_dict() or ActivationDataLoader.state_dict() "
                "returned"
            )
        if state.get("version") != STATE_VERSION:
            raise ConfigError(
                f"loader state version {state.get('version')!r} is not "
                f"{STATE_VERSION}: another actstore version saved it"
            )
        # states saved before runs and slabs existed: single whole blocks
        mine = self.fingerprint()
        # states saved before the store was part of it belong to this one
        state = {"run_blocks": 1, "mix": 1, "store": mine["store"], **state}
        wrong = [
            f"{k}={state.get(k)!r} (this loader: {v!r})"
            for k, v in mine.items()
            if state.get(k) != v
        ]
        if wrong:
            raise ConfigError(
                "the saved state belongs to a different order: "
                + "; ".join(wrong)
                + ". Build the loader with the same options"
            )
        if not 0 <= state["batches"] <= len(self):
            raise ConfigError(f"state says {state['batches']} batches served of {len(self)}")
        self.epoch, self._batches_done = int(state["epoch"]), int(state["batches"])
        self._saved_workers = int(state["num_workers"])

    def fingerprint(self) -> dict[str, Any]:
        """What this loader's order depends on (part of :meth:`state_dict`): a saved
        position continues only on a loader with the same fingerprint."""
        cfg = self.config
        sizes = self.layout.kept_rows.astype("<i8").tobytes()
        return {
            "seed": cfg.seed,
            "batch_size": cfg.batch_size,
            "pool_blocks": self.pool_blocks,
            "run_blocks": self.run_blocks,
            "mix": self.layout.mix,
            "world_size": self.world_size,
            "drop_last": cfg.drop_last,
            "drop_cls": cfg.drop_cls,
            "sites": [str(s) for s in self.sites],
            "blocks": hashlib.sha256(sizes).hexdigest()[:16],
            "store": _store_key(self.reader),
        }

    # ------------------------------------------------------------------ the position in the
    # seam used by ActivationDataLoader (main process) and serve

    def begin(self, num_consumers: int) -> None:
        """Main process, before ``num_consumers`` consumers (worker processes, or 1: this
        process) start an iteration: check that the saved position was reached with as
        many, move on to the next epoch if the last one was served completely, and
        publish the position to persistent workers."""
        self._check_workers(num_consumers)
        if self._batches_done >= len(self) > 0:  # the last epoch was served completely
            self.set_epoch(self.epoch + 1)
        self._saved_workers = num_consumers
        if self._link is not None and self._link.position is not None:
            position = [self.epoch, self._batches_done, num_consumers]
            self._link.position.copy_(torch.tensor(position, dtype=torch.int64))

    def count_batch(self) -> None:
        """Main process: one more batch of this iteration reached the user."""
        self._batches_done += 1

    def end_iteration(self, epoch: int) -> None:
        """Main process: the iteration over epoch ``epoch`` served its last batch; the next
        one starts the following epoch (unless :meth:`set_epoch` chose another)."""
        if self.epoch == epoch:
            self.set_epoch(epoch + 1)

    def _read_position(self) -> None:
        """Worker process: take the position the main process published."""
        if self._link is not None and self._link.position is not None:
            epoch, batches, workers = self._link.position.tolist()
            self.epoch, self._batches_done, self._saved_workers = epoch, batches, workers or None

    def _check_workers(self, num_workers: int) -> None:
        if self._batches_done and self._saved_workers not in (None, num_workers):
            raise ConfigError(
                f"this position was reached with {self._saved_workers} consumer(s) and cannot "
                f"continue with {num_workers}: the order of batches depends on the number of "
                "DataLoader workers (num_workers=0 counts as 1); resume with the same number"
            )


def _store_key(reader: Any) -> str:
    """Which store a position belongs to: its manifest's store id (the same for a copy of
    it), else a digest of its file names and sizes (stores other tools wrote)."""
    manifest = reader.checks.manifest
    if manifest is not None:
        return str(manifest.store_id)
    listing = json.dumps(reader.files.list(), sort_keys=True).encode()
    return hashlib.sha256(listing).hexdigest()[:16]
