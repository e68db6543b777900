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
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..batch import CapturePlan
from ..errors import ConfigError, OtherCaptureError, StorageError, StoreNotFoundError
from ..formats.identity import explain_other_capture
from ..formats.threads import check_settings
from ..formats.writerbase import WriterBase
from ..hub import quiet_transformers
from ..sites import Site
from .data import ExampleSource
from .identity import weights_identity
from .modelfacts import ModelFacts, check_sites, read_model_config
from .outdir import (
    check_not_inside_a_store,
    check_out_target,
    check_output,
    check_space,
    store_bytes,
)
from .runner import CaptureConfig

log = logging.getLogger(__name__)


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
