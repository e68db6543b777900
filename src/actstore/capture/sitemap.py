"""Which Hugging Face module each site kind is read from, per model family.

A :class:`Tap` names a module inside one transformer block (``""`` = the block itself) and
whether the site is that module's input (a forward pre-hook) or its output. The meanings
are TransformerLens's (see :mod:`actstore.sites`): ``attn_out``/``mlp_out`` are exactly what
is added to the residual stream, so ``resid_mid = resid_pre + attn_out`` and, in pre-norm
families, ``resid = resid_mid + mlp_out``; tests/test_sites.py checks every family against a
forward pass. docs/sites.md is the table in prose.

Example:
    >>> tap_for("gpt2", Site("resid_mid", 3))
    Tap(path='ln_2', io='in')
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from ..errors import ConfigError
from ..sites import Site


@dataclass(frozen=True)
class Tap:
    """Read a site at module ``path`` of a block: its input (``"in"``) or output (``"out"``)."""

    path: str
    io: Literal["in", "out"]


def _subs(resid_mid: str, attn: str, attn_out: str, mlp: str, mlp_out: str) -> dict[str, Tap]:
    return {
        "resid_mid": Tap(resid_mid, "in"),
        "attn_in": Tap(attn, "in"),
        "attn_out": Tap(attn_out, "out"),
        "mlp_in": Tap(mlp, "in"),
        "mlp_out": Tap(mlp_out, "out"),
    }


_LLAMA = _subs("post_attention_layernorm", "self_attn", "self_attn", "mlp", "mlp")
_CLIP = _subs("layer_norm2", "self_attn", "self_attn", "mlp", "mlp")

#: Family (``LoadedModel.family``) -> sub-layer taps. ``resid_pre``/``resid`` (the block's
#: input/output) work for every architecture and are not listed.
FAMILY_TAPS: dict[str, dict[str, Tap]] = {
    "gpt2": _subs("ln_2", "attn", "attn", "mlp", "mlp"),
    "llama": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _LLAMA,
    "mistral": _LLAMA,
    "gemma": _LLAMA,
    # Gemma 2 normalises each sub-layer's output before adding it to the residual stream.
    "gemma2": _subs(
        "pre_feedforward_layernorm",
        "self_attn",
        "post_attention_layernorm",
        "mlp",
        "post_feedforward_layernorm",
    ),
    "clip": _CLIP,
    "siglip": _CLIP,
    # DINOv2 scales each sub-layer's output (LayerScale) before the residual add.
    "dinov2": _subs("norm2", "attention", "layer_scale1", "mlp", "layer_scale2"),
    # Post-norm: resid_mid is the sum entering the attention block's closing LayerNorm, and
    # resid_post (TransformerLens's hook_resid_post) the sum entering the block's last one.
    "bert": _subs(
        "attention.output.LayerNorm",
        "attention",
        "attention.output.dense",
        "intermediate",
        "output.dense",
    )
    | {"resid_post": Tap("output.LayerNorm", "in")},
}

_BLOCK = {"resid_pre": Tap("", "in"), "resid": Tap("", "out")}


def tap_for(family: str, site: Site) -> Tap:
    """The module and side to read ``site`` (as :meth:`Site.in_family` reads it for
    ``family``) from, or a one-line :class:`ConfigError`."""
    site = site.in_family(family)
    if site.kind in _BLOCK:
        return _BLOCK[site.kind]
    taps = FAMILY_TAPS.get(family)
    if taps is None:
        raise ConfigError(
            f"{site.kind} sites are not mapped for the {family!r} architecture; capture "
            f"resid.N or resid_pre.N, or use one of: {', '.join(FAMILY_TAPS)}"
        )
    if site.kind not in taps:
        raise ConfigError(
            f"{site} has no module in the {family!r} architecture; it takes "
            f"{', '.join(sorted({*_BLOCK, *taps}))}"
        )
    return taps[site.kind]


def check_sites(family: str, sites: Iterable[Site]) -> tuple[Site, ...]:
    """The sites as ``family`` means them (:meth:`Site.in_family`: a TransformerLens name
    means what it means for that family), or :class:`ConfigError` for the first site
    ``family`` cannot provide. ``family`` is :func:`actstore.capture.models.model_family` of
    config.json's ``model_type``, so this runs before any weights load.

    Example:
        >>> check_sites("bert", [Site.parse("blocks.2.hook_resid_post")])
        (Site(kind='resid_post', layer=2),)
    """
    out = tuple(site.in_family(family) for site in sites)
    for site in out:
        tap_for(family, site)
    return out
