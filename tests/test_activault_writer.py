"""The Activault writer's edges on a local run: opening creates nothing, an aborted open
leaves nothing that blocks another capture, close-then-abort after an upload failure
returns, a run of an older actstore is not resumed (and is named as such on open), and a
merge refuses a damaged part before it writes anything."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest

from actstore.errors import CaptureError, CorruptStoreError, StoreExistsError
from actstore.formats import open_store
from actstore.formats.activault import ActivaultOptions, ActivaultWriter, hook_name
from actstore.formats.activault.parts import part_format
from actstore.storage.object import LocalStore
from actstore.testing import make_acts, make_batches, make_plan


def plan_and_acts(n_examples: int = 12):
    plan = make_plan(n_examples=n_examples, batch_size=4)
    return plan, make_acts(plan)


def files_below(root: Path) -> list[str]:
    if not root.exists():
        return []
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


def writable(path: Path) -> None:
    path.chmod(path.stat().st_mode | stat.S_IWUSR)


def test_opening_a_writer_creates_nothing_and_abort_blocks_no_other_capture(tmp_path):
    plan, acts = plan_and_acts()
    run = tmp_path / "run"
    writer = ActivaultWriter(plan, str(run), ActivaultOptions(rows_per_file=4))
    assert files_below(tmp_path) == [".run.lock"]  # only the write lock: no cfg.json
    writer.abort()
    assert files_below(tmp_path) == []
    # a capture with other options (another record) is not refused as "another capture"
    other = ActivaultWriter(plan, str(run), ActivaultOptions(rows_per_file=2, dtype="float32"))
    for batch in make_batches(plan, acts):
        other.write(batch)
    assert other.close() == run
    reader = open_store(run)
    assert reader.record.rows_per_file == 2 and reader.record.dtype == "float32"
    assert reader.n_files == plan.n_examples * plan.tokens_per_example // (
        2 * plan.tokens_per_example
    )
    assert reader.verify().ok


def test_cfg_json_comes_with_the_first_group(tmp_path):
    plan, acts = plan_and_acts()
    run = tmp_path / "run"
    writer = ActivaultWriter(plan, str(run), ActivaultOptions(rows_per_file=8))
    batches = make_batches(plan, acts)
    writer.write(batches[0])  # 4 examples: half a file, nothing handed to the uploaders
    assert files_below(tmp_path) == [".run.lock"]
    writer.write(batches[1])  # the first group: cfg.json before its files
    writer.flush()
    cfg = json.loads((run / "cfg.json").read_text())
    assert cfg["actstore"]["groups"] == 1
    writer.abort()


def test_close_that_raises_then_abort_returns(tmp_path):
    """Regression: abort() after a close() that raised sent each upload thread a second
    stop marker into a bounded queue nobody read any more, and hung (more threads than
    queue room). test_uploader_close_is_idempotent checks the uploader itself."""
    plan, acts = plan_and_acts()
    run = tmp_path / "run"
    writer = ActivaultWriter(
        plan, str(run), ActivaultOptions(rows_per_file=4, upload_threads=3, queue_files=1)
    )
    hook = hook_name(plan.sites[0])
    run.mkdir()
    (run / hook).write_bytes(b"")  # the hook's folder is a file: its uploads fail
    with pytest.raises(CaptureError, match="uploading to .* failed"):
        writer.write(make_batches(plan, acts)[0])  # a full file: handed to the uploaders
        writer.close()  # the failure shows here, or already in write
    writer.abort()
    writer.abort()  # and again: still returns
    (run / hook).unlink()
    resumed = ActivaultWriter(
        plan, str(run), ActivaultOptions(rows_per_file=4, upload_threads=3, queue_files=1)
    )
    assert resumed.resume_from == 0
    for batch in make_batches(plan, acts):
        resumed.write(batch)
    resumed.close()
    assert open_store(run).verify().ok


def test_a_run_of_an_older_actstore_is_not_resumed(tmp_path):
    plan, acts = plan_and_acts()
    run = tmp_path / "run"
    options = ActivaultOptions(rows_per_file=4)
    writer = ActivaultWriter(plan, str(run), options)
    batches = make_batches(plan, acts)
    writer.write(batches[0])
    writer.flush()
    writer.abort()  # one committed group: a resumable run
    cfg = run / "cfg.json"
    writable(cfg)
    doc = json.loads(cfg.read_text())
    doc["actstore"]["version"] = 1
    del doc["actstore"]["digests"]
    cfg.write_text(json.dumps(doc))
    with pytest.raises(StoreExistsError, match="older actstore .* capture into a new run"):
        ActivaultWriter(plan, str(run), options)


def write_parts(plan, acts, final: Path, options: ActivaultOptions):
    fmt = part_format()
    batches = make_batches(plan, acts)
    for sl in fmt.slices(plan, options, 2):
        writer = fmt.part_writer(plan, str(final), options, sl)
        for batch in batches:
            if sl.start <= batch.example_ids[0] < sl.stop:
                writer.write(batch)
        writer.close()
    parts = fmt.list_parts(str(final))
    assert len(parts) == 2
    return fmt, parts


def test_merge_refuses_a_part_without_digests_before_writing(tmp_path):
    plan, acts = plan_and_acts(n_examples=16)
    options = ActivaultOptions(rows_per_file=4)
    final = tmp_path / "run"
    fmt, parts = write_parts(plan, acts, final, options)
    cfg = Path(str(parts[1].path)) / "cfg.json"
    writable(cfg)
    original = cfg.read_bytes()
    doc = json.loads(original)
    hook = next(iter(doc["actstore"]["digests"]))
    doc["actstore"]["digests"][hook] = doc["actstore"]["digests"][hook][:-1]
    cfg.write_text(json.dumps(doc))
    with pytest.raises(CorruptStoreError, match=f"records 1 file digests of {hook} for 2"):
        fmt.merge(parts, str(final))
    assert files_below(final) == []  # nothing of the run was written
    cfg.write_bytes(original)  # repaired, the same parts merge
    reader = open_store(fmt.merge(parts, str(final)))
    assert reader.verify().ok and reader.n_files == 4


def test_merge_refuses_parts_of_another_capture(tmp_path):
    plan, acts = plan_and_acts(n_examples=16)
    options = ActivaultOptions(rows_per_file=4)
    fmt, parts = write_parts(plan, acts, tmp_path / "a", options)
    other = make_plan(n_examples=16, batch_size=4, ckpt="another-model")
    _, foreign = write_parts(other, make_acts(other), tmp_path / "b", options)
    mine = Path(str(parts[1].path))
    shutil.rmtree(mine)
    shutil.copytree(Path(str(foreign[1].path)), mine)  # the second part of another capture
    with pytest.raises(CorruptStoreError, match="another capture than the first part"):
        fmt.merge(parts, str(tmp_path / "a"))
    assert files_below(tmp_path / "a") == []


def test_uploader_close_is_idempotent(tmp_path):
    from actstore.formats.activault.upload import HookUploader

    errors: list[BaseException] = []
    uploader = HookUploader(
        "h",
        "run/h",
        LocalStore(tmp_path),
        threads=3,
        queue_files=1,
        expected_bytes=None,
        on_done=lambda *a: None,
        on_error=errors.append,
        store_id="0" * 16,
    )
    uploader.close()
    uploader.close(abort=True)
    uploader.close()
    assert errors == [] and os.listdir(tmp_path) == []
    with pytest.raises(CaptureError, match="uploader of h is closed"):
        uploader.submit(None)  # type: ignore[arg-type]
    assert np.all([not t.is_alive() for t in uploader._threads])


def test_a_complete_run_of_an_older_actstore_is_named_as_such_on_open(tmp_path):
    """Runs written before root manifests (record version 1) fail their check with what to
    do, not with "restore the manifest"; verify_reads=False still reads them."""
    plan, acts = plan_and_acts()
    run = tmp_path / "run"
    writer = ActivaultWriter(plan, str(run), ActivaultOptions(rows_per_file=4, dtype="float32"))
    for batch in make_batches(plan, acts):
        writer.write(batch)
    writer.close()
    (run / "actstore-manifest.json").unlink()
    cfg = run / "cfg.json"
    writable(cfg)
    doc = json.loads(cfg.read_text())
    doc["actstore"]["version"] = 1
    del doc["actstore"]["digests"]
    cfg.write_text(json.dumps(doc))
    with pytest.raises(
        CorruptStoreError,
        match=r"written by an older actstore \(run record version 1, before root manifests\)"
        ".*re-capture it, or open it with verify_reads=False",
    ):
        open_store(run)
    reader = open_store(run, verify_reads=False)
    rows = reader.megabatch(hook_name(plan.sites[0]), 0)["states"].reshape(-1, plan.d_model)
    np.testing.assert_array_equal(
        rows.numpy(), acts[str(plan.sites[0])].reshape(-1, plan.d_model)[: len(rows)]
    )


# ---------------------------------------------------------------- the write pipeline (issue 28)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_statistics_folded_on_a_pool_equal_the_sequential_fold_bit_for_bit(dtype):
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from actstore.formats.wholefiles import fold_statistics, statistics_of
    from actstore.stats import RunningStats

    d = 2048  # 512 rows per chunk: this megabatch folds in 3 chunks, the last short
    states = torch.randn(3, 400, d, generator=torch.Generator().manual_seed(1))
    states = states.to(getattr(torch, dtype))
    expected = RunningStats.of(states.reshape(-1, d).to(torch.float32).numpy())
    with ThreadPoolExecutor(3) as pool:
        pooled = fold_statistics(states, pool)()
    for got in (pooled, statistics_of(states)):
        assert got.count == expected.count == 1200
        assert got.mean.tobytes() == expected.mean.tobytes()
        assert got.m2.tobytes() == expected.m2.tobytes()
        assert got.norm_mean == expected.norm_mean


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_megabatch_streams_write_exactly_what_serialize_megabatch_holds(tmp_path, dtype):
    """torch.save straight into the file (around the page cache, digested as written) or
    into the upload buffer gives the bytes and keyed digest of the in-memory serialization."""
    import torch

    from actstore.formats.activault.layout import serialize_megabatch, write_megabatch
    from actstore.formats.activault.upload import _MemoryStream
    from actstore.formats.threads import StageClock
    from actstore.formats.wholefiles import StagedFile, commit_files
    from actstore.storage.manifest import keyed_digest

    # 12 or 6 MiB of states: around the page cache in staged buffers of 8 MiB, the tail not
    states = torch.randn(24, 128, 1024).to(getattr(torch, dtype))
    ids = torch.arange(24 * 128).reshape(24, 128)
    expected = serialize_megabatch(states, ids).getvalue()
    digest = keyed_digest("f" * 16, "h/x.pt", expected)
    stream = StagedFile(tmp_path / "x.pt", "f" * 16, "h/x.pt", StageClock())
    write_megabatch(states, ids, stream)
    stream.finish()
    assert not (tmp_path / "x.pt").exists()  # staged until committed
    commit_files([stream])
    if stream.align:
        assert stream.direct_bytes == len(expected) - len(expected) % stream.align
    assert (tmp_path / "x.pt").read_bytes() == expected and stream.digest() == digest
    assert [p.name for p in tmp_path.iterdir()] == ["x.pt"]
    small = _MemoryStream(100)  # grown as needed
    write_megabatch(states, ids, small)
    assert bytes(small.view()) == expected


def test_a_local_run_leaves_no_temporary_file_and_abort_removes_uncommitted_ones(tmp_path):
    plan, acts = plan_and_acts(n_examples=24)
    run = tmp_path / "run"
    writer = ActivaultWriter(plan, str(run), ActivaultOptions(rows_per_file=4, dtype="float32"))
    for batch in make_batches(plan, acts):
        writer.write(batch)
    writer.close()
    assert not [p for p in files_below(run) if Path(p).name.startswith(".")]
    assert {"cast", "encode", "statistics", "write", "hash", "commit"} <= set(
        writer.stage_seconds()
    )
    assert open_store(run).verify().ok
    other = tmp_path / "other"
    writer = ActivaultWriter(plan, str(other), ActivaultOptions(rows_per_file=4, dtype="float32"))
    batches = list(make_batches(plan, acts))
    for batch in batches[:3]:
        writer.write(batch)
    writer.abort()
    assert not [p for p in files_below(other) if Path(p).name.startswith(".")]
    resumed = ActivaultWriter(plan, str(other), ActivaultOptions(rows_per_file=4, dtype="float32"))
    for batch in batches:
        resumed.write(batch)
    resumed.close()
    for name in files_below(run):
        if (run / name).is_file() and name != "cfg.json" and "manifest" not in name:
            assert (run / name).read_bytes() == (other / name).read_bytes(), name
