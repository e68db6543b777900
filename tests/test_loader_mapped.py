"""The loader's mapped read path: rows gathered straight from the page cache, each block
checked where it lies once per epoch. What that check guarantees (a block that changed
before its check is refused), what it does not (a change in place after the check is
served in that epoch and caught in the next), and that a file shrunk under the mapping is
an error, not a ``SIGBUS``; bounded resident memory; both read paths serve the same."""

from __future__ import annotations

import multiprocessing
import os
import stat
from pathlib import Path

import numpy as np
import pytest
import torch
from saev_fixtures import saev_writer
from test_loader import T, expected, write_store

from actstore.batch import Batch
from actstore.errors import CorruptStoreError
from actstore.formats.saev import SaevMetadata, SaevReader
from actstore.formats.saev.layout import encode_data
from actstore.loader import ActivationDataLoader, ActivationLoader

FORK = multiprocessing.get_context("fork")
ROW = 8 * 4  # D = 8 float32


@pytest.fixture
def store(tmp_path):
    """A fresh two-layer store per test (the tests change its files)."""
    return write_store(tmp_path / "s", n=23)


def writable(path):
    path.chmod(path.stat().st_mode | stat.S_IWUSR)  # published files are read-only
    return path


def block_of(loader, reader, row):
    """(shard file, byte offset) of storage row ``row`` at the loader's site."""
    i = int(np.searchsorted(loader.layout.first_row, row, side="right") - 1)
    extent = reader.block_extent(loader.layout.blocks[0][i])
    return reader.path / extent.name, extent.offset + (row - loader.layout.first_row[i]) * ROW


def test_a_block_changed_before_its_check_is_refused(store):
    reader, _ = store
    loader = ActivationLoader(reader, site=5, batch_size=7, pool_blocks=2, return_index=True)
    assert loader.mapped
    path, at = block_of(loader, reader, 3 * T + 2)
    with open(writable(path), "r+b") as f:
        f.seek(at + 4)
        f.write(b"\x00\x00\x80\x7f")  # one value becomes +inf
    with pytest.raises(CorruptStoreError, match="is not the block published there"):
        list(loader)


def test_a_change_in_place_after_the_check_is_served_then_caught_next_epoch(store):
    """A window's blocks are checked where they lie before any of its rows is served, and
    its rows are then gathered from the same page-cache pages. A file changed in place
    after that check (published files are read-only: it takes a chmod) shows in this
    epoch's batches, and the block's next check, in the next epoch, refuses it."""
    reader, acts = store
    options = {"site": 5, "batch_size": 4, "pool_blocks": 4, "return_index": True}
    stream = [b.rows.tolist() for b in ActivationLoader(reader, **options)]  # the order
    loader = ActivationLoader(reader, **options)
    plan, after = loader.plan(0), loader.plan(1)
    batches = iter(loader)
    next(batches)  # window 0 (4 blocks) checked, its first batch served, one more gathered
    # a row of window 0 served in its 4th batch or later, in a block the next epoch does
    # not read ahead (its first window is checked as this one ends: before the change)
    early = set(after.window_blocks(0).tolist())
    later = {r for batch in stream[3 : plan.window_rows(0) // 4] for r in batch}
    row = next(
        r for i in plan.window_blocks(0).tolist() if i not in early
        for r in range(i * T, i * T + T) if r in later
    )  # fmt: skip
    path, at = block_of(loader, reader, row)
    with open(writable(path), "r+b") as f:
        f.seek(at)
        f.write(np.float32(-12345.0).tobytes())
    seen = None
    for batch in batches:
        hit = np.flatnonzero(batch.rows.numpy() == row)
        if len(hit):
            seen = batch.acts[hit[0], 0].item()
        else:  # every other row is served as stored
            np.testing.assert_array_equal(batch.acts.numpy(), expected(acts, batch.rows, 1))
    assert seen == -12345.0  # the change shows (not checked again within the epoch)
    with pytest.raises(CorruptStoreError, match="is not the block published there"):
        list(loader)  # the next epoch checks the block again


def _read_after_truncation(path, seed, shard, keep, queue):
    loader = ActivationLoader(SaevReader(path), site=5, batch_size=T, pool_blocks=1, seed=seed)
    batches = iter(loader)
    next(batches)  # window 0 served, window 1 being made ready
    os.truncate(shard, keep)
    try:
        for _ in batches:
            pass
        queue.put("no error")
    except CorruptStoreError as err:
        queue.put(str(err))


def test_a_file_shrunk_under_the_mapping_is_an_error_not_a_crash(tmp_path):
    """Touching a mapped page past the end of a file kills the process (SIGBUS); the
    loader faults each window in before gathering from it, which the kernel refuses for
    such pages, so a file truncated while being read stops the epoch with one error. In a
    child process: a SIGBUS must not take pytest down."""
    reader, _ = write_store(tmp_path / "s", n=40, per_shard=40)  # one shard of 4 pages
    # keep the first page: examples 0-9 at layer 5 (bytes (2e+1)*192 onwards) stay whole
    keep = 4096
    whole = {e for e in range(40) if (2 * e + 2) * 192 <= keep}

    def plan(seed):
        return ActivationLoader(reader, site=5, batch_size=T, pool_blocks=1, seed=seed).plan(0)

    # windows 0 and 1 (served and made ready before the truncation) stay whole
    seed = next(s for s in range(2000) if set(plan(s).block_order[:2].tolist()) <= whole)
    queue = FORK.Queue()
    shard = writable(reader.path / "acts000000.bin")
    child = FORK.Process(
        target=_read_after_truncation, args=(reader.path, seed, shard, keep, queue)
    )
    child.start()
    child.join(60)
    assert child.exitcode == 0, f"the reader died (exit {child.exitcode})"
    message = queue.get(timeout=5)
    assert "acts000000.bin is shorter than when it was opened" in message, message


def region_rss(loader):
    """Resident bytes of this process in the loader's mapped region (from smaps)."""
    region = loader._buffers[1].region
    lo, hi = region.base, region.base + region.nbytes
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = lo <= start and end <= hi
        elif inside and head == "Rss:":
            total += int(line.split()[1]) * 1024
    return total


def test_a_served_window_leaves_the_process(tmp_path):
    """Pages of a served window are dropped from the process's page tables (they stay in
    the page cache): a long epoch does not leave the whole store in the resident set."""
    n, t, d = 512, 64, 256  # 32 MiB in blocks of 1 MiB (16 examples of one layer)
    md = SaevMetadata(
        family="gpt2", ckpt="tiny", layers=(3,), patches_per_ex=t, cls_token=False,
        d_model=d, n_examples=n, patches_per_shard=n * t, data=encode_data({}),
        dataset="/nowhere",
    )  # fmt: skip
    writer = saev_writer(md, tmp_path)
    writer.write(Batch(acts={"resid.3": torch.randn(n, t, d)}, example_ids=np.arange(n)))
    reader = SaevReader(writer.close())
    loader = ActivationLoader(reader, batch_size=1024, pool_blocks=4)
    assert loader.mapped and len(reader.blocks(3)) == 32
    for _ in loader:
        pass
    resident = region_rss(loader)  # the next epoch's first window is read ahead: 4 MiB
    assert resident < n * t * d * 4 // 4, resident


@pytest.mark.parametrize("workers", [0, 2])
def test_both_read_paths_serve_the_same_stream(store, monkeypatch, workers):
    """Gathering from the mapped shards or from windows read into buffers
    (``ACTSTORE_MAP=0``) is the same stream, value for value, with and without workers,
    bfloat16 and normalised included."""
    reader, _ = store
    options = {
        "sites": [5, 2],
        "batch_size": 10,
        "pool_blocks": 3,
        "mix": 2,
        "drop_cls": True,
        "dtype": "bfloat16",
        "normalize": "standardize",
        "return_index": True,
    }

    def epoch():
        loader = ActivationLoader(SaevReader(reader.path), **options)
        data = ActivationDataLoader(loader, num_workers=workers)
        got = [(b.acts.clone(), b.rows.clone()) for b in data]
        return loader.mapped, got

    mapped, a = epoch()
    monkeypatch.setenv("ACTSTORE_MAP", "0")
    read, b = epoch()
    assert mapped and not read
    assert len(a) == len(b)
    for (x, r), (y, s) in zip(a, b):
        assert torch.equal(r, s) and torch.equal(x, y)
    rows = torch.cat([r for _, r in a])
    assert sorted(rows.tolist()) == [i for i in range(23 * T) if i % T]


def _epoch_under_a_memory_limit(path, extra, queue):
    import resource

    vm = next(
        line
        for line in Path("/proc/self/status").read_text().splitlines()
        if line.startswith("VmSize")
    )
    limit = int(vm.split()[1]) * 1024 + extra
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    loader = ActivationLoader(SaevReader(path), batch_size=256, pool_blocks=2, io_threads=1)
    rows = sum(len(b) for b in loader)
    queue.put((loader._buffers[1].region is None and not loader.mapped, rows))


def test_a_store_with_no_room_to_map_is_read_into_buffers(tmp_path):
    """Where the address space cannot hold the store (``ulimit -v``, as some clusters
    set), the loader says so once and reads windows into buffers instead (in a child
    process: the limit is the process's)."""
    n, t, d = 256, 64, 1024  # 64 MiB of one layer, blocks of 1 MiB
    md = SaevMetadata(
        family="gpt2", ckpt="tiny", layers=(3,), patches_per_ex=t, cls_token=False,
        d_model=d, n_examples=n, patches_per_shard=n * t, data=encode_data({}),
        dataset="/nowhere",
    )  # fmt: skip
    writer = saev_writer(md, tmp_path)
    writer.write(Batch(acts={"resid.3": torch.randn(n, t, d)}, example_ids=np.arange(n)))
    path = writer.close()
    queue = FORK.Queue()
    child = FORK.Process(target=_epoch_under_a_memory_limit, args=(path, 40 << 20, queue))
    child.start()
    child.join(120)
    assert child.exitcode == 0
    read, rows = queue.get(timeout=5)
    assert read and rows == n * t
