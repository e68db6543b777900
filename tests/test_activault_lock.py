"""Two captures into one local Activault run cannot run at once: the second is refused with
one line naming the capture that holds the run (the API raises StoreLockedError, the
command exits 2 with one ``error:`` line), and the first goes on to a good run."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
from forked import run_actstore
from test_activault_s3 import make_run_data

from actstore.errors import StoreLockedError
from actstore.formats import open_store
from actstore.formats.activault import ActivaultOptions, ActivaultWriter
from actstore.storage.lock import lock_path
from actstore.testing import make_batches

SRC = Path(__file__).resolve().parents[1] / "src"
OPTIONS = ActivaultOptions(rows_per_file=4, dtype="float32")


def _holder_line(message: str, run: Path) -> None:
    assert "\n" not in message
    assert message.startswith(f"another capture (pid {os.getpid()} on host {socket.gethostname()}")
    assert f"is writing {run}" in message


def _snapshot(root: Path) -> dict[str, bytes | None]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes() if p.is_file() else None
        for p in sorted(root.rglob("*"))
    }


def test_second_writer_of_a_local_run_is_refused_naming_the_holder(tmp_path):
    plan, acts = make_run_data()
    run = tmp_path / "run"
    first = ActivaultWriter.from_plan(plan, run, OPTIONS)
    batches = make_batches(plan, acts)
    first.write(batches[0])
    with pytest.raises(StoreLockedError) as err:
        ActivaultWriter.from_plan(plan, run, OPTIONS)
    _holder_line(str(err.value), run)
    with pytest.raises(StoreLockedError):  # whatever it would capture: the run is taken
        ActivaultWriter.from_plan(make_run_data(seed=3)[0], run, OPTIONS)
    for batch in batches[1:]:  # the first capture is not disturbed
        first.write(batch)
    assert Path(first.close()) == run
    assert not lock_path(run).exists()
    assert open_store(run).verify().ok


@pytest.mark.slow  # the real command, in a subprocess, with a tiny model
def test_second_capture_command_exits_2_with_one_error_line(tmp_path, model_dir, text_file):
    plan, acts = make_run_data()
    run = tmp_path / "run"
    holder = ActivaultWriter.from_plan(plan, run, OPTIONS)
    holder.write(make_batches(plan, acts)[0])
    holder.flush()  # its first file is committed: nothing moves while the command runs
    before = _snapshot(tmp_path)
    argv = ["capture", "--model", str(model_dir("gpt2")), "--dataset", str(text_file)]
    argv += ["--layers", "1", "--context-length", "8", "--max-examples", "8"]
    argv += ["--format", "activault", "--opt", "rows_per_file=2", "--out", str(run)]
    # a process of its own, forked from a helper that imported torch once (tests/forked.py)
    proc = run_actstore(
        *argv,
        "--no-progress",
        env={**os.environ, "PYTHONPATH": str(SRC), "TQDM_DISABLE": "1"},
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    _holder_line(errors[0].removeprefix("error: "), run)
    # the refused capture changed nothing; the holder finishes its run
    assert _snapshot(tmp_path) == before
    for batch in make_batches(plan, acts)[1:]:
        holder.write(batch)
    holder.close()
    assert open_store(run).verify().ok
