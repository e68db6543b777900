"""pkl.gz reliability: injected crashes at every writer step, decompression bombs, object
arrays however built, tampered metadata, symlinks (docs/reliability.md)."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import shutil
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pytest
from forked import run_python
from test_pickle_store import PER_SHARD, _replace_shard, _rewrite_metadata, spec_load_shard, write

from actstore import safe_pickle
from actstore.errors import CorruptStoreError, StoreLockedError, UnsafeDataError
from actstore.faults import CRASH_EXIT
from actstore.formats import open_store
from actstore.formats.pickle import PickleOptions, PickleReader, PickleWriter

SRC = Path(__file__).resolve().parents[1] / "src"
TESTS = Path(__file__).resolve().parent

POINTS = [
    "pickle.partial_created",
    "pickle.shard_written:1",
    "pickle.shard_written:3",
    "pickle.shard_synced:2",
    "pickle.shard_recorded:1",
    "pickle.shard_recorded:5",
    "pickle.index_written",
    "pickle.manifest_written",
    "pickle.bookkeeping_removed",
    "pickle.published",
]

WRITE = textwrap.dedent(
    f"""
    import sys
    from actstore.testing import make_acts, make_batches, make_plan
    from actstore.formats.pickle import PickleOptions, PickleWriter
    plan = make_plan()
    writer = PickleWriter(plan, sys.argv[1], PickleOptions(samples_per_shard={PER_SHARD}))
    for batch in make_batches(plan, make_acts(plan)) if not writer.complete else []:
        writer.write(batch)
    print(writer.close())
    """
)


def _run(out: Path, crash_at: str | None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{SRC}:{TESTS}"}
    env.pop("ACTSTORE_CRASH_AT", None)
    if crash_at:
        env["ACTSTORE_CRASH_AT"] = crash_at
    # a process of its own, forked from a helper that imported torch once (tests/forked.py)
    return run_python("-c", WRITE, out, env=env)


def _content(store: Path) -> tuple[dict[str, bytes], dict]:
    shards = {p.name: p.read_bytes() for p in sorted(store.glob("shard_*"))}
    meta = json.loads((store / "metadata.json").read_text())
    meta.pop("created_at")
    meta["statistics"].pop("extraction_duration_seconds")
    return shards, meta


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    return write(tmp_path_factory.mktemp("ref") / "acts")[0]


@pytest.mark.parametrize("crash_at", POINTS)
def test_crash_at_every_writer_step_resumes_to_the_same_store(tmp_path, reference, crash_at):
    out = tmp_path / "acts"
    crashed = _run(out, crash_at)
    assert crashed.returncode == CRASH_EXIT, crashed.stderr
    rerun = _run(out, None)
    assert rerun.returncode == 0, rerun.stderr
    assert _content(out) == _content(reference)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in reference.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["acts"]  # no lock file left
    assert PickleReader(out).verify().ok


def test_decompression_bomb_is_refused_before_it_allocates(tmp_path):
    out, *_ = write(tmp_path / "acts")
    bomb = {"layer_1": [{"activation": b"\0" * (256 << 20)}], "layer_3": []}
    _replace_shard(out, bomb)  # ~256 KB compressed, 256 MiB declared by no one
    assert (out / "shard_0001.pkl.gz").stat().st_size < 1 << 20
    reader = PickleReader(out)
    with pytest.raises(CorruptStoreError, match="holds more than the .* bytes its metadata"):
        reader.read_block(reader.blocks(1)[0])


def test_object_array_built_by_a_direct_ndarray_call_is_refused():
    class ObjectArray:
        def __reduce__(self):
            return (np.ndarray, ((2,), "O"))

    with pytest.raises(UnsafeDataError, match="dtype object"):
        safe_pickle.loads(pickle.dumps({"x": ObjectArray()}))
    with pytest.raises(UnsafeDataError, match="dtype object"):
        safe_pickle.loads(pickle.dumps([np.array([1, "a"], dtype=object)], protocol=2))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m["shards"][2].update(layers=[1]), "does not list every layer"),
        (lambda m: m["extraction_config"]["model_params"].update(hidden_size=7), "d_model"),
        (lambda m: m["shards"].pop(), "the shards hold 20 samples, the capture declared 23"),
    ],
)
def test_tampered_metadata_is_corrupt_never_fewer_rows(tmp_path, edit, message):
    out, *_ = write(tmp_path / "acts")
    meta = json.loads((out / "metadata.json").read_text())
    edit(meta)
    (out / "metadata.json").chmod(0o644)
    (out / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(CorruptStoreError, match="does not match its root manifest"):
        open_store(out)  # the manifest catches any edit
    _rewrite_metadata(out, meta)  # an attacker who fixes the manifest too
    with pytest.raises(CorruptStoreError, match=message):
        reader = open_store(out)
        for block in reader.blocks(3):
            reader.read_block(block)


def test_missing_manifest_is_an_error_and_fails_verify(tmp_path):
    out, *_ = write(tmp_path / "acts")
    (out / "actstore-manifest.json").unlink()
    with pytest.raises(CorruptStoreError, match="root manifest .* is missing"):
        PickleReader(out)
    report = PickleReader(out, verify_reads=False).verify()
    assert not report.ok and "no root manifest" in report.faults[0]


def test_malformed_json_is_corrupt_store_naming_the_file(tmp_path):
    out, *_ = write(tmp_path / "acts")
    (out / "actstore-manifest.json").unlink()
    (out / "metadata.json").chmod(0o644)
    (out / "metadata.json").write_text('{"version": ')
    with pytest.raises(CorruptStoreError, match="metadata.json is not valid JSON"):
        PickleReader(out)


def test_symlinked_shard_out_of_the_store_is_refused(tmp_path):
    out, *_ = write(tmp_path / "acts")
    outside = tmp_path / "elsewhere.pkl.gz"
    shutil.move(out / "shard_0002.pkl.gz", outside)
    (out / "shard_0002.pkl.gz").symlink_to(outside)
    with pytest.raises(CorruptStoreError, match="a symlink out of the store"):
        PickleReader(out)


def test_flipped_byte_fails_reads_unless_verify_reads_is_off(tmp_path):
    out, _, acts = write(tmp_path / "acts", compress=False)
    shard = out / "shard_0001.pkl"
    data = bytearray(shard.read_bytes())
    data[data.find(acts["resid.3"][2].tobytes()) + 100] ^= 0x01  # inside an activation
    shard.chmod(0o644)
    shard.write_bytes(bytes(data))
    reader = PickleReader(out)
    with pytest.raises(CorruptStoreError, match="is not the block published there"):
        reader.read_block(reader.blocks(3)[0])
    unchecked = open_store(out, verify_reads=False)
    assert unchecked.read_block(unchecked.blocks(3)[0]).shape[0] == reader.blocks(3)[0].n_rows


def test_second_writer_is_refused_with_one_line(tmp_path):
    from actstore.testing import make_plan

    plan = make_plan()
    first = PickleWriter(plan, tmp_path / "acts", PickleOptions(samples_per_shard=PER_SHARD))
    with pytest.raises(
        StoreLockedError, match=r"^another capture \(pid \d+ on host .*--break-lock$"
    ):
        PickleWriter(plan, tmp_path / "acts", PickleOptions(samples_per_shard=PER_SHARD))
    first.abort()


def test_gzip_trailing_garbage_is_corrupt(tmp_path):
    out, *_ = write(tmp_path / "acts")
    good = spec_load_shard(out / "shard_0001.pkl.gz")
    path = _replace_shard(out, good)
    data = gzip.compress(pickle.dumps(good) + b"trailing", mtime=0)
    path.write_bytes(data)
    meta = json.loads((out / "metadata.json").read_text())
    import hashlib

    meta["shards"][0].update(
        checksum="sha256:" + hashlib.sha256(data).hexdigest(), size_bytes=len(data)
    )
    _rewrite_metadata(out, meta)
    reader = PickleReader(out)
    with pytest.raises(CorruptStoreError, match="bytes follow the pickle"):
        reader.read_block(reader.blocks(1)[0])


class _Allocate:
    """A 30-byte pickle that asks for ``n`` bytes when loaded."""

    def __init__(self, kind, *args):
        self.kind, self.args = kind, args

    def __reduce__(self):
        return (self.kind, self.args)


@pytest.mark.parametrize(
    "payload",
    [
        _Allocate(bytearray, 4_000_000_000),
        _Allocate(bytes, 4_000_000_000),
        {"activation": _Allocate(np.zeros, (1 << 16, 1 << 16), np.float32)},
    ],
    ids=["bytearray", "bytes", "numpy zeros"],
)
def test_a_small_pickle_that_allocates_gigabytes_is_refused_before_allocating(payload):
    """The bound covers allocations the stream asks for, not only the bytes it holds."""
    import io
    import pickle
    import resource

    from actstore.errors import ActstoreError
    from actstore.safe_pickle import load

    data = pickle.dumps(payload)
    assert len(data) < 200
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ActstoreError):
        load(io.BytesIO(data), max_bytes=1 << 20)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 << 10  # KiB


def test_another_capture_over_an_unfinished_one_is_refused_and_changes_nothing(tmp_path):
    """A rerun with another configuration must not resume (or discard) the unfinished
    capture in the same output: one line says so, and the partial store is kept."""
    from actstore.errors import StoreExistsError
    from actstore.formats.pickle import PickleOptions
    from actstore.formats.registry import get_format
    from actstore.testing import make_acts, make_batches, make_plan

    plan = make_plan()
    spec, options = get_format("pickle"), PickleOptions(samples_per_shard=PER_SHARD)
    writer = spec.open_writer(plan, tmp_path / "out", options)
    for batch in make_batches(plan, make_acts(plan))[:3]:
        writer.write(batch)
    writer.abort()
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    other = make_plan(d_model=16)
    with pytest.raises(StoreExistsError, match="unfinished capture with another configuration"):
        spec.open_writer(other, tmp_path / "out", options)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    resumed = spec.open_writer(plan, tmp_path / "out", options)  # the same one still resumes
    assert resumed.resume_from == 2 * PER_SHARD
    resumed.abort()


def test_publication_cut_short_is_finished_only_by_the_same_capture(tmp_path, reference):
    from actstore.errors import StoreExistsError
    from actstore.testing import make_plan

    out = tmp_path / "acts"
    assert _run(out, "pickle.manifest_written").returncode == CRASH_EXIT
    other = make_plan(ckpt="another-model")
    with pytest.raises(StoreExistsError, match="another capture, cut short while publishing"):
        PickleWriter(other, out, PickleOptions(samples_per_shard=PER_SHARD))
    assert not (out / "metadata.json").exists()  # nothing published by the other capture
    rerun = _run(out, None)
    assert rerun.returncode == 0, rerun.stderr
    assert _content(out) == _content(reference)
