"""Faults of the root manifest's own files: a missing ``actstore-blocks.xxh3`` is listed by
``actstore verify`` (exit 1, not a usage error), and a damaged manifest read with
``verify_reads=False`` is tolerated (one warning, data read unchecked) while checked reads
refuse it."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from forked import run_actstore

from actstore.errors import CorruptStoreError, StoreNotFoundError
from actstore.formats import open_store
from actstore.storage.files import open_files
from actstore.storage.integrity import Integrity
from actstore.storage.manifest import BLOCKS, MANIFEST
from actstore.testing import FormatCase, make_acts, make_batches, make_plan

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    plan = make_plan()
    acts = make_acts(plan)
    root = tmp_path_factory.mktemp("integrity")
    return Path(FormatCase("saev").write(root / "s", plan, make_batches(plan, acts))), acts


@pytest.fixture
def store(built, tmp_path) -> Path:
    copy = tmp_path / built[0].name
    shutil.copytree(built[0], copy)
    for path in copy.iterdir():
        path.chmod(0o644)
    return copy


def _verify(location: Path) -> subprocess.CompletedProcess:
    # a process of its own, forked from a helper that imported torch once (tests/forked.py)
    return run_actstore(
        "verify",
        location,
        "--no-progress",
        env={**os.environ, "PYTHONPATH": str(SRC), "TQDM_DISABLE": "1"},
        timeout=300,
    )


@pytest.mark.slow  # the real command, in a subprocess
def test_verify_lists_a_missing_blocks_file_and_exits_1(store):
    (store / BLOCKS).unlink()
    proc = _verify(store)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "error:" not in proc.stderr, proc.stderr
    faults = [line for line in proc.stderr.splitlines() if line.startswith("FAULT: ")]
    assert f"FAULT: {store}/{BLOCKS} is missing, so the block digests of the store's files " in (
        "\n".join(faults)
    )
    assert any("finish the copy (rerun actstore cp)" in f for f in faults), faults
    assert len(faults) == len(set(faults))  # said once, not once per file


def test_a_missing_blocks_file_is_one_fault_of_verify(store):
    (store / BLOCKS).unlink()
    checks = Integrity.open(open_files(store), verify_reads=False)
    faults: list[str] = []
    checks.verify(faults)
    assert faults[0] == f"{BLOCKS} is missing"
    assert faults[1].startswith(f"{store}/{BLOCKS} is missing, so the block digests")
    assert len(faults) == 2
    with pytest.raises(StoreNotFoundError, match="restore it, finish the copy"):
        checks.digests("acts000000.bin")


def test_a_damaged_manifest_is_read_unchecked_with_one_warning(built, store, caplog):
    _, acts = built
    raw = bytearray((store / MANIFEST).read_bytes())
    raw[raw.index(b'"format"') + 1] ^= 0x01  # the manifest no longer matches its own digest
    (store / MANIFEST).write_bytes(bytes(raw))
    with pytest.raises(CorruptStoreError, match="does not match its own digest"):
        open_store(store)
    with caplog.at_level(logging.WARNING, logger="actstore.storage.integrity"):
        reader = open_store(store, verify_reads=False)
        again = open_store(store, verify_reads=False)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "does not match its own digest" in warnings[0]
    assert warnings[0].endswith(f"reading {store} unchecked (verify_reads=False)")
    assert reader.checks.manifest is None and not reader.checks.enabled
    site = reader.sites[0]
    got = np.concatenate([reader.read_block(b) for b in reader.blocks(site)])
    want = acts[str(site)].reshape(-1, acts[str(site)].shape[-1])
    assert got.tobytes() == want.tobytes()
    faults = again.verify().faults
    assert any("does not match its own digest" in f for f in faults), faults
    assert not any(f.startswith("no root manifest") for f in faults), faults
