"""Token cleaning: which tokens of a packed context are worth storing.

Activault drops, after the forward pass, the activations of tokens that would otherwise
make up a noisy, repetitive share of the data: padding, BOS/EOS and every other special or
added token (chat-template markers such as ``<|eot_id|>``), and each occurrence of the
chat template's default system prompt. The forward pass still sees them (the kept tokens'
activations are computed in full context); only storage skips them. Formats that honour
``Batch.token_mask`` (activault) then pack the kept tokens into equal-length rows, so each
file keeps the same shape.

Example:
    >>> cleaner = TokenCleaner(drop_ids=frozenset({0, 2}), sequences=((7, 8),))
    >>> cleaner.mask(np.array([[0, 5, 7, 8, 9, 2]])).astype(int).tolist()
    [[0, 1, 0, 0, 1, 0]]
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

#: A user message used to find where a chat template's fixed prefix ends.
_PROBE = "actstore-probe-message"


@dataclass(frozen=True)
class TokenCleaner:
    """Token ids to drop and token sequences (e.g. a default system prompt) to drop."""

    drop_ids: frozenset[int]
    sequences: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, *, system_prompt: bool = True) -> TokenCleaner:
        """Drop the tokenizer's special and added tokens and, with ``system_prompt``, the
        token sequence its chat template puts before the first user message."""
        ids: set[int] = set(getattr(tokenizer, "all_special_ids", []) or [])
        ids.update(int(i) for i in (getattr(tokenizer, "added_tokens_decoder", None) or {}))
        for attr in (
            "bos_token_id",
            "eos_token_id",
            "pad_token_id",
            "sep_token_id",
            "cls_token_id",
        ):
            value = getattr(tokenizer, attr, None)
            if isinstance(value, int):
                ids.add(value)
        sequences = []
        if system_prompt:
            prefix = template_prefix_ids(tokenizer)
            content = [t for t in prefix if t not in ids]
            if len(content) >= 1 and len(prefix) >= 2:
                sequences.append(tuple(prefix))
        log.info(
            "token cleaning drops %d special/added token ids%s",
            len(ids),
            f" and a {len(sequences[0])}-token chat-template prefix" if sequences else "",
        )
        return cls(drop_ids=frozenset(ids), sequences=tuple(sequences))

    def mask(self, token_ids: np.ndarray) -> np.ndarray:
        """Boolean ``[B, T]``: True for tokens to keep."""
        ids = np.asarray(token_ids)
        keep = ids >= 0  # negative ids are separators/padding in some collators (-100)
        if self.drop_ids:
            keep &= ~np.isin(ids, np.fromiter(self.drop_ids, dtype=np.int64))
        for seq in self.sequences:
            keep &= ~_occurrences(ids, np.asarray(seq, dtype=ids.dtype))
        return keep


def template_prefix_ids(tokenizer: Any) -> list[int]:
    """Token ids of the chat template's text before the first user message (for Llama 3:
    the begin-of-text, the default system block with its dates, the user header); empty
    when the tokenizer has no chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": _PROBE}], tokenize=False)
    except Exception as err:  # noqa: BLE001 - a template that cannot render has no prefix
        log.warning("cannot render the chat template (%s); not cleaning its prefix", err)
        return []
    head = text.split(_PROBE, 1)[0] if _PROBE in text else ""
    if not head:
        return []
    alone = tokenizer(head, add_special_tokens=False)["input_ids"]
    followed = tokenizer(head + _PROBE, add_special_tokens=False)["input_ids"]
    # Keep the tokens that do not depend on what follows (a trailing space usually merges
    # into the next word's token), so the sequence matches inside real conversations.
    n = 0
    while n < min(len(alone), len(followed)) and alone[n] == followed[n]:
        n += 1
    return list(alone[:n])


def _occurrences(ids: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """Boolean ``[B, T]``: True at every position covered by an occurrence of ``seq``."""
    n = len(seq)
    out = np.zeros(ids.shape, dtype=bool)
    if n == 0 or ids.shape[1] < n:
        return out
    windows = np.lib.stride_tricks.sliding_window_view(ids, n, axis=1)
    hits = (windows == seq).all(axis=-1)  # [B, T - n + 1]
    for k in range(n):
        out[:, k : k + hits.shape[1]] |= hits
    return out
