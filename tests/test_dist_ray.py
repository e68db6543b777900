"""Distributed capture on a real local Ray cluster (2 CPUs, 2 workers, tiny models).

The cluster is started once for the module, with every listener on 127.0.0.1. The merged
store must equal a single-process capture; a worker killed mid-slice is retried and
resumes; a slice that keeps failing is reported and nothing is published.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from store_compare import assert_same_store

from actstore.capture import CaptureConfig, capture
from actstore.dist import MissingPartsError, capture_on_ray, init_local_ray
from actstore.formats import get_format
from actstore.formats.journal import recorded_shards
from actstore.formats.pickle import PickleOptions, PickleReader
from actstore.formats.saev import SaevOptions

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")  # ray[default] ships it

pytestmark = pytest.mark.slow

CONTEXT = 16
SMALL = {
    "sites": ("resid.1", "resid.3"),
    "batch_size": 3,
    "context_length": CONTEXT,
    "max_examples": 22,
    "progress": False,
}
SAEV = SaevOptions(patches_per_shard=4 * CONTEXT * 2)  # 4 examples per shard


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    env = {
        "RAY_AUTH_MODE": "disabled",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    init_local_ray(num_cpus=2, _temp_dir=str(tmp_path_factory.mktemp("ray")), log_to_driver=False)
    yield ray
    ray.shutdown()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def single_capture(config, fmt, out, options):
    spec = get_format(fmt)
    return capture(config, lambda plan: spec.open_writer(plan, str(out), options)).output


def test_every_ray_listener_is_on_loopback(ray_cluster):
    listening = []
    for proc in psutil.Process().children(recursive=True):
        try:
            conns = proc.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        listening += [(proc.name(), c.laddr.ip) for c in conns if c.status == psutil.CONN_LISTEN]
    assert listening, "found no Ray listeners to check"
    assert {ip for _, ip in listening} <= {"127.0.0.1", "::ffff:127.0.0.1"}, listening


def test_two_workers_give_the_single_process_store(ray_cluster, model_dir, text_file, tmp_path):
    config = CaptureConfig(model=str(model_dir("gpt2")), dataset=str(text_file), **SMALL)
    reference = single_capture(config, "saev", tmp_path / "one", SAEV)
    result = capture_on_ray(config, "saev", str(tmp_path / "acts"), SAEV, workers=2)
    assert [(p.slice.start, p.slice.stop) for p in result.parts] == [(0, 12), (12, 22)]
    assert all(p.n_examples_run == p.slice.n_examples for p in result.parts)
    assert result.location.name == reference.name
    # byte-identical, statistics included
    assert_same_store(result.location, reference, across_processes=True)

    options = PickleOptions(samples_per_shard=4)
    pkl_ref = PickleReader(single_capture(config, "pickle", tmp_path / "pkl-one", options))
    merged = PickleReader(
        capture_on_ray(config, "pickle", str(tmp_path / "pkl"), options, workers=2).location
    )
    assert [s.filename for s in merged.shards] == [s.filename for s in pkl_ref.shards]
    for layer in (1, 3):
        got, want = list(merged.items(layer)), list(pkl_ref.items(layer))
        assert [g["sample_idx"] for g in got] == list(range(22))
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g["activation"], w["activation"])
    assert {m["machine_id"] for m in merged.metadata.distributed_config["machines"]} == {0, 1}


def test_workers_with_a_device_map_give_the_single_process_store(
    ray_cluster, model_dir, text_file, tmp_path
):
    """Each worker spreads its model by the map (block 1 offloaded to disk, into a folder of
    its own under the shared --offload-folder)."""
    config = CaptureConfig(model=str(model_dir("gpt2")), dataset=str(text_file), **SMALL)
    reference = single_capture(config, "saev", tmp_path / "one", SAEV)
    device_map = {"wte": "cpu", "wpe": "cpu", "h.0": "cpu", "h.1": "disk", "h.2": "cpu"}
    spread = dataclasses.replace(
        config,
        device_map=json.dumps({**device_map, "h.3": "cpu", "ln_f": "cpu"}),
        offload_folder=str(tmp_path / "offload"),
    )
    result = capture_on_ray(spread, "saev", str(tmp_path / "acts"), SAEV, workers=2)
    assert_same_store(result.location, reference, across_processes=True)


def test_failing_slice_is_reported_and_nothing_published(
    ray_cluster, model_dir, text_file, tmp_path
):
    config = CaptureConfig(model=str(model_dir("gpt2")), dataset=str(text_file), **SMALL)
    reference = single_capture(config, "saev", tmp_path / "one", SAEV)
    out = tmp_path / "acts"
    parts = out / f".{reference.name}.parts"
    parts.mkdir(parents=True)
    blocker = parts / ".part-0000000012-0000000022.partial"
    blocker.write_text("not a directory")  # machine 1 cannot create its part: an I/O error
    with pytest.raises(
        MissingPartsError,
        match=r"machine 1 of 2 \(examples \[12, 22\)\) failed "
        r"after 2 attempts",
    ):
        capture_on_ray(config, "saev", str(out), SAEV, workers=2, retries=1)
    assert not (out / reference.name).exists()  # no store with a hole
    assert (parts / "part-0000000000-0000000012" / "part.json").exists()  # machine 0 kept
    blocker.unlink()
    result = capture_on_ray(config, "saev", str(out), SAEV, workers=2, retries=1)
    assert [p.n_examples_run for p in result.parts] == [0, 10]  # only the failed slice reran
    assert_same_store(result.location, reference, across_processes=True)


def _pids_with_open_files_in(directory: Path) -> set[int]:
    pids = set()
    for proc in psutil.Process().children(recursive=True):
        try:
            if any(str(directory) in f.path for f in proc.open_files()):
                pids.add(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return pids


def test_killed_worker_is_retried_and_resumes(ray_cluster, model_dir, text_file, tmp_path):
    config = CaptureConfig(
        model=str(model_dir("gpt2")),
        dataset=str(text_file),
        sites=("resid.1", "resid.3"),
        batch_size=2,
        context_length=CONTEXT,
        max_examples=640,
        progress=False,
    )
    options = SaevOptions(patches_per_shard=16 * CONTEXT * 2)  # 16 examples per shard
    out = tmp_path / "acts"
    outcome: dict = {}
    runner = threading.Thread(
        target=lambda: outcome.update(
            result=capture_on_ray(config, "saev", str(out), options, workers=2, retries=2)
        )
    )
    runner.start()
    killed = None
    deadline = time.monotonic() + 120
    while killed is None and runner.is_alive():
        assert time.monotonic() < deadline, "machine 1 made no progress"
        for partial in out.glob(".*.parts/.part-0000000320-*.partial"):  # machine 1
            if recorded_shards(partial) >= 2:
                for pid in _pids_with_open_files_in(partial):
                    os.kill(pid, signal.SIGKILL)  # a Ray worker this test's cluster started
                    killed = pid
        time.sleep(0.01)
    runner.join(timeout=300)
    assert killed is not None, "machine 1 finished before it could be killed"
    result = outcome["result"]
    machine1 = result.parts[1]
    assert (machine1.slice.start, machine1.slice.stop) == (320, 640)  # 20 shards of 16
    assert 0 < machine1.n_examples_run < 320  # the retry resumed after the finished shards
    reference = single_capture(config, "saev", tmp_path / "one", options)
    assert_same_store(result.location, reference, across_processes=True)


def test_capture_command_with_ray(ray_cluster, model_dir, text_file, tmp_path):
    from typer.testing import CliRunner

    from actstore.cli import app

    out = tmp_path / "acts"
    result = CliRunner().invoke(
        app,
        [
            "capture",
            "--model",
            str(model_dir("gpt2")),
            "--dataset",
            str(text_file),
            "--layers",
            "1,3",
            "--context-length",
            str(CONTEXT),
            "--max-examples",
            "22",
            "--batch-size",
            "3",
            "--format",
            "pickle",
            "--opt",
            "samples_per_shard=4",
            "--out",
            str(out),
            "--ray",
            "local",
            "--workers",
            "2",
            "--no-progress",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "Captured 22 examples with 2 Ray workers; published" in result.output
    reader = PickleReader(out)
    assert reader.n_examples == 22 and reader.metadata.distributed_config["total_machines"] == 2
