"""Prompt/response examples for capture from a causal language model.

Each record of a JSONL file (or a directory saved by ``datasets``' ``save_to_disk``) has a
prompt (field ``prompt_field``) and, unless responses are generated, a response
(``response_field``). Optional per-sample fields ``hallu_label`` (0/1) and ``split``
(``train``/``val``/``test`` or 0/1/2) are kept when every record has them.

Tokenisation, so that prompt and response tokens split exactly where the model's input
switches from one to the other:

- With a chat template (the tokenizer has one and ``chat_template`` is on), the prompt is
  ``apply_chat_template([user], add_generation_prompt=True)``. A given response is the rest
  of ``apply_chat_template([user, assistant])`` after those prompt tokens, so it includes
  what the template puts after the answer (end-of-turn tokens), as the model would emit.
  If a template does not render the prompt as a prefix of the conversation, the response
  is tokenised alone (no special tokens) and a warning says so.
- Without one, the prompt is ``tokenizer(prompt)`` (with the tokenizer's special tokens,
  e.g. Llama's ``<s>``) and the response ``tokenizer(response, add_special_tokens=False)``.
- Generated responses (``generate_max_new_tokens``): the model with its LM head runs
  ``generate`` greedily on the prompt tokens (left-padded batches); the response is the new
  tokens up to and including the first end-of-sequence token. The LM is loaded for this
  pass only and released before capture (a second copy of the weights while it runs).

Capture then runs the model once over ``prompt + response`` per sample, right-padded, so
prompt tokens are ``0..p`` and response tokens ``p..p+r`` of each row; the lengths go to the
writer in ``Batch.extras`` (``prompt_len``, ``response_len``) and, before the first batch,
in ``CapturePlan.extras`` (every sample's lengths, for choosing ``P_max``/``R_max``).

Example:
    >>> cfg = CaptureConfig(model="Qwen/Qwen2.5-0.5B-Instruct", dataset="qa.jsonl",
    ...                     mode="prompt_response", sites=("resid.10", "resid.20"))  # doctest: +SKIP
    >>> capture(cfg, lambda plan: ZarrWriter.from_plan(plan, "out"))  # doctest: +SKIP
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from ..batch import SPLITS, sample_key
from ..errors import ConfigError, StoreNotFoundError
from ..progress import bar_switch
from .data import ExampleSource, SourceBatch, load_saved
from .data.digest import sequences_digest
from .data.text_files import json_record
from .models import LoadedModel, quiet_transformers, resolve_checkpoint

log = logging.getLogger(__name__)

#: Optional per-sample fields carried from the records into the store.
SAMPLE_FIELDS = ("hallu_label", "split")


@dataclass(frozen=True, kw_only=True)
class PromptRecord:
    """One input record: a prompt, maybe a response, maybe labels."""

    prompt: str
    response: str | None = None
    hallu_label: int | None = None
    split: int | None = None


@dataclass(frozen=True, kw_only=True)
class Sample:
    """A tokenised prompt/response pair."""

    prompt_ids: list[int]
    response_ids: list[int]
    prompt: str
    response: str
    hallu_label: int | None = None
    split: int | None = None

    @property
    def key(self) -> str:
        return sample_key(
            prompt=self.prompt,
            response=self.response,
            prompt_ids=self.prompt_ids,
            response_ids=self.response_ids,
        )


# ---------------------------------------------------------------------------- records


def read_records(
    dataset: str,
    *,
    prompt_field: str = "prompt",
    response_field: str | None = "response",
    split: str = "train",
    max_examples: int | None = None,
) -> tuple[list[PromptRecord], str]:
    """Records of a ``.jsonl`` file or saved HF dataset, and the dataset's absolute path.

    ``response_field=None`` reads prompts only (responses will be generated).
    """
    path = Path(dataset).expanduser().resolve()
    if not path.exists():
        raise StoreNotFoundError(f"dataset {dataset!r} does not exist")
    if path.is_dir():
        rows: Sequence[dict[str, Any]] = load_saved(str(path), split)
        where = lambda i: f"{path} row {i}"
    elif path.suffix == ".jsonl":
        rows = _read_jsonl(path)
        where = lambda i: f"{path}:{i + 1}"
    else:
        raise ConfigError(
            f"prompt/response datasets are .jsonl files or directories saved by "
            f"datasets' save_to_disk; {path} is neither"
        )
    n = len(rows) if max_examples is None else min(len(rows), max_examples)
    records = []
    for i in range(n):
        row = rows[i]
        if prompt_field not in row:
            raise ConfigError(
                f"{where(i)} has no {prompt_field!r} field (fields: {sorted(row)}); "
                "choose it with --prompt-field"
            )
        response = None
        if response_field is not None:
            if row.get(response_field) is None:
                raise ConfigError(
                    f"{where(i)} has no {response_field!r} field; name the response field with "
                    "--response-field, or generate responses with --generate-max-new-tokens N"
                )
            response = str(row[response_field])
        records.append(
            PromptRecord(
                prompt=str(row[prompt_field]),
                response=response,
                hallu_label=_label(row.get("hallu_label"), where(i)),
                split=_split(row.get("split"), where(i)),
            )
        )
    if not records:
        raise ConfigError(f"{path} holds no records")
    return records, str(path)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    with path.open("rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json_record(line, f"{path}:{lineno}")
            if not isinstance(record, dict):
                raise ConfigError(f"{path}:{lineno} is not a JSON object")
            rows.append(record)
    return rows


def _label(value: Any, where: str) -> int | None:
    if value is None:
        return None
    if value not in (0, 1, True, False):
        raise ConfigError(f"{where}: hallu_label must be 0/1 or true/false, not {value!r}")
    return int(value)


def _split(value: Any, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, str):
        if value not in SPLITS:
            raise ConfigError(f"{where}: split must be one of {list(SPLITS)}, not {value!r}")
        return SPLITS[value]
    if value not in (0, 1, 2):
        raise ConfigError(f"{where}: split must be 0, 1 or 2 (train/val/test), not {value!r}")
    return int(value)


# ---------------------------------------------------------------------------- tokenisation


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _render(tokenizer, messages: list[dict[str, str]], *, generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=True, return_dict=True
    )
    return [int(t) for t in out["input_ids"]]


def encode_prompt(tokenizer, prompt: str, *, chat_template: bool = True) -> list[int]:
    """Token ids of ``prompt`` as the model sees it before its answer.

    Example:
        >>> encode_prompt(tok, "What is 2+2?")  # doctest: +SKIP
        [1, 1724, 338, 29871, 29906, 29974, 29906, 29973]
    """
    if chat_template and has_chat_template(tokenizer):
        return _render(tokenizer, [{"role": "user", "content": prompt}], generation_prompt=True)
    return [int(t) for t in tokenizer(prompt, add_special_tokens=True)["input_ids"]]


def encode_pair(
    tokenizer, prompt: str, response: str, *, chat_template: bool = True
) -> tuple[list[int], list[int]]:
    """``(prompt ids, response ids)`` of a given pair (see the module docstring).

    Example:
        >>> p, r = encode_pair(tok, "What is 2+2?", "4")  # doctest: +SKIP
    """
    prompt_ids = encode_prompt(tokenizer, prompt, chat_template=chat_template)
    if chat_template and has_chat_template(tokenizer):
        full = _render(
            tokenizer,
            [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}],
            generation_prompt=False,
        )
        if full[: len(prompt_ids)] == prompt_ids:
            return prompt_ids, full[len(prompt_ids) :]
        log.warning(
            "the chat template does not render the prompt as a prefix of the "
            "conversation; the response is tokenised on its own"
        )
    return prompt_ids, [int(t) for t in tokenizer(response, add_special_tokens=False)["input_ids"]]


def _pad_id(tokenizer) -> int:
    for value in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0):
        if value is not None:
            return int(value)
    raise AssertionError


def _eos_ids(model, tokenizer) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


def generate_responses(
    checkpoint: str,
    tokenizer,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    batch_size: int = 8,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
) -> list[list[int]]:
    """Greedy continuations of ``prompts`` (token ids) by the causal LM at ``checkpoint``:
    the new tokens up to and including the first end-of-sequence token.

    Example:
        >>> generate_responses("gpt2", tok, [[464, 3290]], max_new_tokens=8)  # doctest: +SKIP
        [[318, 257, 1295, 13, 50256]]
    """
    from transformers import AutoModelForCausalLM

    if max_new_tokens < 1:
        raise ConfigError(f"generate_max_new_tokens must be >= 1, not {max_new_tokens}")
    with quiet_transformers():
        lm = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype)
    lm.eval().requires_grad_(False).to(device)
    pad, eos = _pad_id(tokenizer), _eos_ids(lm, tokenizer)
    out: list[list[int]] = []
    try:
        with (
            torch.inference_mode(),
            tqdm(
                total=len(prompts), desc="generating", unit="prompt", **bar_switch(progress)
            ) as bar,
        ):
            for lo in range(0, len(prompts), batch_size):
                chunk = prompts[lo : lo + batch_size]
                width = max(len(p) for p in chunk)
                ids = torch.full((len(chunk), width), pad, dtype=torch.long)
                mask = torch.zeros((len(chunk), width), dtype=torch.long)
                for row, p in enumerate(chunk):  # left padding: every prompt ends at `width`
                    ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
                    mask[row, width - len(p) :] = 1
                generated = lm.generate(
                    input_ids=ids.to(device),
                    attention_mask=mask.to(device),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    num_beams=1,
                    pad_token_id=pad,
                )
                for row in generated[:, width:].tolist():
                    cut = next((k + 1 for k, t in enumerate(row) if t in eos), len(row))
                    out.append([int(t) for t in row[:cut]])
                bar.update(len(chunk))
    finally:
        del lm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------- source


class PromptResponseSource(ExampleSource):
    """Prompt/response samples, batched as right-padded ``prompt + response`` sequences."""

    def __init__(
        self, samples: list[Sample], root: str, description: dict[str, Any], model: LoadedModel
    ) -> None:
        if not samples:
            raise ConfigError(f"{root} holds no samples")
        self.samples, self._root, self._description, self.model = samples, root, description, model
        self.pad_id = _pad_id(model.tokenizer)
        self.prompt_lengths = np.array([len(s.prompt_ids) for s in samples], dtype=np.int64)
        self.response_lengths = np.array([len(s.response_ids) for s in samples], dtype=np.int64)
        #: The longest ``prompt + response`` (the store's T_max before truncation).
        self.tokens_per_example = int((self.prompt_lengths + self.response_lengths).max())
        self.keys = [s.key for s in samples]
        limit = _max_positions(model)
        if limit is not None and self.tokens_per_example > limit:
            worst = int(np.argmax(self.prompt_lengths + self.response_lengths))
            raise ConfigError(
                f"sample {worst} has {self.tokens_per_example} tokens; "
                f"{model.ckpt} takes at most {limit}: shorten it or drop it"
            )
        self.fields = [f for f in SAMPLE_FIELDS if all(getattr(s, f) is not None for s in samples)]

    @property
    def n_examples(self) -> int:
        return len(self.samples)

    @property
    def root(self) -> str:
        return self._root

    @property
    def has_tokens(self) -> bool:
        """Batches carry token ids (the store keeps each sample's real ones)."""
        return True

    @property
    def plan_extras(self) -> dict[str, Any]:
        """What goes into ``CapturePlan.extras``: every sample's lengths, which fields exist."""
        return {
            "prompt_lengths": self.prompt_lengths,
            "response_lengths": self.response_lengths,
            **{f"has_{f}": f in self.fields for f in SAMPLE_FIELDS},
        }

    def describe(self) -> dict[str, Any]:
        return dict(self._description)

    def batches(self, start: int, batch_size: int, num_workers: int = 0) -> Iterator[SourceBatch]:
        for lo in range(start, self.n_examples, batch_size):
            hi = min(lo + batch_size, self.n_examples)
            chunk = self.samples[lo:hi]
            width = max(len(s.prompt_ids) + len(s.response_ids) for s in chunk)
            ids = np.full((hi - lo, width), self.pad_id, dtype=np.int32)
            mask = np.zeros((hi - lo, width), dtype=np.int64)
            for row, s in enumerate(chunk):
                seq = s.prompt_ids + s.response_ids
                ids[row, : len(seq)] = seq
                mask[row, : len(seq)] = 1
            extras: dict[str, Any] = {
                "prompt_len": self.prompt_lengths[lo:hi].copy(),
                "response_len": self.response_lengths[lo:hi].copy(),
                "prompt_text": [s.prompt for s in chunk],
                "response_text": [s.response for s in chunk],
                "sample_key": self.keys[lo:hi],
            }
            for name in self.fields:
                extras[name] = np.array([getattr(s, name) for s in chunk], dtype=np.int8)
            device = self.model.device
            yield SourceBatch(
                example_ids=np.arange(lo, hi, dtype=np.int64),
                inputs={
                    "input_ids": torch.from_numpy(ids.astype(np.int64)).to(device),
                    "attention_mask": torch.from_numpy(mask).to(device),
                },
                token_ids=ids,
                extras=extras,
            )


def _max_positions(model: LoadedModel) -> int | None:
    config = getattr(model.module, "config", None)
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def open_prompt_source(config: Any, model: LoadedModel) -> PromptResponseSource:
    """The prompt/response source a :class:`~actstore.capture.runner.CaptureConfig` in
    ``prompt_response`` mode describes (reads, tokenises and, if asked, generates)."""
    if model.modality != "text" or model.tokenizer is None:
        raise ConfigError(
            f"prompt/response capture needs a language model; {model.ckpt} is not one"
        )
    generate = config.generate_max_new_tokens is not None
    records, root = read_records(
        config.dataset,
        prompt_field=config.prompt_field,
        response_field=None if generate else config.response_field,
        split=config.split,
        max_examples=config.max_examples,
    )
    tok = model.tokenizer
    templated = config.chat_template and has_chat_template(tok)
    with quiet_transformers():
        if generate:
            prompt_ids = [encode_prompt(tok, r.prompt, chat_template=templated) for r in records]
            response_ids = generate_responses(
                resolve_checkpoint(config.model),
                tok,
                prompt_ids,
                max_new_tokens=config.generate_max_new_tokens,
                batch_size=config.batch_size,
                device=config.device,
                dtype=model.dtype,
                progress=config.progress,
            )
            responses = [tok.decode(r, skip_special_tokens=True) for r in response_ids]
        else:
            responses = [r.response for r in records if r.response is not None]
            if len(responses) != len(records):  # read_records gives each one a response
                raise ConfigError(
                    f"{config.dataset}: {len(records) - len(responses)} records have no "
                    f"{config.response_field!r} field; give --response-field or "
                    "--generate-max-new-tokens N"
                )
            pairs = [
                encode_pair(tok, r.prompt, response, chat_template=templated)
                for r, response in zip(records, responses, strict=True)
            ]
            prompt_ids = [p for p, _ in pairs]
            response_ids = [r for _, r in pairs]
    samples = [
        Sample(
            prompt_ids=p,
            response_ids=r,
            prompt=rec.prompt,
            response=text,
            hallu_label=rec.hallu_label,
            split=rec.split,
        )
        for rec, p, r, text in zip(records, prompt_ids, response_ids, responses)
    ]
    description = {
        "kind": "prompt_response",
        "root": root,
        "prompt_field": config.prompt_field,
        "responses": (
            f"generated (greedy, max_new_tokens={config.generate_max_new_tokens})"
            if generate
            else f"given (field {config.response_field!r})"
        ),
        "chat_template": templated,
        "n_records": len(records),
        "tokenizer": model.ckpt,
        # the token ids of every prompt and response stored, and their labels and splits
        "sample_digest": sequences_digest(
            seq
            for s in samples
            for seq in (
                s.prompt_ids,
                s.response_ids,
                [
                    -1 if s.hallu_label is None else s.hallu_label,
                    -1 if s.split is None else s.split,
                ],
            )
        ),
    }
    log.info(
        "%d prompt/response samples from %s (%s responses, chat template %s)",
        len(samples),
        root,
        "generated" if generate else "given",
        "applied" if templated else "not applied",
    )
    return PromptResponseSource(samples, root, description, model)
