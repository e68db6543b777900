"""Stores release what they open (issue 30, item 9): every format's reader gives its file
descriptors back on ``close()`` and when it is dropped unclosed (``weakref.finalize`` on
the files layer), ``verify`` and ``cp`` keep none, and a zarr store with more chunk files
than the process may hold open reads in full (the files layer keeps a bounded,
least-recently-used set of descriptors, not one per file forever).

Descriptors are counted in ``/proc/self/fd``, before and after, in this process."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import test_zarr_conformance as zarr_conformance  # its ZarrCase, not its test classes
from typer.testing import CliRunner

from actstore.cli import app
from actstore.formats import open_store
from actstore.formats.registry import get_format
from actstore.storage.copy import copy_store
from actstore.storage.files import Descriptors, LocalFiles
from actstore.testing import FormatCase, make_acts

SRC = Path(__file__).resolve().parents[1] / "src"
FORMATS = ["saev", "zarr", "pickle", "activault", "saelens"]

pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def case_of(name: str) -> FormatCase:
    return zarr_conformance.ZarrCase(t_chunk=2) if name == "zarr" else FormatCase(name)


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("stores")
    out = {}
    for name in FORMATS:
        case = case_of(name)
        plan = case.plan(n_examples=6)  # small stores: the test counts opens, not bytes
        out[name] = case.write(root / name, plan, case.batches(plan, make_acts(plan)))
    return out


def read_some(reader) -> None:
    """One block of every site: opens the data files a loader would."""
    for site in reader.sites:
        reader.read_block(reader.blocks(site)[0])


@pytest.mark.parametrize("name", FORMATS)
def test_every_format_opened_and_closed_1000_times_keeps_no_descriptor(stores, name):
    location, spec = stores[name], get_format(name)
    with open_store(location) as reader:  # first use: imports, lazy module state
        read_some(reader)
    gc.collect()  # what earlier tests dropped is released now, not during the count
    before = open_fds()
    for _ in range(1000):
        reader = spec.open_reader(location)
        read_some(reader)
        reader.close()
    # never more than before (fewer only if something else of this process closed one)
    assert open_fds() <= before
    for _ in range(10):  # format detection opens the store's files too
        with open_store(location) as reader:
            read_some(reader)
    assert open_fds() <= before
    for _ in range(100):  # dropped without close(): released when collected
        reader = spec.open_reader(location)
        read_some(reader)
        del reader
    gc.collect()
    assert open_fds() <= before


def test_verify_and_cp_keep_no_descriptor(stores, tmp_path):
    runner = CliRunner()
    for name in FORMATS:
        assert runner.invoke(app, ["verify", stores[name], "--no-progress"]).exit_code == 0
    before = open_fds()
    for name in FORMATS:
        result = runner.invoke(app, ["verify", stores[name], "--no-progress"])
        assert result.exit_code == 0, result.output
        copy_store(stores[name], tmp_path / name)
    assert open_fds() == before


def test_a_store_with_more_chunk_files_than_the_descriptor_limit_reads_in_full(tmp_path):
    """A zarr store of 1-token chunks (one file per sample, layer and token) read in a
    process allowed fewer open descriptors than the store has files: every value comes
    back exact, and verify passes."""
    case = zarr_conformance.ZarrCase(t_chunk=1)
    plan = case.plan(n_examples=40)
    acts = make_acts(plan)
    store = case.write(tmp_path / "z", plan, case.batches(plan, acts))
    chunks = sum(1 for p in Path(store).rglob("*") if p.is_file())
    expected = {str(s): case.expected_rows(plan, acts, s) for s in plan.sites}
    np.savez(tmp_path / "expected.npz", **expected)
    script = textwrap.dedent(
        f"""
        import os, resource, numpy as np
        from actstore.formats import open_store
        expected = np.load({str(tmp_path / "expected.npz")!r})
        reader = open_store({store!r})  # imports done: now lower the limit
        reader.close()
        limit = len(os.listdir("/proc/self/fd")) + 48
        assert {chunks} > 2 * limit, ({chunks}, limit)
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        with open_store({store!r}) as reader:
            for site in reader.sites:
                rows = np.concatenate([reader.read_block(b) for b in reader.blocks(site)])
                assert np.array_equal(rows, expected[str(site)]), site
            report = reader.verify()
            assert not report.faults, report.faults
        print("read", {chunks}, "files under a limit of", limit)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SRC), "TQDM_DISABLE": "1"},
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith(f"read {chunks} files")


def test_local_files_keep_at_most_max_open_descriptors(tmp_path):
    for i in range(20):
        (tmp_path / f"f{i}").write_bytes(bytes([i]) * 8)
    files = LocalFiles(tmp_path, max_open=5)
    before = open_fds()
    for _ in range(3):
        for i in range(20):
            assert bytes(files.read_range(f"f{i}", 2, 3)) == bytes([i]) * 3
            assert open_fds() - before <= 5
    assert open_fds() - before == 5
    files.close()
    assert open_fds() == before
    assert bytes(files.read_range("f7", 0, 1)) == b"\x07"  # reopened on use
    del files
    assert open_fds() == before  # the last one closed when the object went


def test_a_descriptor_in_use_is_not_closed_under_its_reader(tmp_path):
    """Eviction while another thread still reads through a descriptor closes it only when
    that read is done: the number is never reused for another file meanwhile."""
    for i in range(3):
        (tmp_path / f"f{i}").write_bytes(bytes([i]) * 4)

    def opener(name: str) -> int:
        return os.open(tmp_path / name, os.O_RDONLY)

    fds = Descriptors(limit=1)
    inside, release = threading.Event(), threading.Event()
    seen: list[bytes] = []

    def hold() -> None:
        with fds.use("f0", opener) as fd:
            inside.set()
            release.wait(10)
            seen.append(os.pread(fd, 4, 0))

    thread = threading.Thread(target=hold)
    thread.start()
    assert inside.wait(10)
    for name in ("f1", "f2"):  # evict f0 while in use, and open others
        with fds.use(name, opener) as fd:
            assert os.pread(fd, 4, 0) == bytes([int(name[1])]) * 4
    release.set()
    thread.join(10)
    assert seen == [b"\x00" * 4]
    assert len(fds) == 1
    fds.close()


def test_a_forked_child_reads_through_its_own_descriptors(tmp_path):
    """A DataLoader worker forked while the parent reads: the child starts with no
    descriptor of the parent's (its copies closed) and reads the same bytes."""
    (tmp_path / "a").write_bytes(b"abcdef")
    files = LocalFiles(tmp_path)
    assert bytes(files.read_range("a", 1, 3)) == b"bcd"
    inherited = set(os.listdir("/proc/self/fd"))
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only if every check holds
        ok = bytes(files.read_range("a", 2, 3)) == b"cde"
        ok = ok and len(set(os.listdir("/proc/self/fd")) - inherited) <= 1
        files.close()
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert bytes(files.read_range("a", 0, 2)) == b"ab"
    files.close()
