"""Checks that run before a capture loads model weights, cheapest first.

In order: the writer's settings from the environment (``ACTSTORE_WRITER_THREADS``,
``ACTSTORE_WRITER_STREAMS``, ``ACTSTORE_DIRECT_IO``) are well formed; the output location
is not inside a store and is a writable directory (not a
file); the ``--device`` exists here (a CUDA device needs a CUDA build of torch and a visible
GPU); the dataset exists and is readable; the model's config.json is on this machine (or the
hub answers) and every site fits it (its layer, and a sub-layer the model family has); a
prompt/response capture is of a language model over prompt/response records (read); the
format stores every site; ``--out`` holds nothing the format would write into (a store of
another format, foreign files; see :func:`check_out_target`); then the store's plan is worked
out from config.json, the tokenizer or image processor, and the dataset alone (read and
tokenised only as far as the budget needs, and kept for the capture, which does not read it
again), which gives the store's location and size: a store that is already complete is
reported at once, and a disk without room for what remains to be written is refused
(``space_check=False`` skips that). Each failure is one
:class:`~actstore.errors.ActstoreError` line; the store's writer is opened only after every
other check has passed.

Prompt/response captures get the checks up to the sites only: their plan may need the
model itself (generated responses).

Example:
    >>> pre = preflight(config, get_format("saev"), "actstore-data", options)  # doctest: +SKIP
    >>> pre.complete  # doctest: +SKIP
    True
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from ..batch import CapturePlan
from ..errors import ConfigError, OtherCaptureError, StorageError, StoreNotFoundError
from ..formats.identity import explain_other_capture
from ..formats.threads import check_settings
from ..formats.writerbase import WriterBase
from ..hub import EMBEDDED_MODEL, EMBEDDED_MODEL_ID, quiet_transformers, resolve_checkpoint
from ..sites import Site
from .data import ExampleSource
from .identity import weights_identity
from .runner import CaptureConfig

log = logging.getLogger(__name__)

#: Bytes per stored value, by the format's stored dtype.
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


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


def is_url(location: str) -> bool:
    """True for ``s3://...`` and other URLs (no local checks apply)."""
    return "://" in str(location)


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_output(out: str, what: str = "--out") -> None:
    """``out`` (named ``what`` in messages) is a directory, or can be created, and a file
    can be written there."""
    if is_url(out):
        return
    path = Path(out).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise ConfigError(
            f"{what} {out} is an existing file; give a directory (it is created if missing)"
        )
    base = _nearest_existing(path)
    if not base.is_dir():
        raise ConfigError(f"{what} {out} cannot be created: {base} is a file, not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".actstore-write-test-", dir=base)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ConfigError(
            f"{what} {out} is not writable ({base}: {err.strerror or err}); "
            "choose a directory you can write to"
        ) from None


#: The file every store actstore publishes holds (``actstore.storage.manifest``).
_ROOT_MANIFEST = "actstore-manifest.json"


def _store_markers() -> frozenset[str]:
    """Names whose presence at the top of a directory makes it worth asking every format
    whether it is a store (asking lists the whole tree): the root manifest and each
    format's :attr:`~actstore.formats.registry.FormatSpec.store_markers`."""
    from ..formats.registry import available_formats

    return frozenset({_ROOT_MANIFEST, *(m for s in available_formats() for m in s.store_markers)})


def _store_at(path: Path, markers: frozenset[str] | None = None) -> str | None:
    """The format of the store at ``path`` ("unfinished" for a writer's partial
    directory), or None; only a directory holding one of ``markers`` is asked."""
    from ..storage.location import final_of_partial

    if final_of_partial(path.name) is not None:
        return "unfinished"
    try:
        names = set(os.listdir(path))
    except OSError:
        return None
    if not names or not names & (_store_markers() if markers is None else markers):
        return None
    from ..formats.registry import format_of

    spec = format_of(path)
    if spec is not None:
        return spec.name
    return "actstore" if _ROOT_MANIFEST in names else None


def check_not_inside_a_store(out: str, what: str = "--out") -> None:
    """``out`` (named ``what``) is not inside a store or an unfinished one: whatever is
    written there would change a store it does not belong to."""
    if is_url(out):
        return
    path = Path(out).expanduser().absolute()
    for parent in path.parents:  # a store actstore published (asking lists the whole tree)
        kind = _store_at(parent, frozenset({_ROOT_MANIFEST}))
        if kind is None:
            continue
        if kind == "unfinished":
            raise ConfigError(
                f"{what} {out} is inside {parent}, an unfinished capture's directory; "
                "give a directory outside it"
            )
        raise ConfigError(
            f"{what} {out} is inside the {kind} store {parent}; writing there would change "
            "that store: give a directory outside it"
        )


def probe_plan(facts: ModelFacts, sites: tuple[Site, ...]) -> CapturePlan:
    """A one-example plan of ``facts`` and ``sites``, to ask a format's writer what it
    would do (store nothing with it)."""
    return CapturePlan(
        ckpt=facts.ckpt,
        family=facts.family,
        modality="image" if facts.is_vision else "text",
        sites=sites,
        n_model_layers=facts.n_layers,
        d_model=facts.d_model,
        tokens_per_example=2,
        has_cls=False,
        n_examples=1,
        dataset_root="",
        data={},
        classes=None,
        has_labels=False,
        has_tokens=False,
        batch_size=1,
    )


def _writer_refusal(spec: Any, plan: CapturePlan, options: Any) -> ConfigError | None:
    """What format ``spec``'s writer says of ``plan``, opened in a scratch directory and
    aborted (None: it takes it)."""
    from ..errors import ActstoreError

    quiet = logging.root.manager.disable
    logging.disable(logging.INFO)  # a probe is not news
    try:
        with tempfile.TemporaryDirectory(prefix="actstore-preflight-") as scratch:
            try:
                writer = spec.open_writer(plan, os.path.join(scratch, "out"), options)
            except ConfigError as err:
                return err
            except ActstoreError:
                return None  # not about the sites: the real writer says it in its turn
            writer.abort()
            return None
    finally:
        logging.disable(quiet)


def check_format_takes_sites(
    spec: Any, options: Any, facts: ModelFacts, sites: tuple[Site, ...]
) -> None:
    """Format ``spec`` stores every site (saev and pkl.gz: the residual stream only), or
    its writer's one-line refusal, before the dataset is read or the model loads."""
    if all(site.kind == "resid" for site in sites):
        return
    refusal = _writer_refusal(spec, probe_plan(facts, sites), options)
    if refusal is None:
        return
    resid = tuple(site for site in sites if site.kind == "resid")
    if resid and _writer_refusal(spec, probe_plan(facts, resid), options) is not None:
        return  # refused for another reason, which the probe plan may not show
    raise refusal


def check_out_target(
    out: str, spec: Any, options: Any, plan: CapturePlan, what: str = "--out"
) -> None:
    """What ``out`` (named ``what``) holds fits what format ``spec`` does with it, or one
    line: a format whose store is the output itself (pkl.gz, SAELens, Activault, zarr's
    ``*.zarr``) takes a new or empty directory, or its own store there (finished:
    reported; unfinished: resumed; another capture's: refused by the writer); a format that
    writes its store under the output as a root (saev's ``<hash>``, zarr's
    ``activations.zarr``) takes any directory that is not itself a store. A store of
    another format, or foreign files, are never written into. ``plan`` is the capture's
    (or :func:`probe_plan`'s: where the store goes depends on the format, not the data)."""
    if is_url(out):
        return
    path = Path(out).expanduser().absolute()
    if not path.is_dir():
        return
    from ..storage.location import Location

    try:
        store = Location.parse(spec.writer.store_location(plan, Location.parse(path), options))
        at_out = store.path() == path
    except ConfigError:
        store, at_out = None, True
    kind = _store_at(path)
    if at_out:
        if kind == spec.name:
            return  # its own store: finished (reported), unfinished or another capture
        if kind is None and not any(path.iterdir()):
            return
        held = f"the {kind} store" if kind else "files that are not a store"
        raise ConfigError(
            f"{what} {out} holds {held}; a {spec.name} store is written at {what} itself, "
            "never into other files: give a new or empty directory"
        )
    if kind is not None:
        raise ConfigError(
            f"{what} {out} is a {kind} store, not an output root; a {spec.name} store is "
            f"written inside {what}: give the store's parent or a new directory"
        )
    store_path = store.path() if store is not None else path
    inner = _store_at(store_path) if store_path.is_dir() else None
    if inner is not None and inner != spec.name:
        raise ConfigError(
            f"{what} {out}: {store_path}, where the {spec.name} store goes, is a {inner} "
            "store; give another directory"
        )


def check_device(device: str) -> None:
    """``device`` names a torch device this machine has (torch loads only for a non-CPU
    device); a device map strategy (``auto``...) is refused, naming ``--device-map``."""
    if device == "cpu":
        return
    from .placement import STRATEGIES

    if device in STRATEGIES:
        raise ConfigError(
            f"--device {device} is a device map strategy, not a device; use --device-map "
            f"{device} (it spreads the model over this machine's devices)"
        )
    import torch

    try:
        kind = torch.device(device)
    except (RuntimeError, ValueError):
        raise ConfigError(
            f"--device {device!r} is not a torch device; use cpu, cuda, cuda:N or mps"
        ) from None
    if kind.type == "cuda":
        _check_cuda(device, kind.index)
    elif kind.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"--device {device}: MPS is not available here; use --device cpu")


def _check_cuda(device: str, index: int | None) -> None:
    import torch

    if not torch.cuda.is_available():
        why = (
            f"this torch ({torch.__version__}) is a CPU-only build"
            if torch.version.cuda is None
            else "no CUDA device is visible (CUDA_VISIBLE_DEVICES, driver)"
        )
        raise ConfigError(
            f"--device {device}: {why}; use --device cpu, or run where torch sees a GPU"
        )
    count = torch.cuda.device_count()
    if index is not None and index >= count:
        raise ConfigError(
            f"--device {device}: this machine has {count} CUDA device(s), cuda:0 to "
            f"cuda:{count - 1}"
        )


def check_dataset(dataset: str) -> None:
    """The dataset path exists and can be read (``embedded`` always can)."""
    from .data import KINDS_HINT, looks_like_hub_id

    if dataset == "embedded" or looks_like_hub_id(dataset):
        return  # Hub ids are checked (offline: at once) when the source opens
    path = Path(dataset).expanduser()
    if not path.exists():
        raise StoreNotFoundError(f"dataset {dataset} does not exist; {KINDS_HINT} (org/name)")
    try:
        if path.is_dir():
            os.listdir(path)
        else:
            with path.open("rb") as f:
                f.read(1)
    except OSError as err:
        raise ConfigError(f"dataset {dataset} is not readable ({err.strerror or err})") from None


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


def check_prompt_response(config: CaptureConfig, facts: ModelFacts) -> None:
    """A prompt/response capture is of a language model over prompt/response records: a
    ``.jsonl`` file or a ``save_to_disk`` directory whose records have the prompt field
    (and the response field, unless responses are generated). Read without the model."""
    if facts.is_vision:
        raise ConfigError(
            f"--mode prompt-response needs a language model; {config.model} is a "
            f"{facts.family} vision model"
        )
    path = Path(config.dataset).expanduser()
    saved = path.is_dir() and any(
        (path / name).exists() for name in ("dataset_info.json", "dataset_dict.json")
    )
    if not saved and not (path.is_file() and path.suffix == ".jsonl"):
        raise ConfigError(
            "--mode prompt-response: prompt/response datasets are .jsonl files or directories "
            f"saved by datasets' save_to_disk; {config.dataset} is neither"
        )
    from .prompts import read_records

    read_records(
        config.dataset,
        prompt_field=config.prompt_field,
        response_field=None
        if config.generate_max_new_tokens is not None
        else config.response_field,
        split=config.split,
        max_examples=config.max_examples,
    )


def _stand_in(facts: ModelFacts, tokenizer: Any = None, image_processor: Any = None):
    """What the dataset code needs of a model (modality, name, tokenizer or image
    processor), with no weights: an empty module in place of the network."""
    import torch

    from .models import LoadedModel

    return LoadedModel(
        module=torch.nn.Module(),
        ckpt=facts.ckpt,
        family=facts.family,
        modality="image" if facts.is_vision else "text",
        blocks=torch.nn.ModuleList(),
        n_layers=facts.n_layers,
        d_model=facts.d_model,
        has_cls=facts.has_cls,
        device=torch.device("cpu"),
        dtype=torch.float32,
        tokenizer=tokenizer,
        image_processor=image_processor,
    )


def _image_tokens(source: Any, facts: ModelFacts) -> int:
    """Tokens per image: the processor's output size in patches, plus the CLS token."""
    first = next(source.batches(0, 1))
    height, width = first.inputs["pixel_values"].shape[-2:]
    return (height // facts.patch_size) * (width // facts.patch_size) + int(facts.has_cls)


def weightless_plan(
    config: CaptureConfig, facts: ModelFacts, sites: tuple[Site, ...]
) -> tuple[CapturePlan, ExampleSource]:
    """The plan capture will make (packed mode), from config.json, the tokenizer or image
    processor, and the dataset only; and the opened source, for capture to take over."""
    from transformers import AutoImageProcessor, AutoTokenizer

    from .runner import packed_source, source_plan

    loader: Any = AutoImageProcessor if facts.is_vision else AutoTokenizer
    try:
        with quiet_transformers():
            helper = loader.from_pretrained(facts.path)
    except OSError:
        what = "image processor config" if facts.is_vision else "tokenizer files"
        raise StoreNotFoundError(
            f"{facts.path!r} has no {what}; save them next to the model"
        ) from None
    model = (
        _stand_in(facts, image_processor=helper) if facts.is_vision else _stand_in(facts, helper)
    )
    source = packed_source(config, model, facts.vocab_size)
    token_ids = source.token_ids
    if source.tokens_per_example is not None:
        tokens = int(source.tokens_per_example)
    elif token_ids is not None:
        tokens = int(token_ids.shape[1])
    elif facts.patch_size:
        tokens = _image_tokens(source, facts)
    else:
        raise ConfigError(f"--model {config.model}: config.json gives no patch size")
    weights = weights_identity(config.model, last_block=max(site.layer for site in sites))
    plan = source_plan(
        config,
        source,
        weights=weights,
        ckpt=facts.ckpt,
        family=facts.family,
        modality=model.modality,
        sites=sites,
        n_layers=facts.n_layers,
        d_model=facts.d_model,
        tokens=tokens,
        has_cls=facts.has_cls,
    )
    return plan, source


def store_bytes(plan: CapturePlan, stored_dtype: str) -> int:
    """Upper estimate of a store's size: every site's vectors plus token ids."""
    values = plan.n_examples * len(plan.sites) * plan.tokens_per_example * plan.d_model
    tokens = plan.n_examples * plan.tokens_per_example * 4 if plan.has_tokens else 0
    return values * _ITEMSIZE.get(stored_dtype, 4) + tokens


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def check_space(out: str, need: int) -> None:
    """Refuse when the file system of ``out`` has less than ``need`` bytes free."""
    if is_url(out) or need <= 0:
        return
    base = _nearest_existing(Path(out).expanduser().absolute())
    free = shutil.disk_usage(base).free
    if free < need:
        raise StorageError(
            f"--out {out}: the store needs about {_size(need)} but {base} has {_size(free)} "
            "free; free some space, choose another --out, or pass --no-space-check"
        )


@dataclass(kw_only=True)
class Preflight:
    """What the checks found. ``writer`` (packed mode) is already open on the store;
    ``source`` is the dataset as read for the plan (capture takes it over)."""

    model: ModelFacts
    sites: tuple[Site, ...]
    plan: CapturePlan | None = None
    writer: WriterBase | None = None
    source: ExampleSource | None = None

    @property
    def complete(self) -> bool:
        return self.writer is not None and self.writer.complete

    def take_writer(self, plan: CapturePlan) -> WriterBase | None:
        """The open writer if ``plan`` is the one it was opened for (else it is aborted)."""
        writer, self.writer = self.writer, None
        if writer is None:
            return None
        if plan == self.plan:
            return writer
        log.debug("capture plan differs from the preflight plan; opening a new writer")
        writer.abort()
        return None

    def release(self) -> None:
        """Abort a writer that capture did not take (durable progress is kept)."""
        if self.writer is not None:
            self.writer.abort()
            self.writer = None


def preflight(
    config: CaptureConfig,
    spec: Any,
    out: str,
    options: Any,
    *,
    space_check: bool = True,
    open_store: bool = True,
    local_devices: bool = True,
) -> Preflight:
    """Run the checks in order; see the module docstring. ``spec`` is the FormatSpec.

    With ``open_store=False`` (distributed capture) only the first three checks run, and
    the device map's. ``local_devices=False`` (Ray: workers run elsewhere) leaves out the
    check that the devices it names exist here.
    """
    check_settings()
    check_not_inside_a_store(out)
    check_output(out)
    check_device(config.device)
    check_dataset(config.dataset)
    facts = read_model_config(config.model)
    sites = check_sites(config.sites, facts)
    if config.mode == "prompt_response":
        check_prompt_response(config, facts)
    check_format_takes_sites(spec, options, facts, sites)
    check_out_target(out, spec, options, probe_plan(facts, sites))
    if config.placement.spread:
        from .models import check_placement

        check_placement(config.model, config.placement, config.dtype, sites, local_devices)
    result = Preflight(model=facts, sites=sites)
    if not open_store or config.mode != "packed":
        return result
    result.plan, result.source = weightless_plan(config, facts, sites)
    plan = result.plan
    try:
        writer = spec.open_writer(plan, out, options)
    except OtherCaptureError as err:  # says what differs: the data, weights, dtype...
        raise explain_other_capture(err, plan) from None
    result.writer = writer
    if writer.complete:
        return result
    if space_check:
        left = plan.n_examples - writer.resume_from
        need = store_bytes(plan, spec.stored_dtype) * left // max(plan.n_examples, 1)
        try:
            check_space(out, need)
        except StorageError:
            result.release()
            raise
    return result
