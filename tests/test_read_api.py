"""The README's read example on an Activault run (ReaderBase's read API over megabatch
files whose rows cross example boundaries), and a run whose dropped tail left fewer tokens
than whole examples: its kept token positions place every stored token (NaN elsewhere)."""

from __future__ import annotations

import numpy as np

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


def test_a_dropped_tail_leaves_every_stored_token_in_its_place(tmp_path):
    plan, acts, run = write_run(tmp_path, 20)  # 120 tokens: one file of 69, the tail dropped
    reader = open_store(run)
    assert reader.n_rows("resid.1") == 69 and reader.shape == (20, 2, 6, 8)
    np.testing.assert_array_equal(reader[0, "resid.1", 0], acts["resid.1"][0, 0])
    np.testing.assert_array_equal(reader[11, "resid.1", :3], acts["resid.1"][11, :3])  # 66-68
    assert np.isnan(reader[11, "resid.1", 3:]).all() and np.isnan(reader[19, "resid.3"]).all()
    np.testing.assert_array_equal(np.asarray(reader.tokens[11]), make_tokens(plan)[11])
    block = reader.blocks("resid.1")[0]
    np.testing.assert_array_equal(reader.read_block(block), acts["resid.1"].reshape(-1, 8)[:69])
