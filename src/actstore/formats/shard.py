"""What a format writes for :class:`~actstore.formats.writer.ShardedWriter`: one
:class:`ShardSink` per shard, returning :class:`WrittenFile` records; :class:`ShardStats`
folds the per-site statistics of a shard the same way whatever the batch sizes."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..batch import Batch
from ..sites import Site
from ..stats import RunningStats
from ..storage.manifest import FileEntry

if TYPE_CHECKING:
    import torch
else:
    from .._lazy import torch


@dataclass(frozen=True)
class WrittenFile:
    """One durable file of a shard: its name in the store, manifest entry and digests, and
    what the format needs of it at publication (``info``, kept in the progress record)."""

    name: str
    entry: FileEntry
    digests: np.ndarray
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


class ShardSink(abc.ABC):
    """Writes the files of one shard. The writer hands it the shard's examples in order."""

    @abc.abstractmethod
    def append(self, batch: Batch) -> None:
        """Encode the next examples of this shard (a batch of at most one shard's worth).
        It may leave writes of the batch's memory in flight until :meth:`settle`."""

    def settle(self) -> None:
        """Wait for the writes :meth:`append` left in flight (the writer computes the
        batch's statistics meanwhile, and calls this before the batch is the caller's
        again). Default: nothing is left in flight."""

    @abc.abstractmethod
    def finish(self) -> list[WrittenFile]:
        """Make every file durable (fsynced) and return them with their block digests."""

    def abort(self) -> None:
        """Close open files; the shard's files are discarded by the next open."""

    def chunk_files(self) -> list[str]:
        """After :meth:`finish`: files of this shard the format checks through its own
        digests (under :meth:`ShardedWriter.manifest_skip`), sealed with the shard for an
        uploader to send early. Default: none."""
        return []


class ShardStats:
    """Per-site statistics of one shard, folded in runs of ``rows_per_chunk`` rows counted
    from the shard's start: the result does not depend on how batches split the shard."""

    def __init__(self, sites: Sequence[Site], d: int) -> None:
        self.stats = {s: RunningStats(d) for s in sites}
        self.per = next(iter(self.stats.values())).rows_per_chunk if self.stats else 1
        self._pending = {s: np.empty((self.per, d), dtype="<f4") for s in sites}
        self._fill = 0

    def update(self, rows: dict[Site, np.ndarray]) -> None:
        """Fold the shard's next rows (``[n, D]`` per site, the same ``n`` for every site)."""
        n = len(next(iter(rows.values()))) if rows else 0
        i = 0
        if self._fill or n < self.per:
            take = min(self.per - self._fill, n)
            for site, part in rows.items():
                self._pending[site][self._fill : self._fill + take] = part[:take]
            self._fill += take
            i = take
            if self._fill == self.per:
                self._fold({s: b for s, b in self._pending.items()})
                self._fill = 0
        while n - i >= self.per:
            self._fold({s: part[i : i + self.per] for s, part in rows.items()})
            i += self.per
        if i < n:
            for site, part in rows.items():
                self._pending[site][: n - i] = part[i:]
            self._fill = n - i

    def finish(self) -> dict[Site, RunningStats]:
        if self._fill:
            self._fold({s: b[: self._fill] for s, b in self._pending.items()})
            self._fill = 0
        return self.stats

    def _fold(self, chunks: dict[Site, np.ndarray]) -> None:
        for site, chunk in chunks.items():
            self.stats[site].update(chunk)


def as_float32(tensor: torch.Tensor) -> np.ndarray:
    """A captured tensor as a C-order float32 array (a view when it already is one)."""
    return np.ascontiguousarray(tensor.detach().to(torch.float32).numpy(), dtype="<f4")
