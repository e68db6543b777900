"""Batches moved to a device: copies on a thread land on the copier's device (``meta``
here, any non-CUDA device alike), a failed copy is one line with advice, and on CUDA
(skipped without one) normalised half-precision batches are pinned and a loop left early
leaves no copy running."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_loader import T, write_store

from actstore.devicecopy import (
    Staging,
    ThreadCopies,
    is_pinned,
    pin,
    pinned_bytes,
    try_pin,
)
from actstore.errors import DeviceError
from actstore.loader import ActivationLoader
from actstore.loader.device import to_device
from actstore.testing import FormatCase, make_acts, make_batches, make_plan


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return write_store(tmp_path_factory.mktemp("loader-device"))


def test_thread_copies_land_on_their_device():
    copies = ThreadCopies("meta")
    try:
        (moved,) = copies.to_device([torch.arange(4.0)]).wait()
        (back,) = copies.to_host([torch.arange(4.0)], torch.float16).wait()
    finally:
        copies.close()
    assert (moved.device.type, moved.shape, moved.dtype) == ("meta", (4,), torch.float32)
    assert (back.device.type, back.dtype, back.tolist()) == ("cpu", torch.float16, [0, 1, 2, 3])


def test_the_loader_moves_batches_to_its_device(store):
    reader, _ = store
    loader = ActivationLoader(reader, site=5, batch_size=16, device="meta", return_index=True)
    batches = list(loader)
    assert {(b.acts.device.type, b.rows.device.type) for b in batches} == {("meta", "meta")}
    assert sum(len(b.acts) for b in batches) == 37 * T


def test_a_failed_copy_is_one_line_with_advice():
    def fail() -> None:
        raise RuntimeError(
            "CUDA error: an illegal memory access was encountered\n"
            "CUDA kernel errors might be asynchronously reported at some other API call\n"
            "For debugging consider passing CUDA_LAUNCH_BLOCKING=1"
        )

    copies = ThreadCopies(before=fail)
    try:
        with pytest.raises(DeviceError) as err:
            copies.to_device([torch.arange(4.0)]).wait()
    finally:
        copies.close()
    assert str(err.value) == (
        "a copy between host and device failed (RuntimeError: CUDA error: an illegal memory "
        "access was encountered); use a smaller batch_size, or free GPU memory (other "
        "processes, tensors you hold), and check the device with nvidia-smi"
    )


@pytest.mark.cuda
def test_normalised_half_precision_batches_are_pinned(tmp_path):
    plan = make_plan()
    case = FormatCase("zarr")  # float16 rows: normalising goes through the float32 stage
    reader = case.open(case.write(tmp_path / "z", plan, make_batches(plan, make_acts(plan))))
    loader = ActivationLoader(
        reader, site="resid.1", batch_size=16, normalize="standardize", pin_memory=True
    )
    batches = list(loader)
    assert batches and all(b.dtype == torch.float32 and b.is_pinned() for b in batches)


@pytest.mark.cuda
def test_leaving_a_device_loop_early_leaves_no_copy_running():
    from actstore.devicecopy import CudaCopies
    from actstore.loader.device import to_device

    host = [torch.full((1 << 24,), float(i)).pin_memory() for i in range(3)]
    copies = CudaCopies("cuda")
    moved = to_device(iter(host), copies)
    first = next(moved)  # the copy of host[1] is started before host[0]'s is handed out
    moved.close()
    assert copies.stream.query()  # host[1] may be reused: its copy has finished
    np.testing.assert_array_equal(first[:4].cpu().numpy(), np.zeros(4, dtype=np.float32))


def test_an_empty_array_is_never_registered():
    """cudaHostRegister rejects zero bytes: pin() returns before it asks CUDA (this torch
    has no CUDA, so asking would raise)."""
    empty = np.empty(0, dtype=np.float32)
    assert pin(empty) is empty and not is_pinned(empty)


def test_with_pinning_off_memory_stays_unpinned(monkeypatch):
    """``ACTSTORE_PIN=0`` forces the staging path: nothing is registered (no CUDA call)."""
    monkeypatch.setenv("ACTSTORE_PIN", "0")
    before = pinned_bytes()
    rows = np.ones(1024, dtype=np.float32)
    with pytest.raises(DeviceError, match=r"^ACTSTORE_PIN=0: host memory is not pinned$"):
        pin(rows)
    assert try_pin(rows) is rows and not is_pinned(rows) and pinned_bytes() == before


def test_staging_copies_batches_into_reused_buffers():
    staging = Staging("cpu", always=True)
    acts = torch.arange(12.0).view(3, 4).to(torch.bfloat16)
    rows = torch.tensor([7, 2, 9])
    staged = []
    for i in range(3):
        a, r = staging.stage([acts + i, rows + i])
        assert torch.equal(a, acts + i) and torch.equal(r, rows + i)
        assert (a.dtype, r.dtype) == (torch.bfloat16, torch.int64)
        staged.append((a, r))
    # two buffers used in turn: batch 2 lies where batch 0 did
    assert staged[2][0].data_ptr() == staged[0][0].data_ptr() != staged[1][0].data_ptr()
    assert staging.staged == 3
    assert not Staging("cpu").needed(acts)  # only CUDA needs pinned sources


def test_staged_loader_batches_reach_the_device_exactly(store):
    """The fallback for host memory that cannot be pinned, forced on the CPU: every batch
    is staged, then copied on the copy thread; values and order are the loader's."""
    reader, _ = store
    options = {"site": 5, "batch_size": 16, "return_index": True}
    staging = Staging("cpu", always=True)
    got = list(to_device(ActivationLoader(reader, **options), ThreadCopies("cpu"), staging))
    want = list(ActivationLoader(reader, **options))
    assert staging.staged == len(want) == len(got)
    for g, w in zip(got, want):
        assert torch.equal(g.rows, w.rows) and torch.equal(g.acts, w.acts)
