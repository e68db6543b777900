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
