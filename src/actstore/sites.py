"""Where in a transformer an activation is taken: a :class:`Site` is (kind, layer).

Kinds:
  ``resid``     the residual stream after block ``layer`` (the block's output; saev's "layers")
  ``attn_out``  the attention sub-layer's output, before it is added to the residual
  ``mlp_out``   the MLP sub-layer's output, before it is added to the residual
  ``attn_in``   the attention sub-layer's input (after its layer norm)
  ``mlp_in``    the MLP sub-layer's input (after its layer norm)

Sites print as ``"kind.layer"`` (``"resid.3"``, ``"mlp_out.-1"``); negative layers count
from the end and are resolved to absolute indices with :func:`resolve_layers`.

Example:
    >>> Site.parse("mlp_out.-1").resolve(12)
    Site(kind='mlp_out', layer=11)
    >>> str(Site("resid", 3))
    'resid.3'
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .errors import ConfigError

SITE_KINDS = ("resid", "attn_out", "mlp_out", "attn_in", "mlp_in")


@dataclass(frozen=True, order=True)
class Site:
    """One activation site: ``kind`` (see module doc) at block ``layer``."""

    kind: str
    layer: int

    def __post_init__(self) -> None:
        if self.kind not in SITE_KINDS:
            raise ConfigError(
                f"unknown site kind {self.kind!r}; choose one of {', '.join(SITE_KINDS)}"
            )

    def __str__(self) -> str:
        return f"{self.kind}.{self.layer}"

    @classmethod
    def parse(cls, text: str | Site) -> Site:
        """Parse ``"kind.layer"``; a bare integer means the residual stream at that layer."""
        if isinstance(text, Site):
            return text
        text = str(text).strip()
        kind, _, layer = text.rpartition(".")
        if not kind:
            kind = "resid"
        try:
            number = int(layer)
        except ValueError as err:
            raise ConfigError(
                f"cannot parse site {text!r}; write it as kind.layer, e.g. resid.6 or mlp_out.-1"
            ) from err
        return cls(kind, number)

    def resolve(self, n_layers: int) -> Site:
        """Turn a negative layer into an absolute one, checking the range."""
        return Site(self.kind, resolve_layers([self.layer], n_layers)[0])


def resolve_layers(layers: Iterable[int], n_layers: int) -> list[int]:
    """Absolute, range-checked layer indices; duplicates are rejected.

    Example:
        >>> resolve_layers([-1, 0], 4)
        [3, 0]
    """
    out: list[int] = []
    for layer in layers:
        absolute = layer + n_layers if layer < 0 else layer
        if not 0 <= absolute < n_layers:
            raise ConfigError(
                f"layer {layer} is out of range for a model with {n_layers} blocks "
                f"(valid: 0..{n_layers - 1} or -{n_layers}..-1)"
            )
        if absolute in out:
            raise ConfigError(f"layer {layer} is given twice (as {absolute})")
        out.append(absolute)
    return out
