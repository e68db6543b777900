"""saev reliability: injected crashes at every writer step, verified reads, strict metadata,
symlinks and the write lock (docs/reliability.md lists what each test backs)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from test_saev_store import batches, make_acts, make_metadata, write_store

from actstore.errors import CorruptStoreError, StoreLockedError
from actstore.faults import CRASH_EXIT
from actstore.formats import open_store
from actstore.formats.saev import SaevReader, SaevWriter
from actstore.storage.lock import lock_path

SRC = Path(__file__).resolve().parents[1] / "src"
TESTS = Path(__file__).resolve().parent

#: every fault point of the saev writer, with the hit to crash at
POINTS = [
    "saev.init_created",
    "saev.init_filled",
    "saev.partial_created",
    "saev.appended:1",
    "saev.appended:3",
    "saev.shard_synced:1",
    "saev.shard_synced:3",
    "saev.sidecar_written:2",
    "saev.shard_recorded:1",
    "saev.shard_recorded:4",
    "saev.index_written",
    "saev.published",
]

WRITE = textwrap.dedent(
    """
    import sys
    from test_saev_store import batches, make_acts, make_metadata
    from actstore.formats.saev import SaevWriter
    acts = make_acts()
    writer = SaevWriter(make_metadata(), sys.argv[1], has_tokens=True)
    for batch in batches(acts, start=writer.resume_from):
        writer.write(batch)
    print(writer.close())
    """
)


def _run(root: Path, crash_at: str | None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{SRC}:{TESTS}"}
    env.pop("ACTSTORE_CRASH_AT", None)
    if crash_at:
        env["ACTSTORE_CRASH_AT"] = crash_at
    return subprocess.run(
        [sys.executable, "-c", WRITE, str(root)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


def _files(store: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(store.iterdir())}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    return write_store(tmp_path_factory.mktemp("ref"), make_acts())


@pytest.mark.parametrize("crash_at", POINTS)
def test_crash_at_every_writer_step_resumes_byte_identical(tmp_path, reference, crash_at):
    crashed = _run(tmp_path, crash_at)
    assert crashed.returncode == CRASH_EXIT, crashed.stderr
    rerun = _run(tmp_path, None)
    assert rerun.returncode == 0, rerun.stderr
    store = Path(rerun.stdout.strip())
    assert _files(store) == _files(reference)
    # nothing left behind: no .partial, no -init directory, no lock file
    assert sorted(p.name for p in tmp_path.iterdir()) == [store.name]
    assert SaevReader(store).verify().ok


def test_crash_during_a_resume_resumes_again(tmp_path, reference):
    assert _run(tmp_path, "saev.shard_recorded:2").returncode == CRASH_EXIT
    assert _run(tmp_path, "saev.shard_recorded:1").returncode == CRASH_EXIT
    rerun = _run(tmp_path, None)
    assert rerun.returncode == 0, rerun.stderr
    assert _files(Path(rerun.stdout.strip())) == _files(reference)


def _writable_copy(path: Path, dest: Path) -> Path:
    shutil.copytree(path, dest)
    for f in dest.iterdir():
        f.chmod(0o644)
    return dest


def test_flipped_byte_fails_read_block_naming_file_block_and_range(tmp_path, reference):
    store = _writable_copy(reference, tmp_path / reference.name)
    reader = SaevReader(store)
    unit = reader.tokens_per_ex * reader.d_model * 4
    # example 7 is shard 1, example 2 in it; layer index 1 -> block 2 * 2 + 1 = 5
    with open(store / "acts000001.bin", "r+b") as f:
        f.seek(5 * unit + 9)
        f.write(b"\x7f")
    block = next(b for b in reader.blocks(5) if b.loc[:2] == (1, 2))
    with pytest.raises(CorruptStoreError) as err:
        reader.read_block(block)
    assert f"acts000001.bin: block 5 (bytes {5 * unit}-{6 * unit})" in str(err.value)
    out = np.zeros((64, reader.d_model), dtype=np.float32)
    rows = np.arange(block.n_rows)[::-1].copy()
    with pytest.raises(CorruptStoreError, match="block 5"):
        reader.read_block_scatter(block, out, rows)
    rows[0] = -1  # skipped rows: the whole block is still checked
    with pytest.raises(CorruptStoreError, match="block 5"):
        reader.read_block_scatter(block, out, rows)
    unchecked = open_store(store, verify_reads=False)
    assert unchecked.read_block(block).shape == (block.n_rows, reader.d_model)
    # other blocks still read, and verify names the block too
    good = next(b for b in reader.blocks(5) if b.loc[:2] == (1, 1))
    np.testing.assert_array_equal(reader.read_block(good), make_acts()[6, 1])
    assert any(
        "acts000001.bin: checksum mismatch in 1 blocks, first block 5" in f
        for f in reader.verify().faults
    )


def test_scatter_read_is_exact_when_verified(reference):
    reader = SaevReader(reference)
    block = reader.blocks(2)[3]
    out = np.zeros((block.n_rows + 2, reader.d_model), dtype=np.float32)
    rows = np.array([2, 0, 5, 1, 3, 4], dtype=np.int64)
    reader.read_block_scatter(block, out, rows)
    np.testing.assert_array_equal(out[rows], reader.read_block(block))


def test_truncated_or_deleted_sidecar(tmp_path, reference):
    store = _writable_copy(reference, tmp_path / reference.name)
    block = SaevReader(store).blocks(2)[0]
    os.truncate(store / "acts000000.bin.xxh3", 24)
    with pytest.raises(CorruptStoreError, match="acts000000.bin.xxh3 holds 1 block checksums"):
        SaevReader(store).read_block(block)
    (store / "acts000000.bin.xxh3").unlink()
    with pytest.raises(CorruptStoreError, match="acts000000.bin.xxh3 is missing"):
        SaevReader(store).read_block(block)
    report = SaevReader(store).verify()
    assert any(
        "acts000000.bin.xxh3 is listed in checksums.xxh128 but missing" in f for f in report.faults
    )


def test_store_without_checksums_reads_unverified_with_one_warning(tmp_path, reference, caplog):
    store = _writable_copy(reference, tmp_path / reference.name)
    for side in store.glob("*.xxh3"):
        side.unlink()
    (store / "checksums.xxh128").unlink()
    reader = SaevReader(store)
    with caplog.at_level(logging.WARNING):
        for block in reader.blocks(2)[:5]:
            reader.read_block(block)
    assert [r.getMessage() for r in caplog.records].count(
        f"{store} has no block checksums (written by another tool or an older actstore): "
        "its reads are not verified"
    ) == 1
    report = reader.verify()  # the manifest is missing: verify fails, it does not pass
    assert not report.ok and any("no checksum manifest" in f for f in report.faults)


def test_verify_fails_when_the_manifest_covers_fewer_files(tmp_path, reference):
    store = _writable_copy(reference, tmp_path / reference.name)
    lines = (store / "checksums.xxh128").read_text().splitlines()
    (store / "checksums.xxh128").write_text("\n".join(lines[1:]) + "\n")
    report = SaevReader(store).verify()
    assert "acts000000.bin is not covered by checksums.xxh128" in report.faults
    (store / "extra.bin").write_bytes(b"x")
    assert "extra.bin is not covered by checksums.xxh128" in SaevReader(store).verify().faults


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d["sites"].pop("2"),
        lambda d: d["sites"]["5"].update(count=3),
        lambda d: d["sites"]["5"].update(mean=[0.0]),
        lambda d: d.update(sites="garbage"),
    ],
)
def test_tampered_statistics_fail_verify(tmp_path, reference, edit):
    store = _writable_copy(reference, tmp_path / reference.name)
    doc = json.loads((store / "statistics.json").read_text())
    edit(doc)
    (store / "statistics.json").write_text(json.dumps(doc))
    faults = SaevReader(store).verify().faults
    assert any(f.startswith("statistics.json is malformed") for f in faults)
    assert "statistics.json: checksum mismatch (the file was changed)" in faults


@pytest.mark.parametrize("name", ["metadata.json", "shards.json"])
def test_malformed_json_is_corrupt_store_naming_the_file(tmp_path, reference, name):
    store = _writable_copy(reference, tmp_path / reference.name)
    (store / name).write_text("{not json")
    with pytest.raises(CorruptStoreError, match=f"{name} is not valid JSON"):
        open_store(store)


def test_shards_json_count_tampered_is_an_error_not_fewer_rows(tmp_path, reference):
    store = _writable_copy(reference, tmp_path / reference.name)
    doc = json.loads((store / "shards.json").read_text())
    doc[-1]["n_examples"] = 1
    (store / "shards.json").write_text(json.dumps(doc))
    with pytest.raises(CorruptStoreError, match="shards.json entry 4"):
        open_store(store)


def test_symlink_out_of_the_store_is_refused(tmp_path, reference):
    store = _writable_copy(reference, tmp_path / reference.name)
    outside = tmp_path / "outside.bin"
    shutil.move(store / "acts000002.bin", outside)
    (store / "acts000002.bin").symlink_to(outside)
    with pytest.raises(CorruptStoreError, match="acts000002.bin is a symlink to .*outside"):
        SaevReader(store)


def test_second_writer_gets_one_line_naming_the_holder(tmp_path):
    first = SaevWriter(make_metadata(), tmp_path, has_tokens=True)
    with pytest.raises(StoreLockedError) as err:
        SaevWriter(make_metadata(), tmp_path, has_tokens=True)
    message = str(err.value)
    assert message.startswith(f"another capture (pid {os.getpid()} on host ")
    assert message.endswith(
        f"is writing {first.final}; wait for it or, if it is dead, rerun with --break-lock"
    )
    assert "\n" not in message
    for batch in batches(make_acts()):
        first.write(batch)
    first.close()
    assert not lock_path(first.final).exists()


def test_break_lock_takes_over_a_held_lock(tmp_path, caplog):
    SaevWriter(make_metadata(), tmp_path, has_tokens=True)  # never closed: still holds it
    with caplog.at_level(logging.WARNING):
        second = SaevWriter(make_metadata(), tmp_path, has_tokens=True, break_lock=True)
    assert any("breaking the lock" in r.getMessage() for r in caplog.records)
    for batch in batches(make_acts(), start=second.resume_from):
        second.write(batch)
    assert second.close().exists()


def test_lock_of_a_dead_capture_is_taken_over_with_a_warning(tmp_path, caplog, reference):
    assert _run(tmp_path, "saev.shard_recorded:2").returncode == CRASH_EXIT
    lock = lock_path(tmp_path / reference.name)
    assert json.loads(lock.read_text())["pid"] != os.getpid()  # the dead capture's record
    with caplog.at_level(logging.WARNING):
        writer = SaevWriter(make_metadata(), tmp_path, has_tokens=True)
    assert any(
        "taking over the write lock" in r.getMessage() and "that process is dead" in r.getMessage()
        for r in caplog.records
    )
    assert writer.resume_from == 10
    writer.abort()


def test_consistently_edited_metadata_is_caught_on_open(tmp_path, reference):
    """Dropping the last shard from metadata.json and shards.json alike would serve fewer
    rows; the manifest digests of the small metadata files catch it on open."""
    store = _writable_copy(reference, tmp_path / reference.name)
    md = json.loads((store / "metadata.json").read_text())
    md["n_examples"] = 20
    (store / "metadata.json").write_text(json.dumps(md, indent=2))
    shards = json.loads((store / "shards.json").read_text())[:-1]
    (store / "shards.json").write_text(json.dumps(shards))
    with pytest.raises(CorruptStoreError, match="metadata.json does not match its digest"):
        open_store(store)
    stats = store / "statistics.json"
    store2 = _writable_copy(reference, tmp_path / "copy2")
    (store2 / "statistics.json").write_text(stats.read_text().replace('"count": 138', '"count": 1'))
    reader = SaevReader(store2)
    with pytest.raises(CorruptStoreError, match="statistics.json does not match its digest"):
        reader.statistics(2)
