"""The root manifest on its own: keyed block digests, block lookup, the manifest's own
digest and HMAC, counted chunk folders, and what ``Integrity`` refuses at open and on read."""

from __future__ import annotations

import itertools
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actstore.errors import CorruptStoreError, StoreNotFoundError
from actstore.storage.files import open_files
from actstore.storage.integrity import Integrity
from actstore.storage.manifest import (
    BLOCKS,
    KEY_ENV,
    MANIFEST,
    FileEntry,
    ManifestBuilder,
    RootManifest,
    hash_ranges,
    store_id_of,
    tile,
)

UNIT = 1000


def _store(root: Path, record=None, seed: int = 0) -> Path:
    """A store of two multi-block files, one file of explicit ranges, one small file and
    a counted chunk folder."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    (root / "a.bin").write_bytes(rng.bytes(4 * UNIT + 123))
    (root / "b.bin").write_bytes(rng.bytes(3 * UNIT))
    (root / "ranged.bin").write_bytes(rng.bytes(900))
    (root / "meta.json").write_text(json.dumps({"rows": 7}))
    (root / "chunks").mkdir()
    for i in range(5):
        (root / "chunks" / str(i)).write_bytes(rng.bytes(64))
    record = record if record is not None else {"store": root.name}
    builder = ManifestBuilder(format="test", store_id=store_id_of(record), record=record)
    builder.add_file(root, "a.bin", unit=UNIT)
    builder.add_file(root, "b.bin", unit=UNIT)
    builder.add_file(root, "ranged.bin", ranges=[(0, 100), (100, 500), (600, 300)])
    builder.add_tree(root, skip=["chunks"])
    builder.write(root, summary={"rows": 7})
    return root


def _open(root: Path, **kw) -> Integrity:
    return Integrity.open(open_files(root), ours=True, **kw)


def test_reads_of_whole_blocks_are_checked_and_others_refused(tmp_path):
    store = _store(tmp_path / "s")
    checks = _open(store)
    data = (store / "a.bin").read_bytes()
    checks.check("a.bin", 0, data)  # the whole file
    checks.check("a.bin", 2 * UNIT, data[2 * UNIT : 4 * UNIT])  # blocks 2 and 3
    checks.check("a.bin", 4 * UNIT, data[4 * UNIT :])  # the short last block
    assert checks.block_index("a.bin", UNIT, 2 * UNIT) == (1, 2)
    with pytest.raises(CorruptStoreError, match=r"bytes 10-1010 are not whole blocks of 1000"):
        checks.check("a.bin", 10, data[10 : 10 + UNIT])
    ranged = (store / "ranged.bin").read_bytes()
    checks.check("ranged.bin", 100, ranged[100:900])
    assert checks.block_index("ranged.bin", 100, 800) == (1, 2)
    with pytest.raises(CorruptStoreError, match="bytes 100-300 are not whole blocks"):
        checks.check("ranged.bin", 100, ranged[100:300])
    flipped = bytearray(data[UNIT : 2 * UNIT])
    flipped[7] ^= 1
    with pytest.raises(CorruptStoreError, match=r"a.bin: block 1 \(bytes 1000-2000\) is not the"):
        checks.check("a.bin", UNIT, bytes(flipped))


def test_a_block_moved_renamed_or_from_another_store_fails(tmp_path):
    """Keyed digests: the same bytes at another index, under another name or in another
    store do not pass, though their plain hash is the same."""
    one, two = _store(tmp_path / "one"), _store(tmp_path / "two", {"other": 1}, seed=1)
    os.chmod(two / "b.bin", 0o644)
    shutil.copy(one / "b.bin", two / "b.bin")  # a file of the same size from another store
    data = (one / "b.bin").read_bytes()
    checks = _open(one)
    with pytest.raises(CorruptStoreError, match="block 0"):
        checks.check("b.bin", 0, data[UNIT : 2 * UNIT])  # block 1's bytes read as block 0
    with pytest.raises(CorruptStoreError, match="a.bin: block 0"):
        checks.check("a.bin", 0, data[:UNIT])  # b.bin's bytes served as a.bin's
    with pytest.raises(CorruptStoreError, match="b.bin: block 0"):
        _open(two).check("b.bin", 0, data[:UNIT])  # opens (same size), but no read passes


def test_open_refuses_missing_extra_resized_and_symlinked_files(tmp_path):
    store = _store(tmp_path / "s")
    (store / "extra.bin").write_bytes(b"x")
    with pytest.raises(CorruptStoreError, match="extra.bin is not listed in the manifest"):
        _open(store)
    (store / "extra.bin").unlink()
    with open(store / "b.bin", "ab") as f:
        f.write(b"\0")
    with pytest.raises(CorruptStoreError, match="b.bin has 3001 bytes, the manifest says 3000"):
        _open(store)
    (store / "b.bin").unlink()
    with pytest.raises(StoreNotFoundError, match="b.bin is missing"):
        _open(store)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"y" * 3000)
    (store / "b.bin").symlink_to(outside)
    with pytest.raises(CorruptStoreError, match="b.bin is a symlink out of the store"):
        _open(store, verify_reads=False)  # refused before any read, checked or not


def test_counted_chunk_folders(tmp_path):
    store = _store(tmp_path / "s")
    manifest = RootManifest.from_bytes((store / MANIFEST).read_bytes(), MANIFEST)
    assert manifest.skip == {"chunks/": (5, 5 * 64)}
    assert not any(name.startswith("chunks/") for name in manifest.files)
    (store / "chunks" / "3").unlink()
    with pytest.raises(StoreNotFoundError, match="chunks holds 4 of the 5 chunk files: 1 is"):
        _open(store)
    (store / "chunks" / "3").write_bytes(b"z" * 65)
    with pytest.raises(CorruptStoreError, match="chunks holds 5 chunk files of 321 bytes"):
        _open(store)


def test_the_manifest_checks_itself_and_an_hmac_key_signs_it(tmp_path, monkeypatch):
    store = _store(tmp_path / "s")
    text = (store / MANIFEST).read_text()
    (store / MANIFEST).write_text(text.replace('"rows": 7', '"rows": 8'))
    with pytest.raises(CorruptStoreError, match="does not match its own digest"):
        _open(store)
    (store / MANIFEST).write_text(text)
    monkeypatch.setenv(KEY_ENV, "lab-secret")
    with pytest.raises(CorruptStoreError, match="is not signed with the key"):
        _open(store)  # written without the key: a rewritten manifest looks just like it
    signed = _store(tmp_path / "signed")
    assert _open(signed).manifest.summary == {"rows": 7}
    monkeypatch.setenv(KEY_ENV, "another-key")
    with pytest.raises(CorruptStoreError, match="is not signed with the key"):
        _open(signed)
    monkeypatch.delenv(KEY_ENV)
    assert _open(signed).manifest is not None  # without a key, the digest still holds


def test_damaged_block_digests_and_summary_mismatch(tmp_path):
    store = _store(tmp_path / "s")
    checks = _open(store)
    with pytest.raises(CorruptStoreError, match=r"reads differently .*rows: 6, published 7"):
        checks.check_summary({"rows": 6})
    data = bytearray((store / BLOCKS).read_bytes())
    data[-3] ^= 0x40
    os.chmod(store / BLOCKS, 0o644)
    (store / BLOCKS).write_bytes(bytes(data))
    with pytest.raises(CorruptStoreError, match=f"{BLOCKS} does not match the root manifest"):
        _open(store).check("a.bin", 0, (store / "a.bin").read_bytes()[:UNIT])


def test_verify_reports_every_fault(tmp_path):
    store = _store(tmp_path / "s")
    for name, at in (("a.bin", 2500), ("ranged.bin", 650)):
        data = bytearray((store / name).read_bytes())
        data[at] ^= 0xFF
        (store / name).write_bytes(bytes(data))
    (store / "meta.json").write_text(json.dumps({"rows": 9}))
    faults: list[str] = []
    _open(store, verify_reads=False).verify(faults)
    assert any("a.bin" in f and "block 2" in f for f in faults), faults
    assert any("ranged.bin" in f and "block 2" in f for f in faults), faults
    assert any("meta.json" in f for f in faults), faults


def _self_signed(doc: dict) -> bytes:
    """``doc`` with a correct ``self`` digest: malformed, but consistent with itself."""
    import xxhash

    body = {k: v for k, v in doc.items() if k not in ("self", "hmac")}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), default=str).encode()
    return json.dumps({**body, "self": xxhash.xxh3_128_hexdigest(canonical)}).encode()


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda d: d.update(version="one"), "version 'one' is not an integer"),
        (lambda d: d.update(version=None), "version None is not an integer"),
        (lambda d: d.update(store_id="not-hex-at-all!!"), "store_id 'not-hex-at-all!!' is not 16"),
        (lambda d: d.update(store_id="abc"), "store_id 'abc' is not 16 hex digits"),
        (lambda d: d.update(blocks="zz"), "blocks 'zz' is not 32 hex digits"),
        (lambda d: d["files"]["meta.json"].update(xxh3="g" * 16), "meta.json: xxh3 'gggg"),
        (lambda d: d["files"]["a.bin"].update(digest=7), "a.bin: digest '7' is not 32 hex"),
        (lambda d: d["files"]["a.bin"].update(size="big"), "malformed file entry"),
    ],
)
def test_a_self_consistent_manifest_with_malformed_values_is_refused(tmp_path, edit, words):
    store = _store(tmp_path / "s")
    doc = json.loads((store / MANIFEST).read_text())
    edit(doc)
    (store / MANIFEST).chmod(0o644)
    (store / MANIFEST).write_bytes(_self_signed(doc))
    with pytest.raises(CorruptStoreError) as err:
        _open(store)
    assert words in str(err.value)
    assert str(err.value).startswith(f"{store}/{MANIFEST}")


def test_entries_with_computed_starts_are_placed_in_the_blocks_file(tmp_path):
    data = bytes(range(256)) * 4
    (tmp_path / "r.bin").write_bytes(data)
    builder = ManifestBuilder(format="t", store_id=store_id_of("r"), record="r")
    entry, digests = hash_ranges(builder.store_id, "r.bin", data, [(0, 100), (100, 500)])
    assert entry.starts.tolist() == [0, 100, 600]  # the cached property is computed
    builder.add("r.bin", entry, digests)
    builder.write(tmp_path, summary={})
    checks = _open(tmp_path)
    assert checks.manifest.files["r.bin"].at == 0
    checks.check("r.bin", 100, data[100:600])


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(0, 5000),
    unit=st.integers(1, 700),
    first=st.integers(0, 20),
    count=st.integers(0, 20),
)
def test_bounds_of_a_slice_are_the_slice_of_all_bounds(size, unit, first, count):
    entry = FileEntry(size=size, digest="", unit=unit, at=0)
    every = entry.bounds()
    assert sum(n for _, n in every) == size and len(every) == entry.n_blocks
    assert entry.bounds(first, count) == every[first : first + count]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(1, 30)), max_size=8))
def test_tile_covers_the_file_with_the_given_ranges_kept(pairs):
    ranges, pos = [], 0
    for gap, length in pairs:
        ranges.append((pos + gap, length))
        pos += gap + length
    size = pos + 5
    tiled = tile(ranges, size)
    assert [r for r in tiled if r in ranges] == ranges
    assert tiled[0][0] == 0 and all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(tiled))
    assert sum(tiled[-1]) == size
    entry, digests = hash_ranges(store_id_of({}), "f", bytes(size), tiled)
    assert entry.n_blocks == len(tiled) == len(digests)
