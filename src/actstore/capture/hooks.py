"""Record activations at chosen sites with forward hooks, stopping after the last block needed.

The recorder hooks the modules :mod:`actstore.capture.sitemap` names for each site. When the last
block that any requested site needs has run, its hook raises :class:`StopForward`, so no
compute is spent on the rest of the model (nor on an LM head, which is never loaded).

Example:
    >>> with ActivationRecorder(model, [Site("resid", 2)]) as rec:  # doctest: +SKIP
    ...     acts = rec.run({"input_ids": ids})  # {"resid.2": tensor[B, T, D]}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Self

import torch

from ..errors import ConfigError
from ..sites import Site
from .models import LoadedModel
from .sitemap import check_sites, tap_for


class StopForward(Exception):
    """Raised inside a hook to end the forward pass early (caught by the recorder)."""


def _first_tensor(value: Any) -> torch.Tensor:
    """Hooked modules return a tensor or a tuple whose first item is the hidden states."""
    return value[0] if isinstance(value, (tuple, list)) else value


class ActivationRecorder:
    """Context manager holding the hooks for ``sites`` on ``model``."""

    def __init__(self, model: LoadedModel, sites: Sequence[Site]) -> None:
        self.model = model
        self.sites = [s.resolve(model.n_layers) for s in sites]
        self.last_layer = max(s.layer for s in self.sites)
        if self.last_layer >= len(model.blocks):
            raise ConfigError(
                f"site {max(self.sites, key=lambda s: s.layer)} needs block {self.last_layer}, "
                f"but {model.ckpt} was loaded through block {len(model.blocks) - 1} only; "
                "load it with the sites to capture (load_model(..., sites=...))"
            )
        self.sites = list(check_sites(model.family, self.sites))  # as the family means them
        self._acts: dict[str, torch.Tensor] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> Self:
        for site in self.sites:
            self._handles.append(self._register(site))
        stop_block = self.model.blocks[self.last_layer]
        if all(s.kind == "resid_pre" for s in self.sites if s.layer == self.last_layer):
            # Only the last block's input is needed: stop before running it.
            self._handles.append(stop_block.register_forward_pre_hook(self._stop))
        else:
            self._handles.append(stop_block.register_forward_hook(self._stop))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _register(self, site: Site) -> torch.utils.hooks.RemovableHandle:
        name = str(site)
        tap = tap_for(self.model.family, site)
        module = self.model.blocks[site.layer]
        if tap.path:
            module = module.get_submodule(tap.path)

        def save_output(_module, _args, output):
            self._acts[name] = _first_tensor(output)

        def save_input(_module, args, kwargs):
            self._acts[name] = args[0] if args else kwargs["hidden_states"]

        if tap.io == "out":
            return module.register_forward_hook(save_output)
        return module.register_forward_pre_hook(save_input, with_kwargs=True)

    def _stop(self, *_: object) -> None:
        raise StopForward

    def run(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Forward ``inputs`` and return ``{site name: tensor[B, T, D]}`` on the model device."""
        self._acts = {}
        extra = {"use_cache": False} if self.model.modality == "text" else {}
        try:
            self.model.module(**inputs, **extra)
        except StopForward:
            pass
        acts, self._acts = self._acts, {}
        missing = [str(s) for s in self.sites if str(s) not in acts]
        assert not missing, f"hooks did not fire for {missing}"
        return acts
