"""The loader's order as pure functions: permutations, epoch plans, rank/worker splits."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actstore.errors import ConfigError
from actstore.order import (
    Span,
    batches_done_by_worker,
    key,
    permutation,
    plan_epoch,
    rank_span,
    slab_of,
    slab_rows,
    splitmix64,
    worker_span,
)

block_sizes = st.lists(st.integers(0, 40), min_size=0, max_size=30)


def test_splitmix64_matches_the_reference_values():
    # the first outputs of the splitmix64 generator seeded with 0 and with 1
    assert int(splitmix64(np.array([0], dtype=np.uint64))[0]) == 0xE220A8397B1DCDAF
    assert int(splitmix64(np.array([1], dtype=np.uint64))[0]) == 0x910A2DEC89025CC1


def test_permutation_is_pinned():
    # The order is part of the resume contract: it must not change between versions.
    assert permutation(key(0, 0, 0), 10).tolist() == PINNED
    assert permutation(key(1, 0, 0), 10).tolist() != PINNED


PINNED = [0, 1, 9, 4, 2, 3, 6, 8, 7, 5]


@given(st.integers(0, 2**64 - 1), st.integers(0, 500))
def test_permutation_is_a_permutation(k, n):
    perm = permutation(k, n)
    assert sorted(perm.tolist()) == list(range(n))


def test_key_rejects_negative_parts():
    with pytest.raises(ConfigError, match=">= 0"):
        key(0, -1)


@settings(max_examples=60, deadline=None)
@given(block_sizes, st.integers(1, 8), st.integers(0, 1000), st.integers(0, 5))
def test_plan_windows_partition_blocks_and_rows(sizes, k, seed, epoch):
    plan = plan_epoch(sizes, pool_blocks=k, seed=seed, epoch=epoch)
    assert sorted(plan.block_order.tolist()) == list(range(len(sizes)))
    blocks = [plan.window_blocks(w).tolist() for w in range(plan.n_windows)]
    assert [i for b in blocks for i in b] == plan.block_order.tolist()
    assert all(1 <= len(b) <= k for b in blocks)
    rows = [plan.window_rows(w) for w in range(plan.n_windows)]
    assert [sum(sizes[i] for i in b) for b in blocks] == rows
    assert plan.n_rows == sum(sizes)
    # the stream is a permutation of all rows: map each window position back to (block, row)
    first = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    stream = []
    for w, b in enumerate(blocks):
        rows = [first[i] + r for i in b for r in range(sizes[i])]
        stream += [rows[p] for p in plan.window_permutation(w)]
    assert sorted(stream) == list(range(sum(sizes)))
    for row in range(0, plan.n_rows, 7):
        w = plan.window_of(row)
        assert plan.row_starts[w] <= row < plan.row_starts[w + 1]
    again = plan_epoch(sizes, pool_blocks=k, seed=seed, epoch=epoch)
    assert again.block_order.tolist() == plan.block_order.tolist()


def test_epochs_and_seeds_change_the_order():
    sizes = [5] * 50
    a = plan_epoch(sizes, pool_blocks=4, seed=0, epoch=0).block_order.tolist()
    assert plan_epoch(sizes, pool_blocks=4, seed=0, epoch=1).block_order.tolist() != a
    assert plan_epoch(sizes, pool_blocks=4, seed=1, epoch=0).block_order.tolist() != a


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 400), st.integers(1, 40), st.integers(1, 5), st.integers(1, 5), st.booleans())
def test_rank_and_worker_spans_serve_every_row_once(n_rows, batch, world, workers, drop_last):
    served: list[int] = []
    per_rank_batches = []
    for rank in range(world):
        span = rank_span(n_rows, rank=rank, world_size=world, batch_size=batch, drop_last=drop_last)
        per_rank_batches.append(span.n_batches)
        spans = [
            worker_span(span, worker=j, num_workers=workers, batch_size=batch)
            for j in range(workers)
        ]
        counts = [s.n_batches for s in spans]
        assert sum(counts) == span.n_batches
        assert counts == sorted(counts, reverse=True) and max(counts) - min(counts) <= 1
        assert [s.start for s in spans] == sorted(s.start for s in spans)  # contiguous runs
        for s in spans:
            assert -(-(s.stop - s.start) // batch) == s.n_batches
            served += range(s.start, s.stop)
    if drop_last:
        assert len(set(per_rank_batches)) == 1
        assert len(served) == per_rank_batches[0] * batch * world == len(set(served))
        assert per_rank_batches[0] == (n_rows // world) // batch
    else:
        assert sorted(served) == list(range(n_rows))


@given(st.integers(0, 60), st.integers(1, 6))
def test_round_robin_accounting(n_batches, workers):
    spans = [
        worker_span(Span(0, n_batches, n_batches), worker=j, num_workers=workers, batch_size=1)
        for j in range(workers)
    ]
    # simulate a DataLoader: output k comes from worker k % N while it still has batches
    queues = [list(range(s.start, s.stop)) for s in spans]
    order, taken = [], [0] * workers
    while any(taken[j] < len(queues[j]) for j in range(workers)):
        for j in range(workers):
            if taken[j] < len(queues[j]):
                order.append((j, queues[j][taken[j]]))
                taken[j] += 1
    for k in range(len(order) + 1):
        for j in range(workers):
            expected = sum(1 for w, _ in order[:k] if w == j)
            assert batches_done_by_worker(k, worker=j, num_workers=workers) == expected


def test_bad_split_arguments():
    with pytest.raises(ConfigError, match="rank"):
        rank_span(10, rank=2, world_size=2, batch_size=4, drop_last=False)
    with pytest.raises(ConfigError, match="batch_size"):
        rank_span(10, rank=0, world_size=1, batch_size=0, drop_last=False)
    with pytest.raises(ConfigError, match="pool_blocks"):
        plan_epoch([1, 2], pool_blocks=0, seed=0, epoch=0)


@settings(max_examples=40, deadline=None)
@given(block_sizes, st.integers(1, 8), st.integers(1, 5), st.integers(0, 1000))
def test_runs_are_consecutive_blocks_in_a_permuted_order(sizes, k, g, seed):
    plan = plan_epoch(sizes, pool_blocks=k, seed=seed, epoch=0, run_blocks=g)
    order = plan.block_order.tolist()
    assert sorted(order) == list(range(len(sizes)))
    i = 0
    while i < len(order):  # each run: g consecutive blocks from a multiple of g (last short)
        first = order[i]
        n = min(g, len(sizes) - first)
        assert first % g == 0 and order[i : i + n] == list(range(first, first + n))
        i += n
    single = plan_epoch(sizes, pool_blocks=k, seed=seed, epoch=0)
    assert single.block_order.tolist() == permutation(key(seed, 0, 0), len(sizes)).tolist()


def test_plan_with_mix_1_is_pinned():
    # the order of whole blocks, computed before mix existed, and mix=1 spelled out
    for mix in ({}, {"mix": 1}):
        plan = plan_epoch(
            [3, 5, 2, 4, 1, 6, 0, 2], pool_blocks=3, seed=7, epoch=1, run_blocks=2, **mix
        )
        assert plan.block_order.tolist() == [0, 1, 6, 7, 4, 5, 2, 3]
        assert plan.window_bounds.tolist() == [0, 3, 6, 8]
        assert plan.row_starts.tolist() == [0, 8, 17, 23]
        assert plan.window_permutation(1).tolist() == [1, 7, 4, 8, 6, 2, 5, 3, 0]


@settings(max_examples=60, deadline=None)
@given(block_sizes, st.integers(1, 6), st.integers(1, 4), st.integers(1, 5), st.integers(0, 99))
def test_plan_with_mix_covers_every_unit_once(sizes, k, g, mix, seed):
    n = len(sizes)
    rows = np.array([[len(slab_rows(s, None, mix, j)) for s in sizes] for j in range(mix)])
    rows = rows.reshape(mix, n)
    plan = plan_epoch(rows, pool_blocks=k, seed=seed, epoch=0, run_blocks=g, mix=mix)
    order = plan.block_order.tolist()
    assert sorted(order) == list(range(n * mix))
    assert all(
        1 <= plan.window_bounds[w + 1] - plan.window_bounds[w] <= k * mix
        for w in range(plan.n_windows)
    )
    assert plan.n_rows == sum(sizes)
    i = 0
    while i < len(order):  # runs: g consecutive blocks of one slab
        block, slab = plan.unit(order[i])
        run = min(g, n - block)
        assert block % g == 0
        assert [plan.unit(u) for u in order[i : i + run]] == [(block + d, slab) for d in range(run)]
        i += run


@given(st.integers(0, 60), st.sampled_from([None, 1, 2, 3, 6]), st.integers(1, 6))
def test_slabs_partition_a_block(n_ex, period, mix):
    n = n_ex * (period or 1)
    if period is not None and mix > period:
        return
    parts = [slab_rows(n, period, mix, j) for j in range(mix)]
    assert sorted(np.concatenate(parts).tolist()) == list(range(n))
    for j, part in enumerate(parts):
        assert (np.diff(part) > 0).all() and (slab_of(part, n, period, mix) == j).all()
        if period:  # the same tokens of every example
            assert len(set((part % period).tolist())) * n_ex == len(part)


def test_bad_mix_in_a_plan():
    with pytest.raises(ConfigError, match="mix"):
        plan_epoch([1, 2], pool_blocks=1, seed=0, epoch=0, mix=0)
    with pytest.raises(ConfigError, match=r"\[2, n_blocks\]"):
        plan_epoch([1, 2], pool_blocks=1, seed=0, epoch=0, mix=2)
