"""docs/design.md's recipe for a new format, measured from outside: ``tests/plugin_format``
is a sixth format (npyshards: one ``.npy`` file per site per shard plus a JSON index),
written as a separate package that declares itself through the ``actstore.formats`` entry
point. This module installs it with pip (into a temporary target directory: a real
``.dist-info`` with ``entry_points.txt``, found by ``importlib.metadata``; nothing is
registered by hand and nothing in actstore names the format), then checks that

* the registry discovers it, after the built-in formats;
* its own project's conformance suite passes every rule of the kit, the S3 round trip and
  the byte-identical resume included, in a pytest process of its own that enables only the
  kit's plugin (``pytest_plugins = ["actstore.testing.plugin"]``);
* ``actstore capture --format npyshards`` in a separate process, then ``open_store``,
  ``reader[...]``, the loader, ``verify``, ``inspect`` and ``convert`` both ways take it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from actstore.formats import open_store
from actstore.formats.registry import (
    ENTRY_POINT_GROUP,
    FORMAT_NAMES,
    available_formats,
    format_names,
    get_format,
)
from actstore.testing import ConformanceSuite

pytestmark = pytest.mark.slow  # pip install, a capture and a pytest run in subprocesses

PLUGIN = Path(__file__).resolve().parent / "plugin_format"
SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture(scope="module")
def site_dir(tmp_path_factory):
    """The plugin package pip-installed into a fresh directory, put on ``sys.path`` for
    this module (and on ``PYTHONPATH`` of the subprocesses)."""
    source = tmp_path_factory.mktemp("plugin-source") / "actstore-npyshards"
    shutil.copytree(PLUGIN, source, ignore=shutil.ignore_patterns("test_*", "conftest.py"))
    target = tmp_path_factory.mktemp("plugin-site")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(target),
            str(source),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (target / "actstore_npyshards.py").exists()
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    yield target
    sys.path.remove(str(target))
    sys.modules.pop("actstore_npyshards", None)
    importlib.invalidate_caches()


def subprocess_env(site_dir: Path) -> dict[str, str]:
    path = [str(site_dir), str(SRC), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}


def test_the_installed_package_is_discovered(site_dir):
    (entry,) = [
        e for e in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP) if e.name == "npyshards"
    ]
    assert entry.value == "actstore_npyshards:FORMAT"
    assert entry.dist is not None and entry.dist.metadata["Name"] == "actstore-npyshards"
    assert "npyshards" not in FORMAT_NAMES
    assert format_names()[: len(FORMAT_NAMES)] == FORMAT_NAMES  # built-in ones first
    assert "npyshards" in format_names()
    spec = get_format("npyshards")
    assert spec.reader.__module__ == "actstore_npyshards"
    assert spec in available_formats()


def test_the_packages_own_suite_passes_every_rule(site_dir, tmp_path):
    """The plugin project's test directory (its ``conftest.py`` enables the kit's pytest
    plugin, nothing else) run by pytest in a process of its own: every rule passes, none is
    skipped."""
    project = tmp_path / "project"
    project.mkdir()
    for name in ("conftest.py", "test_npyshards.py"):
        shutil.copy(PLUGIN / name, project / name)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs"]
        + ["--rootdir", str(project), "-o", "addopts=", "test_npyshards.py"],
        cwd=project,
        env=subprocess_env(site_dir),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    rules = [name for name in dir(ConformanceSuite) if name.startswith("test_")]
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert re.match(rf"{len(rules)} passed", summary), done.stdout[-3000:]
    assert "skipped" not in summary


def test_every_command_takes_the_installed_format(site_dir, tmp_path, model_dir, text_file):
    out = tmp_path / "captured"
    done = subprocess.run(
        [sys.executable, "-m", "actstore", "capture", "--model", str(model_dir("gpt2"))]
        + ["--dataset", str(text_file), "--layers", "0,2", "--context-length", "8"]
        + ["--max-examples", "12", "--format", "npyshards", "--opt", "examples_per_shard=5"]
        + ["--out", str(out), "--no-progress"],
        env=subprocess_env(site_dir),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    reader = open_store(out)
    assert type(reader).__module__ == "actstore_npyshards"
    assert reader.shape == (12, 2, 8, reader.d_model)
    assert reader[3, "resid.2", 0].shape == (reader.d_model,)
    np.testing.assert_array_equal(reader[0:8, 2][3, 0], reader[3, "resid.2", 0])
    assert reader.tokens is not None and len(reader.tokens[11]) == 8
    assert reader.statistics("resid.0").count == 12 * 8

    from actstore.loader import ActivationLoader

    loader = ActivationLoader(str(out), site="resid.2", batch_size=16, return_index=True)
    rows = np.concatenate([b.rows.numpy() for b in loader])
    assert sorted(rows.tolist()) == list(range(12 * 8))

    from actstore.cli import app

    runner = CliRunner()
    result = runner.invoke(app, ["verify", str(out), "--no-progress"])
    assert result.exit_code == 0 and "OK:" in result.output, result.output
    result = runner.invoke(app, ["inspect", str(out)])
    assert result.exit_code == 0 and "npy shards" in result.output, result.output
    as_saev, back = tmp_path / "as-saev", tmp_path / "back"
    result = runner.invoke(
        app, ["convert", str(out), str(as_saev), "--to", "saev", "--no-progress"]
    )
    assert result.exit_code == 0, result.output
    (saev_store,) = [p for p in as_saev.iterdir() if not p.name.startswith(".")]  # <hash>/
    result = runner.invoke(
        app, ["convert", str(saev_store), str(back), "--to", "npyshards", "--no-progress"]
    )
    assert result.exit_code == 0, result.output
    again = open_store(back)
    assert type(again).__module__ == "actstore_npyshards"
    np.testing.assert_array_equal(again[0:12], reader[0:12])
