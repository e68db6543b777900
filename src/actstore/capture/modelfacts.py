"""The model as its config.json describes it, read before any weights load
(:class:`ModelFacts`, :func:`read_model_config`; the hub's offline mode turned on when it
cannot be reached), and the capture's sites checked against it (:func:`check_sites`)."""

from __future__ import annotations

import logging
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from ..errors import ConfigError, StoreNotFoundError
from ..hub import EMBEDDED_MODEL, EMBEDDED_MODEL_ID, quiet_transformers, resolve_checkpoint
from ..sites import Site

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ModelFacts:
    """What config.json says, before any weights load."""

    ckpt: str
    """The name recorded in stores (the hub id for ``embedded``)."""
    path: str
    """What ``from_pretrained`` is given (a directory for ``embedded``)."""
    model_type: str
    family: str
    """``LoadedModel.family``: clip/siglip/dinov2 for vision towers, else the model type."""
    is_vision: bool
    has_cls: bool
    patch_size: int | None
    """Vision towers: pixels per patch side (tokens = patches + CLS)."""
    n_layers: int
    d_model: int
    vocab_size: int | None = None
    """Text models: rows of the input embedding (pre-tokenized ids must be below it)."""


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def go_offline_if_hub_unreachable(timeout: float = 3.0) -> None:
    """Turn on huggingface_hub's offline mode when its endpoint cannot be reached, so a
    model that is not cached fails at once instead of after minutes of retries."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return
    except OSError:
        pass
    log.debug("%s is unreachable; Hugging Face hub offline mode on", host)
    os.environ["HF_HUB_OFFLINE"] = "1"
    if "huggingface_hub" in sys.modules:
        sys.modules["huggingface_hub"].constants.HF_HUB_OFFLINE = True


def read_model_config(model: str) -> ModelFacts:
    """Read ``model``'s config.json (local directory, cache, or hub) without its weights."""
    path = resolve_checkpoint(model)
    local = Path(path).expanduser()
    if path.startswith(("/", ".", "~")) and not local.exists():
        raise StoreNotFoundError(
            f"--model {model}: no such directory; give a directory holding config.json "
            "or a Hugging Face model id"
        )
    if not local.is_dir():
        go_offline_if_hub_unreachable()
    from transformers import AutoConfig

    try:
        with quiet_transformers():
            config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        if Path(path).expanduser().exists():
            raise StoreNotFoundError(
                f"--model {model}: {path} holds no usable config.json ({err})"
            ) from None
        where = (
            "and the Hugging Face hub is unreachable (offline)"
            if _hub_offline()
            else "nor on the Hugging Face hub"
        )
        raise StoreNotFoundError(
            f"model {model!r} is not on this machine {where}; give a local model directory, "
            f"or download it first (`hf download {model}`) where there is network"
        ) from None
    vision = getattr(config, "vision_config", None) or config
    n_layers = getattr(vision, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    d_model = getattr(vision, "hidden_size", None) or getattr(config, "n_embd", None)
    if not n_layers or not d_model:
        raise ConfigError(f"--model {model}: config.json gives no layer count or hidden size")
    from .models import VISION_FAMILIES

    family = next(
        (name for name, (types, _) in VISION_FAMILIES.items() if config.model_type in types),
        config.model_type,
    )
    is_vision = family in VISION_FAMILIES
    return ModelFacts(
        ckpt=EMBEDDED_MODEL_ID if model == EMBEDDED_MODEL else model,
        path=path,
        model_type=config.model_type,
        family=family,
        is_vision=is_vision,
        has_cls=is_vision and VISION_FAMILIES[family][1],
        patch_size=getattr(vision, "patch_size", None) if is_vision else None,
        n_layers=int(n_layers),
        d_model=int(d_model),
        vocab_size=None if is_vision else _vocab_size(config),
    )


def _vocab_size(config: Any) -> int | None:
    value = getattr(config, "vocab_size", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def check_sites(sites: tuple[str, ...], facts: ModelFacts) -> tuple[Site, ...]:
    """Absolute sites as the model's family means them (a TransformerLens name means what it
    means there: BERT's ``hook_resid_post`` is ``resid_post``), each in range for the model's
    blocks and one its family has, none twice."""
    from .sitemap import check_sites as check_family

    resolved = check_family(facts.family, (Site.parse(s).resolve(facts.n_layers) for s in sites))
    for i, site in enumerate(resolved):
        if site in resolved[:i]:
            first = sites[resolved.index(site)]
            raise ConfigError(f"sites {first} and {sites[i]} both name {site}; give it once")
    return resolved
