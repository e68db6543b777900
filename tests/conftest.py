"""Shared fixtures: tiny real models and datasets, built once per test session."""

from __future__ import annotations

import getpass
import os
import signal
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("TQDM_DISABLE", "1")
# A shell without job control starts background commands with SIGINT ignored, and every
# child inherits that: the Ctrl-C tests' captures would never see their interrupt.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
import actstore  # noqa: F401 - sets reproducible MKL/OpenMP defaults before torch loads

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# torch sets this the first time anything in this process imports torch._inductor (an
# in-process capture does); set from the start, to torch's own default, the environment
# the forked runs see (tests/forked.py keys its helpers by it) stays the same all session,
# so the helper that imported torch once is not started a second time.
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR",
    os.path.join(tempfile.gettempdir(), "torchinductor_" + getpass.getuser()),
)

from tiny_models import make_image_folder, save_text_model, save_vision_model

# The conformance kit's pytest plugin: the loopback S3 server fixtures (s3_server, s3,
# s3_proxy, conformance_s3_url) for every test module.
pytest_plugins = ["actstore.testing.plugin"]

# A format package of its own (tests/test_new_format.py installs it and runs its suite).
collect_ignore = ["plugin_format"]

TEXT_KINDS = ("gpt2", "llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "bert")
VISION_KINDS = ("clip", "siglip", "dinov2")


@pytest.fixture(scope="session", autouse=True)
def _session_memo_dir(tmp_path_factory):
    """``actstore capture`` memoises finished captures in ``$ACTSTORE_MEMO_DIR`` (else
    ``~/.cache/actstore/captures``): the suite's own go to a directory of this session, never
    the user's cache (tests that check the memo set a directory of their own)."""
    if os.environ.get("ACTSTORE_MEMO_DIR"):
        yield
        return
    os.environ["ACTSTORE_MEMO_DIR"] = str(tmp_path_factory.mktemp("memo"))
    yield
    os.environ.pop("ACTSTORE_MEMO_DIR", None)


@pytest.fixture(scope="session", autouse=True)
def _session_hub_cache(tmp_path_factory):
    """The Hugging Face Hub cache of this session (``$HF_HUB_CACHE``), empty but for what a
    test puts there: the suite never reads the user's cache, and a test that publishes a
    Hub id into it (a ``models--org--name/snapshots/<commit>/`` folder of its own) runs the
    real command forked from the helper every run shares (tests/forked.py keys its helpers
    by the ``HF_`` variables: a run with an ``HF_HUB_CACHE`` of its own starts another)."""
    before = os.environ.get("HF_HUB_CACHE")
    os.environ["HF_HUB_CACHE"] = str(tmp_path_factory.mktemp("hf-hub"))
    yield Path(os.environ["HF_HUB_CACHE"])
    if before is None:
        os.environ.pop("HF_HUB_CACHE", None)
    else:
        os.environ["HF_HUB_CACHE"] = before


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """``model_dir(kind)`` -> path of a saved tiny model of that architecture."""
    cache: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in cache:
            directory = tmp_path_factory.mktemp(f"model-{kind}")
            if kind in TEXT_KINDS:
                save_text_model(kind, directory)
            else:
                save_vision_model(kind, directory)
            cache[kind] = directory
        return cache[kind]

    return get


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory) -> Path:
    """15 images in 3 class subfolders."""
    return make_image_folder(tmp_path_factory.mktemp("images"))


@pytest.fixture(scope="session")
def text_file(tmp_path_factory) -> Path:
    """A .txt file of real English lines (the Python language reference)."""
    from pydoc_data import topics

    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    lines = [line for k in sorted(topics.topics)[:12] for line in topics.topics[k].splitlines()]
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.cuda`` tests skip where torch sees no CUDA device (CI never needs one)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
