"""The README's read example on an Activault run (ReaderBase's read API over megabatch
files whose rows cross example boundaries), and the one clear error where the run's layout
cannot place examples: token positions lost when the dropped tail (or token cleaning) left
fewer tokens than whole examples."""

from __future__ import annotations

import numpy as np
import pytest

from actstore.errors import ConfigError
from actstore.formats import open_store
from actstore.formats.activault import ActivaultOptions
from actstore.testing import FormatCase, make_acts, make_batches, make_plan, make_tokens


def write_run(tmp_path, n_examples: int):
    plan = make_plan(n_examples=n_examples)  # 6 tokens each, sites resid.1 and resid.3
    acts = make_acts(plan)
    # 69 tokens per file: files end inside examples
    case = FormatCase(
        "activault", ActivaultOptions(rows_per_file=3, sequence_length=23, dtype="float32")
    )
    return plan, acts, case.write(tmp_path / "run", plan, make_batches(plan, acts))


def test_the_readme_read_example_on_an_activault_run(tmp_path):
    plan, acts, run = write_run(tmp_path, 23)  # 138 tokens: two whole files
    reader = open_store(run)
    assert reader.n_files == 2
    assert reader.shape == (23, 2, 6, 8) and len(reader) == 23
    np.testing.assert_array_equal(reader[12, "resid.3", 0], acts["resid.3"][12, 0])
    np.testing.assert_array_equal(reader[0:8, 3], acts["resid.3"][0:8])
    np.testing.assert_array_equal(reader[11, "resid.1"], acts["resid.1"][11])  # two files
    np.testing.assert_array_equal(np.asarray(reader.tokens[12]), make_tokens(plan)[12])
    rows = acts["resid.3"].reshape(-1, 8).astype(np.float64)
    np.testing.assert_allclose(reader.statistics(3).mean, rows.mean(0), rtol=1e-6, atol=1e-9)


def test_lost_token_positions_are_one_clear_error(tmp_path):
    _, acts, run = write_run(tmp_path, 20)  # 120 tokens: one file of 69, the tail dropped
    reader = open_store(run)
    assert reader.n_rows("resid.1") == 69
    with pytest.raises(ConfigError, match="token positions are lost") as refused:
        reader[0, "resid.1", 0]
    assert len(str(refused.value).splitlines()) == 1
    assert reader.tokens is None
    block = reader.blocks("resid.1")[0]
    np.testing.assert_array_equal(reader.read_block(block), acts["resid.1"].reshape(-1, 8)[:69])
