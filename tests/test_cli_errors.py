"""First contact: the mistakes a new user makes, run through the real ``actstore`` command.

Each one must end in exit 2 with one ``error:`` line naming the problem, no traceback, and
nothing changed on disk. Also: an interrupted capture says what is durable (exit 130), a
finished store is reported before the model loads, and an --out root lists its stores.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from actstore.capture.preflight import check_space
from actstore.errors import StorageError

pytestmark = pytest.mark.slow  # each case starts the real command (about 2 s of imports)

SRC = Path(__file__).resolve().parents[1] / "src"


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None):
    environ = {**os.environ, "PYTHONPATH": str(SRC), "TQDM_DISABLE": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "actstore", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=environ,
        timeout=300,
        check=False,
    )


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with its size and, for files, mtime (a directory's own
    mtime moves when capture's write probe comes and goes; its contents do not)."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs:
            out[os.path.relpath(os.path.join(dirpath, name), root)] = (-1, 0)
        for name in files:
            st = os.lstat(os.path.join(dirpath, name))
            out[os.path.relpath(os.path.join(dirpath, name), root)] = (st.st_size, st.st_mtime_ns)
    return out


def assert_one_line_error(proc, needle: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    assert needle in errors[0], errors[0]


@pytest.fixture
def world(tmp_path, model_dir, text_file):
    """A tiny model, a text file, an existing file and an empty output root."""
    (tmp_path / "notes.txt").write_text("not a directory\n")
    (tmp_path / "out").mkdir()
    return {
        "model": str(model_dir("gpt2")),
        "data": str(text_file),
        "file": str(tmp_path / "notes.txt"),
        "out": str(tmp_path / "out"),
        "tmp": tmp_path,
    }


def _unwritable(tmp: Path) -> str:
    """A directory this process cannot create files in (root ignores mode bits: /sys)."""
    if os.geteuid() == 0:
        return "/sys/actstore-out"
    locked = tmp / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    return str(locked / "out")


CASES = {
    # name: (argv template, the error line must contain)
    "out is a file": (
        ["capture", "--model", "{model}", "--dataset", "{data}", "--out", "{file}"],
        "is an existing file",
    ),
    "out under a file": (
        ["capture", "--model", "{model}", "--dataset", "{data}", "--out", "{file}/acts"],
        "cannot be created",
    ),
    "out not writable": (
        ["capture", "--model", "{model}", "--dataset", "{data}", "--out", "{unwritable}"],
        "is not writable",
    ),
    "dataset missing": (
        ["capture", "--model", "{model}", "--dataset", "{tmp}/corpus.jsonl", "--out", "{out}"],
        "does not exist",
    ),
    "empty layer entry": (
        ["capture", "--model", "{model}", "--dataset", "{data}", "--layers", "3,,5"],
        "has an empty entry",
    ),
    # "3, 9" parses (spaces are fine) and then fails on the model's 4 blocks
    "layer out of range": (
        [
            "capture",
            "--model",
            "{model}",
            "--dataset",
            "{data}",
            "--layers",
            "3, 9",
            "--out",
            "{out}",
        ],
        "layer 9 is out of range for a model with 4 blocks",
    ),
    "same layer twice": (
        [
            "capture",
            "--model",
            "{model}",
            "--dataset",
            "{data}",
            "--layers",
            "3,-1",
            "--out",
            "{out}",
        ],
        "name the same site twice",
    ),
    "unknown site kind": (
        ["capture", "--model", "{model}", "--dataset", "{data}", "--sites", "bogus.1"],
        "'bogus",
    ),
    "unknown format": (
        ["capture", "--model", "{model}", "--dataset", "{data}", "--format", "hdf5"],
        "unknown format 'hdf5'",
    ),
    "bad --opt key": (
        ["capture", "--model", "{model}", "--dataset", "{data}", "--opt", "shard_size=3"],
        "--opt 'shard_size=3'",
    ),
    "bad --opt value": (
        ["capture", "--model", "{model}", "--dataset", "{data}", "--opt", "patches_per_shard=x"],
        "patches_per_shard",
    ),
    "model dir missing": (
        ["capture", "--model", "{tmp}/no-model", "--dataset", "{data}", "--out", "{out}"],
        "no such directory",
    ),
    "model id not on this machine": (
        ["capture", "--model", "nobody/absent-model", "--dataset", "{data}", "--out", "{out}"],
        "is not on this machine",
    ),
    "folder dataset for a text model": (
        ["capture", "--model", "{model}", "--dataset", "{out}", "--out", "{tmp}/acts"],
        "cannot tell what kind of dataset",
    ),
    "status of a file": (["status", "{file}"], "is not a directory"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_mistake_gives_one_line_and_changes_nothing(world, case):
    template, needle = CASES[case]
    values = {**world, "unwritable": _unwritable(world["tmp"])}
    argv = [part.format(**values) for part in template]
    before = snapshot(world["tmp"])
    proc = run_cli(*argv, cwd=world["tmp"], env={"HF_HUB_OFFLINE": "1"})
    assert_one_line_error(proc, needle)
    assert snapshot(world["tmp"]) == before
    assert not (world["tmp"] / "actstore-data").exists()


def test_absent_model_fails_at_once_when_the_hub_is_unreachable(world):
    """No HF_HUB_OFFLINE: the hub endpoint is unreachable here (no network), so the model
    fails without retries; on a machine with network the hub answers 404 just as fast."""
    env = {k: v for k, v in os.environ.items() if "OFFLINE" not in k}
    env.update(PYTHONPATH=str(SRC), HF_ENDPOINT="https://127.0.0.1:9")
    proc = subprocess.run(
        [sys.executable, "-m", "actstore", "capture", "--model", "nobody/absent-model"]
        + ["--dataset", world["data"], "--out", world["out"]],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert_one_line_error(proc, "'nobody/absent-model' is not on this machine")
    assert "Retrying" not in proc.stderr and "WARNING" not in proc.stderr


def test_space_check_names_need_and_escape(tmp_path):
    with pytest.raises(StorageError, match="--no-space-check") as err:
        check_space(str(tmp_path / "acts"), 1 << 62)
    assert "the store needs about 4194304.0 TiB but" in str(err.value)
    check_space(str(tmp_path / "acts"), 1)  # enough room: nothing raised, nothing created
    assert list(tmp_path.iterdir()) == []


def test_version_and_bare_command():
    from actstore._version import __version__

    proc = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"actstore {__version__}"
    proc = run_cli()
    assert proc.returncode == 0 and "Usage:" in proc.stdout and "capture" in proc.stdout


def _capture_args(world, *extra: str) -> list[str]:
    return [
        "capture",
        "--model",
        world["model"],
        "--dataset",
        world["data"],
        "--context-length",
        "16",
        "--layers",
        "1, 3",
        "--out",
        world["out"],
        "--no-progress",
        *extra,
    ]


def test_finished_store_is_reported_before_the_model_loads(world):
    first = run_cli(*_capture_args(world, "--max-examples", "40"))
    assert first.returncode == 0, first.stderr
    assert "loaded " in first.stderr  # the first run loads the model
    (store,) = Path(world["out"]).iterdir()
    before = snapshot(Path(world["out"]))
    again = run_cli(*_capture_args(world, "--max-examples", "40"))
    assert again.returncode == 0, again.stderr
    assert f"Already captured (same config, same content hash): {store}" in again.stdout
    assert "loaded " not in again.stderr  # answered from the plan, no weights loaded
    assert snapshot(Path(world["out"])) == before

    # the --out root: status lists it; inspect and verify name it instead of refusing
    status = run_cli("status", world["out"])
    assert status.returncode == 0, status.stderr
    assert f"{world['out']}: 1 finished, 0 unfinished" in status.stdout
    assert "finished    saev" in status.stdout and str(store) in status.stdout
    for command in ("inspect", "verify"):
        proc = run_cli(command, world["out"])
        assert_one_line_error(proc, "is an output root, not a store; it holds")
        assert f"actstore {command} {store}" in proc.stderr


def test_interrupted_capture_says_what_is_durable(world):
    """SIGINT once a shard is durable: exit 130 and 'kept N of M examples'; status lists
    the unfinished store and how to resume or remove it."""
    big = world["tmp"] / "big.txt"
    big.write_text(Path(world["data"]).read_text(encoding="utf-8") * 20, encoding="utf-8")
    args = _capture_args(world, "--batch-size", "1", "--opt", "patches_per_shard=64")
    args[args.index(world["data"])] = str(big)
    environ = {**os.environ, "PYTHONPATH": str(SRC), "TQDM_DISABLE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "actstore", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environ,
    )
    out = Path(world["out"])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        partial = [p for p in out.iterdir() if p.name.endswith(".partial")]
        if partial and (partial[0] / "acts000001.bin").exists():
            break
        time.sleep(0.05)
    assert proc.poll() is None, "capture finished before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    (line,) = [x for x in stderr.splitlines() if x.startswith("interrupted:")]
    kept, total = line.split("kept ")[1].split(" examples")[0].split(" of ")
    # at least the first shard (2 examples of 16 tokens x 2 layers) is durable
    assert 2 <= int(kept.replace(",", "")) < int(total.replace(",", ""))
    assert line.endswith(
        "rerun the same command to resume (`actstore status " + world["out"] + "` lists it)"
    )
    status = run_cli("status", world["out"])
    assert f"{world['out']}: 0 finished, 1 unfinished" in status.stdout
    assert "resume: rerun the capture command" in status.stdout and "rm -rf" in status.stdout
