"""zarr reliability: chunk checksums on every read, missing chunks, tampered statistics,
symlinks, the write lock, stale partials (docs/reliability.md)."""

from __future__ import annotations

import json
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest
from forked import run_python
from test_zarr_store import N, SyntheticBatches, expected, layout, make_writer, write_store

from actstore.errors import CorruptStoreError, StoreLockedError, StoreNotFoundError
from actstore.formats import open_store
from actstore.formats.zarr import ZarrReader
from actstore.testing import resign


@pytest.fixture
def store(tmp_path) -> Path:
    path = write_store(tmp_path / "activations.zarr")
    for f in path.rglob("*"):
        if f.is_file():
            f.chmod(f.stat().st_mode | stat.S_IWUSR)
    return path


def _chunk(store: Path, part: str, sample: int, layer: int, c: int) -> Path:
    return store / "arrays" / f"{part}_activations" / f"{sample}.{layer}.{c}.0"


def _block(reader: ZarrReader, sample: int, part: int, layer: int = 0):
    return next(b for b in reader.blocks(reader.sites[layer]) if b.loc[1:3] == (sample, part))


def test_flipped_byte_in_a_chunk_fails_the_read_naming_it(store):
    path = _chunk(store, "prompt", 4, 1, 0)
    data = bytearray(path.read_bytes())
    data[5] ^= 0x40
    path.write_bytes(bytes(data))
    reader = ZarrReader(store)
    block = _block(reader, 4, 0, layer=1)
    with pytest.raises(
        CorruptStoreError,
        match=r"4\.1\.0\.0 \(sample 4, layer 1, chunk 0, bytes 0-48\) is not the chunk published",
    ):
        reader.read_block(block)
    unchecked = ZarrReader(store, verify_reads=False)
    assert unchecked.read_block(block).shape == (block.n_rows, 8)
    other = _block(reader, 3, 0, layer=1)
    np.testing.assert_array_equal(reader.read_block(other), expected(3, 1, "prompt", layout()))
    assert any("is not the chunk published there" in f for f in reader.verify().faults)


def test_deleted_chunk_is_an_error_not_zeros(store):
    _chunk(store, "response", 1, 0, 0).unlink()
    with pytest.raises(StoreNotFoundError, match="response_activations holds 29 of the 30 chunk"):
        ZarrReader(store)  # counted at open
    reader = ZarrReader(store, verify_reads=False)  # opened unchecked, verify lists it
    assert any("29 of the 30 chunk files" in f for f in reader.verify().faults)


def test_partly_needed_chunks_are_checked_whole_and_read_exactly(store):
    reader = ZarrReader(store)
    for sample in range(N):
        for part, name in ((0, "prompt"), (1, "response")):
            if (reader.prompt_len if part == 0 else reader.response_len)[sample]:
                got = reader.read_block(_block(reader, sample, part, layer=2))
                np.testing.assert_array_equal(got, expected(sample, 2, name, layout()))


def test_store_without_its_digests_is_an_error_unless_read_unchecked(store):
    for digests in (store / "meta" / "chunksums").iterdir():
        digests.unlink()
    with pytest.raises(StoreNotFoundError, match="chunksums/prompt.000000.npy is missing"):
        ZarrReader(store)
    (store / "actstore-manifest.json").unlink()
    with pytest.raises(CorruptStoreError, match="root manifest .* is missing"):
        ZarrReader(store)
    reader = ZarrReader(store, verify_reads=False)
    assert reader.read_block(_block(reader, 0, 0)).shape[1] == 8
    assert any("no chunk digests" in f for f in reader.verify().faults)


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d["sites"].pop("resid.1"),
        lambda d: d["sites"]["resid.3"].update(count=1),
        lambda d: d.update(sites=[1, 2]),
    ],
)
def test_tampered_statistics_fail_open_and_verify(store, edit):
    path = store / "meta" / "statistics.json"
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(CorruptStoreError, match="meta/statistics.json has .* the manifest says"):
        ZarrReader(store)
    faults = ZarrReader(store, verify_reads=False).verify().faults
    assert any("statistics.json is malformed" in f for f in faults)


def test_a_same_size_edit_of_a_mean_is_caught_where_it_is_read(store):
    """An edited mean would skew normalize="standardize": it is refused, not used."""
    path = store / "meta" / "statistics.json"
    text = path.read_text()
    digit = text.index('"mean": [') + len('"mean": [') + 3
    path.write_text(text[:digit] + ("1" if text[digit] != "1" else "2") + text[digit + 1 :])
    reader = ZarrReader(store)
    with pytest.raises(
        CorruptStoreError, match="meta/statistics.json: block 0 .* is not the block"
    ):
        reader.statistics("resid.1")
    assert any(
        f.startswith("meta/statistics.json: 1 block(s) differ") for f in reader.verify().faults
    )


def test_garbage_statistics_json_fails_verify(store):
    (store / "meta" / "statistics.json").write_text("{garbage")
    assert any(
        "statistics.json" in f for f in ZarrReader(store, verify_reads=False).verify().faults
    )


def test_malformed_consolidated_metadata_is_corrupt_store(store):
    (store / ".zmetadata").write_text("{not json")
    with pytest.raises(CorruptStoreError, match=r"\.zmetadata has .* the manifest says"):
        ZarrReader(store)
    with pytest.raises(CorruptStoreError, match=r"\.zmetadata is not valid JSON"):
        ZarrReader(store, verify_reads=False)


def test_reordered_sites_are_caught(store):
    """sites and layers reversed in .zattrs and .zmetadata alike: read_block('resid.3') must
    never return another layer."""
    for name in (".zattrs", ".zmetadata"):
        path = store / name
        doc = json.loads(path.read_text())
        attrs = doc if name == ".zattrs" else doc["metadata"][".zattrs"]
        attrs["sites"], attrs["layers"] = attrs["sites"][::-1], attrs["layers"][::-1]
        attrs["layout"]["sites"], attrs["layout"]["layers"] = attrs["sites"], attrs["layers"]
        path.write_text(json.dumps(doc, indent=2))
    with pytest.raises(CorruptStoreError, match="does not match its root manifest|not the block"):
        ZarrReader(store)
    resign(store)  # even with the manifest rewritten over the edit, its summary catches it
    with pytest.raises(CorruptStoreError, match=r"reads differently .*sites: \['mlp_out.3'"):
        ZarrReader(store)


def test_symlinked_chunk_out_of_the_store_is_refused(store, tmp_path):
    chunk = _chunk(store, "prompt", 1, 0, 0)
    outside = tmp_path / "outside.bin"
    shutil.move(chunk, outside)
    chunk.symlink_to(outside)
    with pytest.raises(CorruptStoreError, match=r"1\.0\.0\.0 is a symlink out of the store"):
        open_store(store)
    with pytest.raises(CorruptStoreError, match=r"1\.0\.0\.0 is a symlink out of the store"):
        open_store(store, verify_reads=False)  # refused before any read, checked or not


@pytest.mark.parametrize("name", [".zattrs", "arrays/prompt_len/.zarray", ".zgroup"])
def test_malformed_zarr_metadata_file_is_corrupt_store_naming_it(store, name):
    (store / name).write_text("{bad")
    with pytest.raises(CorruptStoreError, match=f"{name} has 4 bytes, the manifest says"):
        open_store(store)


def test_second_writer_is_refused_and_a_dead_writers_partial_is_resumed(tmp_path):
    final = tmp_path / "activations.zarr"
    first = make_writer(final)
    with pytest.raises(StoreLockedError, match="another capture .* is writing"):
        make_writer(final)
    for batch in list(SyntheticBatches()(0, N))[:2]:  # 6 samples: one shard of 4 finished
        first.write(batch)
    first.sync()  # the finished shard is durable and recorded
    first._lock.release()  # as if its process died: the kernel drops a dead holder's flock
    first._lock = None
    second = make_writer(final)
    assert second.resume_from == 4
    for batch in SyntheticBatches()(0, N):
        second.write(batch)
    second.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["activations.zarr"]


ZARR_POINTS = [
    "zarr.partial_created",
    "zarr.written:1",
    "zarr.shard_synced:1",
    "zarr.shard_recorded:2",
    "zarr.written:3",
    "zarr.index_written",
    "zarr.manifest_written",
    "zarr.bookkeeping_removed",
    "zarr.published",
]

WRITE = """
import sys
from test_zarr_store import N, SyntheticBatches, make_writer
w = make_writer(sys.argv[1])
if not w.complete:
    for batch in SyntheticBatches()(w.resume_from, N):
        w.write(batch)
print(w.close())
"""


def _run_writer(final: Path, crash_at: str | None):
    import os

    env = {
        **os.environ,
        "PYTHONPATH": f"{Path(__file__).parents[1] / 'src'}:{Path(__file__).parent}",
    }
    env.pop("ACTSTORE_CRASH_AT", None)
    env["SOURCE_DATE_EPOCH"] = "1700000000"  # fixed times: the stores are byte-identical
    if crash_at:
        env["ACTSTORE_CRASH_AT"] = crash_at
    # a process of its own, forked from a helper that imported torch once (tests/forked.py)
    return run_python("-c", WRITE, final, env=env)


def _zarr_files(store: Path) -> dict[str, bytes]:
    return {
        str(f.relative_to(store)): f.read_bytes() for f in sorted(store.rglob("*")) if f.is_file()
    }


@pytest.fixture(scope="module")
def zarr_reference(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("zref") / "activations.zarr"
    assert _run_writer(path, None).returncode == 0
    return path


@pytest.mark.parametrize("crash_at", ZARR_POINTS)
def test_zarr_crash_at_every_writer_step_resumes_to_the_same_store(
    tmp_path, zarr_reference, crash_at
):
    from actstore.faults import CRASH_EXIT

    final = tmp_path / "activations.zarr"
    crashed = _run_writer(final, crash_at)
    assert crashed.returncode == CRASH_EXIT, crashed.stderr
    rerun = _run_writer(final, None)
    assert rerun.returncode == 0, rerun.stderr
    assert _zarr_files(final) == _zarr_files(zarr_reference)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["activations.zarr"]
    assert ZarrReader(final).verify().ok


def test_zarr_rerun_resumes_from_the_last_finished_shard(tmp_path):
    final = tmp_path / "activations.zarr"
    assert _run_writer(final, "zarr.shard_recorded:2").returncode != 0
    writer = make_writer(final)
    assert writer.resume_from == 8  # two shards of 4 samples were recorded
    writer.abort()
    assert (tmp_path / ".activations.zarr.partial").exists()  # kept: resumable
