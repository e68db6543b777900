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
    """Exact running sums for explained variance, MSE and L0.

    The sums stay on the inputs' device (float64) and are read only when a property is
    asked for, so accumulating never synchronises a GPU.
    """

    def __init__(self, d_model: int) -> None:
        self.d_model = d_model
        self.n = 0
        self._sums: dict[str, torch.Tensor] = {}

    def update(self, x: torch.Tensor, x_hat: torch.Tensor, f: torch.Tensor) -> None:
        """Add a batch: inputs ``x``, reconstructions ``x_hat``, latents ``f``."""
        x64 = x.detach().double()
        parts = {
            "sse": (x64 - x_hat.detach().double()).square().sum(),
            "sum_x": x64.sum(0),
            "sum_sq": x64.square().sum(),
            "active": (f.detach() > 0).sum(dtype=torch.float64),
        }
        for key, value in parts.items():
            self._sums[key] = self._sums[key] + value if key in self._sums else value
        self.n += x.shape[0]

    def _get(self, key: str) -> float:
        return float(self._sums[key]) if key in self._sums else 0.0

    @property
    def sse(self) -> float:
        return self._get("sse")

    @property
    def sst(self) -> float:
        if self.n == 0:
            return 0.0
        return self._get("sum_sq") - float(self._sums["sum_x"].square().sum()) / self.n

    @property
    def explained_variance(self) -> float:
        sst = self.sst
        return 1.0 - self.sse / sst if sst > 0 else float("nan")

    @property
    def mse(self) -> float:
        """Mean squared error per element, in the input's units."""
        return self.sse / max(self.n * self.d_model, 1)

    @property
    def l0(self) -> float:
        return self._get("active") / max(self.n, 1)


class DeadLatents:
    """Tokens since each latent last fired."""

    def __init__(self, d_sae: int, window: int, device: torch.device | str = "cpu") -> None:
        self.window = window
        self.seen = 0
        self.since_fired = torch.zeros(d_sae, dtype=torch.long, device=device)

    def update(self, f: torch.Tensor) -> None:
        fired = (f.detach() > 0).any(dim=0)
        self.since_fired += f.shape[0]
        self.since_fired.masked_fill_(fired, 0)  # no boolean indexing: no device sync
        self.seen += f.shape[0]

    @property
    def dead(self) -> torch.Tensor:
        """Boolean mask of dead latents."""
        return self.since_fired >= min(self.window, max(self.seen, 1))

    @property
    def fraction(self) -> float:
        return float(self.dead.float().mean())
