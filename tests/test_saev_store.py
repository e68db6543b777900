"""saev store round trips, reader errors, atomic publication and verification."""

from __future__ import annotations

import json
import os
import shutil
import stat

import numpy as np
import pytest
import torch
from saev_fixtures import saev_writer

from actstore.batch import Batch
from actstore.errors import (
    CaptureError,
    CorruptStoreError,
    IndexOutOfRangeError,
    InvalidIndexError,
    LayerNotStoredError,
    ProtocolVersionError,
    StoreExistsError,
    StoreNotFoundError,
    UnsafeDataError,
)
from actstore.formats import open_store
from actstore.formats.recompute import same_statistics
from actstore.formats.saev import SaevMetadata, SaevReader
from actstore.formats.saev.layout import encode_data
from actstore.formats.saev.verify import _ShardFold
from actstore.formats.shard import ShardStats
from actstore.sites import Site
from actstore.stats import RunningStats

N, LAYERS, T, D = 23, (2, 5), 6, 8


def make_metadata(dialect="protocol", n=N, per_shard=5):
    return SaevMetadata(
        family="clip" if dialect == "saev" else "gpt2",
        ckpt="tiny",
        layers=LAYERS,
        patches_per_ex=T - 1,
        cls_token=True,
        d_model=D,
        n_examples=n,
        patches_per_shard=per_shard * T * len(LAYERS),
        data=encode_data({"kind": "test"}),
        dataset="/nowhere",
        dialect=dialect,
    )


def make_acts(n=N, seed=0):
    return np.random.default_rng(seed).standard_normal((n, len(LAYERS), T, D)).astype(np.float32)


def batches(acts, size=4, start=0):
    for lo in range(start, len(acts), size):
        part = acts[lo : lo + size]
        yield Batch(
            acts={f"resid.{layer}": torch.from_numpy(part[:, i]) for i, layer in enumerate(LAYERS)},
            example_ids=np.arange(lo, lo + len(part)),
            token_ids=np.arange(lo * T, (lo + len(part)) * T, dtype=np.int32).reshape(-1, T),
        )


def write_store(root, acts, dialect="protocol", **kw):
    writer = saev_writer(make_metadata(dialect, n=len(acts), **kw), root, has_tokens=True)
    for batch in batches(acts):
        writer.write(batch)
    return writer.close()


@pytest.mark.parametrize("dialect", ["protocol", "saev"])
def test_round_trip_exact(tmp_path, dialect):
    acts = make_acts()
    path = write_store(tmp_path, acts, dialect)
    reader = open_store(path)
    assert isinstance(reader, SaevReader) and reader.dialect == dialect
    np.testing.assert_array_equal(reader[:], acts)
    np.testing.assert_array_equal(reader[7, 5, 3], acts[7, 1, 3])
    np.testing.assert_array_equal(reader.vector(22, 2, 0), acts[22, 0, 0])
    np.testing.assert_array_equal(reader[[22, 0, 11], 2], acts[[22, 0, 11], 0])
    np.testing.assert_array_equal(reader[-1, :, 1:3], acts[-1, :, 1:3])
    np.testing.assert_array_equal(reader.tokens, np.arange(N * T).reshape(N, T))
    for i, layer in enumerate(LAYERS):
        got = reader.statistics(layer)
        want = acts[:, i].reshape(-1, D).astype(np.float64)
        assert got.count == N * T
        np.testing.assert_allclose(got.mean, want.mean(0), rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(got.var, want.var(0), rtol=1e-10)
        np.testing.assert_allclose(got.norm_mean, np.linalg.norm(want, axis=1).mean(), rtol=1e-12)
    assert reader.verify().ok


def test_files_match_the_spec_bytes(tmp_path):
    acts = make_acts()
    path = write_store(tmp_path, acts)
    md = json.loads((path / "metadata.json").read_text())
    assert path.name == SaevMetadata.from_json_dict(md).content_hash()
    shards = json.loads((path / "shards.json").read_text())
    assert shards == [
        {"name": f"acts{i:06d}.bin", "n_examples": n} for i, n in enumerate([5, 5, 5, 5, 3])
    ]
    # raw little-endian float32, C order (S, L, T, D), split along examples
    raw = np.concatenate([np.fromfile(path / s["name"], dtype="<f4") for s in shards])
    np.testing.assert_array_equal(raw, acts.reshape(-1))
    assert (path / "acts000004.bin").stat().st_size == 3 * len(LAYERS) * T * D * 4
    for f in path.iterdir():  # published files are read-only
        assert not f.stat().st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)
    manifest = json.loads((path / "actstore-manifest.json").read_text())
    listed = set(manifest["files"])
    assert listed == {s["name"] for s in shards} | {
        "metadata.json",
        "shards.json",
        "statistics.json",
        "tokens.bin",
    }
    unit = T * D * 4  # one block per (example, layer): what a loader block reads
    assert manifest["files"]["acts000000.bin"]["unit"] == unit


def test_saev_dialect_layout(tmp_path):
    acts = make_acts()
    path = write_store(tmp_path, acts, "saev")
    assert path.parent == (tmp_path / "saev" / "shards").resolve() and len(path.name) == 8
    doc = json.loads((path / "metadata.json").read_text())
    assert list(doc) == [
        "family",
        "ckpt",
        "layers",
        "content_tokens_per_example",
        "cls_token",
        "d_model",
        "n_examples",
        "max_tokens_per_shard",
        "data",
        "dataset",
        "pixel_agg",
        "dtype",
        "protocol",
    ]
    assert doc["pixel_agg"] == "majority" and doc["protocol"] == "2.1"
    full = 5 * len(LAYERS) * T * D * 4
    assert (path / "acts000004.bin").stat().st_size == full  # last shard zero-padded
    tail = np.fromfile(path / "acts000004.bin", dtype="<f4")
    assert not tail[3 * len(LAYERS) * T * D :].any()
    assert json.loads((path / "shards.json").read_text())[-1] == {
        "name": "acts000004.bin",
        "n_examples": 3,
    }


def test_reader_accepts_the_empty_last_shard_saev_itself_writes(tmp_path):
    """saev's ShardWriter, when n_examples fills the last shard exactly, opens one more
    full-size all-zero shard and lists it with 0 examples; such directories must open."""
    acts = make_acts(n=20)  # 4 full shards of 5
    path = _writable_copy(write_store(tmp_path / "s", acts, "saev"), tmp_path / "saev-made")
    for name in ("actstore-manifest.json", "actstore-blocks.xxh3", "statistics.json", "tokens.bin"):
        (path / name).unlink()  # saev writes none of actstore's files
    shards = json.loads((path / "shards.json").read_text())
    (path / "shards.json").write_text(
        json.dumps([*shards, {"name": "acts000004.bin", "n_examples": 0}])
    )
    (path / "acts000004.bin").write_bytes(bytes((path / "acts000000.bin").stat().st_size))
    reader = SaevReader(path)
    assert reader.shard_counts == [5, 5, 5, 5]
    np.testing.assert_array_equal(reader[:], acts)
    assert sum(b.n_rows for b in reader.blocks(2)) == 20 * T
    (path / "shards.json").write_text(
        json.dumps([*shards, {"name": "acts000004.bin", "n_examples": 1}])
    )
    with pytest.raises(CorruptStoreError, match="lists 5 shards"):
        SaevReader(path)


def test_second_writer_with_same_config_reports_published_store(tmp_path):
    acts = make_acts()
    path = write_store(tmp_path, acts)
    before = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    again = saev_writer(make_metadata(), tmp_path, has_tokens=True)
    assert again.complete and again.close() == path
    with pytest.raises(CaptureError, match="already published"):
        again.write(next(batches(acts)))
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == before


def test_unfinished_writer_publishes_nothing_and_resumes(tmp_path):
    acts = make_acts()
    writer = saev_writer(make_metadata(), tmp_path, has_tokens=True)
    for batch in list(batches(acts))[:3]:  # 12 examples: 2 finished shards + 2 examples
        writer.write(batch)
    writer.abort()
    assert not any(p.name[0] != "." for p in tmp_path.iterdir())  # only the .partial dir
    partial = next(tmp_path.iterdir())
    with pytest.raises(CorruptStoreError, match="unfinished capture"):
        SaevReader(partial)
    resumed = saev_writer(make_metadata(), tmp_path, has_tokens=True)
    assert resumed.resume_from == 10
    for batch in batches(acts, start=8):  # overlapping batch: rows before 10 are skipped
        resumed.write(batch)
    path = resumed.close()
    reference = write_store(tmp_path / "ref", acts)
    for f in reference.iterdir():
        assert (path / f.name).read_bytes() == f.read_bytes(), f.name


def test_close_before_all_examples_refuses_to_publish(tmp_path):
    writer = saev_writer(make_metadata(), tmp_path, has_tokens=True)
    writer.write(next(batches(make_acts())))
    with pytest.raises(CaptureError, match="only 4 of 23"):
        writer.close()
    assert list(tmp_path.iterdir()) == []  # no shard was finished: nothing durable to keep


def test_rerun_after_an_early_close_resumes_to_identical_bytes(tmp_path):
    """Regression: close() with examples missing used to zero-pad the open shard and record
    it as finished, so a rerun kept a short shard and shifted every later example."""
    acts = make_acts()
    writer = saev_writer(make_metadata(), tmp_path, has_tokens=True)
    for batch in list(batches(acts))[:2]:  # 8 examples: shard 0 full, 3 examples of shard 1
        writer.write(batch)
    with pytest.raises(CaptureError, match="only 8 of 23"):
        writer.close()
    resumed = saev_writer(make_metadata(), tmp_path, has_tokens=True)
    assert resumed.resume_from == 5  # only the full shard is kept
    for batch in batches(acts, start=4):
        resumed.write(batch)
    path = resumed.close()
    np.testing.assert_array_equal(SaevReader(path)[:], acts)
    reference = write_store(tmp_path / "ref", acts)
    for f in reference.iterdir():
        assert (path / f.name).read_bytes() == f.read_bytes(), f.name


def test_out_of_order_batches_are_rejected(tmp_path):
    writer = saev_writer(make_metadata(), tmp_path, has_tokens=True)
    with pytest.raises(CaptureError, match="example order"):
        writer.write(list(batches(make_acts()))[1])


def _writable_copy(path, dest):
    shutil.copytree(path, dest)
    for f in dest.iterdir():
        f.chmod(0o644)
    return dest


def test_reader_errors_name_the_problem(tmp_path):
    path = write_store(tmp_path / "s", make_acts())
    reader = SaevReader(path)
    with pytest.raises(LayerNotStoredError, match="resid.3 is not in this store"):
        reader[0, 3, 0]
    with pytest.raises(IndexOutOfRangeError, match="example 23 out of range"):
        reader[23, 2, 0]
    with pytest.raises(IndexOutOfRangeError, match="token 6 out of range"):
        reader[0, 2, 6]
    with pytest.raises(IndexOutOfRangeError, match="token 10 out of range"):
        reader[0, 2, [1, 10]]
    with pytest.raises(InvalidIndexError, match="token index must be an int, slice or int array"):
        reader[0, 2, np.array([1.5])]
    np.testing.assert_array_equal(reader[0, 2, [1, -1]], reader[0, 2, [1, 5]])
    with pytest.raises(StoreNotFoundError):
        SaevReader(tmp_path / "missing")

    old = _writable_copy(path, tmp_path / "old-actstore")  # before the root manifest
    (old / "actstore-manifest.json").unlink()
    (old / "actstore-blocks.xxh3").unlink(missing_ok=True)
    (old / "checksums.xxh128").write_text("")
    with pytest.raises(CorruptStoreError, match="written by an older actstore .* re-capture it"):
        SaevReader(old)
    assert SaevReader(old, verify_reads=False).n_examples == reader.n_examples

    missing = _writable_copy(path, tmp_path / "missing-shard")
    (missing / "acts000002.bin").unlink()
    with pytest.raises(StoreNotFoundError, match="acts000002.bin is missing"):
        SaevReader(missing)

    truncated = _writable_copy(path, tmp_path / "truncated")
    with open(truncated / "acts000001.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(CorruptStoreError, match="acts000001.bin has 100 bytes, the manifest"):
        SaevReader(truncated)

    bad_json = _writable_copy(path, tmp_path / "bad-json")
    (bad_json / "shards.json").write_text("[{")
    with pytest.raises(CorruptStoreError, match="shards.json has 2 bytes, the manifest says"):
        SaevReader(bad_json)
    with pytest.raises(CorruptStoreError, match="shards.json is not valid JSON"):
        SaevReader(bad_json, verify_reads=False)

    future = _writable_copy(path, tmp_path / "future")
    doc = json.loads((future / "metadata.json").read_text())
    (future / "metadata.json").write_text(json.dumps({**doc, "protocol": "3.0"}))
    with pytest.raises(CorruptStoreError, match="metadata.json has .* the manifest says"):
        SaevReader(future)
    with pytest.raises(ProtocolVersionError, match="major"):
        SaevReader(future, verify_reads=False)

    with pytest.raises(UnsafeDataError, match="allow_pickle=True"):
        reader.dataset_description()
    assert reader.dataset_description(allow_pickle=True) == {"kind": "test"}


def test_verify_detects_changed_bytes_and_edited_metadata(tmp_path):
    path = write_store(tmp_path, make_acts())
    flipped = _writable_copy(path, tmp_path / path.name.replace(path.name[:4], "0000"))
    with open(flipped / "acts000003.bin", "r+b") as f:
        f.seek(17)
        f.write(b"\xff")
    report = SaevReader(flipped).verify()
    assert not report.ok and any("acts000003.bin: 1 block(s) differ" in x for x in report.faults)
    assert any("differs from the metadata hash" in x for x in report.faults)


def test_existing_directory_with_other_metadata_is_never_overwritten(tmp_path):
    path = write_store(tmp_path, make_acts())
    md_path = path / "metadata.json"
    md_path.chmod(0o644)
    md_path.write_text(md_path.read_text().replace('"tiny"', '"other"'))
    before = (path / "acts000000.bin").read_bytes()
    with pytest.raises(StoreExistsError, match="damaged"):
        saev_writer(make_metadata(), tmp_path, has_tokens=True)
    assert (path / "acts000000.bin").read_bytes() == before


def test_running_stats_merge_matches_numpy():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1000, 7)) * 5 + 3
    parts = [RunningStats.of(x[a:b]) for a, b in ((0, 1), (1, 400), (400, 1000))]
    merged = parts[0].merge(parts[1]).merge(parts[2])
    np.testing.assert_allclose(merged.mean, x.mean(0), rtol=1e-12)
    np.testing.assert_allclose(merged.var, x.var(0), rtol=1e-12)
    assert merged.count == 1000
    assert (
        RunningStats.from_dict(json.loads(json.dumps(merged.to_dict()))).mean.tolist()
        == merged.mean.tolist()
    )


def test_block_reads_cover_every_row_once(tmp_path):
    acts = make_acts()
    reader = SaevReader(write_store(tmp_path, acts))
    for i, layer in enumerate(LAYERS):
        blocks = reader.blocks(layer)
        assert sum(b.n_rows for b in blocks) == N * T
        rows = np.concatenate([reader.read_block(b) for b in blocks])
        np.testing.assert_array_equal(rows, acts[:, i].reshape(-1, D))
        ex, _tok = zip(*(reader.block_rows(b) for b in blocks))
        np.testing.assert_array_equal(np.concatenate(ex), np.repeat(np.arange(N), T))
    assert os.getpid()  # reader handles are per process; see test_loader for workers


@pytest.mark.parametrize("dialect", ["protocol", "saev"])
def test_verify_folds_the_statistics_from_its_one_read_of_the_shards(tmp_path, dialect):
    """``verify`` folds the statistics while it reads every shard for the manifest (an
    example split across two of its 8 MiB reads carried over, the saev dialect's zero
    padding left out) and gets, bit for bit, what the writer stored (and so what reading
    the store again gives: ``tests/test_verify_recompute.py``): the store is read once."""
    acts = make_acts(n=45_000)  # 384-byte examples: 8 MiB is no whole number of them
    md = make_metadata(dialect, n=len(acts), per_shard=30_000)  # shards of 11.5 MB, 5.8 MB
    writer = saev_writer(md, tmp_path, has_tokens=True)
    for batch in batches(acts, size=1000):
        writer.write(batch)
    reader = SaevReader(writer.close())
    faults: list[str] = []
    reader.checks.verify(faults, on_chunk=reader.scan_chunk)
    folded = reader.scanned_statistics()
    assert not faults and folded is not None and set(folded) == set(reader.sites)
    for site in reader.sites:
        assert same_statistics(folded[site], reader.site_statistics(site))
    assert reader.scanned_statistics() is None  # taken: a later verify folds anew
    assert reader.verify().ok


def test_verify_fold_is_the_same_however_the_reads_cut_the_shard():
    """The fold of one shard's bytes fed in reads of any sizes (cutting rows, slabs and
    examples; one byte at a time included) is bit for bit the writer's fold of each
    site's rows, whole."""
    layers, tokens, d, n = 3, 5, 3, 80_000  # rows of 12 bytes, examples of 180; 400,000 rows
    # a site (runs of 349,525: one run boundary crossed)
    sites = [Site("resid", 7), Site("resid", 2)]  # stored in slots 2 and 0
    values = np.random.default_rng(3).standard_normal((n, layers, tokens, d)).astype("<f4")
    data = memoryview(values.tobytes())

    def folded(cuts):
        fold = _ShardFold(sites, [2, 0], (layers, tokens, d), len(data))
        at = 0
        for end in [*cuts, len(data)]:
            fold.feed(at, data[at:end])
            at = end
        assert fold.result is not None
        return fold.result

    writer = ShardStats(sites, d)
    writer.update({sites[0]: values[:, 2].reshape(-1, d), sites[1]: values[:, 0].reshape(-1, d)})
    want = writer.finish()
    rng = np.random.default_rng(4)
    for cuts in (
        [],
        sorted(rng.choice(len(data), 30, replace=False).tolist()),
        [*range(1, 400), 181 * 12 + 5],
        [180 * 7, 180 * 7 + 12 * 5, 180 * 7 + 12 * 5 + 7],
    ):
        got = folded(cuts)
        for site in sites:
            assert same_statistics(got[site], want[site])
