"""The zarr writer's second chances: a resume re-checks the activation chunks of the shards
it keeps, a merge cut short before the run's manifest named it is finished by running it
again, and a shard without its shard record is refused by name when parts are listed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_zarr_store import (
    N,
    SyntheticBatches,
    make_writer,
    write_store,
    zarr_options,
    zarr_plan,
)

from actstore.errors import CorruptStoreError, StoreExistsError
from actstore.formats.zarr import ZarrReader, ZarrWriter, merge_run, write_manifest
from actstore.formats.zarr.parts import part_format
from actstore.formats.zarr.shards import MANIFEST, shard_path
from actstore.storage.manifest import MANIFEST as ROOT_MANIFEST


def array_files(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in (root / "arrays").rglob("*")
        if p.is_file()
    }


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    return write_store(tmp_path_factory.mktemp("clean") / "activations.zarr")


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[7] ^= 0x20
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "resume_from"),
    [
        ("flip prompt_activations/1.0.0.0", 0),  # shard 0 (samples 0-3)
        ("flip response_activations/5.2.0.0", 4),  # shard 1 (samples 4-7)
        ("drop prompt_activations/6.1.1.0", 4),
        ("stray response_activations/2.0.0.0", 0),  # sample 2 has no response tokens
    ],
)
def test_resume_rewrites_a_kept_shard_whose_chunks_fail_their_digests(
    tmp_path, clean, damage, resume_from
):
    final = tmp_path / "activations.zarr"
    writer = make_writer(final)
    batches = list(SyntheticBatches()(0, N))
    for batch in batches[:3]:  # samples 0-8: shards 0 and 1 finished (4 samples each)
        writer.write(batch)
    writer.abort()
    partial = tmp_path / ".activations.zarr.partial"
    action, name = damage.split()
    chunk = partial / "arrays" / name
    if action == "flip":
        flip(chunk)
    elif action == "drop":
        chunk.unlink()
    else:
        assert not chunk.exists()
        chunk.write_bytes(bytes(6 * 8 * 2))  # a whole chunk's bytes, zeros
    resumed = make_writer(final)
    assert resumed.resume_from == resume_from
    for batch in batches:
        resumed.write(batch)
    reader = ZarrReader(resumed.close())
    assert array_files(reader.path) == array_files(clean)  # as one clean capture wrote it
    report = reader.verify()
    assert report.ok, report.faults


def test_resume_keeps_shards_whose_chunks_are_intact(tmp_path, clean):
    final = tmp_path / "activations.zarr"
    writer = make_writer(final)
    batches = list(SyntheticBatches()(0, N))
    for batch in batches[:3]:
        writer.write(batch)
    writer.abort()
    resumed = make_writer(final)
    assert resumed.resume_from == 8
    for batch in batches:
        resumed.write(batch)
    assert array_files(resumed.close()) == array_files(clean)


def write_run(run: Path) -> None:
    """Both shards of a two-shard run, written in this process, and its manifest."""
    for index, (start, stop) in enumerate([(0, 6), (6, 11)]):
        writer = ZarrWriter.for_shard(zarr_plan(), run, index, 2, zarr_options())
        assert writer.example_range == (start, stop)
        for batch in SyntheticBatches()(start, stop):
            writer.write(batch)
        writer.close()
    write_manifest(run)


def test_a_merge_cut_short_before_the_manifest_is_finished_by_rerunning_it(tmp_path, clean):
    run = tmp_path / "run"
    write_run(run)
    before = {n: (run / n).read_bytes() for n in (MANIFEST, ROOT_MANIFEST)}
    merged = merge_run(run, progress=False)
    after = {n: (run / n).read_bytes() for n in (MANIFEST, ROOT_MANIFEST)}
    for name, data in before.items():  # the crash: merged store published, manifest not yet
        (run / name).chmod(0o644)
        (run / name).write_bytes(data)
    assert ZarrReader(run).manifest["merged"] is None
    stamp = (merged / ".zmetadata").stat().st_mtime_ns
    assert merge_run(run, progress=False) == merged
    assert {n: (run / n).read_bytes() for n in (MANIFEST, ROOT_MANIFEST)} == after
    assert (merged / ".zmetadata").stat().st_mtime_ns == stamp  # kept, not written again
    assert ZarrReader(run).manifest["merged"] == "merged/activations.zarr"
    assert array_files(merged) == array_files(clean)
    assert ZarrReader(merged).verify().ok
    assert merge_run(run, progress=False) == merged  # a finished merge: nothing to do


def test_a_merge_into_a_store_of_another_capture_is_refused(tmp_path):
    run = tmp_path / "run"
    write_run(run)
    other = write_store(tmp_path / "other" / "activations.zarr", r_max=5)
    with pytest.raises(StoreExistsError, match="holds another capture"):
        merge_run(run, other, progress=False)
    assert ZarrReader(run).manifest["merged"] is None


def test_listing_parts_refuses_a_store_without_its_shard_record(tmp_path):
    run = tmp_path / "run"
    writer = ZarrWriter.for_shard(zarr_plan(), run, 1, 2, zarr_options())
    for batch in SyntheticBatches()(6, 11):
        writer.write(batch)
    writer.close()
    (info,) = part_format().list_parts(run)
    assert (info.start, info.stop, info.n_examples) == (6, 11, N)
    assert info.path == shard_path(run, 1)
    write_store(shard_path(run, 0))  # a whole store, not a shard of this run
    with pytest.raises(CorruptStoreError, match="lacks its shard record .*'shard'"):
        part_format().list_parts(run)
    shutil.rmtree(shard_path(run, 0))
    assert len(part_format().list_parts(run)) == 1
