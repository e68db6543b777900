"""Captured activations equal a plain Hugging Face forward pass, exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actstore.capture import ActivationRecorder, CaptureConfig, capture, load_model, open_source
from actstore.errors import ConfigError
from actstore.formats.saev import SaevReader, SaevWriter
from actstore.sites import Site

BATCH = 4


def _plain_hidden_states(kind_dir, source, n_examples):
    """output_hidden_states of an untouched model on the same batches as capture."""
    model = load_model(str(kind_dir))
    out = []
    with torch.inference_mode():
        for sb in source.batches(0, BATCH):
            hs = model.module(**sb.inputs, output_hidden_states=True).hidden_states
            out.append(torch.stack(hs, dim=1).numpy())  # [B, n_layers + 1, T, D]
    return np.concatenate(out)[:n_examples]


@pytest.mark.parametrize("kind", ["clip", "siglip", "dinov2", "gpt2", "llama", "qwen2"])
def test_saev_store_equals_output_hidden_states(kind, model_dir, image_folder, text_file, tmp_path):
    dataset = image_folder if kind in ("clip", "siglip", "dinov2") else text_file
    cfg = CaptureConfig(
        model=str(model_dir(kind)),
        dataset=str(dataset),
        sites=("resid.0", "resid.-2"),
        batch_size=BATCH,
        context_length=16,
        max_examples=10,
        progress=False,
    )
    result = capture(cfg, lambda plan: SaevWriter.from_plan(plan, tmp_path, patches_per_shard=200))
    reader = SaevReader(result.output)
    assert reader.layers == (0, 2)  # -2 stored as its absolute index
    model = load_model(str(model_dir(kind)))
    source = open_source(str(dataset), model, context_length=16, max_examples=10)
    expected = _plain_hidden_states(model_dir(kind), source, reader.n_examples)
    for layer in reader.layers:
        got = reader[:, layer]  # [N, T, D]
        np.testing.assert_array_equal(got, expected[:, layer + 1])  # hidden_states[0] = embeddings
    assert reader.metadata.n_shards > 1  # several shards were written and stitched back
    if kind in ("clip", "dinov2"):
        assert reader.metadata.cls_token and reader.tokens_per_ex == 17  # CLS + 16 patches
    if kind == "siglip":
        assert not reader.metadata.cls_token and reader.tokens_per_ex == 16


def test_text_capture_keeps_token_ids(model_dir, text_file, tmp_path):
    cfg = CaptureConfig(
        model=str(model_dir("llama")),
        dataset=str(text_file),
        sites=("resid.1",),
        batch_size=3,
        context_length=12,
        max_examples=7,
        progress=False,
    )
    result = capture(cfg, lambda plan: SaevWriter.from_plan(plan, tmp_path))
    reader = SaevReader(result.output)
    model = load_model(str(model_dir("llama")))
    source = open_source(str(text_file), model, context_length=12, max_examples=7)
    np.testing.assert_array_equal(reader.tokens, source.token_ids)
    assert (reader.tokens[:, 0] == 1).all()  # Llama-style tokenizer: every context starts with <s>
    assert reader.metadata.family == "llama" and not reader.metadata.cls_token


def test_image_labels_from_class_folders(model_dir, image_folder, tmp_path):
    cfg = CaptureConfig(
        model=str(model_dir("clip")),
        dataset=str(image_folder),
        sites=("resid.1",),
        batch_size=4,
        progress=False,
    )
    reader = SaevReader(capture(cfg, lambda p: SaevWriter.from_plan(p, tmp_path)).output)
    assert reader.classes == ["cat", "dog", "owl"]
    labels = np.asarray(reader.labels)
    assert labels.shape == (15, 16) and labels.dtype == np.uint8  # one label per patch
    np.testing.assert_array_equal(labels[:, 0], np.repeat([0, 1, 2], 5))


def test_forward_stops_after_last_requested_block(model_dir):
    model = load_model(str(model_dir("gpt2")))
    calls = []
    handle = model.blocks[3].register_forward_hook(lambda *a: calls.append(1))
    with torch.inference_mode(), ActivationRecorder(model, [Site("resid", 1)]) as rec:
        acts = rec.run({"input_ids": torch.randint(0, 100, (2, 8))})
    handle.remove()
    assert calls == [] and acts["resid.1"].shape == (2, 8, 32)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen2", "clip"])
def test_sublayer_sites_add_up_to_the_residual_stream(kind, model_dir):
    """resid[i] == (resid[i-1] + attn_out[i]) + mlp_out[i], bit for bit, in every block."""
    model = load_model(str(model_dir(kind)))
    sites = [
        Site(k, layer)
        for layer in (1, 2)
        for k in ("resid", "attn_out", "mlp_out", "attn_in", "mlp_in")
    ] + [Site("resid", 0)]
    inputs = (
        {"pixel_values": torch.randn(2, 3, 32, 32)}
        if kind == "clip"
        else {"input_ids": torch.randint(0, 300, (2, 9))}
    )
    with torch.inference_mode(), ActivationRecorder(model, sites) as rec:
        a = rec.run(inputs)
    for layer in (1, 2):
        mid = a[f"resid.{layer - 1}"] + a[f"attn_out.{layer}"]
        assert torch.equal(mid + a[f"mlp_out.{layer}"], a[f"resid.{layer}"])
        assert a[f"attn_in.{layer}"].shape == a[f"mlp_in.{layer}"].shape == mid.shape
        assert not torch.equal(a[f"attn_in.{layer}"], a[f"resid.{layer - 1}"])  # normalised input


def test_bad_site_and_layer_errors(model_dir):
    model = load_model(str(model_dir("dinov2")))
    with pytest.raises(ConfigError, match="out of range"):
        ActivationRecorder(model, [Site("resid", 4)])
    with pytest.raises(ConfigError, match="unknown site kind"):
        Site.parse("mlp_post.3")
    with pytest.raises(ConfigError, match="saev protocol stores the residual stream only"):
        capture(
            CaptureConfig(
                model=str(model_dir("gpt2")),
                dataset="embedded",
                sites=("mlp_out.1",),
                max_examples=2,
                progress=False,
            ),
            lambda plan: SaevWriter.from_plan(plan, "unused"),
        )


def test_progress_bars_respect_tqdm_disable(model_dir, text_file, tmp_path, capsys):
    """Regression: progress=True passed disable=False to tqdm, which overrides TQDM_DISABLE."""
    from tqdm import tqdm as std_tqdm

    if not std_tqdm(total=1).disable:
        pytest.skip("TQDM_DISABLE is not set in this run")
    capsys.readouterr()
    cfg = CaptureConfig(
        model=str(model_dir("gpt2")),
        dataset=str(text_file),
        sites=("resid.1",),
        batch_size=2,
        context_length=8,
        max_examples=4,
        progress=True,
    )
    capture(cfg, lambda plan: SaevWriter.from_plan(plan, tmp_path))
    err = capsys.readouterr().err
    assert "%|" not in err, err  # neither the tokenising nor the capture bar was drawn
