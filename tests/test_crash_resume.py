"""A capture killed with SIGKILL publishes nothing; rerunning resumes to identical bytes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from forked import run_actstore

from actstore.errors import CorruptStoreError
from actstore.formats.journal import recorded_shards
from actstore.formats.saev import SaevReader

ARGS = [
    "--layers",
    "1,3",
    "--context-length",
    "32",
    "--max-examples",
    "240",
    "--batch-size",
    "8",
    "--patches-per-shard",
    str(16 * 32 * 2),
    "--no-progress",
]  # 16 examples per shard


def run_capture(out, **kw):
    cmd = [sys.executable, "-m", "actstore", "capture", "--out", str(out), *ARGS]
    env = {**os.environ, "TQDM_DISABLE": "1"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kw)


def rerun_capture(out):
    env = {**os.environ, "TQDM_DISABLE": "1"}
    return run_actstore("capture", "--out", out, *ARGS, env=env, timeout=300)


def finished_shards(out):
    for partial in out.glob(".*.partial"):
        return recorded_shards(partial)
    return 0


@pytest.mark.slow
def test_sigkill_mid_capture_then_resume_is_byte_identical(tmp_path):
    crashed, clean = tmp_path / "crashed", tmp_path / "clean"
    proc = run_capture(crashed)
    deadline = time.monotonic() + 120
    while finished_shards(crashed) < 3:
        assert proc.poll() is None, (
            "capture finished before it could be killed:\n" + proc.stdout.read().decode()
        )
        assert time.monotonic() < deadline, "capture made no progress"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    published = [p for p in crashed.iterdir() if not p.name.startswith(".")]
    assert published == []  # nothing a reader could pick up
    partial = next(crashed.glob(".*.partial"))
    with pytest.raises(CorruptStoreError, match="unfinished capture"):
        SaevReader(partial)

    # the kill above is of a process started as the console script is; the rerun and the
    # reference are processes of their own, forked from a helper that imported torch once
    resumed = rerun_capture(crashed)
    log = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, log
    assert "resuming at example" in log
    reference = rerun_capture(clean)
    assert reference.stdout and reference.returncode == 0, reference.stderr

    (a,) = [p for p in crashed.iterdir() if not p.name.startswith(".")]
    (b,) = [p for p in clean.iterdir() if not p.name.startswith(".")]
    assert a.name == b.name
    names = sorted(p.name for p in b.iterdir())
    assert names == sorted(p.name for p in a.iterdir())
    assert len([n for n in names if n.startswith("acts") and n.endswith(".bin")]) == 15
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert not list(crashed.glob(".*.partial"))
