"""zarr reliability: chunk checksums on every read, missing chunks, tampered statistics,
symlinks, the write lock, stale partials (docs/reliability.md)."""

from __future__ import annotations

import json
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest
from test_zarr_store import ATTRS, N, SyntheticBatches, expected, layout, write_store

from actstore.errors import CorruptStoreError, StoreLockedError
from actstore.formats import open_store
from actstore.formats.zarr import ZarrReader, ZarrWriter


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
        match=r"4\.1\.0\.0 \(sample 4, layer 1, chunk 0, bytes 0-48\) fails its xxh3",
    ):
        reader.read_block(block)
    unchecked = ZarrReader(store, verify_reads=False)
    assert unchecked.read_block(block).shape == (block.n_rows, 8)
    other = _block(reader, 3, 0, layer=1)
    np.testing.assert_array_equal(reader.read_block(other), expected(3, 1, "prompt", layout()))
    assert any("fails its xxh3 checksum" in f for f in reader.verify().faults)


def test_deleted_chunk_is_an_error_not_zeros(store):
    _chunk(store, "response", 1, 0, 0).unlink()
    reader = ZarrReader(store)
    with pytest.raises(CorruptStoreError, match=r"1\.0\.0\.0 .* is missing: the store recorded it"):
        reader.read_block(_block(reader, 1, 1))
    assert any("is missing" in f for f in reader.verify().faults)


def test_partly_needed_chunks_are_checked_whole_and_read_exactly(store):
    reader = ZarrReader(store)
    for sample in range(N):
        for part, name in ((0, "prompt"), (1, "response")):
            if (reader.prompt_len if part == 0 else reader.response_len)[sample]:
                got = reader.read_block(_block(reader, sample, part, layer=2))
                np.testing.assert_array_equal(got, expected(sample, 2, name, layout()))


def test_store_without_checksums_reads_unverified_and_fails_verify(store, caplog):
    for part in ("prompt", "response"):
        (store / "meta" / f"chunksums.{part}.npy").unlink()
    reader = ZarrReader(store)
    assert "has no chunk checksums" in caplog.text
    assert reader.read_block(_block(reader, 0, 0)).shape[1] == 8
    assert any("no chunk checksums" in f for f in reader.verify().faults)


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d["sites"].pop("resid.1"),
        lambda d: d["sites"]["resid.3"].update(count=1),
        lambda d: d.update(sites=[1, 2]),
    ],
)
def test_tampered_statistics_fail_verify(store, edit):
    path = store / "meta" / "statistics.json"
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    assert any("statistics.json is malformed" in f for f in ZarrReader(store).verify().faults)


def test_garbage_statistics_json_fails_verify(store):
    (store / "meta" / "statistics.json").write_text("{garbage")
    assert any("statistics.json" in f for f in ZarrReader(store).verify().faults)


def test_malformed_consolidated_metadata_is_corrupt_store(store):
    (store / ".zmetadata").write_text("{not json")
    with pytest.raises(CorruptStoreError, match=r"\.zmetadata is not valid JSON"):
        ZarrReader(store)


def test_symlinked_chunk_out_of_the_store_is_refused(store, tmp_path):
    chunk = _chunk(store, "prompt", 1, 0, 0)
    outside = tmp_path / "outside.bin"
    shutil.move(chunk, outside)
    chunk.symlink_to(outside)
    reader = open_store(store)
    with pytest.raises(
        CorruptStoreError, match=r"1\.0\.0\.0 cannot be opened .*plain files inside"
    ):
        reader.read_block(_block(reader, 1, 0))
    assert any("a symlink, not a chunk file" in f for f in reader.verify().faults)
    shutil.move(store / "meta", tmp_path / "meta")
    (store / "meta").symlink_to(tmp_path / "meta")
    with pytest.raises(CorruptStoreError, match="meta is a symlink to .*outside the store"):
        open_store(store)


@pytest.mark.parametrize("name", [".zattrs", "arrays/prompt_len/.zarray", ".zgroup"])
def test_malformed_zarr_metadata_file_is_corrupt_store_naming_it(store, name):
    (store / name).write_text("{bad")
    with pytest.raises(CorruptStoreError, match=f"{name} is not valid JSON"):
        open_store(store)


def test_second_writer_is_refused_and_a_dead_writers_partial_is_removed(tmp_path):
    final = tmp_path / "activations.zarr"
    first = ZarrWriter(layout(), final, attrs=ATTRS)
    with pytest.raises(StoreLockedError, match="another capture .* is writing"):
        ZarrWriter(layout(), final, attrs=ATTRS)
    first.write(next(SyntheticBatches()(0, N)))
    first._lock.release()  # as if its process died: the kernel drops a dead holder's flock
    stale = tmp_path / ".activations.zarr.k2j4x.partial"  # a dead writer of an older actstore
    stale.mkdir()
    second = ZarrWriter(layout(), final, attrs=ATTRS)
    assert not stale.exists()
    assert second.resume_from == 0  # the first writer made no checkpoint: start over
    for batch in SyntheticBatches()(0, N):
        second.write(batch)
    second.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["activations.zarr"]


ZARR_POINTS = [
    "zarr.written:1",
    "zarr.synced:1",
    "zarr.checkpointed:2",
    "zarr.written:3",
    "zarr.checkpointed:4",
    "zarr.closing",
    "zarr.published",
]

WRITE = """
import sys
from test_zarr_store import ATTRS, N, SyntheticBatches, layout
from actstore.formats.zarr import ZarrWriter
w = ZarrWriter(layout(), sys.argv[1], attrs=ATTRS, optional=("hallu_label",), checkpoint_s=0)
if not w.complete:
    for batch in SyntheticBatches()(w.resume_from, N):
        w.write(batch)
print(w.close())
"""


def _run_writer(final: Path, crash_at: str | None):
    import os
    import subprocess
    import sys

    env = {
        **os.environ,
        "PYTHONPATH": f"{Path(__file__).parents[1] / 'src'}:{Path(__file__).parent}",
    }
    env.pop("ACTSTORE_CRASH_AT", None)
    if crash_at:
        env["ACTSTORE_CRASH_AT"] = crash_at
    return subprocess.run(
        [sys.executable, "-c", WRITE, str(final)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


def _zarr_files(store: Path) -> dict[str, bytes]:
    out = {}
    for f in sorted(store.rglob("*")):
        if f.is_file():
            data = f.read_bytes()
            if f.name in (".zattrs", ".zmetadata"):
                data = b"".join(
                    line for line in data.splitlines(True) if b'"created_at"' not in line
                )
            out[str(f.relative_to(store))] = data
    return out


@pytest.fixture(scope="module")
def zarr_reference(tmp_path_factory) -> Path:
    return write_store(tmp_path_factory.mktemp("zref") / "activations.zarr")


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


def test_zarr_rerun_resumes_from_the_last_checkpoint(tmp_path):
    final = tmp_path / "activations.zarr"
    assert _run_writer(final, "zarr.checkpointed:2").returncode != 0
    writer = ZarrWriter(layout(), final, attrs=ATTRS, optional=("hallu_label",), checkpoint_s=0)
    assert writer.resume_from == 6  # two batches of 3 samples were checkpointed
    writer.abort()
    assert (tmp_path / ".activations.zarr.resumable.partial").exists()  # kept: resumable
