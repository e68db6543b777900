"""Activault reliability on local disk: keyed file digests on every read (a flipped byte,
files swapped between groups), an edited cfg.json (caught by the root manifest at open and,
with the manifest rewritten over it, by the commit record), symlinks out of the run
(docs/reliability.md). S3 faults: tests/test_activault_s3.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from test_activault_s3 import make_run_data, write_run

from actstore.errors import CorruptStoreError
from actstore.formats import open_store
from actstore.formats.activault import ActivaultOptions, ActivaultReader, ActivaultWriter
from actstore.testing import resign


@pytest.fixture
def run(tmp_path) -> Path:
    plan, acts = make_run_data()
    return Path(write_run(str(tmp_path / "run"), plan, acts, rows_per_file=4))


def _files(run: Path) -> list[Path]:
    return sorted(p for p in run.rglob("*.pt"))


def _data_file(reader: ActivaultReader, run: Path, site, index: int) -> Path:
    return run / reader.hook_of(site) / Path(reader.data_files(site)[index].key).name


def test_flipped_byte_fails_the_read_naming_file_and_block(run):
    reader = ActivaultReader(run)
    site = reader.sites[0]
    target = _data_file(reader, run, site, 2)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x10  # inside the tensor bytes
    target.write_bytes(bytes(data))
    with pytest.raises(
        CorruptStoreError,
        match=rf"{target.name}: block 0 \(bytes 0-{len(data)}\) is not the block published there",
    ):
        reader.read_block(reader.blocks(site)[2])
    np.testing.assert_array_equal(  # the other files still read
        reader.read_block(reader.blocks(site)[1]),
        ActivaultReader(run, verify_reads=False).read_block(reader.blocks(site)[1]),
    )
    assert ActivaultReader(run, verify_reads=False).read_block(reader.blocks(site)[2]).size
    assert any(
        f.startswith(f"{target.parent.name}/{target.name}: 1 block(s) differ")
        for f in reader.verify().faults
    )


def test_files_swapped_between_groups_fail_the_read(run):
    """Two whole, valid files of one hook exchanged (same sizes, the listing unchanged):
    each would serve another group's tokens; keyed digests refuse both."""
    reader = ActivaultReader(run)
    site = reader.sites[0]
    a, b = _data_file(reader, run, site, 0), _data_file(reader, run, site, 1)
    data_a, data_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(data_b)
    b.write_bytes(data_a)
    reader = ActivaultReader(run)
    for i, f in enumerate((a, b)):
        with pytest.raises(CorruptStoreError, match=rf"{f.name}: block 0 .* is not the block"):
            reader.read_block(reader.blocks(site)[i])


MANIFEST_SIZE = r"cfg\.json has \d+ bytes, the manifest says \d+"


@pytest.mark.parametrize(
    "edit, at_open, message",
    [  # impossible values are refused as the record is parsed (typed), before the manifest
        ({"groups": -3}, r"groups must be a whole number .*not -3", r"groups must be .*not -3"),
        ({"groups": 1}, MANIFEST_SIZE, "files beyond the 1 its complete cfg.json commits"),
        ({"rows_per_file": 0}, "rows_per_file must be .*not 0", "rows_per_file must be .*not 0"),
    ],
)
def test_edited_cfg_json_is_corrupt_never_fewer_rows(run, edit, at_open, message):
    cfg = json.loads((run / "cfg.json").read_text())
    cfg["actstore"].update(edit)
    (run / "cfg.json").write_text(json.dumps(cfg))
    with pytest.raises(CorruptStoreError, match=at_open):
        open_store(run)
    with pytest.raises(CorruptStoreError, match=message):
        open_store(run, verify_reads=False)
    resign(run)  # the manifest rewritten over the edit: the commit record still refuses it
    with pytest.raises(CorruptStoreError, match=message):
        open_store(run)


def test_a_complete_run_marked_unfinished_is_still_checked(run):
    """cfg.json edited to say "unfinished" must not turn verified reads off: a run with a root
    manifest is checked against it, whatever its cfg.json claims."""
    cfg = json.loads((run / "cfg.json").read_text())
    cfg["actstore"].update(complete=False, groups=2)
    (run / "cfg.json").write_text(json.dumps(cfg))
    for kwargs in ({}, {"allow_incomplete": True}):
        with pytest.raises(CorruptStoreError, match=MANIFEST_SIZE):
            ActivaultReader(run, **kwargs)


def test_malformed_cfg_json_names_the_file(run):
    (run / "cfg.json").write_text("{oops")
    with pytest.raises(CorruptStoreError, match="cfg.json"):
        ActivaultReader(run)


def test_symlinked_file_out_of_the_run_is_refused(run, tmp_path):
    target = _files(run)[0]
    outside = tmp_path / "elsewhere.pt"
    shutil.move(target, outside)
    target.symlink_to(outside)
    with pytest.raises(CorruptStoreError, match=rf"{target.name} is a symlink out of the store"):
        ActivaultReader(run)
    with pytest.raises(CorruptStoreError, match=rf"{target.name} is a symlink out of the store"):
        ActivaultReader(run, verify_reads=False)  # refused before any read, checked or not


def test_unfinished_run_read_unverified_still_refuses_symlinks_out(tmp_path):
    plan, acts = make_run_data()
    writer = write_run(str(tmp_path / "run"), plan, acts, rows_per_file=4, close=False)
    run = tmp_path / "run"
    target = _files(run)[0]
    assert writer.record.groups > 0 and not writer.record.complete
    assert ActivaultReader(run, allow_incomplete=True).n_files == writer.record.groups
    shutil.move(target, tmp_path / "elsewhere.pt")
    target.symlink_to(tmp_path / "elsewhere.pt")
    with pytest.raises(CorruptStoreError, match=rf"{target.name} is a symlink out of the store"):
        ActivaultReader(run, allow_incomplete=True)


def test_resume_refuses_a_committed_file_changed_since_its_commit(tmp_path):
    """Statistics that lag the commit are caught up from the committed files: a file changed
    since (same size) must fail there, not fold wrong values into statistics.json."""
    plan, acts = make_run_data()
    run = tmp_path / "run"
    writer = write_run(str(run), plan, acts, rows_per_file=4, close=False)
    hook = next(iter(writer.hooks))
    (run / hook / "statistics.json").unlink()  # as if the crash came before it was written
    (target,) = (run / hook).glob("*--1.pt")
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x10
    target.write_bytes(bytes(data))
    with pytest.raises(CorruptStoreError, match=rf"{target.name} \(committed group 0\) is not"):
        ActivaultWriter.from_plan(plan, run, ActivaultOptions(rows_per_file=4, dtype="float32"))
