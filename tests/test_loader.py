"""ActivationLoader on real saev stores: exactly once across ranks and workers, exact values,
determinism, resume (also with real DataLoader worker processes), options and errors."""

from __future__ import annotations

import functools
import operator
import pickle

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from saev_fixtures import saev_writer

from actstore.batch import Batch
from actstore.errors import ConfigError, LayerNotStoredError
from actstore.formats.base import ReaderBase
from actstore.formats.saev import SaevMetadata, SaevReader
from actstore.formats.saev.layout import encode_data
from actstore.loader import ActivationDataLoader, ActivationLoader
from actstore.loader.pipeline import Buffers

T, D = 6, 8
STORE = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def write_store(root, *, n=37, layers=(2, 5), cls=True, per_shard=5, seed=0, dialect="protocol"):
    """A published saev store whose row values name themselves: column 0 is the example,
    1 the token, 2 the layer; the rest is noise. Returns (reader, acts[n, L, T, D])."""
    md = SaevMetadata(
        family="clip" if dialect == "saev" else "gpt2",
        ckpt="tiny",
        layers=layers,
        dialect=dialect,
        patches_per_ex=T - 1 if cls else T,
        cls_token=cls,
        d_model=D,
        n_examples=n,
        patches_per_shard=per_shard * T * len(layers),
        data=encode_data({"kind": "test"}),
        dataset="/nowhere",
    )
    acts = np.random.default_rng(seed).standard_normal((n, len(layers), T, D)).astype(np.float32)
    acts[..., 0] = np.arange(n)[:, None, None]
    acts[..., 1] = np.arange(T)
    acts[..., 2] = np.array(layers)[:, None]
    writer = saev_writer(md, root)
    for lo in range(0, n, 4):
        part = acts[lo : lo + 4]
        writer.write(
            Batch(
                acts={f"resid.{l}": torch.from_numpy(part[:, i]) for i, l in enumerate(layers)},
                example_ids=np.arange(lo, lo + len(part)),
            )
        )
    return SaevReader(writer.close()), acts


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Two layers with CLS: one block per example (T rows)."""
    return write_store(tmp_path_factory.mktemp("two-layers"))


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One layer without CLS: blocks group a shard's examples (sizes 7x6 rows and a short one)."""
    return write_store(
        tmp_path_factory.mktemp("one-layer"), n=45, layers=(3,), cls=False, per_shard=7
    )


def expected(acts, rows, layer_pos):
    ex, tok = np.divmod(np.asarray(rows), T)
    return acts[ex, layer_pos, tok]


def collect(iterator):
    return [(b.acts.numpy().copy(), b.rows.numpy().copy()) for b in iterator]


def all_consumers(reader, world, workers, **options):
    """Every batch of one epoch, consumer by consumer (rank, worker), as (acts, rows)."""
    out = {}
    for rank in range(world):
        loader = ActivationLoader(reader, rank=rank, world_size=world, return_index=True, **options)
        for j in range(workers):
            out[rank, j] = collect(loader._iterate(worker=j, num_workers=workers, count=False))
    return out


# ---------------------------------------------------------------------- exactly once


@STORE
@given(
    batch=st.integers(1, 50),
    pool=st.integers(1, 9),
    seed=st.integers(0, 2**32),
    world=st.integers(1, 4),
    workers=st.integers(1, 4),
    drop_cls=st.booleans(),
    multi=st.booleans(),
)
def test_every_row_once_across_ranks_and_workers(
    store, batch, pool, seed, world, workers, drop_cls, multi
):
    reader, acts = store
    site = {"sites": [5, 2]} if multi else {"site": 5}
    parts = all_consumers(
        reader,
        world,
        workers,
        batch_size=batch,
        pool_blocks=pool,
        seed=seed,
        drop_cls=drop_cls,
        **site,
    )
    rows = np.concatenate([r for part in parts.values() for _, r in part])
    want = [e * T + t for e in range(len(acts)) for t in range(T) if not (drop_cls and t == 0)]
    assert sorted(rows.tolist()) == want
    for part in parts.values():
        for i, (x, r) in enumerate(part):
            assert len(r) == batch or i == len(part) - 1  # only a consumer's last may be short
            if multi:
                np.testing.assert_array_equal(x[:, 0], expected(acts, r, 1))
                np.testing.assert_array_equal(x[:, 1], expected(acts, r, 0))
            else:
                np.testing.assert_array_equal(x, expected(acts, r, 1))


@STORE
@given(
    batch=st.integers(1, 40),
    pool=st.integers(1, 5),
    world=st.integers(1, 4),
    workers=st.integers(1, 3),
)
def test_drop_last_gives_every_rank_the_same_full_batches(single, batch, pool, world, workers):
    reader, _ = single
    parts = all_consumers(
        reader, world, workers, batch_size=batch, pool_blocks=pool, drop_last=True
    )
    per_rank = [sum(len(parts[r, j]) for j in range(workers)) for r in range(world)]
    assert len(set(per_rank)) == 1
    assert per_rank[0] == (45 * T // world) // batch
    rows = [r for part in parts.values() for _, r in part]
    assert all(len(r) == batch for r in rows)
    flat = np.concatenate(rows) if rows else np.empty(0)
    assert len(set(flat.tolist())) == len(flat)


def test_blocks_of_a_single_layer_store_vary_in_size(single):
    reader, acts = single
    sizes = [b.n_rows for b in reader.blocks(3)]
    assert len(set(sizes)) > 1  # the property tests above cover uneven blocks
    loader = ActivationLoader(reader, batch_size=16, pool_blocks=2, return_index=True)
    x, r = zip(*collect(loader))
    np.testing.assert_array_equal(np.concatenate(x), expected(acts, np.concatenate(r), 0))


def format_cases():
    """The conformance suite's cases of the formats whose readers work without a server."""
    from test_saev_conformance import TestSaevConformance

    cases = [pytest.param(TestSaevConformance.case, id="saev")]
    try:
        from test_zarr_conformance import ZarrCase  # float16 rows, no scatter hook
    except ImportError:
        return cases
    return [*cases, pytest.param(ZarrCase(t_chunk=2), id="zarr")]


@pytest.mark.parametrize("case", format_cases())
def test_any_format_through_the_reader_contract(case, tmp_path):
    from actstore.testing import make_acts

    plan = case.plan()
    acts = make_acts(plan)
    reader = case.open(case.write(tmp_path / "store", plan, case.batches(plan, acts)))
    sites = list(plan.sites)
    want = [case.expected_rows(plan, acts, s).astype(case.stored_dtype) for s in plan.sites]
    for workers in (1, 3):
        for stream in range(workers):
            loader = ActivationLoader(
                reader,
                sites=sites,
                batch_size=7,
                pool_blocks=3,
                return_index=True,
                normalize="mean_norm",
            )
            factors = loader.normalization[1].numpy()
            for x, r in loader._iterate(worker=stream, num_workers=workers, count=False):
                assert x.dtype == torch.float32 and x.shape[1:] == (2, plan.d_model)
                for k in range(2):
                    np.testing.assert_allclose(
                        x[:, k].numpy(), want[k][r.numpy()] * factors[k], rtol=1e-6
                    )
    plain = ActivationLoader(reader, site=sites[0], batch_size=5, pool_blocks=2, return_index=True)
    rows = np.concatenate([r.numpy() for _, r in plain])
    assert sorted(rows.tolist()) == list(range(plan.n_examples * plan.tokens_per_example))


class _NoHooks(SaevReader):
    """A saev reader that keeps ReaderBase's defaults for the optional capabilities (read
    then copy; no CLS marks): the loader's generic path."""

    read_block_scatter = ReaderBase.read_block_scatter
    cls_rows = ReaderBase.cls_rows


def test_readers_without_optional_hooks(store):
    reader, acts = store
    plain = _NoHooks(reader.path)
    loader = ActivationLoader(plain, site=5, batch_size=11, pool_blocks=2, return_index=True)
    for x, r in loader:
        np.testing.assert_array_equal(x.numpy(), expected(acts, r.numpy(), 1))
    # ReaderBase places CLS rows itself: drop_cls works on the generic path too
    plan = plain.capture_plan()
    assert plan.has_cls
    kept = ActivationLoader(
        plain, site=5, batch_size=11, pool_blocks=2, return_index=True, drop_cls=True
    )
    served = np.concatenate([r.numpy() for _, r in kept])
    t = plan.tokens_per_example
    assert sorted(served.tolist()) == [i for i in range(plan.n_examples * t) if i % t]


# ---------------------------------------------------------------------- determinism


def test_order_is_deterministic_and_changes_with_seed_and_epoch(store):
    reader, _ = store

    def rows(**kw):
        loader = ActivationLoader(
            reader, site=2, batch_size=9, pool_blocks=4, return_index=True, **kw
        )
        return np.concatenate([b.rows.numpy() for b in loader])

    first = rows(seed=3)
    assert np.array_equal(first, rows(seed=3))
    assert not np.array_equal(first, rows(seed=4))
    assert not np.array_equal(first, rows(seed=3, epoch=1))
    # a batch mixes rows of several examples (window of 4 blocks = 4 examples)
    assert len(set((first[:9] // T).tolist())) > 1


def test_iteration_continues_into_the_next_epoch(store):
    reader, _ = store
    options = {"site": 5, "batch_size": 10, "pool_blocks": 3, "seed": 1, "return_index": True}
    loader = ActivationLoader(reader, **options)
    epoch0 = collect(loader)
    assert loader.epoch == 1 and loader.state_dict()["batches"] == 0
    epoch1 = collect(loader)
    fresh = ActivationLoader(reader, epoch=1, **options)
    assert [r.tolist() for _, r in epoch1] == [r.tolist() for _, r in collect(fresh)]
    assert [r.tolist() for _, r in epoch0] != [r.tolist() for _, r in epoch1]
    loader.set_epoch(0)
    assert [r.tolist() for _, r in collect(loader)] == [r.tolist() for _, r in epoch0]
    # a state taken right after an epoch's last batch resumes with the next epoch
    loader.set_epoch(0)
    it = iter(loader)
    for _ in range(len(loader)):
        next(it)
    resumed = ActivationLoader(reader, **options)
    resumed.load_state_dict(loader.state_dict())
    assert [r.tolist() for _, r in collect(resumed)] == [r.tolist() for _, r in epoch1]


def test_the_next_epochs_first_window_is_read_as_an_epoch_ends(store):
    """An epoch iterated to its end starts reading the next epoch's first window (into a
    free pool), so the next epoch's first batch waits for no read; the stream is unchanged,
    and a position changed meanwhile (set_epoch, load_state_dict) drops what was read."""
    reader, _ = store
    options = {"site": 5, "batch_size": 10, "pool_blocks": 3, "seed": 1, "return_index": True}
    fresh = [rows(ActivationLoader(reader, epoch=e, **options)) for e in range(3)]
    loader = ActivationLoader(reader, **options)
    got = []
    for e in range(3):
        got.append(rows(loader))
        assert loader.read_ahead == e + 1
    assert got == fresh
    loader.set_epoch(1)  # not the epoch read ahead (3)
    assert rows(loader) == fresh[1] and loader.read_ahead == 2
    loader.load_state_dict(ActivationLoader(reader, **options).state_dict())
    assert rows(loader) == fresh[0]


def rows(loader):
    return [b.rows.tolist() for b in loader]


# ---------------------------------------------------------------------- resume


@STORE
@given(
    stop=st.integers(0, 40),
    batch=st.integers(3, 30),
    pool=st.integers(1, 6),
    seed=st.integers(0, 1000),
)
def test_resume_equals_uninterrupted(store, stop, batch, pool, seed):
    reader, _ = store
    options = {
        "site": 5,
        "batch_size": batch,
        "pool_blocks": pool,
        "seed": seed,
        "return_index": True,
    }
    whole = [r.tolist() for _, r in collect(ActivationLoader(reader, **options))]
    stop = min(stop, len(whole) - 1)  # (a state taken after the last batch: next test)
    first = ActivationLoader(reader, **options)
    it = iter(first)
    head = [next(it).rows.tolist() for _ in range(stop)]
    state = pickle.loads(pickle.dumps(first.state_dict()))
    del it
    resumed = ActivationLoader(reader, **options)
    resumed.load_state_dict(state)
    tail = [r.tolist() for _, r in collect(resumed)]
    assert head + tail == whole


def test_resume_with_dataloader_workers(store):
    reader, _ = store
    options = {"site": 5, "batch_size": 7, "pool_blocks": 3, "seed": 11, "return_index": True}
    whole = [
        b.rows.tolist()
        for b in ActivationDataLoader(ActivationLoader(reader, **options), num_workers=2)
    ]
    # the DataLoader interleaves the workers' contiguous runs round-robin
    loader = ActivationLoader(reader, **options)
    runs = [
        [r.tolist() for _, r in collect(loader._iterate(worker=j, num_workers=2, count=False))]
        for j in range(2)
    ]
    interleaved = [run[k] for k in range(len(runs[0])) for run in runs if k < len(run)]
    assert whole == interleaved
    direct = [r.tolist() for _, r in collect(ActivationLoader(reader, **options))]
    assert sorted(whole) == sorted(direct)  # the same batches, whatever the worker count

    data = ActivationDataLoader(ActivationLoader(reader, **options), num_workers=2)
    head = []
    for batch in data:
        head.append(batch.rows.tolist())
        if len(head) == 13:
            break
    state = data.state_dict()
    assert state["batches"] == 13 and state["num_workers"] == 2
    again = ActivationDataLoader(ActivationLoader(reader, **options), num_workers=2)
    again.load_state_dict(state)
    assert head + [b.rows.tolist() for b in again] == whole
    assert again.dataset.epoch == 1
    with pytest.raises(ConfigError, match="same number"):
        other = ActivationLoader(reader, **options)
        other.load_state_dict(state)
        iter(other)


def test_persistent_workers_follow_the_main_process(store):
    """Workers that outlive an epoch serve the next epoch, a mid-epoch stop and a resume
    exactly like fresh workers."""
    reader, _ = store
    options = {"site": 2, "batch_size": 6, "pool_blocks": 2, "seed": 5, "return_index": True}

    def epochs(data, n):
        return [[b.rows.tolist() for b in data] for _ in range(n)]

    fresh = epochs(ActivationDataLoader(ActivationLoader(reader, **options), num_workers=2), 3)
    assert fresh[0] != fresh[1] and sorted(functools.reduce(operator.iadd, fresh[0], [])) == sorted(
        functools.reduce(operator.iadd, fresh[1], [])
    )
    kept = ActivationDataLoader(
        ActivationLoader(reader, **options), num_workers=2, persistent_workers=True
    )
    assert epochs(kept, 2) == fresh[:2]

    head = []
    for batch in kept:  # stop part-way through epoch 2, then carry on with the same workers
        head.append(batch.rows.tolist())
        if len(head) == 5:
            break
    state = kept.state_dict()
    assert (state["epoch"], state["batches"]) == (2, 5)
    assert head + [b.rows.tolist() for b in kept] == fresh[2]

    again = ActivationDataLoader(
        ActivationLoader(reader, **options), num_workers=2, persistent_workers=True
    )
    again.load_state_dict(state)
    assert [b.rows.tolist() for b in again] == fresh[2][5:]
    assert again.dataset.epoch == 3


def test_state_from_a_different_order_is_refused(store):
    reader, _ = store
    loader = ActivationLoader(reader, site=5, batch_size=8, seed=1)
    next(iter(loader))
    state = loader.state_dict()
    with pytest.raises(ConfigError, match="batch_size=8"):
        ActivationLoader(reader, site=5, batch_size=16, seed=1).load_state_dict(state)
    with pytest.raises(ConfigError, match="version"):
        loader.load_state_dict({**state, "version": 99})
    with pytest.raises(ConfigError, match="not an ActivationLoader state"):
        loader.load_state_dict({"epoch": 0, "position": 10, "seed": 1})  # e.g. a stream's


# ---------------------------------------------------------------------- options


def test_normalisation_uses_stored_statistics(store):
    reader, acts = store
    stats = reader.statistics(5)
    std = ActivationLoader(
        reader, site=5, batch_size=50, normalize="standardize", return_index=True
    )
    x, r = next(iter(std))
    # column 2 (the layer number) is constant: its std is 0 and the loader keeps it at 0
    want = (expected(acts, r.numpy(), 1) - stats.mean) / np.maximum(np.sqrt(stats.var), 1e-6)
    np.testing.assert_allclose(x.numpy(), want, rtol=1e-5, atol=1e-5)
    shift, scale = std.normalization
    np.testing.assert_allclose((x / scale + shift).numpy(), expected(acts, r.numpy(), 1), atol=1e-5)
    norm = ActivationLoader(reader, site=5, batch_size=50, normalize="mean_norm", return_index=True)
    x, r = next(iter(norm))
    factor = np.sqrt(D) / stats.norm_mean
    np.testing.assert_allclose(x.numpy(), expected(acts, r.numpy(), 1) * factor, rtol=1e-6)
    norm.set_epoch(0)  # iteration continues where it stopped: rewind to see all rows
    everything = torch.cat([b.acts for b in norm])
    assert len(everything) == 37 * T
    assert everything.norm(dim=1).mean().item() == pytest.approx(np.sqrt(D), rel=1e-4)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_output_dtype(store, dtype):
    reader, acts = store
    loader = ActivationLoader(
        reader, sites=[2, 5], batch_size=20, dtype=dtype, return_index=True, normalize="mean_norm"
    )
    for x, r in loader:
        assert x.dtype == getattr(torch, dtype) and x.shape == (len(r), 2, D)
        want = np.stack([expected(acts, r, 0), expected(acts, r, 1)], axis=1)
        scale = loader.normalization[1].numpy()[None]
        torch.testing.assert_close(x, torch.from_numpy(want * scale).to(x.dtype))


def test_batches_stay_valid_while_held(single):
    reader, acts = single
    loader = ActivationLoader(reader, batch_size=5, pool_blocks=1, return_index=True)
    held = list(loader)  # every batch kept: buffers must not be reused under them
    for x, r in held:
        np.testing.assert_array_equal(x.numpy(), expected(acts, r.numpy(), 0))


def test_buffers_are_reused_once_released():
    buffers = Buffers((4, 2), np.float32)
    i = buffers.acquire()
    view = torch.from_numpy(buffers[i][:2])
    buffers.release(i)
    assert buffers.acquire(allocate=False) is None  # a batch still refers to it
    del view
    assert buffers.acquire(allocate=False) == i and len(buffers) == 1


def test_plain_iteration_yields_tensors(store):
    reader, _ = store
    loader = ActivationLoader(reader, site=2, batch_size=64)
    batches = list(loader)
    assert all(isinstance(b, torch.Tensor) and b.dtype == torch.float32 for b in batches)
    assert [len(b) for b in batches] == [64] * (len(loader) - 1) + [37 * T - 64 * (len(loader) - 1)]
    assert loader.mapped  # rows are gathered from the mapped shards: no window buffers
    assert loader.memory_bytes == 4 * 64 * D * 4
    # a small store: the window is the whole store, and a larger pool gives the same order
    assert loader.pool_blocks == len(reader.blocks(2))
    wide = ActivationLoader(reader, site=2, batch_size=64, pool_blocks=10**6)
    assert wide.pool_blocks == loader.pool_blocks
    assert all(torch.equal(a, b) for a, b in zip(batches, wide))


def test_loader_pickles(store):
    reader, _ = store
    loader = ActivationLoader(reader, site=5, batch_size=9, seed=2, return_index=True)
    clone = pickle.loads(pickle.dumps(loader))
    assert [r.tolist() for _, r in collect(clone)] == [r.tolist() for _, r in collect(loader)]


def test_opens_a_path_and_plain_dataloader_with_workers(store):
    reader, _ = store
    loader = ActivationLoader(str(reader.path), site=5, batch_size=16, drop_cls=True)
    rows = sum(len(b) for b in torch.utils.data.DataLoader(loader, batch_size=None, num_workers=2))
    assert rows == 37 * (T - 1)


@pytest.mark.cuda
def test_device_transfer_from_pinned_memory(store):
    reader, acts = store
    for workers in (0, 2):
        loader = ActivationLoader(reader, site=5, batch_size=16, device="cuda", return_index=True)
        for x, r in ActivationDataLoader(loader, num_workers=workers):
            assert x.is_cuda
            np.testing.assert_array_equal(x.cpu().numpy(), expected(acts, r.cpu().numpy(), 1))


@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_device_pipeline_delivers_every_row_once_and_counts_exactly(store, workers, persistent):
    """``device=``: each batch is copied to the device (the next one's copy is started
    before this one is handed out), in process and through worker processes; the stream,
    the values and ``state_dict`` stay exact. device="cpu" runs the same pipeline as
    "cuda" with a thread doing the copies."""
    reader, acts = store
    options = {"site": 5, "batch_size": 7, "pool_blocks": 3, "seed": 3, "return_index": True}
    kwargs = {"persistent_workers": persistent}

    def data(**extra):
        return ActivationDataLoader(
            ActivationLoader(reader, **options, **extra), num_workers=workers, **kwargs
        )

    plain = data()
    want = [b.rows.tolist() for b in plain]
    moved = data(device="cpu")
    got, held = [], []
    for x, r in moved:
        np.testing.assert_array_equal(x.numpy(), expected(acts, r.numpy(), 1))
        got.append(r.tolist())
        held = [*held[-2:], (x, r)]  # copies stay intact while the loader moves on
        for x_held, r_held in held:
            np.testing.assert_array_equal(x_held.numpy(), expected(acts, r_held.numpy(), 1))
    assert got == want
    head = []
    for x, r in moved:  # epoch 1: stop part-way, resume in a new loader
        head.append(r.tolist())
        if len(head) == 4:
            break
    state = moved.state_dict()
    assert (state["epoch"], state["batches"]) == (1, 4)  # the batch fetched ahead not counted
    again = data(device="cpu")
    again.load_state_dict(state)
    tail = [r.tolist() for _, r in again]
    whole = data()
    whole.load_state_dict({**state, "batches": 0})
    assert head + tail == [r.tolist() for _, r in whole]
    rows = [row for batch in head + tail for row in batch]
    assert sorted(rows) == list(range(37 * T))  # every row once in epoch 1


# ---------------------------------------------------------------------- errors


def test_configuration_errors(store):
    reader, _ = store
    with pytest.raises(ConfigError, match="several sites"):
        ActivationLoader(reader)
    with pytest.raises(LayerNotStoredError):
        ActivationLoader(reader, site=7)
    with pytest.raises(ConfigError, match="not both"):
        ActivationLoader(reader, site=2, sites=[2, 5])
    with pytest.raises(ConfigError, match="batch_size"):
        ActivationLoader(reader, site=2, batch_size=0)
    with pytest.raises(ConfigError, match="dtype"):
        ActivationLoader(reader, site=2, dtype="int8")
    with pytest.raises(ConfigError, match="normalize"):
        ActivationLoader(reader, site=2, normalize="whiten")
    with pytest.raises(ConfigError, match="rank"):
        ActivationLoader(reader, site=2, rank=3, world_size=2)
    with pytest.raises(ConfigError, match="ActivationLoader"):
        ActivationDataLoader(reader)
    loader = ActivationLoader(reader, site=2)
    with pytest.raises(ConfigError, match="batch_size"):
        ActivationDataLoader(loader, batch_size=4)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA"):
            ActivationLoader(reader, site=2, pin_memory=True)


def test_worker_batches_arrive_in_reused_shared_slots(single):
    """Workers gather each batch straight into one of their shared slots and send only
    where it lies; the main process hands a slot back once its batch is dropped: held
    batches stay intact, dropped ones let a worker reuse a few slots over and over."""
    reader, acts = single
    options = {"batch_size": 5, "pool_blocks": 2, "return_index": True}
    data = ActivationDataLoader(ActivationLoader(reader, **options), num_workers=2)
    held = [(x, r) for x, r in data]  # every batch kept: no slot may be reused under them
    for x, r in held:
        np.testing.assert_array_equal(x.numpy(), expected(acts, r.numpy(), 0))
    assert len(data._slots) == len(held)  # one slot per batch held
    slots = [(root.ctypes.data, root.ctypes.data + root.nbytes) for root, _ in data._slots.values()]
    assert all(any(lo <= x.data_ptr() < hi for lo, hi in slots) for x, _ in held)  # views
    data = ActivationDataLoader(
        ActivationLoader(reader, **options), num_workers=2, persistent_workers=True
    )
    for _ in range(2):
        for x, r in data:  # each batch dropped before the next: a few slots per worker
            np.testing.assert_array_equal(x.numpy(), expected(acts, r.numpy(), 0))
    assert len(data._slots) <= 2 * 5  # in use, sent, being gathered, ahead, prefetched


def test_persistent_workers_left_early_again_and_again_reuse_their_slots(single):
    """A training loop that breaks out after a few batches, many times: the batches in
    flight the DataLoader drops each time free their slots again (they stayed taken, up to
    ``MAX_SLOTS`` per worker of /dev/shm), and every batch still holds its rows."""
    reader, acts = single
    options = {"batch_size": 5, "pool_blocks": 2, "return_index": True}
    data = ActivationDataLoader(
        ActivationLoader(reader, **options), num_workers=2, persistent_workers=True
    )
    held = []
    for i in range(20):
        for k, (x, r) in enumerate(data):
            np.testing.assert_array_equal(x.numpy(), expected(acts, r.numpy(), 0))
            if i % 5 == 0:
                held.append((x, r))  # some batches kept across the breaks
            if k == i % 3:
                break
    for x, r in held:
        np.testing.assert_array_equal(x.numpy(), expected(acts, r.numpy(), 0))
    taken = int((data._link.slot_flags != 0).sum())
    assert taken <= len(held) + 2 * 5 and len(data._slots) <= len(held) + 2 * 5


def test_runs_of_blocks_keep_every_row_once_and_old_states_resume(single):
    reader, acts = single
    loader = ActivationLoader(reader, batch_size=8, pool_blocks=4, run_blocks=2, return_index=True)
    x, r = zip(*collect(loader))
    rows = np.concatenate(r)
    assert sorted(rows.tolist()) == list(range(45 * T))
    np.testing.assert_array_equal(np.concatenate(x), expected(acts, rows, 0))
    single_blocks = ActivationLoader(reader, batch_size=8, pool_blocks=4, run_blocks=1)
    state = single_blocks.state_dict()
    del state["run_blocks"]  # as saved before runs existed
    single_blocks.load_state_dict(state)
    with pytest.raises(ConfigError, match="run_blocks=1"):
        ActivationLoader(reader, batch_size=8, pool_blocks=4).load_state_dict(state)


def test_workers_refuse_a_shared_memory_too_small_for_their_slots(single, monkeypatch):
    """A /dev/shm smaller than the workers' batch slots is one clear error up front, not a
    bus error mid-epoch (the file system's free space is what the OS reports: faked here)."""
    import os as real_os

    from actstore.loader import dataloader

    reader, _ = single
    loader = ActivationLoader(reader, batch_size=5, pool_blocks=2)
    statvfs = real_os.statvfs

    def tiny(path):
        got = statvfs(path)
        if path != dataloader.SHM:
            return got
        return real_os.statvfs_result((*got[:4], 0, *got[5:]))  # nothing free

    monkeypatch.setattr(real_os, "statvfs", tiny)
    with pytest.raises(ConfigError, match=r"2 DataLoader workers .* /dev/shm.*shm-size"):
        ActivationDataLoader(loader, num_workers=2)
    ActivationDataLoader(loader, num_workers=0)  # no workers: nothing is shared
