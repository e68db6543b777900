"""SAELens's own training runner (``LanguageModelSAETrainingRunner``, sae-lens 6.54) trains an
SAE from an actstore saelens store of a local Hugging Face model, offline, with the one call
docs/saelens.md ("Training with SAELens's runner") shows: ``actstore.saelens.training_runner``.
No override, no renamed column, no logging switch in the user's code."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from actstore.capture import CaptureConfig, capture
from actstore.errors import ConfigError, LayerNotStoredError
from actstore.formats import get_format
from actstore.formats.saelens import SaelensOptions, SaelensReader
from actstore.saelens import open_cache, training_runner
from actstore.sites import Site

sae_lens = pytest.importorskip("sae_lens")

CONTEXT, N_EXAMPLES, D_MODEL = 16, 12, 32
HOOK = "blocks.1.hook_resid_post"
#: the store's columns: the block output, the MLP's output and the MLP's (normed) input
COLUMNS = {
    HOOK: Site("resid", 1),
    "blocks.1.hook_mlp_out": Site("mlp_out", 1),
    "blocks.1.ln2.hook_normalized": Site("mlp_in", 1),
}


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def cache(request, model_dir, text_file, tmp_path_factory):
    """(model directory, saelens store) for a tiny local causal LM."""
    model = str(model_dir(request.param))
    config = CaptureConfig(
        model=model,
        dataset=str(text_file),
        sites=(HOOK, "mlp_out.1", "mlp_in.1"),
        context_length=CONTEXT,
        max_examples=N_EXAMPLES,
        batch_size=4,
        progress=False,
    )
    out = str(tmp_path_factory.mktemp(f"saelens-{request.param}") / "acts")
    spec = get_format("saelens")
    store = capture(config, lambda plan: spec.open_writer(plan, out, SaelensOptions())).output
    return model, str(store)


def test_one_call_trains_with_saelens_runner_offline(cache, tmp_path, monkeypatch):
    """The documented flow, end to end: SAELens's runner, SAELens's training loop."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    model, store = cache
    runner = training_runner(
        store,
        hook=HOOK,
        d_sae=64,
        training_tokens=N_EXAMPLES * CONTEXT,
        train_batch_size_tokens=16,
        store_batch_size_prompts=2,
        n_batches_in_buffer=2,
        output_path=str(tmp_path / "sae"),
    )
    assert isinstance(runner, sae_lens.LanguageModelSAETrainingRunner)
    assert runner.cfg.logger.log_to_wandb is False  # off unless asked for
    # the runner's store serves the cache's rows (its first batch is the first examples)
    acts, ids = runner.activations_store.get_raw_llm_batch()
    reader = SaelensReader(store)
    first = np.concatenate([reader.read_block(b) for b in reader.blocks(HOOK)])
    np.testing.assert_array_equal(acts.numpy(), first[: len(acts)])
    np.testing.assert_array_equal(ids.numpy(), np.asarray(reader.tokens).reshape(-1)[: len(ids)])
    before = runner.sae.W_enc.detach().clone()
    sae = runner.run()
    assert not torch.equal(before, sae.W_enc.detach()) and torch.isfinite(sae.W_enc).all()
    assert runner.model.loaded is False  # training from the cache never ran the model
    saved = json.loads((tmp_path / "sae" / "cfg.json").read_text())
    assert saved["d_in"] == D_MODEL and saved["d_sae"] == 64
    meta = saved["metadata"]
    assert (meta["hook_name"], meta["model_name"], meta["context_size"]) == (HOOK, model, CONTEXT)
    assert meta["model_class_name"] == "AutoModelForCausalLM"
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "wandb").exists()


def test_config_pieces_describe_the_store(cache):
    model, store = cache
    found = open_cache(store, hook="mlp_out.1")  # any site spelling picks the column
    assert found.hook_name == "blocks.1.hook_mlp_out" and found.site == Site("mlp_out", 1)
    assert (found.d_in, found.context_size, found.n_examples) == (D_MODEL, CONTEXT, N_EXAMPLES)
    assert dict(found.hooks) == COLUMNS
    pieces = found.config(training_tokens=100)
    logger = pieces.pop("logger")
    assert logger.log_to_wandb is False
    assert pieces == {
        "model_name": model,
        "model_class_name": "AutoModelForCausalLM",
        "hook_name": "blocks.1.hook_mlp_out",
        "dataset_path": store,
        "is_dataset_tokenized": True,
        "streaming": False,
        "context_size": CONTEXT,
        "use_cached_activations": True,
        "cached_activations_path": store,
        "training_tokens": 100,
    }
    tokens = found.dataset()
    assert tokens.column_names == ["input_ids"] and len(tokens) == N_EXAMPLES
    assert (
        np.asarray(tokens["input_ids"]).tolist()
        == np.asarray(SaelensReader(store).tokens).reshape(N_EXAMPLES, CONTEXT).tolist()
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {},
            ConfigError,
            r"holds 3 columns \(blocks.1.hook_resid_post, .*\); choose one with hook=",
        ),
        ({"hook": "resid.2"}, LayerNotStoredError, "site resid.2 is not in this store; it holds"),
        ({"hook": HOOK, "context_size": 8}, ConfigError, "context_size=8 does not describe"),
        ({"hook": HOOK, "sae_d_in": 16}, ConfigError, "the SAE's d_in is 16, but .* has d_in 32"),
    ],
)
def test_a_runner_that_cannot_fit_the_store_is_one_line(cache, kwargs, error, message):
    from sae_lens.saes.standard_sae import StandardTrainingSAEConfig

    _, store = cache
    kwargs = dict(kwargs)
    sae = StandardTrainingSAEConfig(d_in=kwargs.pop("sae_d_in", D_MODEL), d_sae=8)
    with pytest.raises(error, match=message) as err:
        training_runner(store, sae, **kwargs)
    assert "\n" not in str(err.value)


def test_proxy_hook_points_are_the_store_columns(cache):
    """SAELens's evaluations read ``hook_name`` from the model and splice the SAE's output
    into it: the proxy's hook points hold exactly what the store holds, and replacing one
    changes the logits."""
    _, store = cache
    model = open_cache(store, hook=HOOK).model()
    assert sorted(model.hook_dict) == sorted(COLUMNS) and not model.loaded
    reader = SaelensReader(store)
    tokens = torch.as_tensor(np.asarray(reader.tokens).reshape(N_EXAMPLES, CONTEXT)[:2]).long()
    with torch.inference_mode():
        logits, cache_ = model.run_with_cache(tokens, names_filter=list(COLUMNS))
        for name in COLUMNS:
            stored = np.concatenate([reader.read_block(b) for b in reader.blocks(name)])
            torch.testing.assert_close(
                cache_[name].reshape(-1, D_MODEL),
                torch.as_tensor(stored[: 2 * CONTEXT]),
                rtol=1e-5,
                atol=1e-5,
            )
        zeroed = model.run_with_hooks(tokens, fwd_hooks=[(HOOK, lambda x, hook: x * 0)])
    assert model.loaded and logits.shape == (2, CONTEXT, 300)
    assert not torch.allclose(logits, zeroed)


def test_logging_on_runs_saelens_evaluations_on_the_proxy(cache, tmp_path, monkeypatch):
    """With W&B logging asked for, SAELens evaluates during training: it runs the proxy
    (which loads the checkpoint then), reads hook_name from it and splices the SAE in. W&B
    itself is disabled here (WANDB_MODE=disabled: no network, nothing written)."""
    from sae_lens import LoggingConfig

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.chdir(tmp_path)
    _, store = cache
    runner = training_runner(
        store,
        hook=HOOK,
        d_sae=64,
        training_tokens=4 * CONTEXT,
        train_batch_size_tokens=16,
        store_batch_size_prompts=2,
        n_batches_in_buffer=2,
        n_eval_batches=1,
        eval_batch_size_prompts=2,
        logger=LoggingConfig(log_to_wandb=True, wandb_log_frequency=1, eval_every_n_wandb_logs=2),
        output_path=str(tmp_path / "sae"),
    )
    ran = []
    evaluate = runner.evaluator.__call__

    class Counting:
        def __call__(self, *args):
            ran.append(metrics := evaluate(*args))
            return metrics

    runner.evaluator = Counting()
    runner.run()
    assert runner.model.loaded and len(ran) == 2  # steps 2 and 4 of 4
    ce = ran[0]["model_performance_preservation"]
    assert {"ce_loss_with_sae", "ce_loss_with_ablation", "ce_loss_without_sae"} <= set(ce), ran[0]
    assert all(np.isfinite(v) for v in ce.values())
    assert ce["ce_loss_with_sae"] != ce["ce_loss_with_ablation"]  # the splice took effect


def test_the_bare_runner_still_needs_what_the_helper_supplies(cache, tmp_path):
    """Why the helper exists: on its own, sae_lens loads ``model_name`` even for a cached run
    and hooks only modules named like ``hook_name``; and it wants a dataset ``load_dataset``
    can read (the store is not one)."""
    from sae_lens import LanguageModelSAETrainingRunner

    _, store = cache
    found = open_cache(store, hook=HOOK)
    cfg = found.runner_config(d_sae=8, output_path=str(tmp_path / "sae"))
    with pytest.raises(ValueError, match="hook_names not found as submodules"):
        LanguageModelSAETrainingRunner(cfg)
    with pytest.raises(ValueError, match="save_to_disk"):
        LanguageModelSAETrainingRunner(cfg, override_model=found.model())


def test_a_cache_saelens_wrote_trains_the_same_way(model_dir, tmp_path, monkeypatch):
    """A cache SAELens's own CacheActivationsRunner wrote (its column named after a Hugging
    Face module, no record of the model): the same call, given model_name; the proxy hooks
    that module as HookedProxyLM would."""
    import warnings

    import datasets
    from sae_lens.cache_activations_runner import CacheActivationsRunner
    from sae_lens.config import CacheActivationsRunnerConfig

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    model, column, n, t = str(model_dir("gpt2")), "transformer.h.1", 8, 8
    tokens = np.random.default_rng(0).integers(4, 300, (n, t))
    out = tmp_path / "theirs"
    cfg = CacheActivationsRunnerConfig(
        dataset_path="local",
        model_name=model,
        model_class_name="AutoModelForCausalLM",
        model_batch_size=2,
        hook_name=column,
        d_in=D_MODEL,
        training_tokens=n * t,
        context_size=t,
        new_cached_activations_path=str(out),
        device="cpu",
        buffer_size_gb=2 * 2 * t * D_MODEL * 4 / 1e9,  # 2 model batches per file
        prepend_bos=False,
        streaming=False,
        shuffle=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        CacheActivationsRunner(
            cfg, override_dataset=datasets.Dataset.from_dict({"tokens": tokens})
        ).run()
    with pytest.raises(ConfigError, match="records no model .*; pass model_name="):
        training_runner(out, d_sae=16)
    runner = training_runner(
        out,
        d_sae=16,
        model_name=model,
        training_tokens=n * t,
        train_batch_size_tokens=16,
        store_batch_size_prompts=2,
        n_batches_in_buffer=2,
        output_path=str(tmp_path / "sae"),
    )
    sae = runner.run()
    assert torch.isfinite(sae.W_enc).all() and not runner.model.loaded
    with torch.inference_mode():
        _, cache_ = runner.model.run_with_cache(torch.as_tensor(tokens[:2]), names_filter=[column])
    stored = np.asarray(datasets.load_from_disk(str(out)).with_format("numpy")[column][:2])
    torch.testing.assert_close(cache_[column], torch.as_tensor(stored), rtol=1e-5, atol=1e-5)


def test_the_runner_warns_of_too_few_tokens_only_when_the_store_holds_too_few(
    cache, tmp_path, monkeypatch
):
    """Issue 38 (12): SAELens compares the dataset's samples (contexts) with the training
    tokens, so it warned that a store holding more tokens than training needs holds too
    few; the runner compares tokens with tokens."""
    import warnings

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    _, store = cache
    held = N_EXAMPLES * CONTEXT
    common = {"hook": HOOK, "d_sae": 16, "train_batch_size_tokens": 16}
    common |= {"store_batch_size_prompts": 2, "n_batches_in_buffer": 2}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        training_runner(store, training_tokens=held // 2, **common)  # > samples, < tokens
    texts = [str(w.message) for w in seen]
    assert not [t for t in texts if "fewer" in t], texts
    with pytest.warns(UserWarning, match=rf"holds {held:,} tokens .* fewer than training_tokens"):
        training_runner(store, training_tokens=held * 2, **common)
