"""The README's fenced commands are what CI runs, and its install step works with and
without root (the system tools it calls are recorded by stand-ins on PATH)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARKER = "# README test command:"


def fenced_block(marker: str) -> list[str]:
    """The lines of the ```bash block right after ``<!-- marker -->`` in README.md."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(rf"<!-- {marker} -->\n```bash\n(.*?)```", text, re.DOTALL)
    assert match, f"README.md has no ```bash block after <!-- {marker} -->"
    return match.group(1).rstrip("\n").split("\n")


def ci_command() -> list[str]:
    lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").rstrip("\n").split("\n")
    assert lines.count(MARKER) == 1, f".ci/run must mark the README command with {MARKER!r}"
    return lines[lines.index(MARKER) + 1 :]


def test_ci_runs_exactly_the_readme_test_command():
    assert ci_command() == fenced_block("tests")


def test_ci_lints_before_pytest_and_disables_bars():
    script = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "export TQDM_DISABLE=1" in script.split(MARKER)[0]
    command = " ".join(fenced_block("tests"))
    steps = ("ruff format --check", "ruff check", "lint-imports", "mypy")
    order = [command.index(step) for step in steps]
    assert order == sorted(order) and order[-1] < command.index("python -m pytest")


def test_main_job_is_one_command_that_captures():
    (line,) = fenced_block("main-job")
    assert line.endswith("actstore capture --layers 3,5 --out actstore-data")
    assert "pip install torch==2.13.0 -e '.[embedded]'" in line


def _stand_ins(tmp_path: Path, uid: int) -> tuple[Path, Path]:
    """A PATH of stand-ins: ``id`` says ``uid``; ``apt-get`` and ``sudo`` log their args."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    scripts = {
        "id": f"#!/bin/sh\necho {uid}\n",
        "apt-get": f'#!/bin/sh\necho "apt-get $*" >> {log}\n',
        "sudo": f'#!/bin/sh\necho "sudo $1" >> {log}\nexec "$@"\n',
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    # python3 with ensurepip (so only chromium is "missing"), and env for the apt call.
    (bin_dir / "python3").symlink_to(sys.executable)
    (bin_dir / "env").symlink_to("/usr/bin/env")
    return bin_dir, log


def _stand_in(bin_dir: Path, name: str) -> None:
    (bin_dir / name).write_text("#!/bin/sh\n")
    (bin_dir / name).chmod(0o755)


@pytest.mark.parametrize(("uid", "sudo"), [(0, False), (1000, True)])
def test_install_step_installs_chromium_and_node_with_sudo_only_when_not_root(tmp_path, uid, sudo):
    install = fenced_block("tests")[0]
    bin_dir, log = _stand_ins(tmp_path, uid)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path)}
    subprocess.run(["/bin/bash", "-euo", "pipefail", "-c", install], env=env, check=True)
    calls = log.read_text().splitlines()
    apt = [c for c in calls if c.startswith("apt-get")]
    assert apt == [
        "apt-get update",
        "apt-get install -y chromium python3-venv nodejs npm",
    ]
    assert (calls.count("sudo apt-get") + calls.count("sudo env") == 2) is sudo


def test_install_step_leaves_a_node_already_there(tmp_path):
    """npm present (node from elsewhere, e.g. nodesource): only chromium is installed, so
    apt never replaces that node with Debian's."""
    install = fenced_block("tests")[0]
    bin_dir, log = _stand_ins(tmp_path, 0)
    _stand_in(bin_dir, "npm")
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path)}
    subprocess.run(["/bin/bash", "-euo", "pipefail", "-c", install], env=env, check=True)
    apt = [c for c in log.read_text().splitlines() if c.startswith("apt-get")]
    assert apt == ["apt-get update", "apt-get install -y chromium python3-venv"]


def test_install_step_skips_apt_when_chromium_and_npm_are_there(tmp_path):
    install = fenced_block("tests")[0]
    bin_dir, log = _stand_ins(tmp_path, 1000)
    _stand_in(bin_dir, "chromium")
    _stand_in(bin_dir, "npm")
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path)}
    subprocess.run(["/bin/bash", "-euo", "pipefail", "-c", install], env=env, check=True)
    assert not log.exists()


def test_readme_defines_every_site_kind():
    from actstore.sites import SITE_KINDS

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = " ".join(text[text.index("### What a site means") :].split())
    for kind in SITE_KINDS:
        assert f"`{kind}." in section, kind
    assert "`hidden_states[i + 1]`" in section
    assert "**before** any final layer norm, in every format" in section


@pytest.mark.parametrize(
    ("kind", "last_is_normed"),
    [("gpt2", True), ("llama", True), ("clip", False), ("siglip", False)],
)
def test_site_definitions_hold(model_dir, kind, last_is_normed):
    """What the README says a site is: resid.i = hidden_states[i + 1], and at the last block
    the block output, which differs from hidden_states[-1] exactly for the decoder LMs."""
    import torch

    from actstore.capture.hooks import ActivationRecorder
    from actstore.capture.models import load_model
    from actstore.sites import Site

    model = load_model(str(model_dir(kind)))
    n = model.n_layers
    if model.modality == "text":
        inputs = {"input_ids": torch.arange(4, 12).reshape(1, 8)}
    else:
        size = model.module.config.image_size
        inputs = {"pixel_values": torch.linspace(-1, 1, 3 * size * size).reshape(1, 3, size, size)}
    sites = [Site("resid", i) for i in range(n)]
    with torch.inference_mode(), ActivationRecorder(model, sites) as recorder:
        acts = recorder.run(inputs)
    with torch.inference_mode():
        hidden = model.module(**inputs, output_hidden_states=True).hidden_states
    for i, site in enumerate(sites[:-1]):
        torch.testing.assert_close(acts[str(site)], hidden[i + 1], rtol=0, atol=0)
    last_differs = not torch.equal(acts[str(sites[-1])], hidden[-1])
    assert last_differs is last_is_normed
