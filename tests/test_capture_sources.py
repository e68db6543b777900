"""Every dataset kind capture accepts, and the compute-dtype path."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from actstore.capture import CaptureConfig, capture, load_model, open_source
from actstore.errors import ConfigError, CorruptStoreError
from actstore.formats.saev import SaevReader, SaevWriter


def run(tmp_path, **kw):
    cfg = CaptureConfig(progress=False, **kw)
    return SaevReader(capture(cfg, lambda plan: SaevWriter.from_plan(plan, tmp_path)).output)


def test_jsonl_and_txt_give_the_same_contexts(model_dir, tmp_path):
    docs = [
        "The assert statement checks a condition.",
        "Lists are mutable sequences.",
        "A dict maps keys to values.",
    ] * 5
    (tmp_path / "c.txt").write_text("\n".join(docs))
    with open(tmp_path / "c.jsonl", "w") as f:
        f.writelines(json.dumps({"body": d}) + "\n" for d in docs)
    model = load_model(str(model_dir("gpt2")))
    txt = open_source(str(tmp_path / "c.txt"), model, context_length=8)
    jsonl = open_source(str(tmp_path / "c.jsonl"), model, context_length=8, text_field="body")
    np.testing.assert_array_equal(txt.token_ids, jsonl.token_ids)
    stream = np.concatenate(
        [np.append(model.tokenizer(d, add_special_tokens=False)["input_ids"], 2) for d in docs]
    )
    np.testing.assert_array_equal(txt.token_ids.reshape(-1), stream[: txt.token_ids.size])
    with pytest.raises(ConfigError, match="no 'text' field"):
        open_source(str(tmp_path / "c.jsonl"), model, context_length=8)
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{oops\n')
    with pytest.raises(CorruptStoreError, match="bad.jsonl:2 is not valid JSON"):
        open_source(str(tmp_path / "bad.jsonl"), model, context_length=8)


def test_hf_text_dataset_saved_to_disk(model_dir, tmp_path):
    datasets = pytest.importorskip("datasets")
    texts = [f"Sentence number {i} about Python syntax and semantics." for i in range(30)]
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts})}).save_to_disk(
        tmp_path / "hf"
    )
    reader = run(
        tmp_path / "out",
        model=str(model_dir("qwen2")),
        dataset=str(tmp_path / "hf"),
        sites=("resid.1",),
        context_length=16,
        batch_size=4,
    )
    assert reader.n_examples > 5 and reader.tokens.shape == (reader.n_examples, 16)
    with pytest.raises(ConfigError, match="choose one with --split"):
        run(
            tmp_path / "out2",
            model=str(model_dir("qwen2")),
            dataset=str(tmp_path / "hf"),
            sites=("resid.1",),
            split="validation",
        )


def test_hf_image_dataset_saved_to_disk_keeps_labels(model_dir, tmp_path):
    datasets = pytest.importorskip("datasets")
    from PIL import Image

    rng = np.random.default_rng(1)
    images = [Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)) for _ in range(6)]
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])}
    )
    datasets.Dataset.from_dict(
        {"image": images, "label": [0, 1, 1, 0, 1, 0]}, features=features
    ).save_to_disk(tmp_path / "hf")
    reader = run(
        tmp_path / "out",
        model=str(model_dir("dinov2")),
        dataset=str(tmp_path / "hf"),
        sites=("resid.-1",),
        batch_size=4,
        num_workers=2,
    )
    assert reader.classes == ["a", "b"]
    np.testing.assert_array_equal(np.asarray(reader.labels)[:, 0], [0, 1, 1, 0, 1, 0])
    assert reader.metadata.family == "dinov2" and reader.tokens_per_ex == 17


def test_bfloat16_compute_is_stored_as_float32(model_dir, text_file, tmp_path):
    reader = run(
        tmp_path,
        model=str(model_dir("llama")),
        dataset=str(text_file),
        sites=("resid.2",),
        dtype="bfloat16",
        context_length=8,
        max_examples=6,
        batch_size=3,
    )
    assert reader.metadata.dtype == "float32"
    model = load_model(str(model_dir("llama")), dtype="bfloat16")
    source = open_source(str(text_file), model, context_length=8, max_examples=6)
    with torch.inference_mode():
        hs = [
            model.module(**b.inputs, output_hidden_states=True).hidden_states[3]
            for b in source.batches(0, 3)
        ]
    expected = torch.cat(hs).to(torch.float32).numpy()
    np.testing.assert_array_equal(reader[:, 2], expected)


def test_empty_or_unknown_datasets_are_explained(model_dir, tmp_path):
    model = load_model(str(model_dir("clip")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no images"):
        open_source(str(tmp_path / "empty"), model)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ConfigError, match="x.csv holds no rows"):
        open_source(str(tmp_path / "x.csv"), model)
    (tmp_path / "x.xyz").write_text("a,b\n")
    with pytest.raises(ConfigError, match="cannot tell what kind of dataset"):
        open_source(str(tmp_path / "x.xyz"), model)
    text_model = load_model(str(model_dir("gpt2")))
    (tmp_path / "tiny.txt").write_text("hi\n")
    with pytest.raises(ConfigError, match="fewer tokens than one context"):
        open_source(str(tmp_path / "tiny.txt"), text_model, context_length=64)
