"""The spec's ``ActivationDataset`` (one item per sample), ordered like the shared loader.

The spec's example is a map-style dataset that unpickles every shard to build its index
and, under ``DataLoader(shuffle=True)``, decodes a whole shard for almost every item.
This one reads the index from ``metadata.json`` alone, and each epoch follows the shared
loader's order (:mod:`actstore.order`): shards are permuted, grouped into windows
of ``pool_shards``, and the samples of a window are shuffled together. Every shard is
therefore decoded once per epoch (safely, checksum-verified), memory holds ``pool_shards``
decoded shards, and the order is a pure function of (shard sizes, seed, epoch), split
across ranks and DataLoader workers exactly as the loader splits rows.

Items are what the spec's ``__getitem__`` returns: ``{"activation": float32 tensor
[seq_len, hidden], "sample_idx": int, "text": str}``. For token-level training (shuffled
rows rather than whole samples) use :class:`actstore.loader.ActivationLoader` on the store.

Example:
    >>> import tempfile, torch
    >>> from actstore.testing import FormatCase, make_acts, make_batches, make_plan
    >>> plan, out = make_plan(), tempfile.TemporaryDirectory()  # layers 1 and 3, 6 tokens
    >>> store = FormatCase("pickle").write(out.name, plan, make_batches(plan, make_acts(plan)))
    >>> dataset = ActivationDataset(store, layer_idx=3)
    >>> loader = torch.utils.data.DataLoader(dataset, batch_size=4)
    >>> next(iter(loader))["activation"].shape  # [4, seq_len, hidden]
    torch.Size([4, 6, 8])
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from ...errors import ConfigError
from ...order import plan_epoch, rank_span, worker_span
from .layout import layer_key
from .reader import PickleReader


class ActivationDataset(IterableDataset):
    """Samples of one layer of a pkl.gz store, shuffled per epoch (see module docstring)."""

    def __init__(
        self,
        output_dir: str | os.PathLike,
        layer_idx: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        pool_shards: int = 2,
        epoch: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if pool_shards < 1:
            raise ConfigError(f"pool_shards must be >= 1, not {pool_shards}")
        self.reader = PickleReader(output_dir, cache_shards=pool_shards)
        self.layer_idx = int(layer_idx)
        self.layer_key = layer_key(self.reader.site(layer_idx).layer)
        self.shards = [i for i, s in enumerate(self.reader.shards) if self.layer_idx in s.layers]
        self.shuffle, self.seed, self.pool_shards = shuffle, seed, pool_shards
        self.epoch = epoch
        self.rank, self.world_size = rank, world_size
        self._sizes = np.array([self.reader.shards[i].num_samples for i in self.shards])

    def __len__(self) -> int:
        """Samples this rank serves per epoch."""
        span = rank_span(
            int(self._sizes.sum()),
            rank=self.rank,
            world_size=self.world_size,
            batch_size=1,
            drop_last=False,
        )
        return span.stop - span.start

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s order on the next iteration (like DistributedSampler)."""
        self.epoch = epoch

    def _plan(self):
        if self.shuffle:
            return plan_epoch(
                self._sizes, pool_blocks=self.pool_shards, seed=self.seed, epoch=self.epoch
            )
        return None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        total = int(self._sizes.sum())
        span = rank_span(
            total, rank=self.rank, world_size=self.world_size, batch_size=1, drop_last=False
        )
        info = get_worker_info()
        if info is not None:
            span = worker_span(span, worker=info.id, num_workers=info.num_workers, batch_size=1)
        plan = self._plan()
        if plan is None:  # storage order: shard after shard
            windows = [(np.array([k]), None) for k in range(len(self.shards))]
        else:
            windows = [
                (plan.window_blocks(w), plan.window_permutation(w)) for w in range(plan.n_windows)
            ]
        first = 0  # stream position of the window's first sample
        for blocks, permutation in windows:
            n = int(self._sizes[blocks].sum())
            lo, hi = max(span.start, first), min(span.stop, first + n)
            if lo < hi:
                items = [
                    item
                    for k in blocks
                    for item in self.reader.load_shard(self.shards[k])[self.layer_key]
                ]
                for position in range(lo - first, hi - first):
                    index = position if permutation is None else int(permutation[position])
                    yield _spec_item(items[index])
            first += n


def _spec_item(item: dict[str, Any]) -> dict[str, Any]:
    return {
        "activation": torch.from_numpy(np.asarray(item["activation"], dtype=np.float32)),
        "sample_idx": int(item["sample_idx"]),
        "text": str(item.get("text_preview", "")),
    }
