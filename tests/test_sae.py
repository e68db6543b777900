"""Sparse autoencoders: architecture, normalisation, metrics, checkpoints, sparse activations."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from test_runs import write_store

from actstore.errors import ConfigError, CorruptStoreError, StoreNotFoundError
from actstore.sae import (
    SAEConfig,
    SparseActs,
    SparseAutoencoder,
    TrainConfig,
    encode_store,
    evaluate,
    load_sae,
    save_sae,
    train_sae,
)
from actstore.sae.metrics import DeadLatents, ReconstructionStats
from actstore.sae.rows import ordered_rows
from actstore.sae.train import lr_factor
from actstore.stats import RunningStats


def make_sae(kind="topk", d=8, n=32, k=4, seed=0):
    torch.manual_seed(seed)
    sae = SparseAutoencoder(SAEConfig(d_model=d, d_sae=n, kind=kind, k=k))
    with torch.no_grad():
        for p in sae.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return sae


def test_topk_keeps_exactly_k_and_matches_a_dense_reference():
    sae = make_sae()
    x = torch.randn(64, 8)
    f = sae.encode(x)
    pre = torch.relu((x - sae.b_dec) @ sae.W_enc + sae.b_enc)
    assert ((f > 0).sum(1) <= 4).all() and ((f > 0).sum(1) == (pre > 0).sum(1).clamp(max=4)).all()
    # the kept values are the k largest pre-activations, unchanged
    top = pre.topk(4, dim=1).values
    assert torch.equal(f.sort(dim=1, descending=True).values[:, :4], top)
    x_hat, f2 = sae(x)
    assert torch.equal(f, f2)
    torch.testing.assert_close(x_hat, f @ sae.W_dec + sae.b_dec)


def test_topk_codes_are_the_sparse_form_of_encode():
    sae = make_sae(k=5)
    x = torch.randn(40, 8)
    values, indices = sae.topk_codes(x)
    assert values.shape == indices.shape == (40, 5)
    assert (indices.diff(dim=1) > 0).all()  # ascending within each row
    dense = torch.zeros(40, 32).scatter_(1, indices, values)
    assert torch.equal(dense, sae.encode(x))
    with pytest.raises(ConfigError, match="topk"):
        make_sae("relu").topk_codes(x)


def test_relu_variant_is_relu_of_the_affine_map():
    sae = make_sae("relu")
    x = torch.randn(16, 8)
    torch.testing.assert_close(sae.encode(x), torch.relu((x - sae.b_dec) @ sae.W_enc + sae.b_enc))


def test_config_validation():
    with pytest.raises(ConfigError, match="kind"):
        SAEConfig(d_model=4, d_sae=8, kind="jumprelu")
    with pytest.raises(ConfigError, match="k must be"):
        SAEConfig(d_model=4, d_sae=8, k=9)
    with pytest.raises(ConfigError, match="tokens"):
        TrainConfig(tokens="cls")
    with pytest.raises(ConfigError, match="steps"):
        TrainConfig(steps=0)


def test_normalisation_from_stored_statistics_is_exact():
    rows = np.random.default_rng(0).normal(3.0, [1, 2, 5, 0.5], size=(5000, 4))
    stats = RunningStats.of(rows)
    sae = SparseAutoencoder(SAEConfig(d_model=4, d_sae=8, k=2))
    sae.set_normalisation(stats.mean, stats.var)
    x_n = sae.normalise(torch.from_numpy(rows).float()).double()
    # centred, and the mean squared norm equals d_model
    np.testing.assert_allclose(x_n.mean(0).numpy(), 0, atol=1e-5)
    assert abs(float(x_n.square().sum(1).mean()) - 4.0) < 1e-4
    torch.testing.assert_close(sae.denormalise(sae.normalise(torch.ones(2, 4))), torch.ones(2, 4))
    with pytest.raises(ConfigError, match="zero variance"):
        sae.set_normalisation(np.zeros(4), np.zeros(4))


def test_reconstruction_stats_match_numpy_in_any_batching():
    rng = np.random.default_rng(1)
    x, x_hat = rng.standard_normal((100, 6)), rng.standard_normal((100, 6))
    f = torch.from_numpy((rng.random((100, 10)) > 0.7).astype(np.float32))
    want = 1 - ((x - x_hat) ** 2).sum() / ((x - x.mean(0)) ** 2).sum()
    for size in (100, 7):
        stats = ReconstructionStats(6)
        for lo in range(0, 100, size):
            s = slice(lo, lo + size)
            stats.update(torch.from_numpy(x[s]), torch.from_numpy(x_hat[s]), f[s])
        assert stats.explained_variance == pytest.approx(want, rel=1e-12)
        assert stats.mse == pytest.approx(((x - x_hat) ** 2).mean(), rel=1e-12)
        assert stats.l0 == pytest.approx(float((f > 0).sum()) / 100)


def test_dead_latents_count_tokens_since_last_fire():
    dead = DeadLatents(3, window=10)
    dead.update(torch.tensor([[1.0, 0, 0]] * 4))
    assert dead.dead.tolist() == [False, True, True]  # before the window: never fired = dead
    dead.update(torch.tensor([[0, 1.0, 0]] * 4))
    dead.update(torch.tensor([[0, 0, 0]] * 4))
    assert dead.since_fired.tolist() == [8, 4, 12]
    assert dead.dead.tolist() == [False, False, True] and dead.fraction == pytest.approx(1 / 3)


def test_learning_rate_schedule():
    cfg = TrainConfig(steps=10, warmup_steps=2, decay_fraction=0.5)
    assert [lr_factor(s, cfg) for s in range(10)] == [0.5, 1, 1, 1, 1, 1, 0.8, 0.6, 0.4, 0.2]


def test_checkpoint_round_trip_is_exact_and_safetensors(tmp_path):
    from safetensors.torch import load_file

    sae = make_sae()
    sae.set_normalisation(np.arange(8.0), np.ones(8))
    path = tmp_path / "sae.pt"
    save_sae(sae, path)
    back = load_sae(path)
    for name, tensor in sae.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    assert back.config == sae.config
    x = torch.randn(5, 8)
    assert torch.equal(back.encode(x), sae.encode(x))
    # any safetensors reader opens it; no pickle involved
    assert set(load_file(path)) == {"W_enc", "b_enc", "W_dec", "b_dec", "input_mean", "input_scale"}
    assert [p.name for p in tmp_path.iterdir()] == ["sae.pt"]  # no temporary left


def test_checkpoint_errors(tmp_path):
    sae = make_sae()
    with pytest.raises(StoreNotFoundError, match="does not exist"):
        load_sae(tmp_path / "missing.pt")
    pickled = tmp_path / "pickled.pt"
    torch.save(sae.state_dict(), pickled)
    with pytest.raises(CorruptStoreError, match="not a safetensors file.*never unpickles"):
        load_sae(pickled)
    good = tmp_path / "good.pt"
    save_sae(sae, good)
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:-10])
    with pytest.raises(CorruptStoreError, match="truncated|damaged"):
        load_sae(truncated)
    from safetensors.torch import save_file

    foreign = tmp_path / "foreign.pt"
    save_file({"W": torch.zeros(2)}, foreign)
    with pytest.raises(CorruptStoreError, match="not written by actstore"):
        load_sae(foreign)
    # a header whose config disagrees with the tensors
    data = good.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header["__metadata__"]["actstore.sae"] = json.dumps({"d_model": 8, "d_sae": 16, "k": 4})
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    bad = tmp_path / "bad.pt"
    bad.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n :])
    with pytest.raises(CorruptStoreError, match="do not match its config"):
        load_sae(bad)


def test_checkpoint_whose_header_length_starts_like_a_pickle_loads(tmp_path):
    """Regression: magic bytes were sniffed before the length prefix was parsed, so a valid
    file whose header length is 128 mod 256 (first byte 0x80, pickle's) was refused."""
    sae = make_sae()
    good = tmp_path / "good.pt"
    save_sae(sae, good)
    data = good.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    text = data[8 : 8 + n].rstrip()
    text += b" " * ((128 - len(text)) % 256)  # safetensors pads its header with spaces too
    odd = tmp_path / "odd.pt"
    odd.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n :])
    assert odd.read_bytes()[:1] == b"\x80"
    loaded = load_sae(odd)
    for name, tensor in sae.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor)


def test_sparse_acts_round_trip_and_scipy_reads_it(tmp_path):
    import scipy.sparse as scipy_sparse

    rng = np.random.default_rng(2)
    dense = np.where(rng.random((50, 12)) > 0.8, rng.random((50, 12)), 0).astype(np.float32)
    dense[7] = 0  # an empty row
    acts = SparseActs.from_dense(dense)
    path = tmp_path / "patch_acts.npz"
    acts.save(path)
    back = SparseActs.load(path)
    np.testing.assert_array_equal(back.dense_rows(0, 50), dense)
    assert back.indices.dtype == np.int32 and back.indptr.dtype == np.int64
    # saev's analysis scripts call scipy.sparse.load_npz on this file
    matrix = scipy_sparse.load_npz(path)
    assert matrix.format == "csr" and matrix.shape == (50, 12)
    np.testing.assert_array_equal(matrix.toarray(), dense)
    # and our reader reads scipy's own output
    scipy_sparse.save_npz(tmp_path / "scipy.npz", scipy_sparse.csr_array(dense))
    np.testing.assert_array_equal(SparseActs.load(tmp_path / "scipy.npz").dense_rows(0, 50), dense)
    rows, values = back.column(3)
    np.testing.assert_array_equal(rows, np.flatnonzero(dense[:, 3]))
    np.testing.assert_array_equal(values, dense[rows, 3])
    summary = back.latent_summary()
    np.testing.assert_array_equal(summary["count"], (dense > 0).sum(0))
    np.testing.assert_array_equal(summary["max"], dense.max(0))
    joined = SparseActs.concatenate(
        [SparseActs.from_dense(dense[:20]), SparseActs.from_dense(dense[20:])], 12
    )
    np.testing.assert_array_equal(joined.dense_rows(0, 50), dense)


def test_sparse_acts_reject_damaged_files(tmp_path):
    path = tmp_path / "x.npz"
    path.write_bytes(b"not a zip at all")
    with pytest.raises(CorruptStoreError, match="not a readable npz"):
        SparseActs.load(path)
    np.savez(
        path,
        format=np.array(b"csc"),
        shape=np.array([1, 1]),
        indptr=np.array([0, 0]),
        indices=np.zeros(0, np.int32),
        data=np.zeros(0, np.float32),
    )
    with pytest.raises(CorruptStoreError, match="expected csr"):
        SparseActs.load(path)
    np.savez(
        path,
        format=np.array(b"csr"),
        shape=np.array([1, 2]),
        indptr=np.array([0, 1]),
        indices=np.array([5], np.int32),
        data=np.ones(1, np.float32),
    )
    with pytest.raises(CorruptStoreError, match="latent index"):
        SparseActs.load(path)


def test_training_learns_and_evaluation_reads_every_row(tmp_path):
    """On a real store, training beats the untrained SAE by far, the
    decoder stays unit-norm, and evaluation/inference cover every stored row."""
    store = write_store(tmp_path, n=400, d=16, seed=3)
    from actstore.formats.saev import SaevReader

    reader = SaevReader(store)
    rows = np.concatenate([r.acts for r in ordered_rows(reader, 1, tokens="content")])
    assert rows.shape == (400 * 4, 16)
    config = TrainConfig(
        kind="topk",
        expansion=4,
        k=4,
        steps=150,
        batch_size=128,
        lr=3e-3,
        warmup_steps=10,
        log_every=50,
        device="cpu",
    )
    gen = torch.Generator().manual_seed(0)
    batches = (
        torch.from_numpy(rows)[torch.randint(len(rows), (128,), generator=gen)]
        for _ in range(config.steps)
    )
    untrained = SparseAutoencoder(config.sae_config(16))
    stats = reader.statistics(1)
    untrained.set_normalisation(stats.mean, stats.var)
    before = evaluate(untrained, reader, 1, progress=False)["explained_variance"]
    result = train_sae(config, batches, d_model=16, statistics=reader.statistics(1), progress=False)
    assert [h["step"] for h in result.history] == [50, 100, 150]
    after = evaluate(result.sae, reader, 1, progress=False)
    assert after["rows"] == 400 * 4 and after["l0"] <= 4
    assert after["explained_variance"] > before + 0.3
    norms = result.sae.W_dec.detach().norm(dim=1)
    torch.testing.assert_close(norms, torch.ones_like(norms))
    # evaluation does not depend on how rows are batched
    again = evaluate(result.sae, reader, 1, batch_rows=37, progress=False)
    assert again["explained_variance"] == pytest.approx(after["explained_variance"], rel=1e-9)
    # inference: one CSR row per stored token, equal to encoding that token
    acts = encode_store(result.sae, reader, 1, tokens="all", batch_rows=50, progress=False)
    assert acts.n_rows == 400 * 5
    x = torch.from_numpy(reader[[0, 399], 1].reshape(-1, 16))
    dense = np.concatenate([acts.dense_rows(0, 5), acts.dense_rows(399 * 5, 400 * 5)])
    np.testing.assert_allclose(dense, result.sae.encode(x).detach().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["topk", "relu"])
def test_bf16_autocast_trains_like_fp32(tmp_path, kind):
    """``autocast="bfloat16"``: matmuls in bf16, parameters and metrics in float32; on the
    same batches it learns as well as the fp32 trainer (within bf16's precision)."""
    store = write_store(tmp_path, n=200, d=16, seed=4)
    from actstore.formats.saev import SaevReader

    reader = SaevReader(store)
    rows = torch.from_numpy(np.concatenate([r.acts for r in ordered_rows(reader, 1)]))
    pick = torch.randint(len(rows), (100, 64), generator=torch.Generator().manual_seed(1))
    common = {"kind": kind, "expansion": 4, "k": 4, "steps": 100, "batch_size": 64, "lr": 3e-3}
    common |= {"warmup_steps": 10, "log_every": 50, "device": "cpu", "l1_coeff": 0.5}
    results = {
        mode: train_sae(
            TrainConfig(**common, autocast=mode),
            (rows[i] for i in pick),
            d_model=16,
            statistics=reader.statistics(1),
            progress=False,
        )
        for mode in (None, "bfloat16")
    }
    assert all(p.dtype == torch.float32 for p in results["bfloat16"].sae.parameters())
    ev = {
        m: evaluate(r.sae, reader, 1, progress=False)["explained_variance"]
        for m, r in results.items()
    }
    assert ev["bfloat16"] > 0.3 and ev["bfloat16"] == pytest.approx(ev[None], abs=0.05)
    with pytest.raises(ConfigError, match="autocast"):
        TrainConfig(autocast="float16")


def test_training_stops_clearly_when_data_runs_out():
    config = TrainConfig(steps=5, batch_size=4, warmup_steps=0, device="cpu", normalise=False)
    with pytest.raises(ConfigError, match="ran out after 2 of 5 steps"):
        train_sae(config, [torch.randn(4, 8)] * 2, d_model=8, progress=False)
    with pytest.raises(ConfigError, match="no statistics.json"):
        train_sae(TrainConfig(steps=1), [], d_model=8, statistics=None, progress=False)
