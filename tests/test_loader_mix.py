"""``mix``: windows of token slabs from more examples at equal memory, on real saev stores:
every row once with exact values (ranks, workers, CLS, several sites, the reader contract's
default read), resume, the pair rate it buys, mix=1 pinned, verified reads, errors."""

from __future__ import annotations

import hashlib
import logging
import pickle
import shutil

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_loader import STORE, T, all_consumers, collect, expected, format_cases, write_store

from actstore.errors import ConfigError, CorruptStoreError
from actstore.formats.base import ReaderBase
from actstore.formats.saev import SaevReader
from actstore.loader import ActivationDataLoader, ActivationLoader
from actstore.loader.pipeline import window_shape


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Two layers with CLS (one block per example); reads not verified: slab reads."""
    reader, acts = write_store(tmp_path_factory.mktemp("mix-two"))
    return SaevReader(reader.path, verify_reads=False), acts


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One layer, blocks of 7 examples (and a short one): a slab is a piece of each."""
    reader, acts = write_store(
        tmp_path_factory.mktemp("mix-one"), n=45, layers=(3,), cls=False, per_shard=7
    )
    return SaevReader(reader.path, verify_reads=False), acts


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """Enough examples for pair rates to mean something."""
    reader, _ = write_store(tmp_path_factory.mktemp("mix-wide"), n=240, cls=False)
    return SaevReader(reader.path, verify_reads=False)


def pair_rate(rows: np.ndarray) -> float:
    """Fraction of a batch's row pairs that come from one example."""
    _, counts = np.unique(rows // T, return_counts=True)
    n = len(rows)
    return float((counts * (counts - 1) / 2).sum() / (n * (n - 1) / 2))


# ---------------------------------------------------------------------- exactly once


@STORE
@given(
    batch=st.integers(1, 40),
    pool=st.integers(1, 6),
    mix=st.integers(2, T),
    seed=st.integers(0, 2**32),
    world=st.integers(1, 3),
    workers=st.integers(1, 3),
    drop_cls=st.booleans(),
    multi=st.booleans(),
)
def test_every_row_once_with_exact_values(
    store, batch, pool, mix, seed, world, workers, drop_cls, multi
):
    reader, acts = store
    site = {"sites": [5, 2]} if multi else {"site": 5}
    parts = all_consumers(
        reader,
        world,
        workers,
        batch_size=batch,
        pool_blocks=pool,
        mix=mix,
        seed=seed,
        drop_cls=drop_cls,
        **site,
    )
    rows = np.concatenate([r for part in parts.values() for _, r in part])
    want = [e * T + t for e in range(len(acts)) for t in range(T) if not (drop_cls and t == 0)]
    assert sorted(rows.tolist()) == want
    for part in parts.values():
        for i, (x, r) in enumerate(part):
            assert len(r) == batch or i == len(part) - 1
            if multi:
                np.testing.assert_array_equal(x[:, 0], expected(acts, r, 1))
                np.testing.assert_array_equal(x[:, 1], expected(acts, r, 0))
            else:
                np.testing.assert_array_equal(x, expected(acts, r, 1))


@STORE
@given(
    batch=st.integers(1, 30),
    pool=st.integers(1, 4),
    mix=st.integers(1, T),
    run=st.integers(1, 3),
)
def test_multi_example_blocks_and_runs(single, batch, pool, mix, run):
    reader, acts = single
    loader = ActivationLoader(
        reader, batch_size=batch, pool_blocks=pool, run_blocks=run, mix=mix, return_index=True
    )
    x, r = zip(*collect(loader))
    rows = np.concatenate(r)
    assert sorted(rows.tolist()) == list(range(45 * T))
    np.testing.assert_array_equal(np.concatenate(x), expected(acts, rows, 0))
    # windows read into buffers are what mix=1 uses (slabs of uneven size: at most
    # ceil(T/mix)*mix/T more); mapped stores hold none
    plain = ActivationLoader(reader, batch_size=batch, pool_blocks=pool)
    largest = -(-T // mix)
    rows = window_shape(loader.layout, pool)[1]
    assert rows * T == window_shape(plain.layout, pool)[1] * largest * mix
    assert loader.memory_bytes == plain.memory_bytes == 4 * batch * 8 * 4
    plan = loader.plan(0)
    assert max(plan.window_rows(w) for w in range(plan.n_windows)) <= pool * mix * largest * 7


class _DefaultRead(SaevReader):
    """The reader contract's defaults: whole-block read then copy, contiguous row slabs."""

    read_rows_scatter = ReaderBase.read_rows_scatter
    example_rows = ReaderBase.example_rows


def test_default_reader_methods(store):
    reader, acts = store
    plain = _DefaultRead(reader.path)
    for mix in (2, 3, 5):
        loader = ActivationLoader(
            plain, site=2, batch_size=11, pool_blocks=2, mix=mix, return_index=True
        )
        x, r = zip(*collect(loader))
        rows = np.concatenate(r)
        assert sorted(rows.tolist()) == list(range(37 * T))
        np.testing.assert_array_equal(np.concatenate(x), expected(acts, rows, 0))
    # mix beyond T is fine where slabs are row ranges (T is not known to split on)
    assert len(list(ActivationLoader(plain, site=2, batch_size=64, mix=T + 1))) > 0


# ---------------------------------------------------------------------- resume, workers


@STORE
@given(stop=st.integers(0, 30), batch=st.integers(3, 20), mix=st.integers(2, T))
def test_resume_equals_uninterrupted(store, stop, batch, mix):
    reader, _ = store
    options = {"site": 5, "batch_size": batch, "pool_blocks": 3, "mix": mix, "seed": 9}
    whole = [r.tolist() for _, r in collect(ActivationLoader(reader, return_index=True, **options))]
    stop = min(stop, len(whole) - 1)
    first = ActivationLoader(reader, return_index=True, **options)
    it = iter(first)
    head = [next(it).rows.tolist() for _ in range(stop)]
    state = pickle.loads(pickle.dumps(first.state_dict()))
    del it
    resumed = ActivationLoader(reader, return_index=True, **options)
    resumed.load_state_dict(state)
    assert head + [r.tolist() for _, r in collect(resumed)] == whole


def test_dataloader_workers_and_resume(store):
    reader, acts = store
    options = {"site": 5, "batch_size": 7, "pool_blocks": 3, "mix": 3, "return_index": True}
    whole = [b.rows.tolist() for b in ActivationLoader(reader, **options)]
    data = ActivationDataLoader(ActivationLoader(reader, **options), num_workers=2)
    got = [(b.acts.numpy().copy(), b.rows.numpy().copy()) for b in data]
    assert sorted(r.tolist() for _, r in got) == sorted(whole)
    for x, r in got:
        np.testing.assert_array_equal(x, expected(acts, r, 1))
    data = ActivationDataLoader(ActivationLoader(reader, **options), num_workers=2)
    head = []
    for batch in data:
        head.append(batch.rows.tolist())
        if len(head) == 9:
            break
    again = ActivationDataLoader(ActivationLoader(reader, **options), num_workers=2)
    again.load_state_dict(data.state_dict())
    assert head + [b.rows.tolist() for b in again] == [r.tolist() for _, r in got]


def test_state_of_another_mix_is_refused(store):
    reader, _ = store
    loader = ActivationLoader(reader, site=5, batch_size=8, mix=2)
    next(iter(loader))
    state = loader.state_dict()
    assert state["mix"] == 2
    with pytest.raises(ConfigError, match="mix=2"):
        ActivationLoader(reader, site=5, batch_size=8).load_state_dict(state)
    old = ActivationLoader(reader, site=5, batch_size=8).state_dict()
    del old["mix"]  # as saved before mix existed: whole blocks
    ActivationLoader(reader, site=5, batch_size=8).load_state_dict(old)
    with pytest.raises(ConfigError, match="mix=1"):
        ActivationLoader(reader, site=5, batch_size=8, mix=2).load_state_dict(old)


# ---------------------------------------------------------------------- what it buys


def test_pair_rate_drops_with_mix(wide):
    """Same window memory (4 examples' rows): the same-example pair rate of a batch,
    measured from the rows' example ids, falls about mix-fold towards the uniform ideal."""
    rates = {}
    for mix in (1, 2, 3, 6):
        loader = ActivationLoader(
            wide, site=2, batch_size=12, pool_blocks=4, mix=mix, return_index=True
        )
        assert window_shape(loader.layout, 4) == (1, 4 * T, 8)  # the same for every mix
        rates[mix] = np.mean([pair_rate(b.rows.numpy()) for b in loader])
    window = 4 * T  # rows of a window; about (T/mix - 1) / (window - 1) of pairs share one
    assert rates[1] == pytest.approx((T - 1) / (window - 1), rel=0.05)
    assert rates[2] == pytest.approx((T / 2 - 1) / (window - 1), rel=0.25)
    assert rates[1] > 2 * rates[2] > 3 * rates[3] > 0
    assert rates[6] < 0.02 < rates[3]  # one token per slab: only chance meetings remain
    ideal = (T - 1) / (240 * T - 1)
    assert rates[6] < 10 * ideal < rates[1] / 5


def test_single_block_reads_are_whole_examples_of_each_slab(single):
    """A slab of a multi-example block is the same token range of each of its examples."""
    reader, _ = single
    loader = ActivationLoader(reader, batch_size=4096, pool_blocks=1, mix=3, return_index=True)
    plan = loader.plan(0)
    for w in range(plan.n_windows):
        block, slab = plan.unit(int(plan.window_blocks(w)[0]))
        rows = np.sort(loader.layout.first_row[block] + loader.layout.slab(block, slab))
        examples, tokens = np.divmod(rows, T)
        assert set(tokens.tolist()) == {2 * slab, 2 * slab + 1}
        assert len(set(examples.tolist())) == reader.blocks(3)[block].n_rows // T


# ---------------------------------------------------------------------- mix=1 and errors


def test_mix_1_keeps_the_earlier_order(tmp_path):
    """Row streams pinned from the loader before mix existed."""
    reader, _ = write_store(tmp_path / "one", n=45, layers=(3,), cls=False, per_shard=7)
    for mix in ({}, {"mix": 1}):
        loader = ActivationLoader(
            reader, batch_size=8, pool_blocks=3, run_blocks=2, seed=5, return_index=True, **mix
        )
        rows = np.concatenate([b.rows.numpy() for b in loader])
        assert rows[:8].tolist() == [109, 150, 110, 103, 166, 107, 137, 102]
        assert hashlib.sha256(rows.astype("<i8").tobytes()).hexdigest()[:16] == "40f0b821dfc40b97"
    reader, _ = write_store(tmp_path / "two")
    loader = ActivationLoader(
        reader, site=2, batch_size=9, pool_blocks=4, seed=3, drop_cls=True, return_index=True
    )
    rows = np.concatenate([b.rows.numpy() for b in loader])
    assert hashlib.sha256(rows.astype("<i8").tobytes()).hexdigest()[:16] == "0d68fbeeb2880698"


def test_bad_mix_is_one_clear_error(store):
    reader, _ = store
    with pytest.raises(ConfigError, match="mix must be >= 1, not 0"):
        ActivationLoader(reader, site=5, mix=0)
    with pytest.raises(ConfigError, match=f"use mix between 1 and {T}"):
        ActivationLoader(reader, site=5, mix=T + 1)


# ---------------------------------------------------------------------- verified reads


def test_verified_slab_reads_read_whole_blocks_and_catch_damage(store, tmp_path, caplog):
    """Checksums cover whole examples: with verify_reads a slab is served only from a
    checked block, and a damaged byte stops the epoch. Read into buffers, each slab reads
    and checks its whole block (one warning says so); mapped, each block is checked once
    per epoch where it lies and its slabs gathered from it (no warning: no extra reads)."""
    reader, acts = store
    copy = tmp_path / "copy"
    shutil.copytree(reader.path, copy)
    verified = SaevReader(copy)
    options = {"site": 5, "batch_size": 10, "pool_blocks": 2, "mix": 2, "return_index": True}
    import actstore.formats.saev.reader as saev_reader

    saev_reader._SLAB_WARNED.clear()
    with caplog.at_level(logging.WARNING, logger="actstore.formats.saev.reader"):
        x, r = zip(*collect(ActivationLoader(verified, **options)))
    warned = sum("slab reads (mix > 1) are checked per whole block" in m for m in caplog.messages)
    assert warned == (0 if ActivationLoader(verified, **options).mapped else 1)
    rows = np.concatenate(r)
    np.testing.assert_array_equal(np.concatenate(x), expected(acts, rows, 1))
    # flip a byte of example 0's token 5 at layer 5: every slab of that block is refused,
    # the one holding token 0 too, as the block is read and checked whole
    unit = T * 8 * 4
    with open(copy / "acts000000.bin", "r+b") as f:
        f.seek(unit + 5 * 8 * 4 + 1)
        f.write(b"\x7f")
    with pytest.raises(CorruptStoreError, match="is not the block published there"):
        list(ActivationLoader(SaevReader(copy), **options))
    unchecked = list(ActivationLoader(SaevReader(copy, verify_reads=False), **options))
    assert sum(len(b.rows) for b in unchecked) == 37 * T


@pytest.mark.parametrize("case", format_cases())
def test_any_format_with_mix(case, tmp_path):
    """Through the reader contract (zarr: the default slab read, contiguous row ranges)."""
    from actstore.testing import make_acts

    plan = case.plan()
    acts = make_acts(plan)
    reader = case.open(case.write(tmp_path / "store", plan, case.batches(plan, acts)))
    site = plan.sites[0]
    want = case.expected_rows(plan, acts, plan.sites[0]).astype(case.stored_dtype)
    for mix in (2, 3):
        loader = ActivationLoader(
            reader, site=site, batch_size=5, pool_blocks=2, mix=mix, return_index=True
        )
        x, r = zip(*collect(loader))
        rows = np.concatenate(r)
        assert sorted(rows.tolist()) == list(range(plan.n_examples * plan.tokens_per_example))
        np.testing.assert_array_equal(np.concatenate(x), want[rows])
