"""The contract every example source keeps: :class:`ExampleSource` and its batches.

Example:
    >>> issubclass(ExampleSource, abc.ABC)
    True
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

    from ..models import LoadedModel


@dataclass(frozen=True, kw_only=True)
class SourceBatch:
    """Model inputs for examples ``example_ids`` plus what writers keep beside activations."""

    example_ids: np.ndarray
    inputs: dict[str, torch.Tensor]
    token_ids: np.ndarray | None = None
    labels: np.ndarray | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    """Per-example fields for ``Batch.extras`` (prompt/response lengths, texts...)."""


class ExampleSource(abc.ABC):
    """A deterministic, indexable sequence of model inputs (what capture runs over).

    Optional facts have defaults here, so capture reads them directly: a source that
    knows its examples' token count says so in ``tokens_per_example`` (else capture probes
    one batch), text sources keep their ``token_ids``, labelled image sources ``labels`` and
    ``classes``.
    """

    #: Tokens per example when known without running the model (else None).
    tokens_per_example: int | None = None
    #: int32 ``[n_examples, T]`` token ids when the source is packed text, else None.
    token_ids: np.ndarray | None = None
    #: int64 label per example when known, else None.
    labels: np.ndarray | None = None
    #: Class names when labels are known (index = label), else None.
    classes: list[str] | None = None

    @property
    @abc.abstractmethod
    def n_examples(self) -> int:
        """Total number of examples."""

    @property
    @abc.abstractmethod
    def root(self) -> str:
        """Absolute path (or Hub id) of the dataset (saev's ``dataset`` field)."""

    @property
    def has_tokens(self) -> bool:
        """Whether batches carry token ids."""
        return self.token_ids is not None

    @property
    def plan_extras(self) -> dict[str, Any]:
        """Facts for ``CapturePlan.extras`` (none by default)."""
        return {}

    @abc.abstractmethod
    def describe(self) -> dict[str, Any]:
        """Plain, JSON-able description of the dataset (pickled into saev's ``data`` field)."""

    @abc.abstractmethod
    def batches(self, start: int, batch_size: int, num_workers: int = 0) -> Iterator[SourceBatch]:
        """Batches of consecutive examples ``start, start+1, ...``; batch k starts at
        ``start + k * batch_size``."""

    def for_model(self, model: LoadedModel) -> ExampleSource:
        """The same examples, batched for ``model`` (its device, dtype and processor).

        Preflight opens a source for a weightless stand-in of the model; capture takes it
        over this way instead of reading and tokenizing the dataset again. Sources whose
        batches do not depend on the model return themselves."""
        return self
