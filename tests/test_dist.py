"""Distributed capture without Ray: the split, parts, merge, missing slices, Slurm script.

Each machine runs here in turn (in-process, or as the real `actstore` command of a Slurm
array task); the merged store must equal a single-process capture of the same data.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from store_compare import assert_same_store
from typer.testing import CliRunner

from actstore.capture import CaptureConfig, capture
from actstore.cli import app
from actstore.dist import (
    MissingPartsError,
    capture_distributed,
    capture_part,
    find_unmerged,
    merge_store,
    sbatch_script,
    slurm_machine,
    split_examples,
)
from actstore.errors import ConfigError
from actstore.formats import get_format, open_store
from actstore.formats.pickle import PickleOptions, PickleReader
from actstore.formats.saev import SaevOptions

N_EXAMPLES, CONTEXT, BATCH = 22, 16, 3
SAEV = SaevOptions(patches_per_shard=4 * CONTEXT * 2)  # 4 examples per shard (2 layers)
PICKLE = PickleOptions(samples_per_shard=4)


@pytest.fixture(scope="module")
def config(model_dir, text_file):
    return CaptureConfig(
        model=str(model_dir("gpt2")),
        dataset=str(text_file),
        sites=("resid.1", "resid.3"),
        batch_size=BATCH,
        context_length=CONTEXT,
        max_examples=N_EXAMPLES,
        progress=False,
    )


# ---------------------------------------------------------------- the split


@given(n=st.integers(0, 5000), machines=st.integers(1, 64), align=st.integers(1, 300))
def test_split_is_contiguous_aligned_and_uses_the_spec_sample_ids(n, machines, align):
    slices = split_examples(n, machines, align=align)
    assert len(slices) == machines and slices == split_examples(n, machines, align=align)
    assert slices[0].start == 0 and slices[-1].stop == n
    per = slices[0].per_machine
    assert per % align == 0
    for i, (a, b) in enumerate(zip(slices, slices[1:] + [None])):
        assert a.machine_id == i and a.per_machine == per and a.start == min(i * per, n)
        if b is not None:
            assert a.stop == b.start
            if not b.empty:
                assert a.n_examples == per  # only the last non-empty slice may be short
        first, count = a.batches(7)
        if not a.empty:
            assert first * 7 <= a.start and (first + count) * 7 >= a.stop
    assert sum(s.n_examples for s in slices) == n
    # the busiest machine has the least work any split into aligned parts can give it
    assert max(s.n_examples for s in slices) == min(per, n)
    assert per == align * max(1, -(-n // (align * machines)))


def test_slurm_array_environment():
    assert slurm_machine({}) is None
    assert slurm_machine({"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_COUNT": "3"}) == (2, 3)
    with pytest.raises(ConfigError, match="outside 0..2"):
        slurm_machine({"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "3"})
    # a failed task rerun alone (`sbatch --array=3`): its index stays its machine id
    rerun = {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "1", "SLURM_ARRAY_TASK_MIN": "3"}
    assert slurm_machine(rerun, n_machines=4) == (3, 4)
    with pytest.raises(ConfigError, match="--num-machines"):
        slurm_machine(rerun)  # the array's size alone does not tell N


# ---------------------------------------------------------------- saev


@pytest.fixture(scope="module")
def saev_single(config, tmp_path_factory):
    spec = get_format("saev")
    out = tmp_path_factory.mktemp("single-saev")
    return capture(config, lambda plan: spec.open_writer(plan, str(out), SAEV)).output


def test_saev_parts_merge_byte_identical_to_one_process(config, saev_single, tmp_path):
    out = str(tmp_path / "acts")
    results = [
        capture_distributed(config, "saev", out, SAEV, machine_id=i, n_machines=3)
        for i in (2, 0, 1)
    ]  # any finishing order; the last one publishes
    assert [r.published is None for r in results] == [True, True, False]
    assert results[1].waiting_for == [(8, 16)]
    slices = [(r.part.slice.start, r.part.slice.stop) for r in results]
    assert slices == [(16, 22), (0, 8), (8, 16)]  # 2 shards of 4 per machine, the rest last
    merged = results[-1].published
    assert merged.name == saev_single.name  # same content hash
    assert_same_store(merged, saev_single)  # shards, tokens, statistics, checksums
    assert not (merged.parent / f".{merged.name}.parts").exists()  # parts cleaned up
    assert open_store(merged).verify().ok
    # rerunning a machine after the merge finds the store and does nothing
    again = capture_part(config, "saev", out, SAEV, machine_id=1, n_machines=3)
    assert again.already_complete and again.part is None


def test_merge_refuses_a_missing_slice(config, tmp_path):
    out = tmp_path / "acts"
    for machine in (0, 2):
        capture_part(config, "saev", str(out), SAEV, machine_id=machine, n_machines=3)
    (parts_dir,) = out.glob(".*.parts")
    final = out / parts_dir.name[1:-6]
    with pytest.raises(MissingPartsError, match=r"examples \[8, 16\) of 22"):
        merge_store(final, "saev")
    assert not final.exists()
    result = runner.invoke(app, ["merge", str(out)])
    assert result.exit_code == 1 and "[8, 16)" in result.output
    # a part from another splitting overlaps: refused rather than guessed at
    capture_part(config, "saev", str(out), SAEV, machine_id=1, n_machines=2)  # [12, 22)
    with pytest.raises(ConfigError, match="parts overlap"):
        merge_store(final, "saev")


def test_more_machines_than_shards_leaves_some_idle(config, saev_single, tmp_path):
    out = str(tmp_path / "acts")
    results = [
        capture_distributed(config, "saev", out, SAEV, machine_id=i, n_machines=8) for i in range(8)
    ]
    assert [r.part.slice.n_examples for r in results] == [4, 4, 4, 4, 4, 2, 0, 0]
    assert results[-1].published is not None
    assert_same_store(results[-1].published, saev_single)


# ---------------------------------------------------------------- pkl.gz


def test_pickle_parts_merge_into_the_single_machine_store(config, tmp_path):
    spec = get_format("pickle")
    single = capture(
        config, lambda plan: spec.open_writer(plan, str(tmp_path / "one"), PICKLE)
    ).output
    out = str(tmp_path / "acts")
    for machine in range(2):
        done = capture_distributed(config, "pickle", out, PICKLE, machine_id=machine, n_machines=2)
    assert done.published == Path(out).resolve()
    merged, ref = PickleReader(out), PickleReader(single)
    assert [s.filename for s in merged.shards] == [s.filename for s in ref.shards]
    assert [s.sample_id_range for s in merged.shards] == [s.sample_id_range for s in ref.shards]
    dist = merged.metadata.distributed_config
    assert dist["total_machines"] == 2 and dist["samples_per_machine"] == 12
    assert [m["example_range"] for m in dist["machines"]] == [[0, 12], [12, 22]]
    for layer in (1, 3):
        a, b = list(merged.items(layer)), list(ref.items(layer))
        assert [x["sample_idx"] for x in a] == [x["sample_idx"] for x in b] == list(range(22))
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x["activation"], y["activation"])
            assert x["text_preview"] == y["text_preview"]
            assert x["metadata"]["machine_id"] == x["sample_idx"] // 12
        sa, sb = merged.statistics(layer), ref.statistics(layer)
        assert sa.count == sb.count
        np.testing.assert_allclose(sa.mean, sb.mean, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(sa.var, sb.var, rtol=1e-12)
    assert merged.verify().ok


# ---------------------------------------------------------------- Slurm

runner = CliRunner()


@pytest.mark.slow
def test_slurm_script_runs_as_an_array_job(config, saev_single, tmp_path):
    out = tmp_path / "acts"
    args = [
        "--model",
        config.model,
        "--dataset",
        config.dataset,
        "--layers",
        "1,3",
        "--batch-size",
        str(BATCH),
        "--context-length",
        str(CONTEXT),
        "--max-examples",
        str(N_EXAMPLES),
        "--patches-per-shard",
        str(SAEV.patches_per_shard),
        "--out",
        str(out),
        "--no-progress",
    ]
    result = runner.invoke(
        app,
        [
            "slurm-script",
            "--num-machines",
            "2",
            "--gpus-per-task",
            "1",
            "--time",
            "1:00:00",
            "--setup",
            "echo starting",
            "--",
            *args,
        ],
    )
    assert result.exit_code == 0, result.output
    script = result.output
    assert script.startswith("#!/bin/bash\n")
    for line in (
        "#SBATCH --array=0-1",
        "#SBATCH --gpus-per-task=1",
        "#SBATCH --time=1:00:00",
        "echo starting",
    ):
        assert line in script.splitlines()
    path = tmp_path / "capture.sbatch"
    path.write_text(script)
    # run the script as Slurm would: one process per array task, both at once
    bin_dir = str(Path(sys.executable).parent)
    procs = [
        subprocess.Popen(
            ["bash", str(path)],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={
                **os.environ,
                "PATH": bin_dir + os.pathsep + os.environ["PATH"],
                "SLURM_ARRAY_TASK_ID": str(i),
                "SLURM_ARRAY_TASK_COUNT": "2",
                "SLURM_ARRAY_TASK_MIN": "0",
                "TQDM_DISABLE": "1",
            },
        )
        for i in range(2)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs
    assert sum("from 2 parts" in log for log in logs) == 1  # one task merged ...
    assert any("All slices are done; published" in log for log in logs)  # ... and said so
    assert_same_store(out / saev_single.name, saev_single, across_processes=True)


def test_slurm_script_checks_the_capture_arguments():
    bad = runner.invoke(app, ["slurm-script", "--num-machines", "2", "--", "--modle", "gpt2"])
    assert bad.exit_code != 0 and "No such option: --modle" in str(bad.exception)
    with pytest.raises(ConfigError, match="leave --machine-id out"):
        sbatch_script(["--machine-id", "3"], num_machines=4)


# ---------------------------------------------------------------- zarr


def test_zarr_shards_publish_as_one_run(config, tmp_path):
    from actstore.formats.zarr import ZarrOptions

    options = ZarrOptions()
    spec = get_format("zarr")
    single = open_store(
        capture(config, lambda plan: spec.open_writer(plan, str(tmp_path / "one"), options)).output
    )
    out = tmp_path / "acts"
    first = capture_distributed(config, "zarr", str(out), options, machine_id=2, n_machines=3)
    assert first.published is None and first.waiting_for == [(0, 15)]
    with pytest.raises(FileNotFoundError):  # shards without a manifest are not a store
        open_store(out)
    for machine in (0, 1):
        done = capture_distributed(
            config, "zarr", str(out), options, machine_id=machine, n_machines=3
        )
    assert [done.part.slice.start, done.part.slice.stop] == [8, 15]  # zarr's balanced split
    run = open_store(done.published)
    assert len(run.stores) == 3 and run.n_samples == N_EXAMPLES
    for site in run.sites:
        got = np.concatenate([run.read_block(b) for b in run.blocks(site)])
        want = np.concatenate([single.read_block(b) for b in single.blocks(site)])
        np.testing.assert_array_equal(got, want)
        np.testing.assert_allclose(
            run.statistics(site).mean, single.statistics(site).mean, rtol=1e-12
        )
    assert [run.token_ids(i).tolist() for i in range(N_EXAMPLES)] == [
        single.token_ids(i).tolist() for i in range(N_EXAMPLES)
    ]
    assert run.verify().ok


# ---------------------------------------------------------------- activault


@pytest.mark.parametrize("where", ["local", "s3", "gcs", "azure"])
def test_activault_parts_merge_into_one_run(config, tmp_path, request, where):
    from actstore.formats.activault import ActivaultOptions

    options = ActivaultOptions(rows_per_file=2)  # files of 2 examples: slices align on them
    cfg = dataclasses.replace(config, sites=("resid.1", "mlp_out.2"))
    if where != "local":  # a bucket on the loopback server of that backend
        bucket = request.getfixturevalue(where)
        out, single_out = bucket.url("acts"), bucket.url("one")
    else:
        out, single_out = str(tmp_path / "acts"), str(tmp_path / "one")
    spec = get_format("activault")
    single = open_store(
        capture(cfg, lambda plan: spec.open_writer(plan, single_out, options)).output
    )
    results = [
        capture_distributed(cfg, "activault", out, options, machine_id=i, n_machines=3)
        for i in (1, 2)
    ]
    if where != "local":  # the last machine only captures; `actstore merge URL` publishes
        last = capture_part(cfg, "activault", out, options, machine_id=0, n_machines=3)
        merged = runner.invoke(app, ["merge", out])
        assert merged.exit_code == 0 and f"published {out}" in merged.output, merged.output
        published = out
    else:
        done = capture_distributed(cfg, "activault", out, options, machine_id=0, n_machines=3)
        last, published = done.part, done.published
    assert [r.published is None for r in results] == [True, True] and published is not None
    assert [(r.part.slice.start, r.part.slice.stop) for r in results] + [
        (last.slice.start, last.slice.stop)
    ] == [(8, 16), (16, 22), (0, 8)]
    run = open_store(published)
    assert run.record.complete and run.record.groups == 11 and run.record.dropped_tokens == 0
    for site in run.sites:
        got = np.concatenate([run.read_block(b) for b in run.blocks(site)])
        want = np.concatenate([single.read_block(b) for b in single.blocks(site)])
        np.testing.assert_array_equal(got, want)
        np.testing.assert_allclose(
            run.statistics(site).mean, single.statistics(site).mean, rtol=1e-12
        )
    assert run.verify().ok
    assert find_unmerged(out) == []  # the parts are gone


def test_activault_parts_with_default_file_size_match_one_process(config, tmp_path):
    """The split must follow the writer's own default file size (not a guess of it)."""
    from actstore.formats.activault import ActivaultOptions

    options = ActivaultOptions()  # 85 examples: default files hold 5 rows (1/16 of the data)
    config = dataclasses.replace(config, max_examples=85)
    spec = get_format("activault")
    single = open_store(
        capture(config, lambda plan: spec.open_writer(plan, str(tmp_path / "one"), options)).output
    )
    results = [
        capture_distributed(
            config, "activault", str(tmp_path / "acts"), options, machine_id=i, n_machines=2
        )
        for i in (1, 0)
    ]
    run = open_store(results[-1].published)
    assert run.record.complete
    for site in run.sites:
        got = np.concatenate([run.read_block(b) for b in run.blocks(site)])
        want = np.concatenate([single.read_block(b) for b in single.blocks(site)])
        np.testing.assert_array_equal(got, want)


def test_capture_command_for_one_machine_then_merge(config, tmp_path):
    out = tmp_path / "acts"
    args = [
        "capture",
        "--model",
        config.model,
        "--dataset",
        config.dataset,
        "--layers",
        "1,3",
        "--batch-size",
        str(BATCH),
        "--context-length",
        str(CONTEXT),
        "--max-examples",
        str(N_EXAMPLES),
        "--format",
        "pickle",
        "--opt",
        "samples_per_shard=4",
        "--out",
        str(out),
        "--no-progress",
        "--num-machines",
        "2",
    ]
    # machine 1 as a Slurm task rerun alone (`sbatch --array=1`): the id comes from the array
    first = runner.invoke(
        app,
        args,
        env={
            "SLURM_ARRAY_TASK_ID": "1",
            "SLURM_ARRAY_TASK_COUNT": "1",
            "SLURM_ARRAY_TASK_MIN": "1",
        },
    )
    assert first.exit_code == 0, first.output
    assert "machine 1 of 2: examples [12, 22)" in first.output
    assert "Waiting for examples [0, 12)" in first.output
    assert runner.invoke(app, ["merge", str(out)]).exit_code == 1  # still missing a slice
    typo = runner.invoke(app, ["merge", str(tmp_path / "acst")])
    assert typo.exit_code == 1 and "does not exist" in typo.output
    second = runner.invoke(app, [*args, "--machine-id", "0"])
    assert second.exit_code == 0 and "All slices are done; published" in second.output
    assert PickleReader(out).n_examples == N_EXAMPLES
    both = runner.invoke(app, [*args, "--machine-id", "0", "--ray", "local"])
    assert both.exit_code != 0 and "not both" in str(both.exception)


def test_ray_failure_report_names_the_formats_own_slices():
    """A failed slice is named by the format's own split (zarr's is balanced, not per * i)."""
    from actstore.dist import PartResult, Slice
    from actstore.dist.ray_runner import _failure_report

    slices = tuple(
        Slice(machine_id=i, n_machines=4, start=a, stop=b, per_machine=3)
        for i, (a, b) in enumerate([(0, 3), (3, 6), (6, 8), (8, 10)])
    )
    done = PartResult(
        slice=slices[0],
        part=None,
        final="acts",
        store_examples=10,
        n_examples_run=3,
        seconds=0.0,
        already_complete=False,
        slices=slices,
    )
    text = _failure_report({3: OSError("disk full")}, {0: done}, 4, 2)
    assert "machine 3 of 4 (examples [8, 10)) failed after 3 attempts: disk full" in text
