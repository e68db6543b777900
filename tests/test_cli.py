"""The actstore command: help that teaches, clear errors, and the README's main job."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from forked import run_actstore, run_python
from typer.testing import CliRunner

from actstore.cli import app
from actstore.formats.saev import SaevReader

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def readme_command(marker: str) -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(rf"<!-- {marker} -->\s*```bash\n(.+?)\n```", text, re.DOTALL)
    assert match, f"README has no {marker} block"
    return match.group(1).strip()


def test_readme_commands_match_ci():
    ci = (ROOT / ".ci" / "run").read_text()
    assert readme_command("tests") in ci
    assert "actstore capture" in readme_command("main-job")


@pytest.mark.slow
def test_readme_main_job_runs_end_to_end(tmp_path):
    command = readme_command("main-job").split("&&")[-1].strip()
    argv = shlex.split(command)
    assert argv[0] == "actstore"
    # a process of its own, forked from a helper that imported torch once (tests/forked.py)
    proc = run_actstore(*argv[1:], cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr
    (store,) = (tmp_path / "actstore-data").iterdir()
    reader = SaevReader(store)
    assert reader.layers == (3, 5) and reader.d_model == 384 and reader.n_examples > 500
    assert str(store) in proc.stdout and "actstore inspect" in proc.stdout
    assert reader.verify().ok
    # the printed Python one-liner works as written
    one_liner = re.search(r'python -c "(.+)"', proc.stdout).group(1)
    check = run_python("-c", one_liner)
    assert check.returncode == 0 and check.stdout.strip().startswith("["), check.stderr


def test_help_explains_every_command():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("capture", "inspect", "verify"):
        assert command in result.output
    capture_help = runner.invoke(app, ["capture", "--help"]).output
    for option in (
        "--model",
        "--dataset",
        "--layers",
        "--out",
        "--dialect",
        "--device",
        "--batch-size",
        "Examples",
    ):
        assert option in capture_help


@pytest.fixture(scope="module")
def small_store(tmp_path_factory, model_dir):
    out = tmp_path_factory.mktemp("cli-store")
    result = runner.invoke(
        app,
        [
            "capture",
            "--model",
            str(model_dir("gpt2")),
            "--layers",
            "0,-1",
            "--context-length",
            "8",
            "--max-examples",
            "12",
            "--out",
            str(out),
            "--no-progress",
        ],
    )
    assert result.exit_code == 0, result.output
    (store,) = [p for p in out.iterdir() if not p.name.startswith(".")]
    return store


def test_inspect_and_verify(small_store):
    result = runner.invoke(app, ["inspect", str(small_store), "--json"])
    assert result.exit_code == 0
    summary = json.loads(result.output)
    assert summary["layers"] == [0, 3] and summary["n_examples"] == 12
    site = summary["per_site"]["resid.3"]  # canonical site names
    assert site["count"] == site["rows"] == 12 * 8
    assert runner.invoke(app, ["inspect", str(small_store)]).exit_code == 0
    result = runner.invoke(app, ["verify", str(small_store), "--no-progress"])
    assert result.exit_code == 0 and "OK" in result.output


def test_rerun_reports_existing_store(small_store, model_dir):
    result = runner.invoke(
        app,
        [
            "capture",
            "--model",
            str(model_dir("gpt2")),
            "--layers",
            "0,-1",
            "--context-length",
            "8",
            "--max-examples",
            "12",
            "--out",
            str(small_store.parent),
            "--no-progress",
        ],
    )
    assert result.exit_code == 0 and "Already captured" in result.output
    # inside a Slurm job array (a sweep), --no-slurm is the whole capture, not a slice
    array = {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "3"}
    result = runner.invoke(
        app,
        [
            "capture",
            "--model",
            str(model_dir("gpt2")),
            "--layers",
            "0,-1",
            "--context-length",
            "8",
            "--max-examples",
            "12",
            "--out",
            str(small_store.parent),
            "--no-progress",
            "--no-slurm",
        ],
        env=array,
    )
    assert result.exit_code == 0 and "Already captured" in result.output


def test_verify_fails_on_a_damaged_store(small_store, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(small_store, copy)
    shard = copy / "acts000000.bin"
    shard.chmod(0o644)
    data = bytearray(shard.read_bytes())
    data[5] ^= 0xFF
    shard.write_bytes(bytes(data))
    result = runner.invoke(app, ["verify", str(copy), "--no-progress"])
    assert result.exit_code == 1 and "differ from the manifest" in result.output
    with open(shard, "r+b") as f:
        f.truncate(10)
    result = runner.invoke(app, ["verify", str(copy), "--no-progress"])
    assert result.exit_code == 1 and "has 10 bytes" in result.output


def run_cli(*args, cwd=None):
    # a process per run, forked from a helper that imported torch once (tests/forked.py)
    return run_actstore(*args, cwd=cwd, timeout=300)


def test_bad_input_gives_one_clear_error(tmp_path, model_dir):
    proc = run_cli("capture", "--model", str(tmp_path / "nope"), "--out", str(tmp_path))
    assert proc.returncode == 2 and "error: --model" in proc.stderr
    assert "no such directory" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run_cli(
        "capture", "--model", str(model_dir("gpt2")), "--layers", "7", "--out", str(tmp_path)
    )
    assert (
        proc.returncode == 2 and "layer 7 is out of range for a model with 4 blocks" in proc.stderr
    )
    proc = run_cli(
        "capture", "--model", str(model_dir("gpt2")), "--layers", "a,b", "--out", str(tmp_path)
    )
    assert proc.returncode == 2 and "comma-separated integers" in proc.stderr
    proc = run_cli(
        "capture",
        "--model",
        str(model_dir("gpt2")),
        "--dialect",
        "saev",
        "--max-examples",
        "2",
        "--out",
        str(tmp_path),
    )
    assert proc.returncode == 2 and "--dialect saev is for ViT captures" in proc.stderr
    proc = run_cli(
        "capture",
        "--model",
        str(model_dir("gpt2")),
        "--dataset",
        str(tmp_path / "x.csv"),
        "--out",
        str(tmp_path),
    )
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    proc = run_cli("inspect", str(tmp_path))
    assert proc.returncode == 2 and "not an actstore-readable store" in proc.stderr
    assert list(tmp_path.iterdir()) == []  # nothing was written by any failed command
