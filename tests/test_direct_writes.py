"""Writes around the page cache (storage/writeback.py: DirectFile, Appender): the bytes on
disk are exactly the bytes handed over, however buffers, offsets and lengths line up; the
page cache holds none of what went direct; a file system without direct I/O, or
ACTSTORE_DIRECT_IO=0, gets the same bytes through the page cache; and every writer's store
is byte-identical either way."""

from __future__ import annotations

import ctypes
import dataclasses
import filecmp
import mmap
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from actstore.formats import get_format
from actstore.storage.writeback import (
    BOUNCE_BYTES,
    DIRECT_ENV,
    Appender,
    DirectFile,
    direct_alignment,
)
from actstore.testing import make_acts, make_batches, make_plan

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def _resident_pages(path: Path) -> int:
    """How many of ``path``'s pages are in the page cache (``mincore`` of a mapping)."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        m = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_READ)
    try:
        addr = np.frombuffer(m, np.uint8).ctypes.data
        vec = ctypes.create_string_buffer(-(-size // mmap.PAGESIZE))
        assert _libc.mincore(ctypes.c_void_p(addr), size, vec) == 0, ctypes.get_errno()
        return sum(b & 1 for b in vec.raw)
    finally:
        m.close()


def _new_file(tmp_path: Path, name: str = "f") -> tuple[Path, int]:
    path = tmp_path / name
    return path, os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)


@pytest.fixture
def align(tmp_path):
    path, fd = _new_file(tmp_path, "probe")
    os.close(fd)
    a = direct_alignment(path)
    if not a:
        pytest.skip("this file system offers no direct I/O")
    return a


def _aligned(nbytes: int, seed: int) -> memoryview:
    buf = mmap.mmap(-1, nbytes)
    buf[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    return memoryview(buf)


def test_aligned_writes_go_around_the_page_cache_and_read_back_exactly(tmp_path, align):
    path, fd = _new_file(tmp_path)
    f = DirectFile(path, fd)
    src = _aligned(4 * align * 64, 1)
    f.write([src[: 2 * align * 64], src[2 * align * 64 :]], 0)  # aligned buffers: no copy
    assert f.direct_bytes == len(src)
    f.close()
    os.fsync(fd)
    os.close(fd)
    assert _resident_pages(path) == 0  # none of it went through the page cache
    assert path.read_bytes() == bytes(src)


def test_unaligned_buffers_are_copied_and_unaligned_ranges_use_the_page_cache(tmp_path, align):
    path, fd = _new_file(tmp_path)
    f = DirectFile(path, fd)
    raw = _aligned(BOUNCE_BYTES + 8 * align, 2)
    odd = raw[1 : 1 + BOUNCE_BYTES + 4 * align]  # memory off by one byte, more than a bounce
    released = []
    f.write([odd], 0, released=lambda: released.append(1))
    assert f.direct_bytes == len(odd) and released == [1]
    tail = bytes(range(7)) * 5  # 35 bytes at an aligned offset: not a whole block
    f.write([memoryview(tail)], len(odd), released=lambda: released.append(2))
    assert f.direct_bytes == len(odd) and released == [1, 2]
    f.close()
    os.close(fd)
    assert path.read_bytes() == bytes(odd) + tail


def test_a_refused_direct_write_is_written_through_the_page_cache(tmp_path, align):
    path, fd = _new_file(tmp_path)
    f = DirectFile(path, fd)
    f.align = 1  # claims byte alignment: the kernel refuses an odd offset
    data = _aligned(2 * align, 3)
    f.write([data[: align - 1]], 1)
    f.write([data], align)
    assert f.refused and f.direct_bytes == 0
    f.close()
    os.close(fd)
    assert path.read_bytes() == b"\0" + bytes(data[: align - 1]) + bytes(data)


def test_a_refused_bounced_write_is_written_from_the_bounce_buffer(tmp_path, align):
    """The caller reuses its buffer once released (here: zeroes it); a direct write the
    kernel then refuses is written through the page cache from the copy, not the
    buffer."""
    path, fd = _new_file(tmp_path)
    f = DirectFile(path, fd)
    f.align = 2  # claims 2-byte alignment: odd memory is bounced, the offset is refused
    raw = bytearray(np.random.default_rng(6).integers(0, 256, 3 * align + 1, np.uint8).tobytes())
    view = memoryview(raw)[1:]  # odd address (a bytearray's is even)
    expected = bytes(view)
    f.write([view], 2, released=lambda: view.__setitem__(slice(None), bytes(len(view))))
    assert f.refused and bytes(view) == bytes(len(view))
    f.close()
    os.close(fd)
    assert path.read_bytes() == b"\0\0" + expected


@pytest.mark.parametrize("sizes", [[1, 7, 4096, 3], [BOUNCE_BYTES - 5, 10, 2 * BOUNCE_BYTES + 1]])
def test_an_appender_writes_what_it_was_handed_in_order(tmp_path, align, sizes):
    path, fd = _new_file(tmp_path)
    f = DirectFile(path, fd)
    appender = Appender(f)
    rng = np.random.default_rng(4)
    parts = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    for p in parts:
        buf = bytearray(p)
        appender.write(memoryview(buf))
        buf[:] = bytes(len(buf))  # the caller reuses its buffer once write returns
    appender.finish()
    f.close()
    os.close(fd)
    total = sum(sizes)
    assert f.direct_bytes == total - total % align
    assert path.read_bytes() == b"".join(parts)


def test_without_direct_io_the_same_bytes_go_through_the_page_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(DIRECT_ENV, "0")
    path, fd = _new_file(tmp_path)
    assert direct_alignment(path) == 0
    f = DirectFile(path, fd)
    appender = Appender(f)
    data = _aligned(3 * 4096, 5)
    appender.write(data)
    appender.finish()
    assert f.direct_bytes == 0 and not f.direct
    f.close()
    os.close(fd)
    assert path.read_bytes() == bytes(data)


def test_tmpfs_offers_no_direct_io():
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm here")
    probe = shm / f"actstore-probe-{os.getpid()}"
    probe.write_bytes(b"")
    try:
        assert direct_alignment(probe) == 0
    finally:
        probe.unlink()


def _store(fmt: str, out: Path, dtype: str):
    plan = make_plan(n_examples=24, d_model=256, tokens_per_example=32)
    spec = get_format(fmt)
    options = spec.options()
    if fmt == "activault":  # files of 8 x 32 tokens: 128 KiB of bfloat16
        options = dataclasses.replace(options, rows_per_file=8)
    writer = spec.open_writer(plan, out, options)
    for batch in make_batches(plan, make_acts(plan, dtype=dtype), dtype=dtype):
        writer.write(batch)
    return writer.close()


#: the files written front to back are hashed as written, so they may go around the
#: page cache; saelens's Arrow files are hashed at commit from the page cache, so they stay
DATA = {"saev": "acts*.bin", "activault": "*/*.pt", "pickle": "*.pkl.gz", "saelens": None}


@pytest.mark.parametrize("fmt", sorted(DATA))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_store_is_byte_identical_with_and_without_direct_io(
    tmp_path, monkeypatch, align, fmt, dtype
):
    direct = Path(_store(fmt, tmp_path / "direct", dtype))
    if DATA[fmt] is not None:
        data = sorted(direct.glob(DATA[fmt]))
        assert data
        for path in data:  # at most the last page, not a whole block, is in the page cache
            assert _resident_pages(path) <= 1, path
    monkeypatch.setenv(DIRECT_ENV, "0")
    cached = Path(_store(fmt, tmp_path / "cached", dtype))
    files = sorted(str(p.relative_to(direct)) for p in direct.rglob("*") if p.is_file())
    assert files == sorted(str(p.relative_to(cached)) for p in cached.rglob("*") if p.is_file())
    _, mismatch, errors = filecmp.cmpfiles(direct, cached, files, shallow=False)
    # the run records differ (a run id, a time); every data file is the same bytes
    assert [m for m in mismatch if not m.endswith(".json")] == [] and errors == []


@pytest.mark.parametrize("value", ["yes", "2", "off"])
def test_a_bad_direct_io_setting_is_one_line_before_anything_is_written(
    tmp_path, monkeypatch, value
):
    from actstore.errors import ConfigError
    from actstore.formats.saev import SaevOptions, SaevWriter
    from actstore.storage.location import Location

    monkeypatch.setenv(DIRECT_ENV, value)
    with pytest.raises(ConfigError, match="ACTSTORE_DIRECT_IO must be 0 or 1"):
        SaevWriter.from_plan(make_plan(), Location.parse(tmp_path), SaevOptions())
    with pytest.raises(ConfigError, match="ACTSTORE_DIRECT_IO must be 0 or 1"):
        get_format("activault").open_writer(make_plan(), tmp_path / "run", None)
    assert list(tmp_path.iterdir()) == []


def test_a_large_unaligned_batch_is_copied_into_the_aligned_cast_buffer(tmp_path, align):
    """A float32 batch needs no cast, but a tensor that direct writes cannot read where it
    lies (not aligned) is copied on the CPU pool into the page-aligned cast buffer; the
    store holds exactly its values and none of them went through the page cache."""
    from actstore.batch import Batch
    from actstore.formats.saev import SaevOptions, SaevWriter
    from actstore.storage.location import Location

    plan = make_plan(n_examples=8, d_model=1024, tokens_per_example=256, batch_size=4)
    acts = make_acts(plan)
    writer = SaevWriter.from_plan(plan, Location.parse(tmp_path / "out"), SaevOptions())
    for lo in (0, 4):
        batch_acts = {}
        for site, values in acts.items():
            flat = torch.empty(values[lo : lo + 4].size + 1)  # 4 MiB, 4 bytes off alignment
            tensor = flat[1:].view(values[lo : lo + 4].shape)
            tensor.copy_(torch.from_numpy(values[lo : lo + 4]))
            assert tensor.data_ptr() % align
            batch_acts[site] = tensor
        ids = np.arange(lo, lo + 4)
        tokens = np.zeros((4, plan.tokens_per_example), np.int64)
        writer.write(Batch(acts=batch_acts, example_ids=ids, token_ids=tokens))
    store = Path(writer.close())
    assert writer.stage_seconds().get("cast", 0) > 0  # copied, though already float32
    (shard,) = store.glob("acts*.bin")
    assert _resident_pages(shard) <= 1
    stored = np.fromfile(shard, np.float32).reshape(8, -1, plan.tokens_per_example, 1024)
    for j, site in enumerate(acts):
        np.testing.assert_array_equal(stored[:8, j], acts[site])


_FAILING_WRITE = """
import errno, resource, signal, sys
from pathlib import Path
import numpy as np, torch
from actstore.batch import Batch
from actstore.formats.saev import SaevOptions, SaevWriter
from actstore.storage.location import Location
from actstore.testing import make_acts, make_plan

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
plan = make_plan(n_examples=16, d_model=1024, tokens_per_example=256, batch_size=4)
acts = make_acts(plan)
writer = SaevWriter.from_plan(plan, Location.parse(sys.argv[1]), SaevOptions())
resource.setrlimit(resource.RLIMIT_FSIZE, (3 << 20, resource.RLIM_INFINITY))
try:
    for lo in range(0, 16, 2):  # 2 MiB per site, 4 bytes off alignment: bounced
        ids = np.arange(lo, lo + 2)
        batch_acts = {}
        for k, v in acts.items():
            flat = torch.empty(v[lo : lo + 2].size + 1)
            batch_acts[k] = flat[1:].view(v[lo : lo + 2].shape)
            batch_acts[k].copy_(torch.from_numpy(v[lo : lo + 2]))
        tokens = np.zeros((2, plan.tokens_per_example), np.int64)
        writer.write(Batch(acts=batch_acts, example_ids=ids, token_ids=tokens))
    writer.close()
except OSError as err:
    writer.abort()
    print("failed", errno.errorcode[err.errno])
else:
    print("published")
"""


@pytest.mark.parametrize("direct", ["1", "0"])
def test_a_write_that_fails_after_its_buffers_were_released_fails_the_capture(tmp_path, direct):
    """The disk refuses a write (a file-size limit: the kernel's own EFBIG) after the
    batch's buffers were handed back to the caller (copied into the bounce buffer): the
    error still stops the capture, and no store is published."""
    import subprocess
    import sys

    out = tmp_path / "out"
    env = {**os.environ, DIRECT_ENV: direct}
    run = subprocess.run(
        [sys.executable, "-c", _FAILING_WRITE, str(out)],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["failed", "EFBIG"]
    assert not out.exists() or list(out.rglob("actstore-manifest.json")) == []
