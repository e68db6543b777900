"""Prompt/response capture from tiny real causal LMs into the zarr store.

Checks the token split (with and without a chat template), given and generated (greedy)
responses, truncation, and that stored float16 activations equal a plain transformers
forward pass (``output_hidden_states``) over the same inputs, cast to float16.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import transformers as tf
from typer.testing import CliRunner

from actstore.capture import CaptureConfig, capture
from actstore.capture.prompts import encode_pair, encode_prompt, read_records
from actstore.cli import app
from actstore.errors import ConfigError
from actstore.formats.zarr import ZarrOptions, ZarrReader, ZarrWriter

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
QA = [
    {
        "prompt": "What does the yield statement do?",
        "response": "It suspends a generator.",
        "hallu_label": 0,
        "split": "train",
    },
    {"prompt": "Name a built-in type.", "response": "int", "hallu_label": 1, "split": "val"},
    {
        "prompt": "How are exceptions raised in Python, and what happens when one is not caught "
        "by any handler?",
        "response": "With raise; an uncaught one ends the program with a traceback.",
        "hallu_label": 0,
        "split": "test",
    },
    {"prompt": "Is a tuple mutable?", "response": "No.", "hallu_label": 1, "split": "train"},
    {
        "prompt": "What is a decorator?",
        "response": "A callable that wraps a function.",
        "hallu_label": 0,
        "split": "train",
    },
]
LAYERS = (0, 2)


@pytest.fixture(scope="module")
def qa_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("qa") / "qa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in QA), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def chat_model(model_dir, tmp_path_factory):
    """The tiny Llama with a tokenizer that has a (simple Jinja) chat template."""
    directory = tmp_path_factory.mktemp("chat-llama")
    shutil.copytree(model_dir("llama"), directory, dirs_exist_ok=True)
    tok = tf.AutoTokenizer.from_pretrained(directory)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(directory)
    return directory


def run_capture(model, dataset, out, *, options=None, batch_size=2, **config):
    cfg = CaptureConfig(
        model=str(model),
        dataset=str(dataset),
        sites=tuple(f"resid.{x}" for x in LAYERS),
        batch_size=batch_size,
        mode="prompt_response",
        progress=False,
        **config,
    )
    result = capture(cfg, lambda plan: ZarrWriter.from_plan(plan, out, options or ZarrOptions()))
    return ZarrReader(result.output), result


def reference_hidden(model, reader):
    """Plain forward pass of each sample alone (no padding): hidden_states per layer."""
    lm = tf.AutoModelForCausalLM.from_pretrained(model).eval()
    out = []
    for i in range(len(reader)):
        ids = np.concatenate([reader.token_ids(i, "prompt"), reader.token_ids(i, "response")])
        with torch.inference_mode():
            hs = lm(
                torch.from_numpy(ids.astype(np.int64))[None], output_hidden_states=True
            ).hidden_states
        out.append({layer: hs[layer + 1][0].to(torch.float16).numpy() for layer in LAYERS})
    return out


def assert_same_f16(got, want):
    """Equal float16 values, but for rare one-ulp flips: a batched, padded forward and a
    one-sample forward may differ in the last float32 bit, which can move a value across
    a float16 rounding boundary (see docs/design.md, Reproducibility)."""
    assert got.shape == want.shape and got.dtype == want.dtype == np.float16
    ulp = np.spacing(np.abs(want)).astype(np.float32)
    diff = np.abs(got.astype(np.float32) - want.astype(np.float32))
    assert (diff <= ulp).all(), f"max difference {diff.max()} is more than one float16 ulp"
    assert np.count_nonzero(diff) <= max(1, got.size // 100), "more than 1% of values differ"


def assert_exact(reader, reference):
    for i, hidden in enumerate(reference):
        p, r = int(reader.prompt_len[i]), int(reader.response_len[i])
        for layer in LAYERS:
            assert_same_f16(reader.read(i, layer, "prompt"), hidden[layer][:p])
            assert_same_f16(reader.read(i, layer, "response"), hidden[layer][p : p + r])
            padded = reader.read(i, layer, "response", trim=False)
            assert padded.shape == (reader.layout.r_max, reader.d_model) and not padded[r:].any()


# ---------------------------------------------------------------------------- token split


def test_split_without_chat_template(model_dir):
    for kind, prefix in (("gpt2", []), ("llama", [1])):
        tok = tf.AutoTokenizer.from_pretrained(model_dir(kind))
        prompt_ids, response_ids = encode_pair(tok, "What is a list?", " A sequence.")
        assert prompt_ids == prefix + tok("What is a list?", add_special_tokens=False)["input_ids"]
        assert response_ids == tok(" A sequence.", add_special_tokens=False)["input_ids"]


def test_split_with_chat_template(chat_model):
    tok = tf.AutoTokenizer.from_pretrained(chat_model)
    prompt_ids, response_ids = encode_pair(tok, "Is a tuple mutable?", "No.")
    assert tok.decode(prompt_ids) == "<s>user\nIs a tuple mutable?</s>\n<s>assistant\n"
    assert tok.decode(response_ids) == "No.</s>\n"
    conversation = tok.apply_chat_template(
        [
            {"role": "user", "content": "Is a tuple mutable?"},
            {"role": "assistant", "content": "No."},
        ],
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    assert prompt_ids + response_ids == list(conversation)
    assert encode_prompt(tok, "Hi", chat_template=False) == tok("Hi")["input_ids"]


# ---------------------------------------------------------------------------- capture


@pytest.mark.slow
def test_given_responses_with_chat_template_are_exact(chat_model, qa_file, tmp_path):
    reader, result = run_capture(chat_model, qa_file, tmp_path / "out")
    tok = tf.AutoTokenizer.from_pretrained(chat_model)
    assert result.plan.data["chat_template"] is True and len(reader) == len(QA)
    for i, record in enumerate(QA):
        prompt_ids, response_ids = encode_pair(tok, record["prompt"], record["response"])
        assert reader.token_ids(i, "prompt").tolist() == prompt_ids
        assert reader.token_ids(i, "response").tolist() == response_ids
        assert reader.text(i, "prompt") == record["prompt"]
        assert reader.text(i, "response") == record["response"]
    assert reader.array("hallu_label").tolist() == [r["hallu_label"] for r in QA]
    assert reader.array("split").tolist() == [0, 1, 2, 0, 0]
    assert reader.attrs["prompt_truncated_count"] == 0 and reader.attrs["R_max"] == max(
        len(encode_pair(tok, r["prompt"], r["response"])[1]) for r in QA
    )
    assert_exact(reader, reference_hidden(chat_model, reader))
    assert reader.verify().ok


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "qwen2"])
def test_given_responses_without_template_are_exact(kind, model_dir, qa_file, tmp_path):
    reader, _ = run_capture(model_dir(kind), qa_file, tmp_path / "out", batch_size=1)
    tok = tf.AutoTokenizer.from_pretrained(model_dir(kind))
    for i, record in enumerate(QA):
        assert (
            reader.token_ids(i, "response").tolist()
            == tok(record["response"], add_special_tokens=False)["input_ids"]
        )
    assert_exact(reader, reference_hidden(model_dir(kind), reader))


@pytest.mark.slow
def test_generated_responses_are_greedy_continuations(chat_model, qa_file, tmp_path):
    reader, result = run_capture(chat_model, qa_file, tmp_path / "out", generate_max_new_tokens=4)
    tok = tf.AutoTokenizer.from_pretrained(chat_model)
    lm = tf.AutoModelForCausalLM.from_pretrained(chat_model).eval()
    assert "generated" in result.plan.data["responses"]
    for i, record in enumerate(QA):
        prompt_ids = encode_prompt(tok, record["prompt"])
        assert reader.token_ids(i, "prompt").tolist() == prompt_ids
        alone = lm.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=4,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
        )[0, len(prompt_ids) :].tolist()
        if tok.eos_token_id in alone:
            alone = alone[: alone.index(tok.eos_token_id) + 1]
        assert reader.token_ids(i, "response").tolist() == alone
        assert reader.text(i, "response") == tok.decode(alone, skip_special_tokens=True)
    assert_exact(reader, reference_hidden(chat_model, reader))


@pytest.mark.slow
def test_truncation_keeps_the_chosen_tokens_and_is_recorded(model_dir, qa_file, tmp_path):
    options = ZarrOptions(p_max=6, r_max=3, prompt_keep="last")
    reader, _ = run_capture(model_dir("gpt2"), qa_file, tmp_path / "out", options=options)
    tok = tf.AutoTokenizer.from_pretrained(model_dir("gpt2"))
    pairs = [encode_pair(tok, r["prompt"], r["response"]) for r in QA]
    full_p = np.array([len(p) for p, _ in pairs])
    full_r = np.array([len(r) for _, r in pairs])
    np.testing.assert_array_equal(reader.prompt_len, np.minimum(full_p, 6))
    np.testing.assert_array_equal(reader.array("prompt_len_full"), full_p)
    np.testing.assert_array_equal(reader.array("response_len_full"), full_r)
    assert reader.attrs["prompt_truncated_count"] == int((full_p > 6).sum())
    assert reader.attrs["response_truncated_fraction"] == (full_r > 3).mean()
    lm = tf.AutoModelForCausalLM.from_pretrained(model_dir("gpt2")).eval()
    for i, (p_ids, r_ids) in enumerate(pairs):
        assert reader.token_ids(i, "prompt").tolist() == p_ids[-6:]  # the last 6 prompt tokens
        assert reader.token_ids(i, "response").tolist() == r_ids[:3]
        with torch.inference_mode():
            hs = lm(torch.tensor([p_ids + r_ids]), output_hidden_states=True).hidden_states[3]
        want = hs[0].to(torch.float16).numpy()
        p = len(p_ids)
        np.testing.assert_allclose(reader.read(i, 2, "prompt"), want[max(0, p - 6) : p], atol=2e-3)
        np.testing.assert_allclose(
            reader.read(i, 2, "response"), want[p : p + min(3, len(r_ids))], atol=2e-3
        )


def test_records_errors_name_the_field(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    with pytest.raises(ConfigError, match="--prompt-field"):
        read_records(str(path))
    with pytest.raises(ConfigError, match="--generate-max-new-tokens"):
        read_records(str(path), prompt_field="question")
    records, _ = read_records(str(path), prompt_field="question", response_field="answer")
    assert records[0].prompt == "q" and records[0].response == "a"
    path.write_text(json.dumps({"prompt": "q", "response": "a", "split": "dev"}) + "\n")
    with pytest.raises(ConfigError, match="split"):
        read_records(str(path))
    with pytest.raises(ConfigError, match="prompt_response"):
        CaptureConfig(mode="chat")


def test_hf_dataset_records(tmp_path):
    import datasets

    datasets.Dataset.from_list(QA).save_to_disk(str(tmp_path / "qa"))
    records, root = read_records(str(tmp_path / "qa"), max_examples=3)
    assert [r.prompt for r in records] == [r["prompt"] for r in QA[:3]]
    assert [r.split for r in records] == [0, 1, 2] and root == str(tmp_path / "qa")


@pytest.mark.slow
def test_cli_prompt_response_capture(model_dir, qa_file, tmp_path):
    runner = CliRunner()
    result = runner.invoke(
        app,
        [
            "capture",
            "--model",
            str(model_dir("gpt2")),
            "--dataset",
            str(qa_file),
            "--layers",
            "0,2",
            "--format",
            "zarr",
            "--mode",
            "prompt-response",
            "--opt",
            "r_max=4",
            "--out",
            str(tmp_path / "out"),
            "--no-progress",
        ],
    )
    assert result.exit_code == 0, result.output
    store = tmp_path / "out" / "activations.zarr"
    assert str(store) in result.output
    assert ZarrReader(store).layout.r_max == 4
    again = runner.invoke(
        app,
        [
            "capture",
            "--model",
            str(model_dir("gpt2")),
            "--dataset",
            str(qa_file),
            "--layers",
            "0,2",
            "--format",
            "zarr",
            "--mode",
            "prompt-response",
            "--opt",
            "r_max=4",
            "--out",
            str(tmp_path / "out"),
            "--no-progress",
        ],
    )
    assert again.exit_code == 0 and "Already captured" in again.output
    inspect = runner.invoke(app, ["inspect", str(store)])
    assert inspect.exit_code == 0 and "R_max" in inspect.output, inspect.output
    verify = runner.invoke(app, ["verify", str(store), "--no-progress"])
    assert verify.exit_code == 0, verify.output


@pytest.mark.slow
def test_sharded_capture_reads_like_a_single_capture(model_dir, qa_file, tmp_path):
    """Each shard writer takes only its example range (as a distributed worker would); the
    run, read through its manifest, equals one capture of the whole dataset."""
    from actstore.formats.zarr import write_manifest

    single, _ = run_capture(model_dir("qwen2"), qa_file, tmp_path / "single")
    cfg = CaptureConfig(
        model=str(model_dir("qwen2")),
        dataset=str(qa_file),
        sites=tuple(f"resid.{x}" for x in LAYERS),
        batch_size=2,
        mode="prompt_response",
        progress=False,
    )
    run = tmp_path / "run"
    for index in range(2):
        result = capture(cfg, lambda plan, index=index: ZarrWriter.for_shard(plan, run, index, 2))
        assert result.n_examples_run == (3 if index == 0 else 2)
    write_manifest(run)
    sharded = ZarrReader(run)
    assert len(sharded.stores) == 2 and sharded.sample_keys == single.sample_keys
    for i in range(len(QA)):
        for layer in LAYERS:
            for part in ("prompt", "response"):
                np.testing.assert_array_equal(
                    sharded.read(i, layer, part), single.read(i, layer, part)
                )
