"""Every stored row of one layer, in storage order, in batches (for evaluation and inference).

Training reads shuffled rows through :mod:`actstore.loader`; evaluation and inference need
each row exactly once and in order, so they read the store's blocks sequentially.

Example:
    >>> import tempfile
    >>> from actstore.testing import FormatCase, make_acts, make_batches, make_plan
    >>> plan, out = make_plan(has_cls=True), tempfile.TemporaryDirectory()  # 23 x 6 tokens
    >>> batches = make_batches(plan, make_acts(plan))
    >>> reader = SaevReader(FormatCase("saev").write(out.name, plan, batches))
    >>> for rows in ordered_rows(reader, layer=3, tokens="content", batch_rows=64):
    ...     rows.acts.shape, int(rows.example[0]), int(rows.token[0])
    ((65, 8), 0, 1)
    ((50, 8), 13, 1)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from ..formats.saev import SaevReader

TOKEN_CHOICES = ("all", "content")


@dataclass(frozen=True)
class Rows:
    """A run of consecutive stored rows: ``acts [n, D]`` and where each row came from."""

    acts: np.ndarray
    example: np.ndarray
    token: np.ndarray


def token_positions(reader: SaevReader, tokens: str) -> np.ndarray:
    """Token indices kept per example: all, or all but a leading CLS (``content``).

    Example:
        >>> import tempfile
        >>> from actstore.testing import FormatCase, make_acts, make_batches, make_plan
        >>> plan, out = make_plan(has_cls=True), tempfile.TemporaryDirectory()  # CLS at 0
        >>> batches = make_batches(plan, make_acts(plan))
        >>> reader = SaevReader(FormatCase("saev").write(out.name, plan, batches))
        >>> token_positions(reader, "content"), token_positions(reader, "all")
        (array([1, 2, 3, 4, 5]), array([0, 1, 2, 3, 4, 5]))
    """
    if tokens not in TOKEN_CHOICES:
        raise ConfigError(f"tokens must be one of {TOKEN_CHOICES}, not {tokens!r}")
    start = 1 if tokens == "content" and reader.metadata.cls_token else 0
    return np.arange(start, reader.tokens_per_ex)


def ordered_rows(
    reader: SaevReader, layer: int, *, tokens: str = "all", batch_rows: int = 8192
) -> Iterator[Rows]:
    """Rows of ``layer`` in storage order (example-major), about ``batch_rows`` at a time."""
    keep = np.zeros(reader.tokens_per_ex, dtype=bool)
    keep[token_positions(reader, tokens)] = True
    parts: list[Rows] = []
    n = 0
    for block in reader.blocks(layer):
        acts = reader.read_block(block)
        example, token = reader.block_rows(block)
        mask = keep[token]
        parts.append(Rows(acts[mask], example[mask], token[mask]))
        n += int(mask.sum())
        if n >= batch_rows:
            yield _join(parts)
            parts, n = [], 0
    if parts:
        yield _join(parts)


def _join(parts: list[Rows]) -> Rows:
    if len(parts) == 1:
        return parts[0]
    return Rows(
        np.concatenate([p.acts for p in parts]),
        np.concatenate([p.example for p in parts]),
        np.concatenate([p.token for p in parts]),
    )
