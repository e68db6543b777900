"""``actstore verify`` lists every fault of a store, not the first: each format with two
faults at once (a flipped byte in a data file, and a metadata file edited with the root
manifest rewritten over it) exits 1 naming both, whether the edit leaves the store
readable or not. A path that does not exist is a usage error: exit 2, one ``error:`` line."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from forked import run_actstore
from test_fault_property import BUILDERS, writable_copy

from actstore.testing import resign

SRC = Path(__file__).resolve().parents[1] / "src"


def run_verify(location: str) -> subprocess.CompletedProcess:
    # a process of its own, forked from a helper that imported torch once (tests/forked.py)
    return run_actstore(
        "verify",
        location,
        "--no-progress",
        env={**os.environ, "PYTHONPATH": str(SRC), "TQDM_DISABLE": "1"},
        timeout=300,
    )


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> dict[str, Path]:
    return {fmt: build(tmp_path_factory.mktemp(f"v-{fmt}"), 0) for fmt, build in BUILDERS.items()}


def _edit_json(path: Path, edit: Callable[[Any], None]) -> None:
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc, indent=2))


def _first_site(doc: dict) -> dict:
    return doc["sites"][next(iter(doc["sites"]))]


def _reverse_sites(attrs: dict) -> None:
    attrs["sites"], attrs["layers"] = attrs["sites"][::-1], attrs["layers"][::-1]
    attrs["layout"]["sites"], attrs["layout"]["layers"] = attrs["sites"], attrs["layers"]


def _zarr_sites_reversed(store: Path) -> str:
    _edit_json(store / ".zattrs", _reverse_sites)
    _edit_json(store / ".zmetadata", lambda d: _reverse_sites(d["metadata"][".zattrs"]))
    return "reads differently"


def _data_file(fmt: str, store: Path) -> str:
    """A data file of the store (one holding activation values)."""
    pick = {
        "saev": "acts000001.bin",
        "zarr": "arrays/prompt_activations/4.1.0.0",
        "pickle": "shard_0002.pkl.gz",
        "saelens": "data-00001-of-00003.arrow",
    }
    if fmt == "activault":
        return sorted(store.glob("models.layers.2.mlp.post/*.pt"))[2].relative_to(store).as_posix()
    return pick[fmt]


# An edit (returns the words its fault line holds) that leaves the store readable: the
# statistics (or totals) no longer match the data...
READABLE: dict[str, Callable[[Path], str]] = {
    "saev": lambda s: (
        _edit_json(s / "statistics.json", lambda d: _first_site(d).update(count=3)),
        "statistics.json is malformed",
    )[1],
    "zarr": lambda s: (
        _edit_json(s / "meta/statistics.json", lambda d: d["sites"]["resid.3"].update(count=1)),
        "statistics.json is malformed",
    )[1],
    "pickle": lambda s: (
        _edit_json(s / "metadata.json", lambda d: d["statistics"].update(total_samples=22)),
        "statistics.total_samples is 22",
    )[1],
    "activault": lambda s: (
        _edit_json(
            s / "models.layers.1.post/statistics.json", lambda d: d.update(count=d["count"] - 64)
        ),
        (
            "models.layers.1.post/statistics.json: the statistics of models.layers.1.post do "
            "not match the data"
        ),
    )[1],
    "saelens": lambda s: (
        _edit_json(s / "statistics.json", lambda d: _first_site(d).update(count=3)),
        "statistics.json is malformed",
    )[1],
}

# ...and one the format refuses to open even unchecked (its index no longer adds up)
UNREADABLE: dict[str, Callable[[Path], str]] = {
    "saev": lambda s: (
        _edit_json(s / "shards.json", lambda d: d[-1].update(n_examples=1)),
        "shards.json entry 4",
    )[1],
    "zarr": _zarr_sites_reversed,
    "pickle": lambda s: (
        _edit_json(s / "metadata.json", lambda d: d["shards"][2].update(layers=[1])),
        "does not list every layer",
    )[1],
    "activault": lambda s: (
        _edit_json(s / "cfg.json", lambda d: d["actstore"].update(groups=1)),
        "files beyond the 1 its complete cfg.json commits",
    )[1],
    "saelens": lambda s: (
        _edit_json(s / "actstore.json", lambda d: d["files"][0].update(n_examples=3)),
        "actstore.json records 16 examples",
    )[1],
}


@pytest.mark.slow  # the real command, in a subprocess (about 2 s of imports)
@pytest.mark.parametrize("edits", [READABLE, UNREADABLE], ids=["readable", "unreadable"])
@pytest.mark.parametrize("fmt", list(BUILDERS))
def test_verify_lists_both_faults_and_exits_1(stores, tmp_path, fmt, edits):
    store = writable_copy(stores[fmt], tmp_path / stores[fmt].name)
    words = edits[fmt](store)
    resign(store)  # the manifest rewritten over the edited metadata file...
    data = _data_file(fmt, store)
    raw = bytearray((store / data).read_bytes())
    raw[len(raw) // 2] ^= 0x10  # ...and then a data file damaged
    (store / data).write_bytes(bytes(raw))
    proc = run_verify(str(store))
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    faults = [line for line in proc.stderr.splitlines() if line.startswith("FAULT: ")]
    assert any(words in f for f in faults), proc.stderr
    # the damaged file by name (zarr opened unchecked names the sample whose digest fails:
    # see test_zarr_verify_unchecked_names_the_damaged_chunk)
    named = (Path(data).name, "sample 4 does not match its stored digest")
    assert any(w in f for f in faults for w in named[: 2 if fmt == "zarr" else 1]), proc.stderr


@pytest.mark.slow
def test_verify_of_a_path_that_does_not_exist_is_a_usage_error(tmp_path):
    proc = run_verify(str(tmp_path / "no-such-store"))
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no-such-store does not exist" in errors[0], proc.stderr
    assert "FAULT" not in proc.stderr


def test_zarr_verify_unchecked_names_the_damaged_chunk(stores, tmp_path):
    from actstore.formats import open_store

    store = writable_copy(stores["zarr"], tmp_path / "activations.zarr")
    chunk = store / "arrays/prompt_activations/4.1.0.0"
    raw = bytearray(chunk.read_bytes())
    raw[5] ^= 0x10
    chunk.write_bytes(bytes(raw))
    faults = open_store(store, verify_reads=False).verify().faults
    assert not any("has no chunk digests" in f for f in faults), faults
    assert any("4.1.0.0" in f for f in faults), faults
