"""The capture loop: model + dataset -> batches -> a format writer on a background thread.

Example:
    >>> from actstore.formats.registry import get_format
    >>> cfg = CaptureConfig(model="embedded", dataset="embedded", sites=("resid.3",))
    >>> result = capture(cfg, lambda plan: get_format("saev").open_writer(plan, "out"))  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from ..batch import Batch, CapturePlan
from ..errors import ConfigError, DeviceError
from ..formats.writerbase import WriterBase
from ..progress import bar_switch
from ..sites import Site
from .background import BackgroundWriter
from .copyout import CopyOut, Sink, device_failure, open_copyout
from .data import ExampleSource, open_source
from .hooks import ActivationRecorder
from .identity import module_identity
from .models import DTYPES, LoadedModel, load_model
from .placement import Placement, parse_placement

log = logging.getLogger(__name__)

#: ``CaptureConfig.copy_dtype`` values: casts on the device that are exact from any
#: compute dtype (float32, bfloat16, float16).
COPY_DTYPES = {"float32": torch.float32}


@dataclass(frozen=True, kw_only=True)
class CaptureConfig:
    """What to run and over what. Storage options belong to the format's writer."""

    model: str = "embedded"
    """Hugging Face model id, local model directory, or ``embedded``."""
    dataset: str = "embedded"
    """Image folder, .txt/.jsonl file, saved HF dataset directory, parquet/arrow/json/csv
    file or folder, Hugging Face Hub id (``org/name``), or ``embedded``."""
    dataset_config: str | None = None
    """Hub datasets: the configuration (subset) name."""
    streaming: bool = False
    """Hub ids and data files: stream in stored order, reading only the examples needed."""
    max_tokens: int | None = None
    """Text: use at most this many tokens (``max_tokens // context_length`` contexts)."""
    sites: tuple[str, ...] = ("resid.-1",)
    """Sites in any spelling :meth:`actstore.sites.Site.parse` takes (``resid.6``,
    ``mlp_out.-1``, ``blocks.6.hook_resid_post``)."""
    batch_size: int = 32
    device: str = "cpu"
    dtype: str = "float32"
    """Compute dtype: float32, bfloat16 or float16 (stores cast as their format says)."""
    context_length: int = 128
    """Tokens per packed text context (text models only)."""
    max_examples: int | None = None
    split: str = "train"
    text_field: str | None = None
    """The field of JSONL records / column of a dataset holding text (None: ``text``, else a
    column of token ids, ``input_ids`` or ``tokens``; see :mod:`actstore.capture.data.columns`)."""
    token_field: str | None = None
    """The field / column holding pre-tokenized ids, used as is."""
    num_workers: int = 0
    """DataLoader workers decoding images."""
    queue_size: int = 4
    """Batches buffered between the forward pass and the writer thread."""
    copy_slots: int = 4
    """CUDA: batches whose copies to pinned host memory may be in flight at once (on a
    side stream; the forward pass waits only when all are). 0: copy each batch in the
    forward loop (``tensor.to("cpu")``, as CPU captures always do)."""
    copy_dtype: str | None = None
    """Cast activations to this dtype on the device before copying them off it, e.g.
    ``float32`` for a float32 store of a bfloat16 model (no cast on the writer thread;
    twice the bytes to copy). Only ``float32``, exact from any compute dtype. None: the
    writer casts."""
    progress: bool = True
    mode: str = "packed"
    """``packed``: text packed into fixed contexts; ``prompt_response``: one example per
    prompt/response record, for the zarr format (see :mod:`actstore.capture.prompts`)."""
    prompt_field: str = "prompt"
    """prompt_response mode: the records' prompt field."""
    response_field: str = "response"
    """prompt_response mode: the records' response field (unless responses are generated)."""
    generate_max_new_tokens: int | None = None
    """prompt_response mode: generate responses greedily, up to this many new tokens."""
    chat_template: bool = True
    """prompt_response mode: apply the tokenizer's chat template when it has one."""
    clean_tokens: bool = False
    """Store no special, added or chat-template tokens (sets ``Batch.token_mask``, see
    :mod:`actstore.capture.cleaning`); formats that honour the mask pack the rest."""
    device_map: str | None = None
    """Spread the model over this machine's devices instead of ``device``: ``auto``,
    ``balanced``, ``balanced_low_0``, ``sequential``, or a JSON module -> device map (see
    :mod:`actstore.capture.placement`)."""
    max_memory: str | None = None
    """With a device map strategy: bytes per device, ``0=70GiB,1=70GiB,cpu=200GiB``."""
    offload_folder: str | None = None
    """Where weights a device map puts on ``disk`` are kept."""

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, not {self.batch_size}")
        if self.context_length < 2:
            raise ConfigError(f"context_length must be >= 2, not {self.context_length}")
        if not self.sites:
            raise ConfigError("give at least one site (e.g. resid.-1)")
        if self.max_examples is not None and self.max_examples < 1:
            raise ConfigError("max_examples must be >= 1")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ConfigError("max_tokens must be >= 1")
        if self.mode == "prompt_response" and (self.max_tokens or self.streaming):
            raise ConfigError(
                "--max-tokens and --streaming apply to packed text, not prompt-response"
            )
        for site in self.sites:
            Site.parse(site)
        if self.mode not in ("packed", "prompt_response"):
            raise ConfigError(
                f"mode must be 'packed' or 'prompt-response' (prompt_response), not {self.mode!r}"
            )
        if self.dtype not in DTYPES:
            raise ConfigError(
                f"dtype must be one of {', '.join(DTYPES)} (the compute dtype), not {self.dtype!r}"
            )
        if self.generate_max_new_tokens is not None and self.generate_max_new_tokens < 1:
            raise ConfigError("generate_max_new_tokens must be >= 1")
        if self.copy_slots < 0:
            raise ConfigError(f"copy_slots must be >= 0, not {self.copy_slots}")
        if self.copy_dtype not in (None, *COPY_DTYPES):
            raise ConfigError(
                f"copy_dtype must be 'float32' (a cast exact from any compute dtype) or "
                f"None, not {self.copy_dtype!r}"
            )
        if self.device_map is not None and self.device != "cpu":
            raise ConfigError("give --device or --device-map, not both (the map names devices)")
        if self.device_map is not None and self.generate_max_new_tokens is not None:
            raise ConfigError(
                "--generate-max-new-tokens loads the whole model on --device to generate, "
                "without --device-map: drop --device-map and give a --device that holds the "
                "model, or generate the responses first and give them with --response-field"
            )
        self.placement  # noqa: B018 - checks the device map and memory syntax now

    @property
    def placement(self) -> Placement:
        """The parsed ``device_map``, ``max_memory`` and ``offload_folder``."""
        return parse_placement(self.device_map, self.max_memory, self.offload_folder)


@dataclass(frozen=True, kw_only=True)
class CaptureResult:
    """What happened: where the data is and how long it took."""

    output: Any
    """The writer's manifest (a path for local formats)."""
    plan: CapturePlan
    n_examples_run: int
    resumed_from: int
    already_complete: bool
    seconds: float
    """Wall time of the forward loop (model loading and tokenisation excluded)."""
    setup_seconds: float
    """Time spent loading the model and preparing the dataset."""
    writer_wait_s: float
    """Time the forward loop was blocked on a full writer queue."""
    extra: dict[str, Any] = field(default_factory=dict)


def _probe_tokens(model: LoadedModel, source: ExampleSource, sites: list[Site]) -> int:
    if source.tokens_per_example is not None:
        return int(source.tokens_per_example)
    if source.token_ids is not None:
        return int(source.token_ids.shape[1])
    first = next(source.batches(0, 1))
    with torch.inference_mode(), ActivationRecorder(model, sites[:1]) as rec:
        return int(next(iter(rec.run(first.inputs).values())).shape[1])


def packed_source(
    config: CaptureConfig, model: Any, vocab_size: int | None = None
) -> ExampleSource:
    """The packed-mode example source of ``config`` for ``model`` (a loaded model, or the
    weightless stand-in preflight uses, with the ``vocab_size`` of config.json: both must
    see the same examples)."""
    return open_source(
        config.dataset,
        model,
        context_length=config.context_length,
        max_examples=config.max_examples,
        max_tokens=config.max_tokens,
        split=config.split,
        text_field=config.text_field,
        token_field=config.token_field,
        dataset_config=config.dataset_config,
        streaming=config.streaming,
        progress=config.progress,
        vocab_size=vocab_size,
    )


def plan_capture(
    config: CaptureConfig,
    source: ExampleSource | None = None,
    model: LoadedModel | None = None,
) -> tuple[LoadedModel, ExampleSource, CapturePlan]:
    """Load the model (unless ``model`` is given, already loaded) and the dataset and work
    out the shapes the store will have. A packed ``source`` already opened for ``config``
    (by preflight) is taken over, not reopened."""
    if model is None:
        model = load_model(
            config.model,
            device=config.device,
            dtype=config.dtype,
            sites=config.sites,
            placement=config.placement,
        )
    sites = [Site.parse(s).resolve(model.n_layers).in_family(model.family) for s in config.sites]
    for i, site in enumerate(sites):
        if site in sites[:i]:
            first = config.sites[sites.index(site)]
            raise ConfigError(f"sites {first} and {config.sites[i]} both name {site}; give it once")
    if config.mode == "prompt_response":
        from .prompts import open_prompt_source

        source = open_prompt_source(config, model)
    elif source is None:
        source = packed_source(config, model)
    else:
        source = source.for_model(model)
    plan = source_plan(
        config,
        source,
        ckpt=model.ckpt,
        family=model.family,
        modality=model.modality,
        sites=tuple(sites),
        n_layers=model.n_layers,
        d_model=model.d_model,
        tokens=_probe_tokens(model, source, sites),
        has_cls=model.has_cls,
        weights=model.weights if model.weights is not None else module_identity(model.module),
    )
    return model, source, plan


def source_plan(
    config: CaptureConfig,
    source: ExampleSource,
    *,
    ckpt: str,
    family: str,
    modality: str,
    sites: tuple[Site, ...],
    n_layers: int,
    d_model: int,
    tokens: int,
    has_cls: bool,
    weights: dict[str, str],
) -> CapturePlan:
    """The plan of a capture of ``source`` by a model with these facts (capture and the
    weightless preflight build it here, so they agree).

    Its ``data`` (every format's record holds it) is the source's description plus what
    else decides the values: the identity of the model's ``weights``
    (:mod:`~actstore.capture.identity`), the compute dtype, and token cleaning when it is
    on (text models)."""
    data = {**source.describe(), "weights": dict(weights), "compute_dtype": config.dtype}
    if config.clean_tokens and modality == "text":
        data["clean_tokens"] = True
    return CapturePlan(
        ckpt=ckpt,
        family=family,
        modality=modality,
        sites=sites,
        n_model_layers=n_layers,
        d_model=d_model,
        tokens_per_example=tokens,
        has_cls=has_cls,
        n_examples=source.n_examples,
        dataset_root=source.root,
        data=data,
        classes=source.classes,
        has_labels=source.labels is not None,
        has_tokens=source.has_tokens,
        batch_size=config.batch_size,
        extras=source.plan_extras,
    )


def capture(
    config: CaptureConfig,
    open_writer: Callable[[CapturePlan], WriterBase],
    *,
    source: ExampleSource | None = None,
    copy_out: Callable[[Sink], CopyOut] | None = None,
    model: LoadedModel | None = None,
) -> CaptureResult:
    """Run ``config.model`` over ``config.dataset`` and write the activations.

    ``open_writer(plan)`` returns a :class:`~actstore.formats.base.WriterBase`; its
    ``resume_from`` (examples already durable) and ``complete`` (already published) say
    where to start. Batches always start at multiples of
    ``batch_size``, so a resumed run computes exactly the batches an uninterrupted one
    would (bitwise-identical activations on deterministic hardware).

    A writer with an ``example_range = (start, stop)`` (one part of a distributed capture,
    see :mod:`actstore.dist`) gets only the examples ``start <= id < stop``, with their
    global example ids. A writer with ``wants_texts`` also gets each example's decoded
    text (text models). ``source``: the packed source preflight opened for ``config``
    (its dataset is then not read again). ``model``: an already loaded model (e.g. one
    built in place from a config) instead of ``config.model``'s weights.

    ``copy_out(sink)`` makes the stage that moves activations off the model's device
    (default: :func:`~actstore.capture.copyout.open_copyout` for the model's device,
    ``copy_slots`` and ``copy_dtype``; see :mod:`actstore.capture.copyout`).
    """
    t0 = time.perf_counter()
    model, source, plan = plan_capture(config, source, model)
    writer = open_writer(plan)
    setup_seconds = time.perf_counter() - t0
    start, stop = writer.example_range or (0, plan.n_examples)
    if writer.complete:
        output = writer.close()
        log.info("already captured: %s", output)
        return CaptureResult(
            output=output,
            plan=plan,
            n_examples_run=0,
            resumed_from=stop,
            already_complete=True,
            seconds=0.0,
            setup_seconds=setup_seconds,
            writer_wait_s=0.0,
        )
    resume_from = max(writer.resume_from, start)
    first = (resume_from // config.batch_size) * config.batch_size
    if resume_from > start:
        log.info("resuming at example %d of %d", resume_from, plan.n_examples)
    decode = model.tokenizer if writer.wants_texts else None
    cleaner = None
    if config.clean_tokens and model.tokenizer is None:
        log.warning("token cleaning applies to text models; %s keeps every token", model.ckpt)
    elif config.clean_tokens:
        from .cleaning import TokenCleaner

        cleaner = TokenCleaner.from_tokenizer(model.tokenizer)
    n_run = 0
    names = [str(s) for s in plan.sites]
    make_copyout = copy_out or functools.partial(_default_copyout, config, model.device)
    t_loop = time.perf_counter()
    with (
        torch.inference_mode(),
        ActivationRecorder(model, list(plan.sites)) as recorder,
        BackgroundWriter(writer, queue_size=config.queue_size) as background,
        make_copyout(background.put) as copyout,
        tqdm(
            total=stop - start,
            initial=resume_from - start,
            unit="ex",
            desc="capture",
            dynamic_ncols=True,
            **bar_switch(config.progress),
        ) as bar,
    ):
        try:
            for source_batch in source.batches(first, config.batch_size, config.num_workers):
                ids = source_batch.example_ids
                if ids[0] >= stop:
                    break
                acts = recorder.run(source_batch.inputs)
                # only what the writer keeps: not the inputs, which may be on the GPU
                build = functools.partial(
                    _host_batch,
                    example_ids=ids,
                    token_ids=source_batch.token_ids,
                    labels=source_batch.labels,
                    extras=source_batch.extras,
                    token_mask=None
                    if cleaner is None or source_batch.token_ids is None
                    else cleaner.mask(source_batch.token_ids),
                    texts=None
                    if decode is None or source_batch.token_ids is None
                    else decode.batch_decode(source_batch.token_ids),
                    stop=stop,
                )
                copyout.put({name: acts[name] for name in names}, build)
                del acts
                fresh = int(np.count_nonzero((ids >= resume_from) & (ids < stop)))
                n_run += fresh
                bar.update(fresh)
            copyout.close()
        except (torch.OutOfMemoryError, DeviceError) as err:
            raise device_failure(err) from err
        output = background.close()
    seconds = time.perf_counter() - t_loop
    log.info(
        "captured %d examples in %.1fs (writer back-pressure %.1fs)",
        n_run,
        seconds,
        background.blocked_s,
    )
    return CaptureResult(
        output=output,
        plan=plan,
        n_examples_run=n_run,
        resumed_from=resume_from,
        already_complete=False,
        seconds=seconds,
        setup_seconds=setup_seconds,
        writer_wait_s=background.blocked_s,
        extra={"copy_wait_s": copyout.waited_s},
    )


def _default_copyout(config: CaptureConfig, device: torch.device, sink: Sink) -> CopyOut:
    dtype = COPY_DTYPES.get(config.copy_dtype or "")
    return open_copyout(sink, device=device, slots=config.copy_slots, dtype=dtype)


def _host_batch(
    host_acts: dict[str, torch.Tensor],
    *,
    example_ids: np.ndarray,
    token_ids: np.ndarray | None,
    labels: np.ndarray | None,
    extras: dict[str, Any],
    token_mask: np.ndarray | None,
    texts: list[str] | None,
    stop: int,
) -> Batch:
    """The writer's batch of a source batch (its fields the writer keeps, never its model
    inputs) once its activations are in host memory (examples from ``stop`` on left out)."""
    batch = Batch(
        acts=host_acts,
        example_ids=example_ids,
        token_ids=token_ids,
        token_mask=token_mask,
        labels=labels,
        extras=extras,
        texts=texts,
    )
    if example_ids[-1] >= stop:
        batch = batch.select(batch.example_ids < stop)
    return batch
