"""Activault reliability on local disk: file digests on every read, an edited cfg.json,
symlinks out of the run (docs/reliability.md). S3 faults: tests/test_activault_s3.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_activault_s3 import make_run_data, write_run

from actstore.errors import CorruptStoreError
from actstore.formats import open_store
from actstore.formats.activault import ActivaultReader


@pytest.fixture
def run(tmp_path) -> Path:
    plan, acts = make_run_data()
    return Path(write_run(str(tmp_path / "run"), plan, acts, rows_per_file=4))


def _files(run: Path) -> list[Path]:
    return sorted(p for p in run.rglob("*.pt"))


def test_flipped_byte_fails_the_read_naming_file_and_block(run):
    reader = ActivaultReader(run)
    hook = reader.sites[0]
    target = Path(reader.store.root) / reader.files(hook)[2].key
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x10  # inside the tensor bytes
    target.write_bytes(bytes(data))
    with pytest.raises(CorruptStoreError, match=rf"{target.name}: block 2 \(bytes 0-\d+\) fails"):
        reader.read_block(reader.blocks(hook)[2])
    assert ActivaultReader(run, verify_reads=False).read_block(reader.blocks(hook)[2]).size


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"groups": -3}, r"impossible values .*groups=-3"),
        ({"groups": 1}, "files beyond the 1 its complete cfg.json commits"),
        ({"rows_per_file": 0}, "rows_per_file=0"),
    ],
)
def test_edited_cfg_json_is_corrupt_never_fewer_rows(run, edit, message):
    cfg = json.loads((run / "cfg.json").read_text())
    cfg["actstore"].update(edit)
    (run / "cfg.json").write_text(json.dumps(cfg))
    with pytest.raises(CorruptStoreError, match=message):
        open_store(run)


def test_malformed_cfg_json_names_the_file(run):
    (run / "cfg.json").write_text("{oops")
    with pytest.raises(CorruptStoreError, match="cfg.json"):
        ActivaultReader(run)


def test_symlinked_file_out_of_the_run_is_refused(run, tmp_path):
    target = _files(run)[0]
    outside = tmp_path / "elsewhere.pt"
    shutil.move(target, outside)
    target.symlink_to(outside)
    with pytest.raises(CorruptStoreError, match="outside the store"):
        ActivaultReader(run)
