"""``actstore cp`` to local disk: what an interrupted copy leaves is cleaned up (its
resumable parts kept), a destination holding other files is refused up front, a fault
found after copying exits 1 like ``verify``, a disk error is one line saying how to
resume, and a multipart ETag is recomputed with the copy's own part size."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest
from forked import run_python

from actstore.errors import ConfigError
from actstore.formats import verify_store
from actstore.storage.copy import copy_store, multipart_etag
from actstore.storage.files import LocalFiles
from actstore.storage.object import MiB
from actstore.testing import FormatCase, make_acts, make_batches, make_plan

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    plan = make_plan()
    root = tmp_path_factory.mktemp("cp-src")
    return Path(FormatCase("saev").write(root / "s", plan, make_batches(plan, make_acts(plan))))


def _names(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def _run(*args: str, preamble: str = "") -> subprocess.CompletedProcess:
    code = f"{preamble}\nimport sys\nsys.argv = ['actstore', *{list(args)!r}]\n"
    code += "from actstore.cli import main\nmain()\n"
    # a process of its own, forked from a helper that imported torch once (tests/forked.py)
    return run_python(
        "-c",
        code,
        env={**os.environ, "PYTHONPATH": str(SRC), "TQDM_DISABLE": "1"},
        timeout=300,
    )


def test_leftovers_of_a_killed_copy_are_removed_and_the_copy_completes(store, tmp_path):
    dst = tmp_path / "dst"
    copy_store(store, dst, check_store=verify_store)
    # as a copy killed while writing the data file and the manifest leaves it: their
    # mkstemp files, half written, and no final files
    for name in ("acts000000.bin", "actstore-manifest.json"):
        (dst / name).unlink()
        fd, _ = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=dst)
        os.write(fd, b"half")
        os.close(fd)
    report = copy_store(store, dst, check_store=verify_store)
    assert (report.copied, report.skipped) == (2, 5)
    assert "SaevReader.verify()" in report.verified
    assert _names(dst) == _names(store)
    for name in _names(store):
        assert (dst / name).read_bytes() == (store / name).read_bytes(), name


def test_a_destination_holding_other_files_is_refused_before_anything_is_copied(store, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "notes.txt").write_text("mine")
    (dst / ".other.tmp").write_text("someone else's")
    with pytest.raises(ConfigError) as err:
        copy_store(store, dst)
    assert str(err.value) == (
        f"{dst} holds 2 file(s) that are not in the source (.other.tmp, notes.txt): remove "
        "them, or copy into an empty directory"
    )
    assert _names(dst) == [".other.tmp", "notes.txt"]


def test_a_large_files_partial_copy_is_resumed_and_stray_temp_files_removed(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    data = np.random.default_rng(0).integers(0, 256, 11 * MiB, dtype=np.uint8).tobytes()
    (src / "big.bin").write_bytes(data)
    (src / "small.txt").write_text("small")
    part = 5 * MiB
    # the first part of big.bin copied, as its journal says; stray temp files of both files
    header = json.dumps(
        {"size": len(data), "version": LocalFiles(src).version("big.bin"), "part": part}
    )
    (dst / ".big.bin.partial.tmp").write_bytes(data[:part] + bytes(len(data) - part))
    (dst / ".big.bin.parts.tmp").write_text(f"{header}\n0\n")
    (dst / ".big.bin.q1w2e3r4.tmp").write_bytes(b"stale")
    (dst / ".small.txt.k3j4h5g6.tmp").write_bytes(b"stale")
    (dst / ".small.txt.partial.tmp").write_bytes(b"stale")
    report = copy_store(src, dst, part_bytes=part, threads=1, check_store=None)
    assert (report.copied, report.parts_reused) == (2, 1)
    assert _names(dst) == ["big.bin", "small.txt"]
    assert (dst / "big.bin").read_bytes() == data
    # a journal left beside a file that is complete is removed by the next run
    (dst / ".big.bin.parts.tmp").write_text(f"{header}\n0\n")
    again = copy_store(src, dst, part_bytes=part, check_store=None)
    assert (again.copied, again.skipped) == (0, 2)
    assert _names(dst) == ["big.bin", "small.txt"]


@pytest.mark.slow  # the real command, in a subprocess
def test_cp_exits_1_listing_a_fault_found_after_copying(store, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(store, src)
    victim = src / "acts000000.bin"
    victim.chmod(0o644)
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    victim.write_bytes(bytes(raw))
    proc = _run("cp", str(src), str(tmp_path / "dst"), "--no-progress")
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "error:" not in proc.stderr, proc.stderr
    faults = [line for line in proc.stderr.splitlines() if line.startswith("FAULT: ")]
    assert len(faults) == 1 and "acts000000.bin" in faults[0], proc.stderr
    assert f"{tmp_path / 'dst'} fails verification" in faults[0]
    assert "Exits 1 when the copy's verification" in _run("cp", "--help").stdout


@pytest.mark.slow  # the real command, in a subprocess
def test_a_disk_error_while_copying_is_one_line_saying_how_to_resume(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    (src / "big.bin").write_bytes(bytes(2 * MiB))
    # files may grow to 1 MiB at most: writing big.bin fails with EFBIG, as a full disk would
    limit = (
        "import resource, signal\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))"
    )
    proc = _run("cp", str(src), str(dst), "--no-progress", preamble=limit)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        f"error: writing {dst}/big.bin failed (EFBIG: File too large); fix the cause and "
        "rerun the same copy to resume"
    )
    assert _names(dst) == []  # the temporary file is removed


def test_a_multipart_etag_is_recomputed_with_the_copys_part_size(tmp_path):
    path = tmp_path / "f.bin"
    data = np.random.default_rng(3).integers(0, 256, 13 * MiB, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    part = 6 * MiB  # 3 parts; so would 5 MiB be, which the common sizes guess first
    md5s = [hashlib.md5(data[o : o + part]).digest() for o in range(0, len(data), part)]
    etag = f"{hashlib.md5(b''.join(md5s)).hexdigest()}-3"
    assert multipart_etag(path, etag, part) == etag
    assert multipart_etag(path, etag) != etag  # guessed 5 MiB parts
