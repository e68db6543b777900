"""Capture: load a Hugging Face model, run it over a dataset, hand batches to a writer.

Example:
    >>> from actstore.capture import CaptureConfig, capture
    >>> from actstore.formats.saev import SaevWriter
    >>> cfg = CaptureConfig(sites=("resid.3",), max_examples=64)
    >>> result = capture(cfg, lambda plan: SaevWriter.from_plan(plan, "out"))  # doctest: +SKIP
"""

from ..batch import Batch, CapturePlan
from .background import BackgroundWriter
from .data import ExampleSource, open_source, pack_documents
from .hooks import ActivationRecorder
from .models import LoadedModel, load_model
from .runner import CaptureConfig, CaptureResult, capture, plan_capture

__all__ = [
    "ActivationRecorder",
    "BackgroundWriter",
    "Batch",
    "CaptureConfig",
    "CapturePlan",
    "CaptureResult",
    "ExampleSource",
    "LoadedModel",
    "capture",
    "load_model",
    "open_source",
    "pack_documents",
    "plan_capture",
]
