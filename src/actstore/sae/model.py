"""Sparse autoencoders over activation vectors: TopK and ReLU (trained with an L1 penalty).

Both share one architecture. An input ``x`` is first normalised with the statistics stored
beside the shards, ``x_n = (x - mean) * scale`` where ``scale = sqrt(d_model / sum(var))``
makes the mean squared norm of ``x_n`` equal ``d_model`` (each coordinate has unit variance
on average, so the per-element MSE of a reconstruction is about ``1 - explained variance``).
Then::

    pre   = (x_n - b_dec) @ W_enc + b_enc              # [B, d_sae]
    f     = TopK_k(ReLU(pre))   or   ReLU(pre)          # the latents
    x_hat = (f @ W_dec + b_dec) / scale + mean          # back in the input's units

Decoder rows have unit L2 norm (re-imposed after each optimiser step), so latent values
measure how much of each direction is present and an L1 penalty cannot be dodged by
shrinking ``f`` and growing ``W_dec``.

Example:
    >>> sae = SparseAutoencoder(SAEConfig(d_model=8, d_sae=32, kind="topk", k=4))
    >>> x = torch.randn(5, 8)
    >>> f = sae.encode(x)
    >>> f.shape, int((f > 0).sum(1).max()) <= 4
    (torch.Size([5, 32]), True)
    >>> sae.decode(f).shape
    torch.Size([5, 8])
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError

KINDS = ("topk", "relu")


@dataclass(frozen=True, kw_only=True)
class SAEConfig:
    """The architecture (everything needed to rebuild the module from its tensors)."""

    d_model: int
    """Width of the activations it reads."""
    d_sae: int
    """Number of latents (a multiple of ``d_model``: the expansion factor)."""
    kind: str = "topk"
    """``topk``: keep the ``k`` largest pre-activations; ``relu``: ReLU, sparsified by L1."""
    k: int = 32
    """Active latents per token (``topk`` only)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"SAE kind must be one of {KINDS}, not {self.kind!r}")
        if self.d_model < 1 or self.d_sae < 1:
            raise ConfigError(f"d_model and d_sae must be >= 1 (got {self.d_model}, {self.d_sae})")
        if self.kind == "topk" and not 1 <= self.k <= self.d_sae:
            raise ConfigError(f"k must be between 1 and d_sae={self.d_sae}, not {self.k}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SAEConfig:
        known = {"d_model", "d_sae", "kind", "k"}
        return cls(**{k: v for k, v in data.items() if k in known})


class SparseAutoencoder(nn.Module):
    """A TopK or ReLU sparse autoencoder with built-in input normalisation."""

    input_mean: torch.Tensor  # buffers, registered in __init__
    input_scale: torch.Tensor

    def __init__(self, config: SAEConfig) -> None:
        super().__init__()
        self.config = config
        d, n = config.d_model, config.d_sae
        w_dec = torch.randn(n, d)
        w_dec /= w_dec.norm(dim=1, keepdim=True)
        self.W_dec = nn.Parameter(w_dec)
        self.W_enc = nn.Parameter(w_dec.T.clone())  # tied initialisation
        self.b_enc = nn.Parameter(torch.zeros(n))
        self.b_dec = nn.Parameter(torch.zeros(d))
        self.register_buffer("input_mean", torch.zeros(d))
        self.register_buffer("input_scale", torch.ones(()))

    # ------------------------------------------------------------------ normalisation

    def set_normalisation(self, mean: Any, var: Any) -> None:
        """Use per-dimension ``mean`` and ``var`` (e.g. ``reader.statistics(layer)``)."""
        mean_t = torch.as_tensor(mean, dtype=torch.float64)
        total_var = float(torch.as_tensor(var, dtype=torch.float64).sum())
        if mean_t.shape != (self.config.d_model,):
            raise ConfigError(
                f"normalisation mean has shape {tuple(mean_t.shape)}, expected "
                f"({self.config.d_model},)"
            )
        if not total_var > 0:
            raise ConfigError("the stored activations have zero variance; nothing to learn")
        self.input_mean.copy_(mean_t.float())
        self.input_scale.fill_((self.config.d_model / total_var) ** 0.5)

    def normalise(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.input_mean) * self.input_scale

    def denormalise(self, x_n: torch.Tensor) -> torch.Tensor:
        return x_n / self.input_scale + self.input_mean

    # ------------------------------------------------------------------ forward

    def encode_normalised(self, x_n: torch.Tensor) -> torch.Tensor:
        """Latents ``[B, d_sae]`` of already-normalised inputs."""
        pre = torch.relu((x_n - self.b_dec) @ self.W_enc + self.b_enc)
        if self.config.kind == "relu":
            return pre
        values, indices = pre.topk(self.config.k, dim=-1, sorted=False)
        return torch.zeros_like(pre).scatter_(-1, indices, values)

    def topk_codes(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """TopK only: ``(values, indices)`` ``[B, k]`` of the latents of raw ``x``, indices
        ascending within each row (values may be 0 where fewer than k are positive)."""
        if self.config.kind != "topk":
            raise ConfigError("topk_codes needs a topk SAE")
        pre = torch.relu((self.normalise(x) - self.b_dec) @ self.W_enc + self.b_enc)
        values, indices = pre.topk(self.config.k, dim=-1, sorted=False)
        indices, order = indices.sort(dim=-1)
        return values.gather(-1, order), indices

    def decode_normalised(self, f: torch.Tensor) -> torch.Tensor:
        return f @ self.W_dec + self.b_dec

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Latent activations ``[B, d_sae]`` of raw activations ``x`` ``[B, d_model]``."""
        return self.encode_normalised(self.normalise(x))

    def decode(self, f: torch.Tensor) -> torch.Tensor:
        """Reconstruction in the input's units."""
        return self.denormalise(self.decode_normalised(f))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x_hat, f)`` for raw activations ``x``."""
        f = self.encode(x)
        return self.decode(f), f

    # ------------------------------------------------------------------ decoder constraint

    @torch.no_grad()
    def remove_parallel_grad(self) -> None:
        """Drop the part of ``W_dec.grad`` that would change the rows' norms."""
        if self.W_dec.grad is not None:
            along = (self.W_dec.grad * self.W_dec).sum(dim=1, keepdim=True)
            self.W_dec.grad -= along * self.W_dec

    @torch.no_grad()
    def normalise_decoder(self) -> None:
        """Rescale decoder rows to unit norm."""
        self.W_dec.div_(self.W_dec.norm(dim=1, keepdim=True).clamp_min(1e-12))
