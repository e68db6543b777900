"""A capture killed and rerun ends as the very same store: every file's name and bytes equal
those of an uninterrupted capture with the same ``SOURCE_DATE_EPOCH``.

For every registered format this is a rule of the conformance kit,
``ConformanceSuite.test_resume_after_a_crash_at_each_fault_point_is_byte_identical``
(:mod:`actstore.testing.crash`): each format's suite (``tests/test_*_conformance.py``,
``tests/test_saelens.py``, a plugin's own) kills its writer at every fault point it
reaches, between two batches and again while resuming, and compares bytes; no format is
named here. What stays here is one writer's own moments that are not fault points:
Activault's uploads, killed after 0, 2 or 5 batches were committed or with uploads still
in flight.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
from forked import run_python

from actstore.faults import CRASH_EXIT
from actstore.formats import open_store
from actstore.testing.crash import EPOCH, differences, store_bytes

pytestmark = pytest.mark.slow  # each case runs the writer in two or three processes

SRC = Path(__file__).resolve().parents[1] / "src"
TESTS = Path(__file__).resolve().parent

#: Writes a local Activault run at argv[1] (resuming whatever is there); with argv[2] =
#: "flush:<k>" or "inflight:<k>" it dies after k batches, after waiting for their commits
#: or at once.
WRITE = textwrap.dedent(
    """
    import os, sys
    from test_activault_s3 import make_run_data
    from actstore.formats.activault import ActivaultOptions, ActivaultWriter
    from actstore.testing import make_batches

    out = sys.argv[1]
    die = sys.argv[2] if len(sys.argv) > 2 else None
    plan, acts = make_run_data()
    options = ActivaultOptions(rows_per_file=4, dtype="float32")
    writer = ActivaultWriter.from_plan(plan, out, options)
    if not writer.complete:
        for i, batch in enumerate(make_batches(plan, acts)):
            if die is not None and i == int(die.split(":")[1]):
                if die.startswith("flush"):
                    writer.flush()
                os._exit(137)
            writer.write(batch)
    print(writer.close())
    """
)


def write(out: Path, die: str | None = None):
    env = {**os.environ, "PYTHONPATH": f"{SRC}:{TESTS}", "SOURCE_DATE_EPOCH": EPOCH}
    env.pop("ACTSTORE_CRASH_AT", None)
    # a process of its own, forked from a helper that imported torch once (tests/forked.py)
    return run_python("-c", WRITE, out, *([die] if die else []), env=env)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, bytes]:
    """The run written in one go, with the same SOURCE_DATE_EPOCH."""
    store = tmp_path_factory.mktemp("ref") / "run"
    done = write(store)
    assert done.returncode == 0, done.stderr
    return store_bytes(str(store))


@pytest.mark.parametrize("die", ["flush:0", "flush:2", "flush:5", "inflight:3"])
def test_activault_killed_mid_run_then_rerun_is_byte_identical(tmp_path, reference, die):
    store = tmp_path / "run"
    crashed = write(store, die=die)
    assert crashed.returncode == CRASH_EXIT, crashed.stderr
    rerun = write(store)
    assert rerun.returncode == 0, rerun.stderr
    diffs = differences(store_bytes(str(store)), reference)
    assert not diffs, "; ".join(diffs)
    # nothing left beside it: no partial directory, no lock file
    assert sorted(p.name for p in tmp_path.iterdir()) == [store.name]
    assert open_store(store).verify().ok
