"""Token positions of an Activault run (issue 38, item 11).

An Activault capture with token cleaning (the default) stores only the kept tokens, packed
into equal files, so the files alone no longer say which example and position a row is:
``reader.shape`` said ``(examples, sites, tokens, d)`` but ``reader[i, site, t]`` refused
("token positions are lost"), and so did the README's read example and ``convert``. The
writer now keeps, in ``actstore-positions.npy`` (actstore's own file at the run's root,
covered by the root manifest; Activault's reader reads hook folders only), where each
example's kept tokens lie: random access, tokens, conversion and the README example work
on every capture, with NaN where nothing is stored.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_fault_property import writable_copy

from actstore.convert import convert
from actstore.errors import ActstoreError
from actstore.formats import open_store
from actstore.formats.activault import ActivaultOptions, ActivaultWriter
from actstore.formats.activault.positions import PIECES, POSITIONS
from actstore.testing import make_acts, make_batches, make_plan, resign

N = 24


def cleaned(seed: int = 0):
    """A plan, its activations and batches that carry a token mask, as token cleaning
    gives them (about a third of the tokens dropped; one example dropped whole)."""
    plan = make_plan(n_examples=N)
    acts = make_acts(plan)
    rng = np.random.default_rng(seed)
    batches = []
    for batch in make_batches(plan, acts):
        mask = rng.random((batch.n_examples, batch.n_tokens)) > 0.3
        mask[batch.example_ids == 5] = False
        batches.append(dataclasses.replace(batch, token_mask=mask))
    return plan, acts, batches


def write(out: Path, plan, batches, **options) -> Path:
    writer = ActivaultWriter(plan, str(out), ActivaultOptions(rows_per_file=2, **options))
    for batch in batches:
        writer.write(batch)
    return Path(writer.close())


def expected(acts: dict, site: str, dtype: str = "bfloat16") -> np.ndarray:
    """The values of ``site`` as the run stores them (cast to its dtype, read as float32)."""
    values = torch.as_tensor(np.asarray(acts[site]))
    return values.to(getattr(torch, dtype)).to(torch.float32).numpy()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    plan, acts, batches = cleaned()
    return write(tmp_path_factory.mktemp("pos") / "run", plan, batches), plan, acts, batches


def test_random_access_of_a_cleaned_run_places_every_stored_token(run):
    """reader[i, site, t] of a cleaned run (was: refused, "token positions are lost"): the
    stored value at every kept position, NaN where cleaning dropped the token or the tail
    past the last file holds it; reader.token_mask says which; the README's read example
    (shape, reader[12, site, 0], reader[0:8, site], tokens[12], statistics) works."""
    store, plan, acts, batches = run
    mask = np.concatenate([b.token_mask for b in batches])
    with open_store(store) as reader:
        assert reader.shape == (N, 2, plan.tokens_per_example, plan.d_model)
        stored = np.asarray(reader.token_mask[:])
        rows = reader.n_rows(reader.sites[0])
        assert (stored <= mask).all() and stored.sum() == rows < mask.sum()  # a tail dropped
        assert not stored[5].any()
        for site in reader.sites:
            got, want = reader[:, site], expected(acts, str(site))
            np.testing.assert_array_equal(got[stored], want[stored])
            assert np.isnan(got[~stored]).all()
            # the stored rows are the blocks' rows, in example order
            blocks = np.concatenate([reader.read_block(b) for b in reader.blocks(site)])
            np.testing.assert_array_equal(got[stored], blocks)
        site = reader.sites[-1]
        assert reader[12, site, 0].shape == (plan.d_model,)
        assert reader[0:8, site].shape == (8, plan.tokens_per_example, plan.d_model)
        np.testing.assert_array_equal(reader[[3, 0], site, 2], reader[:, site][[3, 0], 2])
        ids = np.concatenate([b.token_ids for b in batches])
        np.testing.assert_array_equal(reader.tokens[12], ids[12])  # dropped tokens' ids too
        assert reader.statistics(site).count == rows
        assert reader.verify().ok


def test_a_resumed_run_keeps_the_same_positions(run, tmp_path):
    """Killed (aborted) part way and resumed: the positions file is byte-identical to an
    uninterrupted run's, and no positions piece is left beside the run."""
    store, plan, _, batches = run
    first = ActivaultWriter(plan, str(tmp_path / "run"), ActivaultOptions(rows_per_file=2))
    for batch in batches[:3]:
        first.write(batch)
    first.flush()
    first.abort()
    assert list((tmp_path / "run" / PIECES).iterdir())  # the committed examples' pieces
    again = ActivaultWriter(plan, str(tmp_path / "run"), ActivaultOptions(rows_per_file=2))
    assert 0 < again.resume_from < N
    for batch in batches:
        again.write(batch)
    resumed = Path(again.close())
    assert (resumed / POSITIONS).read_bytes() == (store / POSITIONS).read_bytes()
    assert not (resumed / PIECES).exists()


@pytest.mark.parametrize("to", ["saev", "activault"])
def test_a_cleaned_run_converts(run, tmp_path, to):
    """convert from a cleaned run (was: refused): into Activault, exactly the stored tokens
    again (the batches carry the stored positions as their token mask); into a format
    that keeps every position, the stored values in place and NaN where none is stored.
    convert's own check compares every row."""
    store, _, _acts, _ = run
    result = convert(str(store), str(tmp_path / "out"), to=to, progress=False)
    with open_store(store) as source, open_store(result.location) as target:
        site = source.sites[0]
        np.testing.assert_array_equal(target[:, site], source[:, site])
        if to == "activault":
            assert target.n_rows(site) == source.n_rows(site)


def test_activault_reads_the_run_and_the_positions_file_is_covered(run, tmp_path):
    """The positions file is the run's own (beside cfg.json, outside every hook folder
    Activault's reader reads) and the root manifest lists it: flipped, it is refused."""
    store, *_ = run
    manifest = json.loads((store / "actstore-manifest.json").read_text())
    assert POSITIONS in manifest["files"]
    assert all(not name.startswith(".") for name in manifest["files"])
    copy = writable_copy(store, tmp_path / "run")
    data = bytearray((copy / POSITIONS).read_bytes())
    data[-3] ^= 1
    (copy / POSITIONS).write_bytes(bytes(data))
    with open_store(copy) as reader:
        with pytest.raises(ActstoreError):
            reader[0, reader.sites[0], 0]
        assert not reader.verify().ok


def test_edited_positions_are_a_fault_even_with_the_manifest_rewritten(run, tmp_path):
    """Two examples' positions exchanged, manifest rewritten: the files' token ids are no
    longer the ones the positions place at each row (verify), so values would not be served
    at other positions unnoticed."""
    from actstore.formats.activault.positions import decode, encode

    store, plan, *_ = run
    copy = writable_copy(store, tmp_path / "run")
    table = decode((copy / POSITIONS).read_bytes(), plan.tokens_per_example, POSITIONS)
    table["kept"][[1, 2]] = table["kept"][[2, 1]]
    table["ids"][[1, 2]] = table["ids"][[2, 1]]
    (copy / POSITIONS).write_bytes(encode(table))
    resign(copy)
    with open_store(copy) as reader:
        faults = reader.verify().faults
    assert any("its tokens are not the ones" in f or POSITIONS in f for f in faults), faults


def test_a_run_of_an_older_actstore_reads_and_says_what_it_lacks(run, tmp_path):
    """A run written before positions were kept (record version 2, no positions file):
    blocks, statistics and verify as before; reader[...] says it lacks the positions file
    (one actstore error); the same run marked version 3 without the file is a fault."""
    store, *_ = run
    copy = writable_copy(store, tmp_path / "run")
    (copy / POSITIONS).unlink()
    cfg = json.loads((copy / "cfg.json").read_text())
    cfg["actstore"]["version"] = 2
    (copy / "cfg.json").write_text(json.dumps(cfg, indent=2))
    resign(copy)
    with open_store(copy) as reader:
        assert reader.positions is None and reader.token_mask is None
        site = reader.sites[0]
        assert reader.read_block(reader.blocks(site)[0]).shape[0] > 0
        with pytest.raises(ActstoreError, match="did not keep token positions"):
            reader[0, site, 0]
    cfg["actstore"]["version"] = 3
    (copy / "cfg.json").write_text(json.dumps(cfg, indent=2))
    resign(copy)
    with pytest.raises(ActstoreError, match=f"{POSITIONS} is missing"):
        open_store(copy)[0, "resid.1", 0]


def test_the_readme_example_on_a_default_cleaned_capture(tmp_path, model_dir, text_file):
    """A real capture with token cleaning (the default: BOS and EOS dropped) against the
    same capture without: every stored position holds the value the uncleaned run holds
    there, the dropped ones are NaN, and the README's read example works."""
    from actstore.capture import CaptureConfig, capture

    def run(clean: bool):
        config = CaptureConfig(
            model=str(model_dir("llama")),
            dataset=str(text_file),
            sites=("resid.2",),
            context_length=24,
            max_examples=32,
            batch_size=8,
            progress=False,
            clean_tokens=clean,
        )
        out = str(tmp_path / ("clean" if clean else "raw"))
        options = ActivaultOptions(rows_per_file=8 if not clean else 3, dtype="float32")
        return capture(config, lambda plan: ActivaultWriter.from_plan(plan, out, options)).output

    raw, clean = open_store(run(False)), open_store(run(True))
    site = "resid.2"
    stored = np.asarray(clean.token_mask[:])
    assert not stored[:, 0].any() and 0 < stored.sum() < stored.size  # BOS: never stored
    got, want = clean[:, site], raw[:, site]
    np.testing.assert_array_equal(got[stored], want[stored])
    assert np.isnan(got[~stored]).all()
    np.testing.assert_array_equal(clean.tokens[:], raw.tokens[:])
    assert clean.shape == raw.shape == (32, 1, 24, clean.d_model)
    assert np.isnan(clean[12, site, 0]).all() and not np.isnan(clean[12, site, 1]).any()
    assert clean.statistics(site).count == stored.sum()
