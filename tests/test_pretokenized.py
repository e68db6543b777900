"""Pre-tokenized input of every kind gives exactly the contexts of the same text tokenized by
the model: JSONL and JSON lists, parquet, arrow, save_to_disk, a Hub-style repository,
.npy (1-D and 2-D) and .bin token files (nanoGPT's raw uint16, llm.c's header). The column
is found from its type; ids are packed as they are and checked against the vocabulary; and
text is read only as far as the budget needs."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from actstore.capture import CaptureConfig, capture, load_model, open_source
from actstore.errors import ConfigError
from actstore.formats.saev import SaevReader, SaevWriter

datasets = pytest.importorskip("datasets")

CTX = 16
DOCS = [f"Sentence {i}: the {w} statement of Python, once more." for i, w in enumerate(["if"] * 30)]


@pytest.fixture(scope="module")
def gpt2(model_dir):
    return load_model(str(model_dir("gpt2")))


@pytest.fixture(scope="module")
def rows(gpt2):
    """Each document tokenized by the model, with its end-of-sequence token: what packing
    the text puts in the stream."""
    tok = gpt2.tokenizer
    return [tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for d in DOCS]


@pytest.fixture(scope="module")
def want(gpt2, tmp_path_factory):
    """The contexts of the text itself."""
    path = tmp_path_factory.mktemp("text") / "docs.txt"
    path.write_text("\n".join(DOCS))
    return open_source(str(path), gpt2, context_length=CTX).token_ids


def _write(kind: str, rows: list[list[int]], root):
    """``rows`` as a dataset of kind ``kind`` under ``root``; returns its path."""
    flat = np.concatenate([np.asarray(r) for r in rows])
    if kind == "jsonl":
        path = root / "tok.jsonl"
        path.write_text(
            "".join(json.dumps({"id": i, "input_ids": r}) + "\n" for i, r in enumerate(rows))
        )
    elif kind == "json":
        path = root / "tok.json"
        path.write_text(json.dumps([{"tokens": r} for r in rows]))
    elif kind in ("parquet", "arrow"):
        table = datasets.Dataset.from_dict({"input_ids": rows, "n": list(range(len(rows)))})
        path = root / f"tok.{kind}"
        if kind == "parquet":
            table.to_parquet(path)
        else:
            with datasets.arrow_writer.ArrowWriter(path=str(path)) as writer:
                writer.write_table(table.data.table)
                writer.finalize()
    elif kind == "save_to_disk":
        path = root / "saved"
        features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32"))})
        datasets.Dataset.from_dict({"input_ids": rows}, features=features).save_to_disk(path)
    elif kind == "hub repository":
        path = root / "repo"
        (path / "data").mkdir(parents=True)
        datasets.Dataset.from_dict({"input_ids": rows}).to_parquet(path / "data" / "train.parquet")
        card = "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: data/train.parquet\n---\n"
        (path / "README.md").write_text(card)
    elif kind == "npy 1-D":
        path = root / "tok.npy"
        np.save(path, flat.astype(np.int32))
    elif kind == "npy 2-D":
        path = root / "tok2.npy"
        usable = len(flat) // CTX * CTX
        np.save(path, flat[:usable].astype(np.int64).reshape(-1, CTX))
    elif kind == "bin (nanoGPT)":
        path = root / "train.bin"
        flat.astype(np.uint16).tofile(path)
    elif kind == "bin (llm.c)":
        path = root / "train_000.bin"
        header = np.zeros(256, dtype=np.int32)
        header[:3] = [20240520, 1, len(flat)]
        path.write_bytes(header.tobytes() + flat.astype(np.uint16).tobytes())
    else:
        raise ValueError(kind)
    return path


KINDS = [
    "jsonl",
    "json",
    "parquet",
    "arrow",
    "save_to_disk",
    "hub repository",
    "npy 1-D",
    "npy 2-D",
    "bin (nanoGPT)",
    "bin (llm.c)",
]


@pytest.mark.parametrize("kind", KINDS)
def test_pre_tokenized_input_equals_the_tokenized_text(gpt2, rows, want, tmp_path, kind):
    path = _write(kind, rows, tmp_path)
    source = open_source(str(path), gpt2, context_length=CTX)
    np.testing.assert_array_equal(source.token_ids, want)
    # a budget takes the same first contexts
    budget = open_source(str(path), gpt2, context_length=CTX, max_tokens=3 * CTX + 5)
    np.testing.assert_array_equal(budget.token_ids, want[:3])


def test_capture_of_token_ids_stores_what_the_text_stores(model_dir, rows, tmp_path):
    text = tmp_path / "docs.txt"
    text.write_text("\n".join(DOCS))
    tokens = _write("jsonl", rows, tmp_path)
    stores = []
    for dataset in (text, tokens):
        cfg = CaptureConfig(
            model=str(model_dir("gpt2")),
            dataset=str(dataset),
            sites=("resid.1",),
            context_length=CTX,
            batch_size=4,
            progress=False,
        )
        result = capture(cfg, lambda plan: SaevWriter.from_plan(plan, tmp_path / "out"))
        stores.append(SaevReader(result.output))
    assert stores[0].path != stores[1].path  # two datasets, two stores
    np.testing.assert_array_equal(stores[1].tokens, stores[0].tokens)
    np.testing.assert_array_equal(stores[1][:, 1], stores[0][:, 1])


def test_the_column_is_chosen_by_its_type(gpt2, rows, tmp_path):
    both = tmp_path / "both.jsonl"
    both.write_text("".join(json.dumps({"text": d, "ids": r}) + "\n" for d, r in zip(DOCS, rows)))
    text = open_source(str(both), gpt2, context_length=CTX)
    ids = open_source(str(both), gpt2, context_length=CTX, token_field="ids")
    np.testing.assert_array_equal(ids.token_ids, text.token_ids)
    assert text.describe()["text_field"] == "text" and ids.describe()["token_field"] == "ids"
    with pytest.raises(
        ConfigError, match="'ids' field holds token ids, not text; pass --token-field ids"
    ):
        open_source(str(both), gpt2, context_length=CTX, text_field="ids")
    with pytest.raises(ConfigError, match="--token-field text: .* holds text, not tokens"):
        open_source(str(both), gpt2, context_length=CTX, token_field="text")
    # a list of words is not token ids
    words = tmp_path / "words.jsonl"
    words.write_text(json.dumps({"tokens": ["a", "b"]}) + "\n")
    with pytest.raises(ConfigError, match="no 'text' field and no token-id field"):
        open_source(str(words), gpt2, context_length=CTX)
    parquet = tmp_path / "t.parquet"
    datasets.Dataset.from_dict({"text": rows}).to_parquet(parquet)
    with pytest.raises(
        ConfigError, match="'text' column holds token ids, not text; pass --token-field text"
    ):
        open_source(str(parquet), gpt2, context_length=CTX)
    np.testing.assert_array_equal(
        open_source(str(parquet), gpt2, context_length=CTX, token_field="text").token_ids,
        open_source(str(both), gpt2, context_length=CTX).token_ids,
    )


def test_ids_outside_the_vocabulary_and_bad_token_files_are_refused(gpt2, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"input_ids": [5, 6, 300, 7]}) + "\n")
    with pytest.raises(ConfigError, match="token id 300, outside .* vocabulary of 300"):
        open_source(str(bad), gpt2, context_length=2)
    wide = tmp_path / "wide.bin"
    np.arange(4, 204, dtype=np.uint32).tofile(wide)  # uint32 ids, read as uint16 would be
    with pytest.raises(ConfigError, match="every other 16-bit value is 0"):
        open_source(str(wide), gpt2, context_length=CTX)
    floats = tmp_path / "f.npy"
    np.save(floats, np.zeros((4, CTX), dtype=np.float32))
    with pytest.raises(ConfigError, match="a token file is a 1-D or 2-D array of integer"):
        open_source(str(floats), gpt2, context_length=CTX)


def test_text_is_read_only_as_far_as_the_budget_needs(gpt2, tmp_path, caplog):
    big = tmp_path / "big.jsonl"
    with big.open("w") as f:
        for i in range(20_000):
            f.write(json.dumps({"text": f"{DOCS[i % len(DOCS)]} {i}"}) + "\n")
    with caplog.at_level(logging.INFO, logger="actstore.capture.data"):
        source = open_source(str(big), gpt2, context_length=CTX, max_tokens=4 * CTX)
    assert source.n_examples == 4 and source.describe()["n_docs"] < 10
    (line,) = [r.getMessage() for r in caplog.records if "packed" in r.getMessage()]
    assert "packed 4 contexts of 16 tokens: documents" in line
    read = int(line.split("documents ")[1].split(" read")[0])
    assert read < 40 and "MB of big.jsonl (>99.9%) left unread" in line
