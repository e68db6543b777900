"""Capture's copy-out stage on the CPU: the ring's bookkeeping (order, back-pressure, casts,
errors) with ThreadCopies doing the copies a CUDA stream does on a GPU, and real captures
through the ring storing exactly the bytes of the synchronous path, also after an
out-of-memory error mid-capture and a resume."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from actstore.batch import Batch
from actstore.capture import CaptureConfig, capture
from actstore.capture.copyout import RingCopyOut, SyncCopyOut, open_copyout
from actstore.devicecopy import ThreadCopies
from actstore.errors import CaptureError, ConfigError, CorruptStoreError, DeviceError
from actstore.formats.saev import SaevReader, SaevWriter

SITES = ("resid.0", "resid.1")


def acts_of(i: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    return {
        s: torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(10 * i + k)).to(dtype)
        for k, s in enumerate(SITES)
    }


def build_for(i: int):
    return lambda host: Batch(acts=host, example_ids=np.array([2 * i, 2 * i + 1]))


def jitter(seed: int = 0):
    rng = np.random.default_rng(seed)
    return lambda: time.sleep(float(rng.uniform(0, 0.004)))


def test_ring_hands_every_batch_over_in_order_with_its_values():
    got: list[Batch] = []
    ring = RingCopyOut(got.append, lambda d: ThreadCopies(d, before=jitter()), slots=3)
    sent = []
    for i in range(25):
        acts = acts_of(i)
        sent.append(acts)
        ring.put(acts, build_for(i))
        assert ring.in_flight <= 3
    ring.close()
    assert ring.in_flight == 0
    assert [int(b.example_ids[0]) for b in got] == list(range(0, 50, 2))
    for batch, acts in zip(got, sent):
        for s in SITES:
            assert torch.equal(batch.acts[s], acts[s])
            assert batch.acts[s].data_ptr() != acts[s].data_ptr()  # a copy, not the source


def test_ring_full_is_the_only_wait():
    """Puts return at once while fewer than ``slots`` batches are in flight; the next put
    waits for the oldest copy, then hands it to the sink."""
    gate = threading.Event()
    got: list[Batch] = []
    ring = RingCopyOut(got.append, lambda d: ThreadCopies(d, before=gate.wait), slots=3)
    start = time.perf_counter()
    for i in range(3):
        ring.put(acts_of(i), build_for(i))
    assert time.perf_counter() - start < 0.5 and ring.in_flight == 3 and got == []
    fourth = threading.Thread(target=ring.put, args=(acts_of(3), build_for(3)))
    fourth.start()
    fourth.join(0.3)
    assert fourth.is_alive()  # back-pressure: the ring is full
    gate.set()
    fourth.join(10)
    assert not fourth.is_alive() and got and ring.waited_s > 0.2
    ring.close()
    assert [int(b.example_ids[0]) for b in got] == [0, 2, 4, 6]


def test_cast_before_the_copy_is_exact():
    got: list[Batch] = []
    ring = RingCopyOut(got.append, ThreadCopies, slots=2, dtype=torch.float32)
    sent = [acts_of(i, torch.bfloat16) for i in range(4)]
    for i, acts in enumerate(sent):
        ring.put(acts, build_for(i))
    ring.close()
    for batch, acts in zip(got, sent):
        for s in SITES:
            assert batch.acts[s].dtype == torch.float32
            assert torch.equal(batch.acts[s], acts[s].float())


def test_a_failed_copy_is_one_error_after_the_batches_before_it():
    got: list[Batch] = []
    with (
        pytest.raises(DeviceError, match="copy between host and device failed"),
        RingCopyOut(got.append, ThreadCopies, slots=4) as ring,
    ):
        ring.put(acts_of(0), build_for(0))
        ring.put(acts_of(1), build_for(1))
        ring.put({s: torch.empty(2, 3, 4, device="meta") for s in SITES}, build_for(2))
        ring.put(acts_of(3), build_for(3))
        ring.close()
    assert [int(b.example_ids[0]) for b in got] == [0, 2]


def test_an_error_in_the_forward_loop_still_hands_over_the_finished_copies():
    got: list[Batch] = []
    with (
        pytest.raises(torch.OutOfMemoryError),
        RingCopyOut(got.append, ThreadCopies, slots=4) as ring,
    ):
        ring.put(acts_of(0), build_for(0))
        ring.put(acts_of(1), build_for(1))
        while not all(flight.done() for flight in ring._flights):
            time.sleep(0.001)
        raise torch.OutOfMemoryError("CUDA out of memory")
    assert [int(b.example_ids[0]) for b in got] == [0, 2]  # copied, so written


def test_cpu_captures_keep_the_synchronous_path():
    """On the CPU the copy-out hands the writer the model's own tensors, as before."""
    got: list[Batch] = []
    out = open_copyout(got.append, device=torch.device("cpu"), slots=4)
    assert isinstance(out, SyncCopyOut)
    acts = acts_of(0)
    out.put(acts, build_for(0))
    assert all(got[0].acts[s] is acts[s] for s in SITES)
    with pytest.raises(ConfigError, match="copy_dtype"):
        CaptureConfig(copy_dtype="bfloat16")
    with pytest.raises(ConfigError, match="copy_slots"):
        CaptureConfig(copy_slots=-1)


def config(model_dir, text_file, **kw) -> CaptureConfig:
    return CaptureConfig(
        model=str(model_dir("gpt2")),
        dataset=str(text_file),
        sites=("resid.1", "resid.3"),
        batch_size=3,
        context_length=16,
        max_examples=40,
        progress=False,
        **kw,
    )


def writer(out: Path):
    return lambda plan: SaevWriter.from_plan(plan, out, patches_per_shard=6 * 16 * 2)


def files(store: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(store.iterdir())}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_capture_through_the_ring_stores_the_bytes_of_the_synchronous_path(
    dtype, model_dir, text_file, tmp_path
):
    """The ring (copies on another thread, finishing at random moments; for bfloat16 the
    cast to float32 done before the copy) stores the same bytes as the synchronous path."""
    cfg = config(model_dir, text_file, dtype=dtype)
    plain = capture(cfg, writer(tmp_path / "plain"))
    ring = capture(
        cfg,
        writer(tmp_path / "ring"),
        copy_out=lambda sink: RingCopyOut(
            sink, lambda d: ThreadCopies(d, before=jitter(1)), slots=2, dtype=torch.float32
        ),
    )
    assert ring.n_examples_run == plain.n_examples_run == 40
    assert files(Path(ring.output)) == files(Path(plain.output))


def test_out_of_memory_mid_capture_keeps_finished_shards_and_resumes_exactly(
    model_dir, text_file, tmp_path
):
    cfg = config(model_dir, text_file)
    clean = capture(cfg, writer(tmp_path / "clean"))
    transfers = iter(range(10**6))

    def out_of_memory_at_the_ninth() -> None:
        if next(transfers) == 8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def ring(sink):
        return RingCopyOut(sink, lambda d: ThreadCopies(d, before=out_of_memory_at_the_ninth))

    with pytest.raises(CaptureError) as caught:
        capture(cfg, writer(tmp_path / "failed"), copy_out=ring)
    message = str(caught.value)
    assert message.startswith("capture ran out of GPU memory; the shards finished so far are kept")
    assert "\n" not in message and "smaller --batch-size" in message
    with pytest.raises(CorruptStoreError, match="unfinished capture"):
        SaevReader(next((tmp_path / "failed").iterdir()))
    resumed = capture(cfg, writer(tmp_path / "failed"))
    assert 0 < resumed.resumed_from < 40  # shards written before the error were kept
    assert files(Path(resumed.output)) == files(Path(clean.output))
