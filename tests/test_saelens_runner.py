"""SAELens's own training runner (``LanguageModelSAETrainingRunner``, sae-lens 6.54) trains an
SAE from an actstore saelens cache of a local Hugging Face model that TransformerLens cannot
name, offline, exactly as docs/saelens.md ("Training with SAELens's runner") says, and
the two things that runner needs besides the cache are shown to be needed."""

from __future__ import annotations

import json

import datasets
import numpy as np
import pytest
import torch

from actstore.capture import CaptureConfig, capture
from actstore.formats import get_format
from actstore.formats.saelens import SaelensOptions, SaelensReader

sae_lens = pytest.importorskip("sae_lens")

CONTEXT, N_EXAMPLES, D_MODEL = 16, 12, 32
HOOK = "blocks.1.hook_resid_post"


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def cache(request, model_dir, text_file, tmp_path_factory):
    """(model directory, saelens store) for a tiny local causal LM."""
    model = str(model_dir(request.param))
    config = CaptureConfig(
        model=model,
        dataset=str(text_file),
        sites=(HOOK,),
        context_length=CONTEXT,
        max_examples=N_EXAMPLES,
        batch_size=4,
        progress=False,
    )
    out = str(tmp_path_factory.mktemp(f"saelens-{request.param}") / "acts")
    spec = get_format("saelens")
    store = capture(config, lambda plan: spec.open_writer(plan, out, SaelensOptions())).output
    return model, store


def runner_config(model: str, store, tmp_path, **changes):
    from sae_lens import LanguageModelSAERunnerConfig, LoggingConfig
    from sae_lens.saes.standard_sae import StandardTrainingSAEConfig

    values = {
        "sae": StandardTrainingSAEConfig(d_in=D_MODEL, d_sae=64),
        "model_name": model,
        "model_class_name": "AutoModelForCausalLM",
        "hook_name": HOOK,
        "dataset_path": str(store),
        "context_size": CONTEXT,
        "use_cached_activations": True,
        "cached_activations_path": str(store),
        "training_tokens": N_EXAMPLES * CONTEXT,
        "train_batch_size_tokens": 16,
        "store_batch_size_prompts": 2,
        "n_batches_in_buffer": 2,
        "device": "cpu",
        "logger": LoggingConfig(log_to_wandb=False),
        "output_path": str(tmp_path / "sae"),
        "n_checkpoints": 0,
    }
    values.update(changes)
    return LanguageModelSAERunnerConfig(**values)


def documented_overrides(model: str, store):
    """The two overrides of docs/saelens.md: the model, wrapped without hook names, and the
    store's own token ids as the dataset."""
    from sae_lens.load_model import HookedProxyLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hooked = HookedProxyLM(
        AutoModelForCausalLM.from_pretrained(model), AutoTokenizer.from_pretrained(model)
    )
    tokens = (
        datasets.load_from_disk(str(store))
        .select_columns(["token_ids"])
        .rename_column("token_ids", "input_ids")
    )
    return {"override_model": hooked, "override_dataset": tokens}


def test_runner_trains_from_the_cache_offline(cache, tmp_path, monkeypatch):
    from sae_lens import LanguageModelSAETrainingRunner

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, store = cache
    cfg = runner_config(model, store, tmp_path)
    runner = LanguageModelSAETrainingRunner(cfg, **documented_overrides(model, store))
    # the runner's store serves the cache's rows (its first batch is the first examples)
    acts, ids = runner.activations_store.get_raw_llm_batch()
    reader = SaelensReader(store)
    first = np.concatenate([reader.read_block(b) for b in reader.blocks(HOOK)])
    np.testing.assert_array_equal(acts.numpy(), first[: len(acts)])
    np.testing.assert_array_equal(ids.numpy(), np.asarray(reader.tokens).reshape(-1)[: len(ids)])
    before = runner.sae.W_enc.detach().clone()
    sae = runner.run()
    assert not torch.equal(before, sae.W_enc.detach()) and torch.isfinite(sae.W_enc).all()
    saved = json.loads((tmp_path / "sae" / "cfg.json").read_text())
    assert saved["d_in"] == D_MODEL and saved["metadata"]["hook_name"] == HOOK
    assert saved["metadata"]["model_name"] == model


def test_runner_without_the_overrides_fails_as_documented(cache, tmp_path):
    """Why docs/saelens.md passes both overrides: sae_lens loads ``model_name`` even for a
    cached run, and its AutoModelForCausalLM wrapper hooks only modules named like
    ``hook_name``; and it wants a dataset ``load_dataset`` can read (the cache is not one)."""
    from sae_lens import LanguageModelSAETrainingRunner

    model, store = cache
    cfg = runner_config(model, store, tmp_path)
    with pytest.raises(ValueError, match="hook_names not found as submodules"):
        LanguageModelSAETrainingRunner(cfg)
    overrides = documented_overrides(model, store)
    with pytest.raises(ValueError, match="save_to_disk"):
        LanguageModelSAETrainingRunner(cfg, override_model=overrides["override_model"])
