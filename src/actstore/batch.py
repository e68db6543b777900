"""What capture hands to writers: a :class:`CapturePlan` first, then :class:`Batch` after batch.

Example:
    >>> import torch, numpy as np
    >>> b = Batch(acts={"resid.0": torch.zeros(2, 3, 4)}, example_ids=np.array([0, 1]))
    >>> b.n_examples, b.n_tokens, b.d_model
    (2, 3, 4)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from .sites import Site

if TYPE_CHECKING:
    import torch

#: Split ids a prompt/response example carries (``Batch.extras["split"]``).
SPLITS = {"train": 0, "val": 1, "test": 2}
#: Keys of ``CapturePlan.data`` that identify what made the values, not where it was
#: found: digests of the examples consumed (``actstore.capture.data.digest``), the
#: identity of the model's weights (``actstore.capture.identity``: a digest of their bytes,
#: or the Hub revision), the compute dtype, token cleaning and, for a store converted from
#: another, that store's identity and the precision its values were kept at.
DATA_IDENTITY = (
    "token_digest",
    "image_digest",
    "sample_digest",
    "weights",
    "compute_dtype",
    "clean_tokens",
    "converted_from",
)
#: How :func:`plan_differences` names each key of ``CapturePlan.data`` it compares.
_DATA_WORDS = {
    "token_digest": "the data changed (the digest of its token ids",
    "image_digest": "the data changed (the digest of its images",
    "sample_digest": "the data changed (the digest of its samples",
    "weights": "the model's weights changed (their identity",
    "compute_dtype": "another compute dtype (--dtype",
    "clean_tokens": "token cleaning differs (--clean",
    "converted_from": "another source store (converted from",
}


@dataclass(frozen=True, kw_only=True)
class Batch:
    """Activations of ``B`` examples of ``T`` tokens, keyed by site name (``"resid.3"``)."""

    acts: dict[str, torch.Tensor]
    """site name -> CPU tensor ``[B, T, D]`` in the capture dtype."""
    example_ids: np.ndarray
    """int64 ``[B]``: global example indices, increasing."""
    token_ids: np.ndarray | None = None
    """int ``[B, T]`` token ids (text models), else None."""
    token_mask: np.ndarray | None = None
    """bool ``[B, T]``: True for tokens to keep (None: keep all)."""
    labels: np.ndarray | None = None
    """int64 ``[B]`` class labels (image folders with class subfolders), else None."""
    texts: list[str] | None = None
    """The source text of each example, when there is one."""
    extras: dict[str, Any] = field(default_factory=dict)
    """Format-specific per-example fields (e.g. prompt/response lengths)."""

    @property
    def n_examples(self) -> int:
        return int(self.example_ids.shape[0])

    @property
    def n_tokens(self) -> int:
        return int(next(iter(self.acts.values())).shape[1])

    @property
    def d_model(self) -> int:
        return int(next(iter(self.acts.values())).shape[2])

    def select(self, keep: np.ndarray) -> Batch:
        """The sub-batch of examples where the boolean mask ``keep`` ([B]) is True."""
        import torch

        index = torch.from_numpy(np.flatnonzero(keep))
        pick = lambda a: None if a is None else a[keep]
        return Batch(
            acts={k: v.index_select(0, index) for k, v in self.acts.items()},
            example_ids=self.example_ids[keep],
            token_ids=pick(self.token_ids),
            token_mask=pick(self.token_mask),
            labels=pick(self.labels),
            texts=None if self.texts is None else [t for t, k in zip(self.texts, keep) if k],
            extras={
                k: (v[keep] if isinstance(v, np.ndarray) else [x for x, m in zip(v, keep) if m])
                for k, v in self.extras.items()
            },
        )


@dataclass(frozen=True, kw_only=True)
class CapturePlan:
    """Everything a writer needs to know before the first batch arrives."""

    ckpt: str
    family: str
    modality: str
    sites: tuple[Site, ...]
    n_model_layers: int
    d_model: int
    tokens_per_example: int
    has_cls: bool
    n_examples: int
    dataset_root: str
    data: dict[str, Any]
    classes: list[str] | None
    has_labels: bool
    has_tokens: bool
    batch_size: int
    extras: dict[str, Any] = field(default_factory=dict)
    """Facts a format needs up front, e.g. every example's ``prompt_lengths`` and
    ``response_lengths`` for a prompt/response capture (see actstore.capture.prompts)."""

    @property
    def layers(self) -> list[int]:
        return [s.layer for s in self.sites]

    @property
    def data_identity(self) -> dict[str, Any]:
        """What in ``data`` identifies the data itself (:data:`DATA_IDENTITY`): every
        writer's record holds ``data``, so a store of other data is another store."""
        return {k: self.data[k] for k in DATA_IDENTITY if k in self.data}

    def to_json_dict(self) -> dict[str, Any]:
        """The plan as plain JSON values (sites as their names)."""
        raw = {f.name: getattr(self, f.name) for f in fields(self)}
        raw["sites"] = [str(s) for s in self.sites]
        return json.loads(json.dumps(raw, default=str))

    @classmethod
    def from_json_dict(cls, doc: dict[str, Any]) -> CapturePlan:
        """Inverse of :meth:`to_json_dict` (unknown keys are ignored)."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in doc.items() if k in known}
        values["sites"] = tuple(Site.parse(s) for s in doc["sites"])
        return cls(**values)


def sample_key(
    *,
    prompt: str | None = None,
    response: str | None = None,
    prompt_ids: Sequence[int] | np.ndarray | None = None,
    response_ids: Sequence[int] | np.ndarray | None = None,
    fallback: str = "",
) -> str:
    """sha256 hex (64 chars) identifying a sample by its text and tokens.

    Example:
        >>> sample_key(prompt="2+2?", response="4")[:12]
        'aa20e581ed1c'
    """
    record: dict[str, Any] = {}
    if prompt is not None or response is not None:
        record.update(prompt=prompt, response=response)
    if prompt_ids is not None or response_ids is not None:
        record.update(
            prompt_ids=None if prompt_ids is None else [int(t) for t in prompt_ids],
            response_ids=None if response_ids is None else [int(t) for t in response_ids],
        )
    if not record:
        record["id"] = fallback
    text = json.dumps(record, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def plan_differences(stored: CapturePlan, wanted: CapturePlan) -> list[str]:
    """What differs between the capture a store holds (``stored``, as its reader gives it
    back) and the one asked for (``wanted``), in words, most telling first; empty when
    the plans agree on everything a reader gives back (the format's options then differ).

    Example:
        >>> from actstore.testing import make_plan
        >>> import dataclasses
        >>> a = make_plan()
        >>> b = dataclasses.replace(a, data={**a.data, "token_digest": "ff00"})
        >>> plan_differences(a, b)[0][:16]
        'the data changed'
    """
    out: list[str] = []
    if stored.ckpt != wanted.ckpt:
        out.append(f"another model ({stored.ckpt} there, {wanted.ckpt} now)")
    old = stored.data if isinstance(stored.data, dict) else {}
    new = wanted.data if isinstance(wanted.data, dict) else {}
    for key, words in _DATA_WORDS.items():
        there, now = old.get(key), new.get(key)
        if there != now:
            if key == "clean_tokens":
                there, now = ("on" if v else "off" for v in (there, now))
            out.append(f"{words}: {_short(there)} there, {_short(now)} now)")
    if [str(s) for s in stored.sites] != [str(s) for s in wanted.sites]:
        there, now = (", ".join(str(s) for s in p.sites) for p in (stored, wanted))
        out.append(f"other sites ({there} there, {now} now)")
    if stored.dataset_root != wanted.dataset_root:
        out.append(f"another dataset ({stored.dataset_root} there, {wanted.dataset_root} now)")
    for name, what in (("n_examples", "examples"), ("tokens_per_example", "tokens per example")):
        a, b = getattr(stored, name), getattr(wanted, name)
        if a != b:
            out.append(f"{a} {what} there, {b} now")
    if not out and old != new:
        keys = sorted(k for k in {*old, *new} if old.get(k) != new.get(k))
        out.append(f"another dataset description ({', '.join(keys)})")
    return out


def _short(value: Any) -> str:
    """A value as a difference shows it: digests cut to 12 hex, dicts as their values."""
    if value is None:
        return "none"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_short(v)}" for k, v in sorted(value.items()))
    text = str(value)
    return text[:12] if len(text) > 16 and all(c in "0123456789abcdef" for c in text) else text
