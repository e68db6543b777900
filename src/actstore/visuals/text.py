"""Token contexts of text examples with one latent's activation highlighted.

Token ids come from the shards' ``tokens.bin``; they are turned back into text with the
tokenizer of the model named in the shards' metadata (the embedded default resolves to its
bundled copy). Each context is drawn as HTML spans and as a PNG strip; a token's
background is orange in proportion to its activation and the peak token is underlined.

Example:
    >>> pieces = TokenText.load("gpt2").pieces([464, 3797])  # doctest: +SKIP
    ['The', ' cat']
"""

from __future__ import annotations

import functools
import html
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

log = logging.getLogger(__name__)

HIGHLIGHT_RGB = (255, 140, 0)
_VISIBLE = {"\n": "⏎", "\t": "⇥", "\r": "␍"}


@functools.lru_cache(maxsize=8)
def font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    """Pillow's bundled scalable font at ``size`` pixels."""
    return ImageFont.load_default(size=size)


@dataclass
class TokenText:
    """Token id -> the text it stands for."""

    tokenizer: Any = None

    @classmethod
    def load(cls, ckpt: str) -> TokenText:
        """The tokenizer saved with ``ckpt``; without one, tokens show as ``<id>``."""
        from transformers import AutoTokenizer

        from ..capture.models import (
            EMBEDDED_MODEL,
            EMBEDDED_MODEL_ID,
            quiet_transformers,
            resolve_checkpoint,
        )

        try:
            path = resolve_checkpoint(EMBEDDED_MODEL) if ckpt == EMBEDDED_MODEL_ID else ckpt
            with quiet_transformers():
                return cls(AutoTokenizer.from_pretrained(path))
        except (OSError, ValueError, ImportError) as err:
            log.warning("no tokenizer for %s (%s); showing token ids", ckpt, err)
            return cls(None)

    def pieces(self, ids: list[int] | np.ndarray) -> list[str]:
        """The text each token adds in context (spaces included), whitespace made visible.

        Each piece is what decoding one more token appends, so word-piece, byte-level and
        sentencepiece tokenizers all show their real spacing; where the decoded prefix
        changes (a multi-byte character split over tokens) the token is shown alone.
        """
        ids = [int(i) for i in ids]
        if self.tokenizer is None:
            return [f"<{i}>" for i in ids]
        tokens = self.tokenizer.convert_ids_to_tokens(ids)
        out, before = [], ""
        for i, token in enumerate(tokens):
            text = self.tokenizer.decode(ids[: i + 1], clean_up_tokenization_spaces=False)
            if text.startswith(before):
                piece = text[len(before) :]
            else:
                piece = self.tokenizer.convert_tokens_to_string([token])
            before = text
            out.append("".join(_VISIBLE.get(ch, ch) for ch in piece) or "∅")
        return out


@dataclass(frozen=True)
class Context:
    """A window of one example's tokens with the latent's activation at each."""

    example: int
    peak_token: int
    pieces: list[str]
    values: np.ndarray
    start: int
    """Index of the first token shown."""


def context_html(context: Context, scale_max: float) -> str:
    """The context as HTML spans (escaped), highlighted by activation."""
    spans = []
    for offset, (piece, value) in enumerate(zip(context.pieces, context.values)):
        alpha = min(1.0, float(value) / scale_max) if value > 0 else 0.0
        style = (
            f"background:rgba({HIGHLIGHT_RGB[0]},{HIGHLIGHT_RGB[1]},{HIGHLIGHT_RGB[2]},{alpha:.2f})"
        )
        peak = ' class="peak"' if context.start + offset == context.peak_token else ""
        title = f"token {context.start + offset}: {value:.3g}"
        spans.append(
            f'<span{peak} style="{style}" title="{html.escape(title)}">{html.escape(piece)}</span>'
        )
    return "".join(spans)


def render_contexts(
    contexts: list[Context], *, scale_max: float, width: int = 900, size: int = 14
) -> Image.Image:
    """All contexts of one latent as a PNG: one block per example, wrapped to ``width``."""
    fnt = font(size)
    line_h = size + 8
    margin = 6
    lines: list[list[tuple[str, float, bool, float]]] = []  # (text, alpha, peak, x)
    labels: list[tuple[int, str]] = []
    for context in contexts:
        labels.append((len(lines), f"example {context.example}"))
        x = 0.0
        line: list[tuple[str, float, bool, float]] = []
        for offset, (piece, value) in enumerate(zip(context.pieces, context.values)):
            w = fnt.getlength(piece)
            if line and x + w > width - 2 * margin:
                lines.append(line)
                x, line = 0.0, []
            alpha = min(1.0, float(value) / scale_max) if value > 0 else 0.0
            line.append((piece, alpha, context.start + offset == context.peak_token, x))
            x += w
        lines.append(line)
    height = margin * 2 + len(lines) * line_h + len(contexts) * (line_h - 4)
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    y = margin
    label_at = dict(labels)
    for i, line in enumerate(lines):
        if i in label_at:
            draw.text((margin, y), label_at[i], fill=(90, 90, 90), font=font(size - 3))
            y += line_h - 4
        for piece, alpha, peak, x in line:
            w = fnt.getlength(piece)
            left = margin + x
            if alpha > 0:
                fill = tuple(round(255 + (c - 255) * alpha) for c in HIGHLIGHT_RGB)
                draw.rectangle((left, y, left + w, y + line_h - 3), fill=fill)
            draw.text((left, y + 2), piece, fill="black", font=fnt)
            if peak:
                draw.line((left, y + line_h - 3, left + w, y + line_h - 3), fill="black", width=2)
        y += line_h
    return image
