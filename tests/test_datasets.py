"""Datasets the way researchers name them: parquet/arrow/json/csv files and folders, Hub-style
repositories (config, split, streaming), pre-tokenized columns, token budgets, and offline
Hub ids. Local files go through the same ``datasets.load_dataset`` call as Hub ids."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from actstore.capture import CaptureConfig, capture, load_model, open_source
from actstore.capture.data import HFDataset
from actstore.errors import ConfigError, StoreNotFoundError
from actstore.formats.saev import SaevReader, SaevWriter

datasets = pytest.importorskip("datasets")

DOCS = [f"Sentence {i}: the {w} statement of Python." for i, w in enumerate(["if", "for"] * 20)]
CTX = 16


@pytest.fixture(scope="module")
def gpt2(model_dir):
    return load_model(str(model_dir("gpt2")))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """The same documents as .txt, .parquet, .arrow, .json, .csv and a folder of parquet."""
    root = tmp_path_factory.mktemp("data")
    (root / "docs.txt").write_text("\n\n".join(DOCS) + "\n  \n")  # blank lines are skipped
    table = datasets.Dataset.from_dict({"text": DOCS, "id": list(range(len(DOCS)))})
    table.to_parquet(root / "docs.parquet")
    table.to_json(root / "docs.json")
    table.to_csv(root / "docs.csv", index=False)
    with datasets.arrow_writer.ArrowWriter(path=str(root / "docs.arrow")) as writer:
        writer.write_table(table.data.table)
        writer.finalize()
    (root / "shards").mkdir()
    table.select(range(25)).to_parquet(root / "shards" / "part-0.parquet")
    table.select(range(25, len(DOCS))).to_parquet(root / "shards" / "part-1.parquet")
    return root


def test_every_file_kind_gives_the_same_contexts(gpt2, files):
    want = open_source(str(files / "docs.txt"), gpt2, context_length=CTX).token_ids
    assert want.shape[0] > 10
    for name in ("docs.parquet", "docs.arrow", "docs.json", "docs.csv", "shards"):
        source = open_source(str(files / name), gpt2, context_length=CTX)
        np.testing.assert_array_equal(source.token_ids, want, err_msg=name)
        assert source.describe()["kind"] == "hf_files" and source.root == str(files / name)
    shards = open_source(str(files / "shards"), gpt2, context_length=CTX).describe()
    assert [Path(f).name for f in shards["data_files"]] == ["part-0.parquet", "part-1.parquet"]


def test_streaming_a_local_file_reads_the_same_prefix_into_the_same_store(gpt2, files):
    """Local files are always read lazily, so --streaming changes nothing, not even the
    description (the store hash): both stop at the document that fills the budget."""
    full = open_source(str(files / "docs.parquet"), gpt2, context_length=CTX).token_ids
    for name in ("docs.parquet", "docs.json", "shards", "docs.txt"):
        path = str(files / name)
        plain = open_source(path, gpt2, context_length=CTX, max_examples=5)
        streamed = open_source(path, gpt2, context_length=CTX, max_examples=5, streaming=True)
        np.testing.assert_array_equal(streamed.token_ids, full[:5], err_msg=name)
        assert streamed.describe() == plain.describe() and "streaming" not in plain.describe()
        assert streamed.describe()["n_docs"] < len(DOCS)  # stopped once 5 contexts were full
    with pytest.raises(ConfigError, match="--streaming reads only what the store needs"):
        open_source(str(files / "docs.parquet"), gpt2, context_length=CTX, streaming=True)


def test_max_tokens_is_a_budget_next_to_max_examples(gpt2, files):
    path = str(files / "docs.parquet")
    full = open_source(path, gpt2, context_length=CTX).token_ids
    assert open_source(path, gpt2, context_length=CTX, max_tokens=4 * CTX + 3).n_examples == 4
    both = open_source(path, gpt2, context_length=CTX, max_tokens=10 * CTX, max_examples=3)
    np.testing.assert_array_equal(both.token_ids, full[:3])
    streamed = open_source(path, gpt2, context_length=CTX, max_tokens=6 * CTX, streaming=True)
    np.testing.assert_array_equal(streamed.token_ids, full[:6])
    with pytest.raises(ConfigError, match="--max-tokens 15 is less than one context of 16"):
        open_source(path, gpt2, context_length=CTX, max_tokens=15)


def test_pre_tokenized_rows_are_used_as_is(gpt2, model_dir, tmp_path):
    rng = np.random.default_rng(0)
    rows = rng.integers(4, 300, size=(9, CTX)).tolist()
    datasets.Dataset.from_dict({"input_ids": rows}).to_parquet(tmp_path / "tok.parquet")
    source = open_source(str(tmp_path / "tok.parquet"), gpt2, context_length=CTX)
    np.testing.assert_array_equal(source.token_ids, rows)  # no BOS added, nothing re-tokenized
    assert source.describe()["token_column"] == "input_ids"
    # Rows of other lengths are concatenated and cut, still without adding a token.
    ragged = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    datasets.Dataset.from_dict({"tokens": ragged}).to_parquet(tmp_path / "ragged.parquet")
    got = open_source(str(tmp_path / "ragged.parquet"), gpt2, context_length=4).token_ids
    assert got.tolist() == [[5, 6, 7, 8], [9, 10, 11, 12]]
    # A save_to_disk dataset of fixed-length token sequences (as SAELens pretokenizes).
    fixed = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32"), length=CTX)})
    datasets.Dataset.from_dict({"input_ids": rows}, features=fixed).save_to_disk(tmp_path / "s")
    saved = open_source(str(tmp_path / "s"), gpt2, context_length=CTX, max_tokens=5 * CTX)
    np.testing.assert_array_equal(saved.token_ids, rows[:5])
    streamed = open_source(
        str(tmp_path / "tok.parquet"), gpt2, context_length=CTX, max_examples=2, streaming=True
    )
    np.testing.assert_array_equal(streamed.token_ids, rows[:2])
    # Through capture: the store's tokens are the rows, in order.
    cfg = CaptureConfig(
        model=str(model_dir("gpt2")),
        dataset=str(tmp_path / "tok.parquet"),
        sites=("blocks.1.hook_resid_post",),
        context_length=CTX,
        batch_size=4,
        progress=False,
    )
    reader = SaevReader(capture(cfg, lambda plan: SaevWriter.from_plan(plan, tmp_path)).output)
    np.testing.assert_array_equal(reader.tokens, rows)
    assert reader.layers == (1,)


def test_token_ids_outside_the_vocabulary_are_refused(gpt2, tmp_path):
    datasets.Dataset.from_dict({"input_ids": [[1, 2, 50256, 3]]}).to_parquet(tmp_path / "t.parquet")
    with pytest.raises(ConfigError, match="token id 50256, outside .* vocabulary of 300"):
        open_source(str(tmp_path / "t.parquet"), gpt2, context_length=4)


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """A dataset repository laid out as on the Hub: two configs, each with two splits."""
    root = tmp_path_factory.mktemp("repo")
    for config, docs in (("small", DOCS[:20]), ("all", DOCS)):
        for split in ("train", "test"):
            (root / config).mkdir(exist_ok=True)
            rows = docs if split == "train" else docs[::-1]
            datasets.Dataset.from_dict({"text": rows}).to_parquet(
                root / config / f"{split}.parquet"
            )
    card = ["---", "configs:"]
    for config in ("small", "all"):
        card += [f"- config_name: {config}", "  data_files:"]
        card += [f"  - split: {s}\n    path: {config}/{s}.parquet" for s in ("train", "test")]
    (root / "README.md").write_text("\n".join([*card, "---", ""]))
    return root


def test_hub_repository_config_split_and_streaming(gpt2, repo):
    """The Hub's code path (load_dataset(id, name=config, split=..., streaming=...)) on a
    repository on disk, which load_dataset reads exactly as it reads a downloaded one."""
    ds = HFDataset(kind="hub", path=str(repo), config="small", split="test").load()
    assert ds["text"] == DOCS[:20][::-1]
    streamed = HFDataset(kind="hub", path=str(repo), config="all", split="train", streaming=True)
    assert [r["text"] for r in streamed.load().take(3)] == DOCS[:3]
    with pytest.raises(ConfigError, match="has no split 'validation'; choose one with --split"):
        HFDataset(kind="hub", path=str(repo), config="all", split="validation").load()
    # --dataset on the repository folder takes the same path, with config and split.
    source = open_source(str(repo), gpt2, context_length=CTX, dataset_config="small", split="test")
    want = open_source(str(repo / "small" / "test.parquet"), gpt2, context_length=CTX)
    np.testing.assert_array_equal(source.token_ids, want.token_ids)
    assert source.describe()["kind"] == "hf_repo" and source.describe()["config"] == "small"


def test_options_that_do_not_apply_are_refused(gpt2, files):
    with pytest.raises(ConfigError, match="--dataset-config applies to Hub ids"):
        open_source(str(files / "docs.parquet"), gpt2, dataset_config="small")
    with pytest.raises(ConfigError, match="plain data files, which form one split"):
        open_source(str(files / "shards"), gpt2, split="test")


def test_image_parquet_plain_and_streamed(model_dir, tmp_path):
    from PIL import Image

    model = load_model(str(model_dir("dinov2")))
    rng = np.random.default_rng(2)
    images = [Image.fromarray(rng.integers(0, 255, (36, 36, 3), dtype=np.uint8)) for _ in range(7)]
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b", "c"])}
    )
    table = datasets.Dataset.from_dict(
        {"image": images, "label": [0, 1, 2, 0, 1, 2, 0]}, features=features
    )
    table.save_to_disk(tmp_path / "saved")
    table.to_parquet(tmp_path / "img.parquet")
    saved = open_source(str(tmp_path / "saved"), model, max_examples=5)
    plain = open_source(str(tmp_path / "img.parquet"), model, max_examples=5)
    streamed = open_source(str(tmp_path / "img.parquet"), model, max_examples=5, streaming=True)
    want = next(saved.batches(0, 5)).inputs["pixel_values"]
    for source in (plain, streamed):
        assert source.n_examples == 5 and source.classes == ["a", "b", "c"]
        np.testing.assert_array_equal(source.labels[:5], [0, 1, 2, 0, 1])
        batch = next(source.batches(0, 5))
        assert torch.equal(batch.inputs["pixel_values"], want)
    with pytest.raises(ConfigError, match="--max-tokens counts text tokens"):
        open_source(str(tmp_path / "img.parquet"), model, max_tokens=100)


def test_hub_id_without_network_fails_at_once(gpt2, monkeypatch):
    """Online mode but no route to the Hub (this machine has none): one line, no retries."""
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.invalid")
    with pytest.raises(
        StoreNotFoundError, match=r"Hugging Face Hub \(hub.invalid\) cannot be"
    ) as err:
        open_source("someorg/somedata", gpt2, context_length=CTX)
    assert "\n" not in str(err.value) and "HF_HUB_OFFLINE=1" in str(err.value)
    with pytest.raises(StoreNotFoundError, match="'missing.parquet' does not exist"):
        open_source("missing.parquet", gpt2, context_length=CTX)


def test_offline_hub_id_is_one_line_from_the_cli(model_dir, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run(
        [sys.executable, "-m", "actstore", "capture", "--model", str(model_dir("gpt2"))]
        + ["--dataset", "someorg/somedata", "--out", str(tmp_path / "out"), "--no-progress"],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("error: dataset 'someorg/somedata' is not in the local Hugging Face")
    assert "Traceback" not in run.stderr and not (tmp_path / "out").exists()


def test_cli_passes_the_new_dataset_options(model_dir, files, tmp_path):
    from typer.testing import CliRunner

    from actstore.cli import app

    out = tmp_path / "out"
    args = ["capture", "--model", str(model_dir("gpt2")), "--dataset", str(files / "shards")]
    args += ["--streaming", "--max-tokens", str(3 * CTX), "--context-length", str(CTX)]
    args += ["--sites", "blocks.0.hook_resid_post,resid.2", "--out", str(out), "--no-progress"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    (store,) = [p for p in out.iterdir() if p.is_dir()]
    reader = SaevReader(store)
    assert reader.n_examples == 3 and reader.layers == (0, 2)
    assert reader.metadata.dataset == str(files / "shards")


def test_example_sources_share_one_typed_contract(gpt2, files, model_dir, image_folder):
    from actstore.capture.data import ExampleSource, ImageSource, TextSource
    from actstore.capture.prompts import PromptResponseSource

    with pytest.raises(TypeError, match="abstract"):
        ExampleSource()  # type: ignore[abstract]

    class Partial(ExampleSource):
        n_examples = 1  # type: ignore[assignment]

    with pytest.raises(TypeError, match="abstract"):
        Partial()  # type: ignore[abstract]
    assert all(
        issubclass(c, ExampleSource) for c in (TextSource, ImageSource, PromptResponseSource)
    )
    text = open_source(str(files / "docs.parquet"), gpt2, context_length=CTX, max_examples=3)
    assert (text.n_examples, text.tokens_per_example, text.has_tokens) == (3, CTX, True)
    assert text.labels is None and text.classes is None and text.plan_extras == {}
    images = open_source(str(image_folder), load_model(str(model_dir("clip"))))
    assert images.token_ids is None and not images.has_tokens and images.tokens_per_example is None
    assert images.classes == ["cat", "dog", "owl"] and images.labels.shape == (15,)
    assert images.plan_extras["image_files"][0].endswith("cat_000.jpg")


def test_streamed_capture_resumes_and_splits_exactly(model_dir, files, tmp_path):
    """A streamed dataset is read in the same order by every run: the machines of a
    distributed capture merge into the store one process writes, and a rerun finds it."""
    from actstore.dist import capture_distributed
    from actstore.formats import get_format
    from actstore.formats.saev import SaevOptions

    cfg = CaptureConfig(
        model=str(model_dir("gpt2")),
        dataset=str(files / "shards"),
        streaming=True,
        max_tokens=12 * CTX,
        sites=("blocks.1.hook_resid_post",),
        batch_size=2,
        context_length=CTX,
        progress=False,
    )
    options = SaevOptions(patches_per_shard=4 * CTX)
    spec = get_format("saev")
    single = capture(cfg, lambda plan: spec.open_writer(plan, str(tmp_path / "one"), options))
    again = capture(cfg, lambda plan: spec.open_writer(plan, str(tmp_path / "one"), options))
    assert again.already_complete and again.output == single.output
    out = str(tmp_path / "many")
    results = [
        capture_distributed(cfg, "saev", out, options, machine_id=i, n_machines=2) for i in (1, 0)
    ]
    merged = results[-1].published
    assert merged.name == single.output.name
    one, many = SaevReader(single.output), SaevReader(merged)
    assert one.n_examples == 12
    np.testing.assert_array_equal(many.tokens, one.tokens)
    np.testing.assert_array_equal(many[:, 1], one[:, 1])
