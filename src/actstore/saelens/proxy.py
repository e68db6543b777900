"""A SAELens model whose hook points are a store's TransformerLens hook names.

SAELens's ``HookedProxyLM`` names its hook points after the Hugging Face model's modules
(``model.layers.6``), so a hook name such as ``blocks.6.hook_resid_post``, the column of
an actstore saelens store, is not among them. :class:`StoreModel` is that proxy with one
hook point per column of the store, placed where actstore read the column
(:func:`actstore.capture.sitemap.tap_for`: a module's input or output inside block ``L``).
SAELens reads a hook point (``run_with_cache(names_filter=[hook])``) or replaces its value
(``run_with_hooks``, its reconstruction evaluations) as it would on a HookedTransformer.

The checkpoint is loaded on the first forward pass only: training from the cache never runs
the model, so no weights are read unless SAELens evaluates (which it does when logging to
W&B).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import torch
from sae_lens.load_model import HookedProxyLM, get_hook_fn
from transformer_lens.hook_points import HookPoint

from ..capture.models import _find_blocks
from ..capture.sitemap import Tap, tap_for
from ..formats.saelens import ColumnSite
from ..sites import Site


class StoreModel(HookedProxyLM):
    """``HookedProxyLM`` over ``model_name`` (loaded lazily) with hook points ``hooks``
    (TransformerLens hook name -> the actstore site it holds, blocks of a ``family`` model
    with ``n_layers`` blocks, 0: as its config says). A column a SAELens-written cache named
    after a Hugging Face module (a :class:`ColumnSite`) hooks that module's output, as
    ``HookedProxyLM`` does."""

    def __init__(
        self,
        model_name: str,
        hooks: Mapping[str, Site],
        *,
        family: str,
        n_layers: int,
        device: str | torch.device = "cpu",
        from_pretrained_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        super(HookedProxyLM, self).__init__()  # HookedRootModule's: no model to hook yet
        self.model_name = model_name
        self.family = family
        self.n_layers = n_layers
        self.sites = dict(hooks)
        self.cfg = SimpleNamespace(device=torch.device(device))
        self._from_pretrained = dict(from_pretrained_kwargs or {})
        self._tokenizer: Any = None
        self._allowed_hook_names = set(self.sites)
        self.hook_dict: dict[str, HookPoint] = {}
        for name in self.sites:
            point = HookPoint()
            point.name = name
            self.hook_dict[name] = point
        self.mod_dict = dict(self.hook_dict)
        self.named_modules_dict: dict[str, torch.nn.Module] = {}

    def setup(self) -> None:  # the hook points are made in __init__, placed in load()
        pass

    @property
    def tokenizer(self) -> Any:
        """The checkpoint's tokenizer (loaded on first use)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_name)
        return self._tokenizer

    @property
    def loaded(self) -> bool:
        """Whether the checkpoint's weights are loaded."""
        return "model" in self._modules

    def load(self) -> torch.nn.Module:
        """Load the checkpoint (once) and place each hook point at its site."""
        if self.loaded:
            return self._modules["model"]  # type: ignore[return-value]
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(self.model_name, **self._from_pretrained)
        if self._from_pretrained.get("device_map") is None:
            hf = hf.to(self.cfg.device)
        hf.eval()
        n_layers = self.n_layers or hf.config.get_text_config().num_hidden_layers
        blocks: Any = None
        for name, site in self.sites.items():
            if isinstance(site, ColumnSite):
                tap, module = Tap(name, "out"), hf.get_submodule(name)
            else:
                if blocks is None:
                    blocks = hf.get_submodule(_find_blocks(hf, n_layers))
                tap = tap_for(self.family, site)
                module = blocks[site.layer]
                if tap.path:
                    module = module.get_submodule(tap.path)
            point = self.hook_dict[name]
            if tap.io == "out":
                module.register_forward_hook(get_hook_fn(point))
            else:
                module.register_forward_pre_hook(_input_hook(point), with_kwargs=True)
            self.named_modules_dict[name] = module
        self.model = hf
        return hf

    def forward(self, tokens: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.load()
        return super().forward(tokens, *args, **kwargs)


def _input_hook(point: HookPoint) -> Any:
    """A forward pre-hook passing a module's hidden-states input through ``point``."""

    def hook(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if args:
            return (point(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": point(kwargs["hidden_states"])}

    return hook
