"""saev reliability: injected crashes at every writer step, verified reads, strict metadata,
symlinks and the write lock (docs/reliability.md lists what each test backs)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pytest
from forked import run_python
from saev_fixtures import saev_writer
from test_saev_store import batches, make_acts, make_metadata, write_store

from actstore.errors import CorruptStoreError, StoreLockedError, StoreNotFoundError
from actstore.faults import CRASH_EXIT
from actstore.formats import open_store
from actstore.formats.saev import SaevReader
from actstore.storage.lock import lock_path

SRC = Path(__file__).resolve().parents[1] / "src"
TESTS = Path(__file__).resolve().parent

#: every fault point of the saev writer, with the hit to crash at
POINTS = [
    "saev.init_created",
    "saev.init_filled",
    "saev.partial_created",
    "saev.written:1",
    "saev.written:3",
    "saev.shard_finished:1",
    "saev.shard_synced:3",
    "saev.shard_recorded:1",
    "saev.shard_recorded:4",
    "saev.index_written",
    "saev.manifest_written",
    "saev.bookkeeping_removed",
    "saev.published",
]

WRITE = textwrap.dedent(
    """
    import sys
    from saev_fixtures import saev_writer
    from test_saev_store import batches, make_acts, make_metadata
    acts = make_acts()
    writer = saev_writer(make_metadata(), sys.argv[1], has_tokens=True)
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
    # a process of its own, forked from a helper that imported torch once (tests/forked.py)
    return run_python("-c", WRITE, root, env=env)


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
    assert f"acts000001.bin: block 5 (bytes {5 * unit}-{6 * unit}) is not the block" in str(
        err.value
    )
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
        "acts000001.bin: 1 block(s) differ from the manifest, first block 5" in f
        for f in reader.verify().faults
    )


def test_scatter_read_is_exact_when_verified(reference):
    reader = SaevReader(reference)
    block = reader.blocks(2)[3]
    out = np.zeros((block.n_rows + 2, reader.d_model), dtype=np.float32)
    rows = np.array([2, 0, 5, 1, 3, 4], dtype=np.int64)
    reader.read_block_scatter(block, out, rows)
    np.testing.assert_array_equal(out[rows], reader.read_block(block))


def test_damaged_or_deleted_block_digests(tmp_path, reference):
    store = _writable_copy(reference, tmp_path / reference.name)
    block = SaevReader(store).blocks(2)[0]
    blocks = store / "actstore-blocks.xxh3"
    data = bytearray(blocks.read_bytes())
    data[20] ^= 0xFF
    blocks.write_bytes(bytes(data))
    with pytest.raises(CorruptStoreError, match="actstore-blocks.xxh3 does not match the root man"):
        SaevReader(store).read_block(block)
    assert any(
        "actstore-blocks.xxh3 does not match" in f for f in SaevReader(store).verify().faults
    )
    blocks.unlink()
    with pytest.raises(StoreNotFoundError, match="actstore-blocks.xxh3 is missing"):
        SaevReader(store)


def test_our_store_without_its_manifest_is_an_error(tmp_path, reference):
    store = _writable_copy(reference, tmp_path / reference.name)
    (store / "actstore-manifest.json").unlink()
    with pytest.raises(CorruptStoreError, match="root manifest .* is missing"):
        SaevReader(store)
    reader = SaevReader(store, verify_reads=False)  # the caller's choice: read unchecked
    np.testing.assert_array_equal(reader[3, 2], make_acts()[3, 0])
    assert not reader.verify().ok


def test_a_store_saev_wrote_reads_unverified_with_one_warning(tmp_path, reference, caplog):
    store = _writable_copy(reference, tmp_path / reference.name)
    for name in ("actstore-manifest.json", "actstore-blocks.xxh3", "statistics.json", "tokens.bin"):
        (store / name).unlink()  # what saev's own writer leaves
    with caplog.at_level(logging.WARNING):
        reader = SaevReader(store)
        for block in reader.blocks(2)[:5]:
            reader.read_block(block)
        SaevReader(store)
    assert [r.getMessage() for r in caplog.records].count(
        f"{store} has no actstore manifest (written by another tool): its contents cannot "
        "be verified"
    ) == 1
    report = reader.verify()  # nothing to verify against: verify fails, it does not pass
    assert not report.ok and any("no root manifest" in f for f in report.faults)


def test_a_file_the_manifest_does_not_list_is_refused(tmp_path, reference):
    store = _writable_copy(reference, tmp_path / reference.name)
    (store / "extra.bin").write_bytes(b"x")
    with pytest.raises(CorruptStoreError, match="extra.bin is not listed in the manifest"):
        SaevReader(store)
    report = SaevReader(store, verify_reads=False).verify()
    assert "extra.bin is not listed in the manifest" in report.faults


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
    with pytest.raises(CorruptStoreError, match="statistics.json has .* the manifest says"):
        SaevReader(store)
    faults = SaevReader(store, verify_reads=False).verify().faults
    assert any(f.startswith("statistics.json is malformed") for f in faults)
    assert any(f.startswith("statistics.json has") for f in faults)


@pytest.mark.parametrize("name", ["metadata.json", "shards.json"])
def test_malformed_json_is_corrupt_store_naming_the_file(tmp_path, reference, name):
    store = _writable_copy(reference, tmp_path / reference.name)
    (store / name).write_text("{not json")
    with pytest.raises(CorruptStoreError, match=f"{name} has 9 bytes, the manifest says"):
        open_store(store)
    with pytest.raises(CorruptStoreError, match=f"{name} is not valid JSON"):
        SaevReader(store, verify_reads=False)


def test_shards_json_count_tampered_is_an_error_not_fewer_rows(tmp_path, reference):
    store = _writable_copy(reference, tmp_path / reference.name)
    doc = json.loads((store / "shards.json").read_text())
    doc[-1]["n_examples"] = 1
    (store / "shards.json").write_text(json.dumps(doc))
    with pytest.raises(CorruptStoreError, match="shards.json has .* the manifest says"):
        open_store(store)
    with pytest.raises(CorruptStoreError, match="shards.json entry 4"):  # the reader's own check
        SaevReader(store, verify_reads=False)


def test_symlink_out_of_the_store_is_refused(tmp_path, reference):
    store = _writable_copy(reference, tmp_path / reference.name)
    outside = tmp_path / "outside.bin"
    shutil.move(store / "acts000002.bin", outside)
    (store / "acts000002.bin").symlink_to(outside)
    with pytest.raises(CorruptStoreError, match="acts000002.bin is a symlink out of the store"):
        SaevReader(store)


def test_second_writer_gets_one_line_naming_the_holder(tmp_path):
    first = saev_writer(make_metadata(), tmp_path, has_tokens=True)
    with pytest.raises(StoreLockedError) as err:
        saev_writer(make_metadata(), tmp_path, has_tokens=True)
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


def test_break_lock_takes_over_a_held_lock(tmp_path, caplog, monkeypatch):
    saev_writer(make_metadata(), tmp_path, has_tokens=True)  # never closed: still holds it
    monkeypatch.setenv("ACTSTORE_BREAK_LOCK", "1")  # what capture --break-lock sets
    with caplog.at_level(logging.WARNING):
        second = saev_writer(make_metadata(), tmp_path, has_tokens=True)
    assert any("breaking the lock" in r.getMessage() for r in caplog.records)
    for batch in batches(make_acts(), start=second.resume_from):
        second.write(batch)
    assert second.close().exists()


def test_lock_of_a_dead_capture_is_taken_over_with_a_warning(tmp_path, caplog, reference):
    assert _run(tmp_path, "saev.shard_recorded:2").returncode == CRASH_EXIT
    lock = lock_path(tmp_path / reference.name)
    assert json.loads(lock.read_text())["pid"] != os.getpid()  # the dead capture's record
    with caplog.at_level(logging.WARNING):
        writer = saev_writer(make_metadata(), tmp_path, has_tokens=True)
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
    with pytest.raises(CorruptStoreError, match="does not match its root manifest"):
        open_store(store)
    stats = store / "statistics.json"
    store2 = _writable_copy(reference, tmp_path / "copy2")
    (store2 / "statistics.json").write_text(
        stats.read_text().replace('"count": 138', '"count": 137')
    )
    reader = SaevReader(store2)
    with pytest.raises(CorruptStoreError, match="statistics.json: block 0 .* is not the block"):
        reader.statistics(2)


def test_a_finished_shard_damaged_before_the_rerun_is_rewritten(tmp_path, reference, caplog):
    """Resume trusts a recorded shard only if it still matches its digests: one damaged in
    the partial directory (a bad disk, a stray edit) is written again from there."""
    acts = make_acts()
    out = tmp_path / "out"
    writer = saev_writer(make_metadata(), out, has_tokens=True)
    for batch in list(batches(acts))[:4]:  # 16 examples: shards 0-2 finished
        writer.write(batch)
    writer.abort()
    partial = next(out.glob(".*.partial"))
    shard = partial / "acts000001.bin"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x01
    shard.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        resumed = saev_writer(make_metadata(), out, has_tokens=True)
    assert resumed.resume_from == 5  # shard 0 kept, shard 1 and after written again
    assert "shard 1" in caplog.text and "fails its checksums" in caplog.text
    for batch in batches(acts, start=4):
        resumed.write(batch)
    store = resumed.close()
    for f in reference.iterdir():
        assert (store / f.name).read_bytes() == f.read_bytes(), f.name
