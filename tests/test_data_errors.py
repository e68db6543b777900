"""Datasets that cannot be read as they say they are: data files that do not parse (at once
or past the first batch), splits that are not there, token lists that are not lists of
integers, ids outside the vocabulary. Each is one ``error:`` line that says what to do."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from forked import run_actstore

from actstore.capture import load_model, open_source
from actstore.capture.data import HFDataset
from actstore.errors import ConfigError, CorruptStoreError

datasets = pytest.importorskip("datasets")

SRC = Path(__file__).resolve().parents[1] / "src"
FIX = "repair or re-create it, or give another --dataset"


@pytest.fixture(scope="module")
def gpt2(model_dir):
    return load_model(str(model_dir("gpt2")))


@pytest.fixture(scope="module")
def bad(tmp_path_factory) -> Path:
    """A .json with a broken record, a .csv with a row of too many fields, a .parquet of
    garbage between its magic bytes, and a .csv whose bad row is past its first chunk
    (``datasets`` parses CSV 10,000 rows at a time)."""
    root = tmp_path_factory.mktemp("bad")
    (root / "bad.json").write_text('{"text": "the if statement"}\n{"text": "unterminated\n')
    (root / "bad.csv").write_text('text,id\n"the if statement",1\n"a","b","c","d"\n')
    (root / "bad.parquet").write_bytes(b"PAR1" + b"\x00garbage" * 50 + b"PAR1")
    rows = "\n".join(f'"document {i}: the for statement of Python",{i}' for i in range(12_000))
    (root / "late.csv").write_text(f'text,id\n{rows}\n"x","y","z","w"\n')
    return root


WHY = {
    "bad.json": "JSON (JSON parse error: Invalid encoding in string. in row 1)",
    "bad.csv": "CSV (Error tokenizing data. C error: Expected 2 fields in line 3, saw 4)",
    "bad.parquet": (
        "Parquet (Parquet file size is 408 bytes, smaller than the size reported by "
        "footer's (1701273954bytes))"
    ),
}


@pytest.mark.parametrize("name", sorted(WHY))
def test_a_data_file_that_does_not_parse_is_one_line_from_the_cli(name, bad, model_dir, tmp_path):
    path, out = bad / name, tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(SRC), "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1"}
    # a process of its own, forked from a helper that imported torch once (tests/forked.py)
    run = run_actstore(
        *["capture", "--model", str(model_dir("gpt2")), "--dataset", str(path)],
        *["--context-length", "8", "--out", str(out), "--no-progress"],
        env=env,
        timeout=300,
    )
    assert run.returncode == 2, run.stderr
    assert run.stderr.splitlines() == [
        f"error: cannot read {path}: it is not valid {WHY[name]}; {FIX}"
    ]
    assert not out.exists()


def test_a_bad_row_past_the_first_batch_is_one_line(bad, gpt2):
    """Local files are read as packing needs them, so row 12,002 fails while packing."""
    path = bad / "late.csv"
    with pytest.raises(CorruptStoreError) as err:
        open_source(str(path), gpt2, context_length=8)
    assert str(err.value) == (
        f"cannot read {path}: it is not valid CSV (Error tokenizing data. C error: Expected 2 "
        f"fields in line 12002, saw 4); {FIX}"
    )
    # a budget met in the first chunk never reads the bad row
    assert open_source(str(path), gpt2, context_length=8, max_examples=4).n_examples == 4


def test_a_missing_split_is_named_and_other_split_errors_are_not_taken_for_one(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    datasets.Dataset.from_dict({"text": ["a b c"] * 3}).to_parquet(repo / "train.parquet")
    card = (
        "configs:\n- config_name: default\n  data_files:\n  - split: train\n    path: train.parquet"
    )
    (repo / "README.md").write_text(f"---\n{card}\n---\n")
    for streaming in (False, True):
        hf = HFDataset(kind="repo", path=str(repo), split="validation", streaming=streaming)
        with pytest.raises(ConfigError) as err:
            hf.load()
        assert str(err.value) == (
            f"{repo} has no split 'validation'; choose one with --split (it has ['train'])"
        )
    with pytest.raises(ConfigError) as err:
        HFDataset(kind="repo", path=str(repo), split="bad name!").load()
    assert str(err.value) == (
        f"cannot load {repo}: Split name should match '^\\w+(\\.\\w+)*$' but got 'bad name!'."
    )


def test_nested_token_lists_are_checked_element_by_element(gpt2, tmp_path):
    """A record's lists of ids of any lengths are its ids end to end, as for a column of
    nested lists read by ``datasets`` (the same records as .json); a float or bool
    anywhere, or lists mixed with ids, is refused naming the line."""
    records = [{"input_ids": [[5, 6, 7], [8]]}, {"input_ids": [[9], [], [10, 11, 12]]}]
    lines = "".join(json.dumps(r) + "\n" for r in records)
    (tmp_path / "ragged.jsonl").write_text(lines)
    (tmp_path / "ragged.json").write_text(lines)
    got = open_source(str(tmp_path / "ragged.jsonl"), gpt2, context_length=4).token_ids
    assert got.tolist() == [[5, 6, 7, 8], [9, 10, 11, 12]]
    via_datasets = open_source(str(tmp_path / "ragged.json"), gpt2, context_length=4).token_ids
    np.testing.assert_array_equal(via_datasets, got)
    cases = {
        "later.jsonl": (
            [{"input_ids": [[1, 2], [3]]}, {"input_ids": [[1, 2], [3.7, 4]]}],
            (
                "{}:2: field 'input_ids' holds a list of float, int, where earlier records hold "
                "token ids"
            ),
        ),
        "bool.jsonl": (
            [{"input_ids": [[1, 2], [3, True]]}],
            (
                "{}:1's 'input_ids' field holds a list of bool, int, not token ids: every id must "
                "be an integer"
            ),
        ),
        "mixed.jsonl": (
            [{"tokens": [[1, 2], 3]}],
            (
                "{}:1's 'tokens' field holds a list of int, list, not token ids: every id must be "
                "an integer"
            ),
        ),
        "named.jsonl": (
            [{"ids": [4, 5]}, {"ids": [[4], [5.0]]}],
            "{}:2: field 'ids' holds a list of float, int, where earlier records hold token ids",
        ),
    }
    for name, (rows, message) in cases.items():
        path = tmp_path / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        field = "ids" if name == "named.jsonl" else None
        with pytest.raises(ConfigError) as err:
            open_source(str(path), gpt2, context_length=2, token_field=field)
        assert str(err.value) == message.format(path), name


def test_ids_outside_the_vocabulary_say_what_to_do_for_their_kind_of_source(gpt2, tmp_path):
    column = tmp_path / "ids.jsonl"
    column.write_text(json.dumps({"input_ids": [5, 6, 300, 7]}) + "\n")
    with pytest.raises(ConfigError) as err:
        open_source(str(column), gpt2, context_length=2)
    assert str(err.value) == (
        f"{column} holds token id 300, outside {gpt2.ckpt}'s vocabulary of 300: was it "
        "tokenized for another model? Capture its text column with --text-field instead"
    )
    for name in ("ids.npy", "ids.bin"):
        path = tmp_path / name
        ids = np.array([5, 6, 7, 400, 8, 9], dtype=np.uint16)
        np.save(path, ids) if name.endswith(".npy") else ids.tofile(path)
        with pytest.raises(ConfigError) as err:
            open_source(str(path), gpt2, context_length=2)
        assert str(err.value) == (
            f"{path} holds token id 400, outside {gpt2.ckpt}'s vocabulary of 300: was it "
            f"tokenized for another model? Tokenize the text again with {gpt2.ckpt}'s "
            "tokenizer, or capture the model it was made for"
        )
