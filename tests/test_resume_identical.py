"""A capture killed at any step of its writer and rerun ends as the very same store: every
file's name and bytes equal those of an uninterrupted capture with the same
``SOURCE_DATE_EPOCH`` (pkl.gz, SAELens, zarr and a local Activault run). The process dies
with ``os._exit(137)`` at an ``ACTSTORE_CRASH_AT`` fault point, or, for Activault (whose
writer has one fault point), right after a commit or with uploads still in flight."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from actstore.faults import CRASH_EXIT
from actstore.formats import open_store

pytestmark = pytest.mark.slow  # each case runs the writer in two or three processes

SRC = Path(__file__).resolve().parents[1] / "src"
TESTS = Path(__file__).resolve().parent
EPOCH = "1700000000"

#: Writes the store of one format at argv[2] (resuming whatever is there); with
#: argv[3] = "flush:<k>" or "inflight:<k>" (Activault) it dies after k batches, after
#: waiting for their commits or at once.
WRITE = textwrap.dedent(
    """
    import os, sys
    from actstore.testing import make_acts, make_batches, make_plan

    fmt, out = sys.argv[1], sys.argv[2]
    die = sys.argv[3] if len(sys.argv) > 3 else None
    if fmt == "pickle":
        from actstore.formats.pickle import PickleOptions, PickleWriter

        plan = make_plan()
        writer = PickleWriter(plan, out, PickleOptions(samples_per_shard=5))
        batches = make_batches(plan, make_acts(plan))
    elif fmt == "saelens":
        from actstore.formats.saelens import SaelensOptions, SaelensWriter

        plan = make_plan()
        options = SaelensOptions(examples_per_shard=5, block_kb=1)
        writer = SaelensWriter.from_plan(plan, out, options)
        batches = make_batches(plan, make_acts(plan))
    elif fmt == "zarr":
        from test_zarr_store import N, SyntheticBatches, make_writer

        writer = make_writer(out)
        batches = list(SyntheticBatches()(0, N))
    else:
        from test_activault_s3 import make_run_data
        from actstore.formats.activault import ActivaultOptions, ActivaultWriter

        plan, acts = make_run_data()
        options = ActivaultOptions(rows_per_file=4, dtype="float32")
        writer = ActivaultWriter.from_plan(plan, out, options)
        batches = make_batches(plan, acts)
    if not writer.complete:
        for i, batch in enumerate(batches):
            if die is not None and i == int(die.split(":")[1]):
                if die.startswith("flush"):
                    writer.flush()
                os._exit(137)
            writer.write(batch)
    print(writer.close())
    """
)

STORE_NAME = {"pickle": "acts", "saelens": "acts", "zarr": "activations.zarr", "activault": "run"}


def write(out: Path, fmt: str, crash_at: str | None = None, die: str | None = None):
    env = {**os.environ, "PYTHONPATH": f"{SRC}:{TESTS}", "SOURCE_DATE_EPOCH": EPOCH}
    env.pop("ACTSTORE_CRASH_AT", None)
    if crash_at:
        env["ACTSTORE_CRASH_AT"] = crash_at
    argv = [sys.executable, "-c", WRITE, fmt, str(out)] + ([die] if die else [])
    return subprocess.run(argv, env=env, capture_output=True, text=True, check=False)


def tree(store: Path) -> dict[str, bytes]:
    """Every file under ``store`` (relative name -> bytes)."""
    return {
        p.relative_to(store).as_posix(): p.read_bytes()
        for p in sorted(store.rglob("*"))
        if p.is_file()
    }


def differences(a: dict[str, bytes], b: dict[str, bytes]) -> list[str]:
    out = [f"{n} only in the resumed store" for n in sorted(set(a) - set(b))]
    out += [f"{n} missing from the resumed store" for n in sorted(set(b) - set(a))]
    out += [f"{n} differs" for n in sorted(set(a) & set(b)) if a[n] != b[n]]
    return out


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, dict[str, bytes]]:
    """Each format's store written in one go, with the same SOURCE_DATE_EPOCH."""
    out = {}
    for fmt, name in STORE_NAME.items():
        store = tmp_path_factory.mktemp(f"ref-{fmt}") / name
        done = write(store, fmt)
        assert done.returncode == 0, done.stderr
        out[fmt] = tree(store)
    return out


def finish_and_compare(tmp_path: Path, fmt: str, references) -> None:
    store = tmp_path / STORE_NAME[fmt]
    rerun = write(store, fmt)
    assert rerun.returncode == 0, rerun.stderr
    diffs = differences(tree(store), references[fmt])
    assert not diffs, "; ".join(diffs)
    # nothing left beside it: no partial directory, no lock file
    assert sorted(p.name for p in tmp_path.iterdir()) == [store.name]
    assert open_store(store).verify().ok


#: (format, ACTSTORE_CRASH_AT) of the shared writer protocol and pkl.gz's own step
CRASHES = [
    ("pickle", "pickle.partial_created"),
    ("pickle", "pickle.shard_written:2"),
    ("pickle", "pickle.shard_recorded:3"),
    ("pickle", "pickle.index_written"),
    ("pickle", "pickle.manifest_written"),
    ("pickle", "pickle.bookkeeping_removed"),
    ("saelens", "saelens.init_filled"),
    ("saelens", "saelens.written:2"),
    ("saelens", "saelens.shard_synced:2"),
    ("saelens", "saelens.shard_recorded:3"),
    ("saelens", "saelens.index_written"),
    ("saelens", "saelens.manifest_written"),
    ("zarr", "zarr.partial_created"),
    ("zarr", "zarr.written:2"),
    ("zarr", "zarr.shard_recorded:1"),
    ("zarr", "zarr.index_written"),
    ("activault", "activault.completed"),
]


@pytest.mark.parametrize("fmt, crash_at", CRASHES, ids=[c for _, c in CRASHES])
def test_crash_at_a_fault_point_then_rerun_is_byte_identical(tmp_path, references, fmt, crash_at):
    crashed = write(tmp_path / STORE_NAME[fmt], fmt, crash_at=crash_at)
    assert crashed.returncode == CRASH_EXIT, crashed.stderr
    assert f"injected crash at {crash_at.split(':')[0]}" in crashed.stderr
    finish_and_compare(tmp_path, fmt, references)


@pytest.mark.parametrize("fmt", ["pickle", "saelens", "zarr"])
def test_crash_while_resuming_then_rerun_is_byte_identical(tmp_path, references, fmt):
    store = tmp_path / STORE_NAME[fmt]
    assert write(store, fmt, crash_at=f"{fmt}.shard_recorded:2").returncode == CRASH_EXIT
    assert write(store, fmt, crash_at=f"{fmt}.resumed").returncode == CRASH_EXIT
    assert write(store, fmt, crash_at=f"{fmt}.shard_recorded:1").returncode == CRASH_EXIT
    finish_and_compare(tmp_path, fmt, references)


@pytest.mark.parametrize("die", ["flush:0", "flush:2", "flush:5", "inflight:3"])
def test_activault_killed_mid_run_then_rerun_is_byte_identical(tmp_path, references, die):
    store = tmp_path / "run"
    crashed = write(store, "activault", die=die)
    assert crashed.returncode == CRASH_EXIT, crashed.stderr
    rerun = write(store, "activault")
    assert rerun.returncode == 0, rerun.stderr
    finish_and_compare(tmp_path, "activault", references)
