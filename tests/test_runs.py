"""The saev run layout: roots, run creation, link resolution, errors naming what is missing."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from forked import run_actstore
from saev_fixtures import saev_writer
from typer.testing import CliRunner

from actstore.batch import Batch
from actstore.cli import app
from actstore.errors import ConfigError, CorruptStoreError, StoreExistsError, StoreNotFoundError
from actstore.formats.saev import SaevMetadata, SaevReader
from actstore.formats.saev.layout import encode_data
from actstore.runs import LINKS, Run, nfs_root, runs_root, scratch_root, shards_root
from actstore.sae import (
    InferenceConfig,
    SAEConfig,
    SparseAutoencoder,
    TrainConfig,
    infer_run,
    load_inference,
    load_sae,
    save_sae,
    train_run,
)

runner = CliRunner()


def write_store(root, *, n=6, seed=0, dataset="/data/somewhere", layers=(1,), d=4):
    """A small published saev store (real writer) under ``root``."""
    md = SaevMetadata(
        family="clip",
        ckpt="tiny",
        layers=layers,
        patches_per_ex=4,
        cls_token=True,
        d_model=d,
        n_examples=n,
        patches_per_shard=5 * 3,
        data=encode_data({"kind": "test", "seed": seed}),
        dataset=dataset,
        dialect="saev",
    )
    acts = np.random.default_rng(seed).standard_normal((n, len(layers), 5, d)).astype(np.float32)
    writer = saev_writer(md, root)
    writer.write(
        Batch(
            acts={f"resid.{l}": torch.from_numpy(acts[:, i]) for i, l in enumerate(layers)},
            example_ids=np.arange(n),
        )
    )
    return writer.close()


@pytest.fixture()
def stores(tmp_path):
    data = tmp_path / "data"
    (data / "train").mkdir(parents=True)
    (data / "val").mkdir()
    train = write_store(tmp_path / "scratch", seed=0, dataset=str(data / "train"))
    val = write_store(tmp_path / "scratch", seed=1, dataset=str(data / "val"))
    return train, val, data


def test_roots_follow_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SAEV_SCRATCH", str(tmp_path / "s"))
    monkeypatch.setenv("SAEV_NFS", str(tmp_path / "n"))
    assert scratch_root() == tmp_path / "s" and nfs_root() == tmp_path / "n"
    assert shards_root() == tmp_path / "s" / "saev" / "shards"
    assert runs_root() == tmp_path / "n" / "saev" / "runs"
    monkeypatch.delenv("SAEV_SCRATCH")
    monkeypatch.delenv("SAEV_NFS")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert shards_root() == tmp_path / "home" / ".cache" / "actstore" / "saev" / "shards"
    assert runs_root() == tmp_path / "home" / ".local" / "share" / "actstore" / "saev" / "runs"


def test_create_builds_the_layout_with_links(stores, tmp_path, monkeypatch):
    train, val, data = stores
    monkeypatch.setenv("SAEV_NFS", str(tmp_path / "nfs"))
    run = Run.create(train_shards=train, val_shards=val)
    assert run.path.parent == tmp_path / "nfs" / "saev" / "runs"
    assert len(run.run_id) == 8
    assert sorted(p.name for p in run.path.iterdir()) == ["checkpoint", "inference", "links"]
    for name in LINKS:
        assert (run.path / "links" / name).is_symlink()
    assert run.shards("train") == train and run.shards("val") == val
    # datasets default to the shards' metadata "dataset" field
    assert run.dataset("train") == data / "train" and run.dataset("val") == data / "val"
    assert run.sae_path == run.path / "checkpoint" / "sae.pt"
    assert run.inference_dir(val) == run.path / "inference" / val.name
    assert run.resolve_shards("val") == (val, "val")
    assert run.resolve_shards(str(train)) == (train, "train")
    # nothing left behind but the run itself
    assert [p.name for p in run.path.parent.iterdir()] == [run.run_id]


def test_create_refuses_bad_input_and_existing_runs(stores, tmp_path):
    train, val, _ = stores
    root = tmp_path / "runs"
    Run.create(train_shards=train, val_shards=val, run_id="r1", root=root)
    with pytest.raises(StoreExistsError, match="already exists"):
        Run.create(train_shards=train, val_shards=val, run_id="r1", root=root)
    with pytest.raises(ConfigError, match="run id"):
        Run.create(train_shards=train, val_shards=val, run_id="../escape", root=root)
    with pytest.raises(StoreNotFoundError, match="val shards .* does not exist"):
        Run.create(train_shards=train, val_shards=tmp_path / "nope", root=root)
    with pytest.raises(StoreNotFoundError, match="no metadata.json"):
        Run.create(train_shards=train.parent, val_shards=val, root=root)
    assert [p.name for p in root.iterdir()] == ["r1"]


def test_errors_name_the_missing_link_or_file(stores, tmp_path):
    train, val, _ = stores
    with pytest.raises(StoreNotFoundError, match="does not exist.*actstore new-run"):
        Run(tmp_path / "no-run")
    (tmp_path / "plain").mkdir()
    with pytest.raises(StoreNotFoundError, match="no links/ directory"):
        Run(tmp_path / "plain")
    run = Run.create(train_shards=train, val_shards=val, run_id="r", root=tmp_path / "runs")
    (run.path / "links" / "val-shards").unlink()
    with pytest.raises(StoreNotFoundError, match="no link links/val-shards"):
        run.shards("val")
    (run.path / "links" / "val-shards").symlink_to(tmp_path / "moved-away")
    with pytest.raises(StoreNotFoundError, match=r"links/val-shards points to .*moved-away"):
        run.shards("val")
    with pytest.raises(StoreNotFoundError, match="no checkpoint/sae.pt.*actstore train --run"):
        run.require_checkpoint()
    with pytest.raises(ConfigError, match="split must be one of"):
        run.shards("test")


def test_legacy_single_links_are_read_as_train(stores, tmp_path):
    train, _, data = stores
    path = tmp_path / "runs" / "old"
    (path / "links").mkdir(parents=True)
    (path / "links" / "shards").symlink_to(train)
    (path / "links" / "dataset").symlink_to(data / "train")
    run = Run(path)
    assert run.shards("train") == train and run.dataset("train") == data / "train"


def test_new_run_command_and_cli_error_exit(stores, tmp_path):
    train, val, _ = stores
    result = runner.invoke(
        app,
        [
            "new-run",
            "--train-shards",
            str(train),
            "--val-shards",
            str(val),
            "--run-id",
            "cli",
            "--runs-root",
            str(tmp_path / "runs"),
        ],
    )
    assert result.exit_code == 0, result.output
    run_dir = tmp_path / "runs" / "cli"
    assert f"Created run {run_dir}" in result.output
    assert f"actstore train --run {run_dir}" in result.output
    assert Run(run_dir).shards("val") == val
    # the real console entry point turns a missing checkpoint into one clear line, exit 2
    # a process of its own, forked from a helper that imported torch once (tests/forked.py)
    proc = run_actstore(
        "inference", "--run", run_dir, timeout=120, env={**os.environ, "TQDM_DISABLE": "1"}
    )
    assert proc.returncode == 2
    assert "error:" in proc.stderr and "no checkpoint/sae.pt" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_inference_rows_follow_saev_and_need_the_checkpoint_config_describes(stores, tmp_path):
    """Inference rows are saev's (content tokens: row = example * P + patch); a sae.pt that
    checkpoint/config.json does not describe (training interrupted between its two writes)
    is refused instead of encoding the wrong layer."""
    train, val, _ = stores
    run = Run.create(train_shards=train, val_shards=val, run_id="inf", root=tmp_path / "runs")
    train_run(
        run,
        TrainConfig(
            k=2, expansion=2, steps=3, batch_size=8, warmup_steps=1, log_every=1, device="cpu"
        ),
        progress=False,
    )
    cpu = InferenceConfig(device="cpu")
    record, acts = load_inference(infer_run(run, "val", cpu, progress=False))
    assert record["tokens"] == "content" and record["first_token"] == 1
    assert record["rows_per_example"] == 4
    assert acts.n_rows == 6 * 4  # 6 examples x 4 patches, no CLS rows
    sae, reader = load_sae(run.sae_path), SaevReader(val)
    for example in (0, 5):
        want = sae.encode(torch.from_numpy(reader[example, 1][1:])).detach().numpy()
        np.testing.assert_allclose(
            acts.dense_rows(4 * example, 4 * example + 4), want, rtol=1e-5, atol=1e-6
        )

    save_sae(SparseAutoencoder(SAEConfig(d_model=4, d_sae=8, k=2)), run.sae_path)
    with pytest.raises(CorruptStoreError, match="describes another checkpoint.*actstore train"):
        infer_run(run, "val", cpu, progress=False)
    run.config_path.write_text('{"sae": {}}')
    with pytest.raises(CorruptStoreError, match="not written by `actstore train`"):
        infer_run(run, "val", cpu, progress=False)
    run.config_path.unlink()
    with pytest.raises(StoreNotFoundError, match="no checkpoint/config.json.*actstore train"):
        infer_run(run, "val", cpu, progress=False)
    with pytest.raises(StoreNotFoundError, match="neither 'train' nor 'val'.*shard directory"):
        run.resolve_shards("test")
