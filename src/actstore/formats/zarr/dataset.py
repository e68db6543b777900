"""A torch map-style Dataset of the zarr store's training pattern: random samples, each
at a few random layers (see :class:`ZarrPairDataset`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ...errors import ConfigError
from .layout import PARTS


class ZarrPairDataset(torch.utils.data.Dataset):
    """torch map-style Dataset of the training pattern: item ``i`` is sample ``i`` at
    ``n_layers`` distinct layers drawn from ``(seed, epoch, i)``.

    Items are ``{"acts": float16 [n_layers, T, H], "length": int, "layers": int64
    [n_layers], "index": int}``, with ``T = R_max``/``P_max`` (fixed shape; the default
    collate stacks them) or the sample's own length with ``trim``. Indexing with a list of
    indices returns the batch directly (``acts [b, n_layers, T, H]``, read into one array,
    no stacking): :meth:`loader` builds that DataLoader. Call :meth:`set_epoch` to draw new
    layers each epoch. DataLoader workers each get their own pickled copy of the reader.

    Example:
        >>> import tempfile
        >>> from actstore.formats import open_store
        >>> from actstore.testing import FormatCase, make_acts, make_batches, make_plan
        >>> plan, out = make_plan(), tempfile.TemporaryDirectory()  # 6-token prompts
        >>> batches = make_batches(plan, make_acts(plan))
        >>> reader = open_store(FormatCase("zarr").write(out.name, plan, batches))
        >>> ds = reader.dataset("prompt")
        >>> loader = torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True,
        ...                                      num_workers=2)  # per item
        >>> next(iter(loader))["acts"].shape  # [b, n_layers, P_max, H]
        torch.Size([4, 2, 6, 8])
        >>> loader = ds.loader(4, num_workers=2)  # per batch, faster
    """

    def __init__(
        self,
        reader: Any,
        *,
        part: str = "response",
        n_layers: int = 2,
        seed: int = 0,
        trim: bool = False,
    ) -> None:
        if part not in PARTS:
            raise ConfigError(f"part must be 'prompt' or 'response', not {part!r}")
        if not 1 <= n_layers <= reader.layout.n_layers:
            raise ConfigError(f"n_layers must lie in 1..{reader.layout.n_layers}, not {n_layers}")
        self.reader, self.part, self.n_layers = reader, part, n_layers
        self.seed, self.trim, self.epoch = seed, trim, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.reader)

    def layers_of(self, i: int) -> np.ndarray:
        """Layer positions drawn for item ``i`` this epoch."""
        rng = np.random.default_rng((self.seed, self.epoch, int(i)))
        return rng.choice(self.reader.layout.n_layers, size=self.n_layers, replace=False)

    def __getitem__(self, index: int | Sequence[int]) -> dict[str, Any]:
        samples = np.atleast_1d(np.asarray(index, dtype=np.int64))
        idx = np.stack([self.layers_of(i) for i in samples])
        acts, lengths = self.reader.read_batch_index(samples, idx, self.part, self.trim)
        layers = np.asarray(self.reader.layout.layers)[idx]
        if isinstance(index, (int, np.integer)):
            return {
                "acts": torch.from_numpy(acts[0]),
                "length": int(lengths[0]),
                "layers": torch.from_numpy(layers[0]),
                "index": int(index),
            }
        return {
            "acts": torch.from_numpy(acts),
            "length": torch.from_numpy(lengths.astype(np.int64)),
            "layers": torch.from_numpy(layers),
            "index": torch.from_numpy(samples),
        }

    def loader(
        self,
        batch_size: int,
        *,
        shuffle: bool = True,
        drop_last: bool = False,
        generator: torch.Generator | None = None,
        **kwargs: Any,
    ) -> torch.utils.data.DataLoader:
        """A DataLoader whose workers read whole batches (one array each, no collate copy);
        ``kwargs`` go to DataLoader (``num_workers``, ``pin_memory``...)."""
        order = (
            torch.utils.data.RandomSampler(self, generator=generator)
            if shuffle
            else torch.utils.data.SequentialSampler(self)
        )
        batches = torch.utils.data.BatchSampler(order, batch_size, drop_last)
        return torch.utils.data.DataLoader(self, sampler=batches, batch_size=None, **kwargs)
