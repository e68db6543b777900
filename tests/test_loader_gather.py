"""Random access for analysis: SaevReader.gather (sorted, coalesced reads) and the
vectored block reads the loader uses (read_block_scatter, cls_rows)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_loader import D, T, write_store

from actstore.errors import (
    ConfigError,
    CorruptStoreError,
    IndexOutOfRangeError,
    LayerNotStoredError,
)
from actstore.loader import ActivationLoader

N = 37


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return write_store(tmp_path_factory.mktemp("gather"), n=N)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    rows=st.lists(st.integers(0, N * T - 1), max_size=60),
    layer=st.sampled_from([2, 5]),
    checked=st.booleans(),
)
def test_gather_matches_indexing_in_the_callers_order(store, rows, layer, checked):
    """Checked: whole slabs read and checked; unchecked: rows coalesced into vectored reads."""
    from actstore.formats.saev import SaevReader

    reader, acts = store
    if not checked:
        reader = SaevReader(reader.path, verify_reads=False)
    got = reader.gather(np.array(rows, dtype=np.int64), layer)
    ex, tok = np.divmod(np.array(rows, dtype=np.int64), T)
    want = acts[ex, (2, 5).index(layer), tok]
    assert got.shape == (len(rows), 8)
    np.testing.assert_array_equal(got, want)


def test_gather_forms(store):
    reader, acts = store
    np.testing.assert_array_equal(
        reader.gather([[7, 7], [0, 221]], 5), acts[[[1, 1], [0, 36]], 1, [[1, 1], [0, 5]]]
    )
    cls = reader.gather((np.arange(0, N, 3), 0), 2)  # token 0 of every third example
    np.testing.assert_array_equal(cls, acts[::3, 0, 0])
    np.testing.assert_array_equal(reader.gather(5, 2), acts[0, 0, 5])
    assert reader.gather([], 2).shape == (0, 8)


def test_gather_errors(store):
    reader, _ = store
    with pytest.raises(IndexOutOfRangeError, match="row 222"):
        reader.gather([0, N * T], 2)
    with pytest.raises(IndexOutOfRangeError, match="token"):
        reader.gather(([0], [T]), 2)
    with pytest.raises(ConfigError, match="name the site to gather from"):
        reader.gather([0])
    with pytest.raises(LayerNotStoredError):
        reader.gather([0], 3)


def test_loader_rows_gather_back_to_the_same_activations(store):
    reader, _ = store
    loader = ActivationLoader(reader, site=5, batch_size=50, return_index=True, drop_cls=True)
    for acts, rows in loader:
        np.testing.assert_array_equal(reader.gather(rows.numpy(), 5), acts.numpy())


def test_gather_on_a_saev_dialect_store(tmp_path):
    reader, acts = write_store(tmp_path, n=11, per_shard=4, dialect="saev")
    assert reader.dialect == "saev"
    rows = np.array([65, 0, 30, 31, 32, 65])
    np.testing.assert_array_equal(reader.gather(rows, 2), acts[rows // T, 0, rows % T])


def test_read_block_scatter_places_rows_and_skips_negatives(store):
    reader, acts = store
    block = reader.blocks(5)[4]  # example 4
    out = np.full((10, 8), np.nan, dtype=np.float32)
    dest = np.array([9, -1, 0, 3, -1, 2])
    reader.read_block_scatter(block, out, dest)
    for i, d in enumerate(dest):
        if d >= 0:
            np.testing.assert_array_equal(out[d], acts[4, 1, i])
    assert np.isnan(out[[1, 4, 5, 6, 7, 8]]).all()
    pool = np.zeros((6, 2, 8), dtype=np.float32)  # strided destination (one site of two)
    reader.read_block_scatter(block, pool[:, 1, :], np.arange(6)[::-1].copy())
    np.testing.assert_array_equal(pool[:, 1], acts[4, 1, ::-1])
    assert not pool[:, 0].any()
    with pytest.raises(ConfigError, match="destination"):
        reader.read_block_scatter(block, out, np.array([10, 0, 1, 2, 3, 4]))
    assert reader.cls_rows(reader.blocks(2)[0]).tolist() == [0]


def test_a_file_truncated_after_opening_is_reported(tmp_path):
    reader, acts = write_store(tmp_path, n=10)
    shard = reader.path / "acts000001.bin"
    block = reader.blocks(5)[-1]  # example 9, the last of shard 1
    rows = np.arange(T)
    out = np.empty((T, 8), dtype=np.float32)
    reader.read_block_scatter(block, out, rows)
    np.testing.assert_array_equal(out, acts[9, 1])
    shard.chmod(0o644)
    with open(shard, "r+b") as f:  # cut the file in the middle of the block's third row
        f.truncate(shard.stat().st_size - 3 * 8 * 4 - 5)
    with pytest.raises(CorruptStoreError, match="ended at byte 1819, expected 1920: the file is"):
        reader.read_block_scatter(block, out, rows)
    np.testing.assert_array_equal(out[:2], acts[9, 1, :2])  # what was there was read
    with pytest.raises(CorruptStoreError, match="acts000001.bin ended at byte"):
        reader.gather([9 * T + 5], 5)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(pick=st.lists(st.booleans(), min_size=T * 2, max_size=T * 2), skip=st.integers(0, 11))
def test_read_rows_scatter_places_the_rows_asked_for(store, pick, skip):
    """Slab reads (loader ``mix``): any ascending rows, one preadv per consecutive stretch,
    verified or not (verified: the whole block is read and checked)."""
    from actstore.formats.saev import SaevReader

    reader, acts = store
    block = reader.blocks(2)[4]
    rows = np.flatnonzero(pick[: block.n_rows]).astype(np.int64)
    dest = np.arange(len(rows), dtype=np.int64)[::-1].copy()
    if len(dest):
        dest[skip % len(dest)] = -1
    for r in (reader, SaevReader(reader.path, verify_reads=False)):
        out = np.zeros((T + 1, D), dtype=np.float32)
        r.read_rows_scatter(block, rows, out, dest)
        keep = dest >= 0
        np.testing.assert_array_equal(out[dest[keep]], acts[4, 0, rows[keep]])
    with pytest.raises(ConfigError, match="ascending"):
        reader.read_rows_scatter(block, np.array([1, 0]), out, np.array([0, 1]))
    with pytest.raises(ConfigError, match="ascending"):
        reader.read_rows_scatter(block, np.array([T]), out, np.array([0]))


def test_read_slabs_scatter_reads_pieces_of_several_blocks_and_shards(store):
    from actstore.formats.saev import SaevReader

    reader, acts = store
    blocks = reader.blocks(5)
    picks = [(b, np.arange(T)[k % 3 :: 2]) for k, b in enumerate(blocks[3:12])]  # 2 shards
    total = sum(len(r) for _, r in picks)
    slots = np.random.default_rng(0).permutation(total)
    pieces, k = [], 0
    for b, r in picks:
        pieces.append((b, r, slots[k : k + len(r)]))
        k += len(r)
    for r in (reader, SaevReader(reader.path, verify_reads=False)):
        out = np.zeros((total, D), dtype=np.float32)
        r.read_slabs_scatter(pieces, out)
        for b, rows, dest in pieces:
            example = b.loc[0] * 5 + b.loc[1]
            np.testing.assert_array_equal(out[dest], acts[example, 1, rows])
