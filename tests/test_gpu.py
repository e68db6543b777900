"""On a CUDA GPU (skipped without one; ``benchmarks/gpu_session.sh`` runs them): the pinned
copy ring, GPU captures storing the bytes of the synchronous copy, a GPU capture killed
with SIGKILL resuming exactly, the loader on CUDA exactly once with workers and through
``serve``, no pinned memory left behind across epochs, the bf16-autocast trainer."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_crash_resume import finished_shards
from test_loader import T, expected, write_store

from actstore.batch import Batch
from actstore.capture import CaptureConfig, capture
from actstore.capture.copyout import RingCopyOut
from actstore.devicecopy import CudaCopies, can_pin_files_under, copies_for, pinned_bytes
from actstore.faults import CRASH_EXIT, ENV
from actstore.formats.saev import SaevWriter
from actstore.loader import ActivationDataLoader, ActivationLoader
from actstore.loader.serve import ServedLoader, start_server

pytestmark = pytest.mark.cuda


def busy(x: torch.Tensor, rounds: int = 20) -> torch.Tensor:
    """Queue real work on the current stream (so copies that did not wait would read too
    early)."""
    for _ in range(rounds):
        x = torch.tanh(x @ x.T @ x) * 0.5 + x
    return x


def test_cuda_copies_land_in_pinned_memory_with_exact_values():
    copies = CudaCopies("cuda")
    x = busy(torch.randn(256, 256, device="cuda"))
    h = x.to(torch.bfloat16)
    out = copies.to_host([x, h], None).wait()
    assert all(t.is_pinned() and not t.is_cuda for t in out)
    assert torch.equal(out[0], x.cpu()) and torch.equal(out[1], h.cpu())
    widened = copies.to_host([h], torch.float32).wait()[0]
    assert widened.dtype == torch.float32 and torch.equal(widened, h.cpu().float())
    back = copies.to_device(out).use()
    assert back[0].is_cuda and torch.equal(back[0], x)


def test_ring_on_cuda_hands_over_every_batch_in_order_with_exact_values():
    """Sources are dropped right after ``put`` and their memory is reused at once by new
    work on the compute stream: the copies still read the values they were given."""
    got: list[Batch] = []
    ring = RingCopyOut(got.append, copies_for, slots=3)
    want = []
    for i in range(40):
        acts = {"resid.0": busy(torch.randn(64, 64, device="cuda") + i, rounds=5)}
        want.append(acts["resid.0"].cpu())
        ring.put(acts, lambda host, i=i: Batch(acts=host, example_ids=np.array([i])))
        del acts
        torch.full((64, 64), float("nan"), device="cuda")  # reuses the freed block at once
        assert ring.in_flight <= 3
    ring.close()
    assert [int(b.example_ids[0]) for b in got] == list(range(40))
    for batch, ref in zip(got, want):
        assert batch.acts["resid.0"].is_pinned()
        assert torch.equal(batch.acts["resid.0"], ref)


def files(store: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(store.iterdir())}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_capture_stores_the_bytes_of_the_synchronous_copy(
    dtype, model_dir, text_file, tmp_path
):
    cfg = CaptureConfig(
        model=str(model_dir("qwen2")),
        dataset=str(text_file),
        sites=("resid.1", "resid.3"),
        batch_size=4,
        context_length=32,
        max_examples=60,
        device="cuda",
        dtype=dtype,
        progress=False,
    )
    runs = {
        "sync": {"copy_slots": 0},
        "ring": {"copy_slots": 4},
        "ring, cast on the GPU": {"copy_slots": 2, "copy_dtype": "float32"},
    }
    stores = {}
    for name, options in runs.items():
        out = tmp_path / name.replace(" ", "_").replace(",", "")
        result = capture(
            CaptureConfig(**{**cfg.__dict__, **options}),
            lambda plan, out=out: SaevWriter.from_plan(plan, out, patches_per_shard=8 * 32 * 2),
        )
        stores[name] = files(Path(result.output))
    assert stores["ring"] == stores["sync"]
    assert stores["ring, cast on the GPU"] == stores["sync"]


def test_gpu_capture_killed_mid_run_resumes_exactly(model_dir, text_file, tmp_path):
    """The process dies at once (``os._exit``, like ``kill -9``) as its third shard is
    recorded, with copies in flight on the side stream; rerunning resumes and publishes
    the bytes of an uninterrupted GPU capture."""
    args = ["--model", str(model_dir("qwen2")), "--dataset", str(text_file)]
    args += ["--device", "cuda", "--layers", "1,3", "--context-length", "32"]
    args += ["--max-examples", "240", "--batch-size", "8", "--no-progress"]
    args += ["--patches-per-shard", str(16 * 32 * 2)]  # 16 examples per shard

    def start(out, crash_at=None):
        env = {**os.environ, "TQDM_DISABLE": "1"}
        env.pop(ENV, None)
        if crash_at:
            env[ENV] = crash_at
        cmd = [sys.executable, "-m", "actstore", "capture", "--out", str(out), *args]
        return subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )

    def run(out, crash_at=None):
        proc = start(out, crash_at)
        output, _ = proc.communicate(timeout=300)
        return proc.returncode, output

    crashed, clean = tmp_path / "crashed", tmp_path / "clean"
    # the uninterrupted capture runs beside the crashing one (most of each run is the
    # process starting: torch, the model, CUDA), so the test costs two starts, not three
    uninterrupted = start(clean)
    try:
        code, output = run(crashed, "saev.shard_recorded:3")
        assert code == CRASH_EXIT, output
        assert [p for p in crashed.iterdir() if not p.name.startswith(".")] == []
        assert finished_shards(crashed) >= 2
        code, output = run(crashed)
        assert code == 0, output
        assert "resuming at example" in output
        output, _ = uninterrupted.communicate(timeout=300)
        assert uninterrupted.returncode == 0, output
    finally:
        uninterrupted.kill()
    (a,) = [p for p in crashed.iterdir() if not p.name.startswith(".")]
    (b,) = [p for p in clean.iterdir() if not p.name.startswith(".")]
    assert files(a) == files(b)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return write_store(tmp_path_factory.mktemp("gpu-loader"))


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_on_cuda_serves_every_row_once_with_exact_values(store, workers):
    reader, acts = store
    options = {"site": 5, "batch_size": 16, "pool_blocks": 3, "return_index": True}
    data = ActivationDataLoader(
        ActivationLoader(reader, device="cuda", **options), num_workers=workers
    )
    for _ in range(2):
        rows = []
        for x, r in data:
            assert x.is_cuda and r.is_cuda
            busy(torch.randn(128, 128, device="cuda"), rounds=2)  # the trainer's step
            np.testing.assert_array_equal(x.cpu().numpy(), expected(acts, r.cpu().numpy(), 1))
            rows += r.tolist()
        assert sorted(rows) == list(range(37 * T))
    plain = [
        r.tolist()
        for _, r in ActivationDataLoader(ActivationLoader(reader, **options), num_workers=workers)
    ]
    assert plain  # the CPU loader's stream, for the order check below
    again = ActivationDataLoader(
        ActivationLoader(reader, device="cuda", **options), num_workers=workers
    )
    assert [r.tolist() for _, r in again] == plain


def test_pinned_batches_are_gathered_into_registered_buffers(store):
    reader, acts = store
    loader = ActivationLoader(
        reader, site=5, batch_size=16, pool_blocks=3, pin_memory=True, return_index=True
    )
    for x, r in loader:
        assert x.is_pinned()
        np.testing.assert_array_equal(x.numpy(), expected(acts, r.numpy(), 1))


@pytest.mark.parametrize("workers", [0, 2])
def test_no_pinned_memory_is_left_behind_across_epochs(store, workers):
    """Each batch buffer (each worker slot) is registered once for the loader's life
    (workers persist by default with device="cuda", so their slots do too) and released
    with it."""
    reader, _ = store
    gc.collect()
    before = pinned_bytes()
    data = ActivationDataLoader(
        ActivationLoader(reader, site=5, batch_size=16, pool_blocks=3, device="cuda"),
        num_workers=workers,
    )
    held = []
    for epoch in range(6):
        for x in data:
            pass
        gc.collect()
        held.append(pinned_bytes() - before)
        if workers:  # exactly the workers' slots this process maps, once each
            assert held[-1] == data.host_bytes()
        del x
    assert max(held) > 0  # buffers were registered ...
    if not workers:
        assert held[-1] <= held[1]  # ... and the epochs after the first add none
    del data
    gc.collect()
    assert pinned_bytes() == before  # every registration ended with its memory


def test_workers_on_cuda_with_pinning_off_stage_every_batch_exactly(store, monkeypatch):
    """``ACTSTORE_PIN=0``: no host memory is registered; batches reach CUDA through the
    pinned staging buffers, exactly once each."""
    monkeypatch.setenv("ACTSTORE_PIN", "0")
    reader, acts = store
    before = pinned_bytes()
    options = {"site": 5, "batch_size": 16, "pool_blocks": 3, "return_index": True}
    for workers in (0, 2):
        data = ActivationDataLoader(
            ActivationLoader(reader, device="cuda", **options), num_workers=workers
        )
        rows = []
        for x, r in data:
            assert x.is_cuda
            np.testing.assert_array_equal(x.cpu().numpy(), expected(acts, r.cpu().numpy(), 1))
            rows += r.tolist()
        assert sorted(rows) == list(range(37 * T))
        assert pinned_bytes() == before


@pytest.mark.parametrize("where", ["disk", "shm"])
def test_served_batches_reach_cuda_exactly(store, tmp_path, where):
    """A ring in /dev/shm is pinned (DMA from the ring); one on a disk file system cannot
    be (Linux refuses long-term pins of such files) and goes through the staging copy."""
    reader, acts = store
    options = {"site": 5, "batch_size": 7, "pool_blocks": 3, "seed": 4}
    directory = tmp_path if where == "disk" else Path("/dev/shm")
    name = f"gpu-{os.getpid()}-{where}"
    server = start_server(
        reader, name=name, consumers=1, directory=directory, context="spawn", **options
    )
    try:
        loader = ServedLoader(name, 0, directory=directory, return_index=True, device="cuda")
        assert loader.staging == (not can_pin_files_under(directory))
        rows = []
        for x, r in loader:
            assert x.is_cuda
            np.testing.assert_array_equal(x.cpu().numpy(), expected(acts, r.cpu().numpy(), 1))
            rows.append(r.tolist())
        loader.close()
        server.join(60)
    finally:
        server.kill()
    plain = ActivationLoader(reader, return_index=True, **options)
    assert rows == [b.rows.tolist() for b in plain]


def test_bf16_autocast_training_on_cuda(store):
    from actstore.sae.train import TrainConfig, train_sae

    reader, _ = store
    loader = ActivationLoader(reader, site=5, batch_size=32, device="cuda", drop_last=True)

    def batches():
        while True:
            yield from loader

    config = TrainConfig(
        expansion=2,
        k=4,
        steps=30,
        batch_size=32,
        warmup_steps=2,
        device="cuda",
        normalise=False,
        autocast="bfloat16",
        log_every=10,
    )
    result = train_sae(config, batches(), d_model=reader.d_model, progress=False)
    assert np.isfinite(result.history[-1]["loss"])
    assert all(p.dtype == torch.float32 and p.is_cuda for p in result.sae.parameters())
