"""The options of :class:`~actstore.loader.ActivationLoader`: :class:`LoaderConfig`, checked
when made, the defaults it falls back on, and the rank and world size it resolves."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..formats.reading import SiteLike

#: Bytes of one shuffle window when ``pool_blocks`` is not given.
DEFAULT_POOL_BYTES = 256 << 20
#: Bytes of one run of consecutive blocks (one sequential read) when ``run_blocks`` is not given.
DEFAULT_RUN_BYTES = 16 << 20
NORMALIZE = ("standardize", "mean_norm")
OUT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class LoaderConfig:
    """Options of :class:`ActivationLoader` (all keyword-only)."""

    site: SiteLike | None = None
    """The site to read, in any spelling :meth:`actstore.sites.Site.parse` takes (``5``,
    ``"resid.5"``, ``"blocks.5.hook_resid_post"``, ``-1``) or the reader's own name. None:
    the store's only site. Batches are ``[B, D]``."""
    sites: tuple[SiteLike, ...] | None = None
    """Several sites aligned on the same tokens (crosscoders): batches ``[B, len(sites), D]``."""
    batch_size: int = 4096
    pool_blocks: int | None = None
    """Blocks per shuffle window (K). None: as many as fit in 256 MiB. Memory is about
    ``2 x K x block bytes x n_sites`` per consumer (one window served, one being read)."""
    run_blocks: int | None = None
    """Blocks are shuffled in runs of this many consecutive blocks (read as one sequential
    stretch). None: as many as fit in 16 MiB, at most ``pool_blocks``. 1 shuffles single
    blocks. Runs do not change how many examples a window mixes."""
    mix: int = 1
    """Split every block into this many slabs and fill a window with ``pool_blocks * mix``
    slabs of as many blocks: the same memory, rows from ``mix`` times as many examples per
    window (a batch's same-example pair rate drops about ``mix``-fold) at the cost of
    ``mix`` times smaller reads. On a store whose blocks hold whole examples of ``T``
    tokens (saev) slab ``j`` is tokens ``[j*T//mix, (j+1)*T//mix)`` of each example, so
    ``mix`` may be at most ``T``; elsewhere a slab is one of ``mix`` contiguous row ranges.
    1: whole blocks (the order of earlier versions). See :mod:`actstore.order`."""
    seed: int = 0
    epoch: int = 0
    """The epoch to start at (see :meth:`ActivationLoader.set_epoch`)."""
    drop_cls: bool = False
    """Leave out CLS-token rows (needs a reader that marks them, e.g. saev ViT stores)."""
    drop_last: bool = False
    """Serve only full batches; every rank then serves the same number of batches."""
    dtype: str = "float32"
    """Output dtype: ``float32``, ``bfloat16`` or ``float16``."""
    normalize: str | None = None
    """None, ``"standardize"`` (``(x - mean) / std`` per dimension, stored statistics) or
    ``"mean_norm"`` (every row times ``sqrt(D) / mean L2 norm``, so the mean norm is sqrt(D))."""
    rank: int | None = None
    """This process's rank; None: ``torch.distributed``'s if initialised, else 0."""
    world_size: int | None = None
    """Number of ranks; None: ``torch.distributed``'s if initialised, else 1."""
    io_threads: int = 4
    """Threads reading blocks in parallel (per consumer process)."""
    return_index: bool = False
    """Yield :class:`LoaderBatch` ``(acts, rows)`` with each row's storage index."""
    pin_memory: bool = False
    """Yield batches in pinned memory (needs CUDA): the batch buffers are registered with
    CUDA once, so batches are still views of them (no copy)."""
    device: str | None = None
    """Move batches there (``"cuda"``): pinned as above, each batch is copied on a side
    stream while the previous one is in use (see :mod:`actstore.loader.device`). Any other
    device: copied there on a background thread."""

    def __post_init__(self) -> None:
        if self.site is not None and self.sites is not None:
            raise ConfigError("give site (one) or sites (several), not both")
        if self.sites is not None:
            sites = tuple(self.sites)
            if not sites or len(set(sites)) != len(sites):
                raise ConfigError(f"sites must be distinct and non-empty, not {list(sites)}")
            object.__setattr__(self, "sites", sites)
        for name in ("batch_size", "io_threads", "mix"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, not {getattr(self, name)}")
        for name in ("pool_blocks", "run_blocks"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, not {getattr(self, name)}")
        if self.seed < 0 or self.epoch < 0:
            raise ConfigError("seed and epoch must be >= 0")
        if self.dtype not in OUT_DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(OUT_DTYPES)}, not {self.dtype!r}")
        if self.normalize is not None and self.normalize not in NORMALIZE:
            raise ConfigError(
                f"normalize must be None or one of {NORMALIZE}, not {self.normalize!r}"
            )
        if (
            self.pin_memory or (self.device and torch.device(self.device).type == "cuda")
        ) and not torch.cuda.is_available():
            raise ConfigError("pin_memory and device='cuda' need CUDA, which is not available")


def _rank_and_world(config: LoaderConfig) -> tuple[int, int]:
    rank, world = config.rank, config.world_size
    if rank is None or world is None:
        dist = torch.distributed
        initialised = dist.is_available() and dist.is_initialized()
        if rank is None:
            rank = dist.get_rank() if initialised else 0
        if world is None:
            world = dist.get_world_size() if initialised else 1
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world}")
    return rank, world
