"""Training and evaluation metrics: reconstruction, sparsity and dead latents.

``explained variance`` is ``1 - SSE / SST`` over all rows seen, with ``SST`` the total
squared deviation of the inputs from their mean; it is accumulated exactly in float64, so
evaluating in any batch size gives the same number. ``L0`` is the mean number of active
latents per token. A latent is *dead* when it has not fired on the last ``window`` tokens
(or on any token, before ``window`` tokens have been seen).

Example:
    >>> stats = ReconstructionStats(d_model=2)
    >>> x = torch.tensor([[1.0, 0.0], [-1.0, 0.0]])
    >>> stats.update(x, x * 0.5, torch.ones(2, 3))
    >>> round(stats.explained_variance, 3), stats.l0
    (0.75, 3.0)
"""

from __future__ import annotations

import torch


class ReconstructionStats:
    """Exact running sums for explained variance, MSE and L0."""

    def __init__(self, d_model: int) -> None:
        self.n = 0
        self.sse = 0.0
        self.sum_x = torch.zeros(d_model, dtype=torch.float64)
        self.sum_sq = 0.0
        self.active = 0

    def update(self, x: torch.Tensor, x_hat: torch.Tensor, f: torch.Tensor) -> None:
        """Add a batch: inputs ``x``, reconstructions ``x_hat``, latents ``f``."""
        x64 = x.detach().double()
        self.n += x.shape[0]
        self.sse += float((x64 - x_hat.detach().double()).square().sum())
        self.sum_x += x64.sum(0).cpu()
        self.sum_sq += float(x64.square().sum())
        self.active += int((f.detach() > 0).sum())

    @property
    def sst(self) -> float:
        if self.n == 0:
            return 0.0
        return self.sum_sq - float(self.sum_x.square().sum()) / self.n

    @property
    def explained_variance(self) -> float:
        return 1.0 - self.sse / self.sst if self.sst > 0 else float("nan")

    @property
    def mse(self) -> float:
        """Mean squared error per element, in the input's units."""
        return self.sse / max(self.n * self.sum_x.numel(), 1)

    @property
    def l0(self) -> float:
        return self.active / max(self.n, 1)


class DeadLatents:
    """Tokens since each latent last fired."""

    def __init__(self, d_sae: int, window: int, device: torch.device | str = "cpu") -> None:
        self.window = window
        self.seen = 0
        self.since_fired = torch.zeros(d_sae, dtype=torch.long, device=device)

    def update(self, f: torch.Tensor) -> None:
        fired = (f.detach() > 0).any(dim=0)
        self.since_fired += f.shape[0]
        self.since_fired[fired] = 0
        self.seen += f.shape[0]

    @property
    def dead(self) -> torch.Tensor:
        """Boolean mask of dead latents."""
        return self.since_fired >= min(self.window, max(self.seen, 1))

    @property
    def fraction(self) -> float:
        return float(self.dead.float().mean())
