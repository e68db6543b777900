"""Reading an Activault run's megabatch files: concurrent ranged GETs, checked against
their keyed digests, decoded and checked against ``metadata.json``; one block per file, and
each hook's statistics."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import ConfigError, CorruptStoreError
from ...sites import Site
from ...stats import RunningStats
from ...storage.object import MiB, base_name, join_key
from ..blocks import Block
from .layout import STATISTICS, load_megabatch, parse_dtype
from .listing import ActivaultListing
from .metadata import HookMetadata, statistics_from_dict

if TYPE_CHECKING:
    import torch
else:
    from ..._lazy import torch


class ActivaultFiles(ActivaultListing):
    """The megabatch files of a run, fetched, checked and decoded."""

    def _thread_pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:  # read_block may be called from several loader threads
            if self._pool is None or self._pid != os.getpid():
                self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="actstore-get")
                self._pid = os.getpid()
            return self._pool

    def fetch(self, site: Any, index: int) -> bytearray:
        """The raw bytes of file ``index`` of ``site`` (concurrent ranged GETs), checked."""
        listing = self.listings[self.hook_of(site)]
        f = listing.files[index]
        size = listing.metadata.file_bytes
        out = bytearray(size)
        self.store.get_into(
            f.key,
            out,
            chunk_size=self.chunk_size or auto_chunk(size, self.concurrency),
            pool=self._thread_pool(),
        )
        self.checks.check(f"{listing.hook}/{base_name(f.key)}", 0, out)
        return out

    def decode(self, site: Any, index: int, data: bytes | bytearray) -> dict[str, torch.Tensor]:
        """Load fetched bytes and check them against ``metadata.json``."""
        listing = self.listings[self.hook_of(site)]
        return check_megabatch(
            load_megabatch(data, source=self.store.url(listing.files[index].key)),
            listing.metadata,
            self.store.url(listing.files[index].key),
        )

    def megabatch(self, site: Any, index: int) -> dict[str, torch.Tensor]:
        """File ``index`` of ``site``: ``{"states": [rows, seq, d], "input_ids": [rows, seq]}``
        in the stored dtypes."""
        return self.decode(site, index, self.fetch(site, index))

    def site_blocks(self, site: Site) -> list[Block]:
        """One block per megabatch file; ``loc = (file index,)``."""
        listing = self.listings[self._site_hooks[site]]
        n = listing.metadata.tokens_per_file
        return [Block(site=site, n_rows=n, loc=(i,)) for i in range(len(listing.files))]

    def n_rows(self, site: Any) -> int:
        listing = self.listings[self.hook_of(site)]
        return len(listing.files) * listing.metadata.tokens_per_file

    def read_block(self, block: Block, out: np.ndarray | None = None) -> np.ndarray:
        """Rows of ``block`` as ``[rows*seq, d]`` (float32 for bfloat16 stores)."""
        states = self.megabatch(block.site, block.loc[0])["states"]
        flat = states.reshape(-1, states.shape[-1])
        if out is None:
            out = np.empty(flat.shape, dtype=self.dtype)
        if out.shape != tuple(flat.shape):
            raise ConfigError(f"out has shape {out.shape}, the block is {tuple(flat.shape)}")
        torch.from_numpy(out).copy_(flat)
        return out

    def site_statistics(self, site: Site) -> RunningStats | None:
        """Exact statistics from statistics.json; None if absent or written by Activault
        (its file has no count, and its std leaves out within-batch variance)."""
        listing = self.listings[self._site_hooks[site]]
        key = join_key(listing.prefix, STATISTICS)
        exact = self.record is not None and self.checks.manifest is not None
        if self.store.size(key) is None:
            if exact:
                raise CorruptStoreError(
                    f"{self.store.url(key)} is missing, where actstore's writer stored the "
                    "hook's exact statistics: restore it or capture again"
                )
            return None
        return statistics_from_dict(
            self._json(f"{listing.hook}/{STATISTICS}"), source=self.store.url(key), exact=exact
        )


def auto_chunk(size: int, concurrency: int) -> int:
    """Range size that splits one file over every download thread, within 1-16 MiB.

    Example:
        >>> auto_chunk(64 << 20, 8) >> 20, auto_chunk(4 << 30, 100) >> 20
        (8, 16)
    """
    return int(min(16 * MiB, max(MiB, -(-size // concurrency))))


def check_megabatch(
    mb: dict[str, torch.Tensor], md: HookMetadata, source: str
) -> dict[str, torch.Tensor]:
    """Raise :class:`CorruptStoreError` unless ``mb`` matches ``md``'s shape and dtype."""
    states, ids = mb["states"], mb["input_ids"]
    if tuple(states.shape) != md.shape or states.dtype != parse_dtype(md.dtype):
        raise CorruptStoreError(
            f"{source} holds states {tuple(states.shape)} {states.dtype}, metadata.json says "
            f"{list(md.shape)} {md.dtype}"
        )
    if ids is not None and (tuple(ids.shape) != md.input_ids_shape or ids.dtype != torch.int64):
        raise CorruptStoreError(
            f"{source} holds input_ids {tuple(ids.shape)} {ids.dtype}, expected "
            f"{list(md.input_ids_shape)} torch.int64"
        )
    return mb
