"""Where in a transformer an activation is taken: a :class:`Site` is (kind, layer).

Kinds (block ``L``; docs/sites.md maps each onto the modules of every supported family):
  ``resid_pre``  the residual stream entering block ``L`` (``hidden_states[L]``)
  ``resid_mid``  the residual stream between attention and MLP: ``resid_pre + attn_out``
  ``resid``      the output of block ``L`` (``hidden_states[L + 1]``; saev's "layers")
  ``attn_out``   what the attention sub-layer adds to the residual stream
  ``mlp_out``    what the MLP sub-layer adds to the residual stream
  ``attn_in``    the attention sub-layer's input (after its layer norm, if it has one)
  ``mlp_in``     the MLP sub-layer's input (after its layer norm)
  ``resid_post`` TransformerLens's ``hook_resid_post``: the residual sum after the MLP, before
                 any norm that closes the block. Only post-norm blocks (BERT) have such a
                 norm; elsewhere it is the block output and is stored as ``resid``

The canonical spelling is ``kind.layer`` (``resid.3``, ``mlp_out.-1``): ``str(site)`` prints
it, stores record it, and it means the same in every family. :meth:`Site.parse` also takes a
bare layer (``5`` = ``resid.5``) and TransformerLens hook names (``blocks.5.hook_resid_post``
= ``resid.5``, ``blocks.5.hook_resid_pre``, ``blocks.5.hook_mlp_in`` = ``resid_mid.5``,
``blocks.5.ln2.hook_normalized`` = ``mlp_in.5``, ...). A TransformerLens name means what it
means in TransformerLens for the model's family: :meth:`Site.in_family` turns it into the site
of that family (BERT's ``hook_resid_post`` is ``resid_post``, its ``ln2.hook_normalized`` the
block output). Negative layers count from the end and are resolved with :meth:`Site.resolve`.

Example:
    >>> Site.parse("mlp_out.-1").resolve(12)
    Site(kind='mlp_out', layer=11)
    >>> str(Site.parse("blocks.5.hook_resid_post")), str(Site.parse(5))
    ('resid.5', 'resid.5')
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from .errors import ConfigError

#: The kinds every mapped family has (docs/sites.md).
SITE_KINDS = ("resid", "attn_out", "mlp_out", "attn_in", "mlp_in", "resid_pre", "resid_mid")
#: Kinds only post-norm families (BERT) have apart from ``resid``: the sum entering the
#: block's closing LayerNorm. In other families :meth:`Site.in_family` makes it ``resid``.
POST_NORM_KINDS = ("resid_post",)
ALL_KINDS = SITE_KINDS + POST_NORM_KINDS

#: TransformerLens hook (``blocks.L.<hook>``) -> site kind with the same meaning.
TL_HOOKS = {
    "hook_resid_pre": "resid_pre",
    "hook_resid_mid": "resid_mid",
    "hook_resid_post": "resid",
    "hook_attn_out": "attn_out",
    "hook_mlp_out": "mlp_out",
    "hook_mlp_in": "resid_mid",  # TransformerLens: a copy of resid_mid, before ln2
    "hook_normalized_resid_post": "resid",  # BERT-style blocks: the block output
    "ln1.hook_normalized": "attn_in",  # pre-norm: the norm before attention
    "ln2.hook_normalized": "mlp_in",  # pre-norm: the norm before the MLP
}
#: What a TransformerLens hook means in a post-norm family, where it differs (TL's BertBlock:
#: ``ln1`` normalises ``resid_mid``, ``hook_resid_post`` is the sum ``ln2`` normalises into
#: the block output).
POST_NORM_TL_HOOKS = {
    "hook_resid_post": "resid_post",
    "ln1.hook_normalized": "mlp_in",
    "ln2.hook_normalized": "resid",
}
_TL_NAME = {kind: hook for hook, kind in TL_HOOKS.items() if hook.startswith("hook_resid_")}
_TL_NAME |= {"attn_out": "hook_attn_out", "mlp_out": "hook_mlp_out"}
_TL_NAME |= {"resid_post": "hook_resid_post"}

#: Families whose blocks end in a LayerNorm after the residual add (BERT-style): there,
#: TransformerLens's ``hook_resid_post`` is the sum *before* that norm (``resid_post``), and
#: the block output actstore stores as ``resid.L`` is ``hook_normalized_resid_post``.
POST_NORM_FAMILIES = frozenset({"bert"})

_SPELLINGS = "kind.layer (resid.6, mlp_out.-1), a layer (6) or blocks.6.hook_resid_post"
_TL_RE = re.compile(r"^blocks\.(-?\d+)\.(\w+(?:\.\w+)?)$")
_SITE_RE = re.compile(r"^(?:(\w+)\.)?(-?\d+)$")


@dataclass(frozen=True, order=True)
class Site:
    """One activation site: ``kind`` (see module doc) at block ``layer``."""

    kind: str
    layer: int
    tl: str = field(default="", compare=False, repr=False)
    """The TransformerLens hook it was spelled as (``hook_resid_post``), whose meaning
    depends on the family: see :meth:`in_family`."""

    def __post_init__(self) -> None:
        if self.kind not in ALL_KINDS:
            raise ConfigError(
                f"unknown site kind {self.kind!r}; choose one of {', '.join(ALL_KINDS)}"
            )

    def __str__(self) -> str:
        return f"{self.kind}.{self.layer}"

    @property
    def tl_name(self) -> str | None:
        """The TransformerLens hook name with this meaning in pre-norm models, if any."""
        hook = _TL_NAME.get(self.kind)
        return None if hook is None else f"blocks.{self.layer}.{hook}"

    def tl_name_in(self, family: str) -> str | None:
        """The TransformerLens hook name with this meaning in a model of ``family``: the
        block output of a post-norm family (BERT) is ``hook_normalized_resid_post``.

        Example:
            >>> Site("resid", 3).tl_name_in("bert"), Site("resid", 3).tl_name_in("gpt2")
            ('blocks.3.hook_normalized_resid_post', 'blocks.3.hook_resid_post')
            >>> Site("resid_post", 3).tl_name_in("bert")
            'blocks.3.hook_resid_post'
        """
        if self.kind == "resid" and family in POST_NORM_FAMILIES:
            return f"blocks.{self.layer}.hook_normalized_resid_post"
        return self.tl_name

    def in_family(self, family: str) -> Site:
        """The site this spelling means in a model of ``family``: a TransformerLens name
        means there what TransformerLens means by it (BERT's ``hook_resid_post`` is the sum
        before the closing LayerNorm, ``resid_post``), and ``resid_post`` of a pre-norm
        family is its block output, ``resid``.

        Example:
            >>> tl = Site.parse("blocks.3.hook_resid_post")
            >>> tl.in_family("bert"), tl.in_family("gpt2")
            (Site(kind='resid_post', layer=3), Site(kind='resid', layer=3))
            >>> Site.parse("blocks.3.ln1.hook_normalized").in_family("bert")
            Site(kind='mlp_in', layer=3)
        """
        if family in POST_NORM_FAMILIES:
            kind = POST_NORM_TL_HOOKS.get(self.tl)
            return self if kind is None else Site(kind, self.layer)
        if self.kind in POST_NORM_KINDS:
            return Site("resid", self.layer)
        return self

    @classmethod
    def parse(cls, text: str | int | Site) -> Site:
        """Parse any accepted spelling: ``kind.layer``, a layer, or a TransformerLens name."""
        if isinstance(text, Site):
            return text
        text = str(text).strip()
        if m := _TL_RE.match(text):
            hook, layer = m.group(2), int(m.group(1))
            if hook == "hook_attn_in":
                raise ConfigError(
                    f"{text} is TransformerLens's resid_pre repeated once per head; "
                    f"capture blocks.{layer}.hook_resid_pre (resid_pre.{layer}) instead"
                )
            if hook not in TL_HOOKS:
                raise ConfigError(
                    f"TransformerLens hook {hook!r} in {text!r} has no actstore site; "
                    f"use one of {', '.join(TL_HOOKS)}"
                )
            return cls(TL_HOOKS[hook], layer, tl=hook)
        m = _SITE_RE.match(text)
        if m is None:
            raise ConfigError(f"cannot parse site {text!r}; write it as {_SPELLINGS}")
        return cls(m.group(1) or "resid", int(m.group(2)))

    def resolve(self, n_layers: int) -> Site:
        """Turn a negative layer into an absolute one, checking the range."""
        return Site(self.kind, resolve_layers([self.layer], n_layers)[0], tl=self.tl)


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
