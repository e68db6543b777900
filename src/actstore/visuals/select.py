"""Which latents to show, and their highest-activating examples.

Latents are ranked by their total activation over the considered tokens (how much of the
SAE's output they carry); latents that never fire are skipped. For each latent the top
examples are the ones whose single highest-activating token is highest, one entry per
example, so a latent that fires on every patch of one image does not fill its row with
that image.

Example:
    >>> acts = SparseActs.from_dense(np.array([[0, 2.0], [1.0, 0], [0, 3.0], [0, 0]], np.float32))
    >>> tokens = TokenRows(rows_per_example=2, first_token=0, n_examples=2)
    >>> [s.latent for s in top_latents(acts, tokens, 2)]
    [1, 0]
    >>> top_examples(acts, 1, tokens, 5)
    [Example(example=1, token=0, value=3.0), Example(example=0, token=0, value=2.0)]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from ..sae.sparse import SparseActs


@dataclass(frozen=True)
class TokenRows:
    """How rows of the activation matrix map to (example, token)."""

    rows_per_example: int
    first_token: int
    n_examples: int
    skip_tokens: tuple[int, ...] = ()
    """Stored token indices to leave out of rankings (a CLS token, for image patches)."""

    def example(self, rows: np.ndarray) -> np.ndarray:
        return rows // self.rows_per_example

    def token(self, rows: np.ndarray) -> np.ndarray:
        return self.first_token + rows % self.rows_per_example

    def considered(self, rows: np.ndarray) -> np.ndarray:
        """Boolean mask of rows that take part in rankings."""
        if not self.skip_tokens:
            return np.ones(len(rows), dtype=bool)
        return ~np.isin(self.token(rows), self.skip_tokens)


@dataclass(frozen=True)
class LatentSummary:
    """One latent's firing statistics over the considered tokens."""

    latent: int
    count: int
    """Tokens it is active on."""
    total: float
    peak: float


@dataclass(frozen=True)
class Example:
    """One example's highest activation of a latent, and the token where it occurs."""

    example: int
    token: int
    value: float


def _considered_entries(acts: SparseActs, tokens: TokenRows) -> np.ndarray:
    rows = np.repeat(np.arange(acts.n_rows), np.diff(acts.indptr))
    return tokens.considered(rows)


def top_latents(acts: SparseActs, tokens: TokenRows, n: int) -> list[LatentSummary]:
    """The ``n`` latents with the largest total activation (ties: lower index first)."""
    keep = _considered_entries(acts, tokens)
    indices, data = acts.indices[keep], acts.data[keep]
    count = np.bincount(indices, minlength=acts.d_sae)
    total = np.bincount(indices, weights=data, minlength=acts.d_sae)
    order = np.lexsort((np.arange(acts.d_sae), -total))
    chosen = [int(i) for i in order if count[i] > 0][:n]
    return [summarise(acts, tokens, latent) for latent in chosen]


def summarise(acts: SparseActs, tokens: TokenRows, latent: int) -> LatentSummary:
    """Statistics of one latent (an error if it does not exist)."""
    if not 0 <= latent < acts.d_sae:
        raise ConfigError(f"latent {latent} does not exist; this SAE has 0..{acts.d_sae - 1}")
    rows, values = acts.column(latent)
    values = values[tokens.considered(rows)]
    return LatentSummary(
        latent=latent,
        count=len(values),
        total=float(values.sum()),
        peak=float(values.max()) if len(values) else 0.0,
    )


def top_examples(acts: SparseActs, latent: int, tokens: TokenRows, n: int) -> list[Example]:
    """Up to ``n`` examples with the highest peak activation of ``latent``."""
    rows, values = acts.column(latent)
    keep = tokens.considered(rows)
    rows, values = rows[keep], values[keep]
    order = np.lexsort((rows, -values))  # highest value first, then earliest row
    seen: set[int] = set()
    out: list[Example] = []
    for i in order:
        example = int(tokens.example(rows[i]))
        if example in seen:
            continue
        seen.add(example)
        out.append(
            Example(example=example, token=int(tokens.token(rows[i])), value=float(values[i]))
        )
        if len(out) == n:
            break
    return out


def example_activations(
    acts: SparseActs, latent: int, tokens: TokenRows, example: int
) -> np.ndarray:
    """Activation of ``latent`` at every row of ``example`` (``[rows_per_example]``)."""
    lo = example * tokens.rows_per_example
    out = np.zeros(tokens.rows_per_example, dtype=np.float32)
    for offset in range(tokens.rows_per_example):
        cols, vals = acts.row(lo + offset)
        hit = np.searchsorted(cols, latent)
        if hit < len(cols) and cols[hit] == latent:
            out[offset] = vals[hit]
    return out
