"""saev and pkl.gz stores on the loopback S3 server: readers over ranged GETs, the loader
exactly once, the local cache tier, ``actstore cp`` both ways, and faults through the proxy."""

from __future__ import annotations

import gc
import multiprocessing
import os
import time
from pathlib import Path

import numpy as np
import pytest
from forked import pythonpath, run_actstore, run_python
from test_pickle_store import write as write_pickle
from test_saev_store import T, make_acts, write_store
from typer.testing import CliRunner

from actstore.cli import app
from actstore.errors import StoreNotFoundError
from actstore.formats import open_store, verify_store
from actstore.formats.pickle import PickleReader
from actstore.formats.saev import SaevReader
from actstore.loader import ActivationLoader
from actstore.storage.cache import BlockCache
from actstore.storage.copy import copy_store
from actstore.storage.files import open_files
from actstore.storage.manifest import BLOCKS, MANIFEST
from actstore.testing import make_plan


@pytest.fixture
def saev_local(tmp_path):
    acts = make_acts()
    return write_store(tmp_path / "local", acts), acts


def upload(local, url):
    report = copy_store(local, url, threads=4, check_store=verify_store)
    assert report.copied == report.files and report.skipped == 0
    return report


def gets(s3) -> int:
    """GETs of shard data (the block digests, ``actstore-blocks.xxh3``, are fetched once)."""
    return sum(
        1
        for method, path, _ in s3.faults.requests
        if method == "GET" and path.endswith(".bin") and not path.endswith(BLOCKS)
    )


def test_saev_reader_over_s3_matches_the_local_reader(s3, saev_local):
    local, acts = saev_local
    url = s3.url("acts", local.name)
    upload(local, url)
    remote, here = open_store(url), SaevReader(local)
    assert isinstance(remote, SaevReader) and not remote.location.is_local
    assert remote.shape == here.shape
    np.testing.assert_array_equal(remote[7, 5, 3], acts[7, 1, 3])
    np.testing.assert_array_equal(remote[[21, 2, 7], 2], acts[[21, 2, 7], 0])
    np.testing.assert_array_equal(remote[3:9, :, 1:4], acts[3:9, :, 1:4])
    np.testing.assert_array_equal(remote[[4, 11], 5, [5, 0, 2]], here[[4, 11], 5, [5, 0, 2]])
    np.testing.assert_array_equal(remote[-1, :, -1], acts[-1, :, -1])
    np.testing.assert_array_equal(remote.vector(12, 2, 4), acts[12, 0, 4])
    rows = np.array([5, 130, 5, 0, 137])
    np.testing.assert_array_equal(remote.gather(rows, 5), here.gather(rows, 5))
    for block in remote.blocks(2):
        np.testing.assert_array_equal(remote.read_block(block), here.read_block(block))
    np.testing.assert_array_equal(remote.tokens, here.tokens)
    assert remote.statistics(5).to_dict() == here.statistics(5).to_dict()
    assert remote.describe()["files"] == here.describe()["files"]
    report = remote.verify()
    assert report.ok and report.files_checked == here.verify().files_checked


def test_one_row_costs_one_small_ranged_get(s3, saev_local):
    local, acts = saev_local
    url = s3.url("acts", local.name)
    upload(local, url)
    reader = SaevReader(url)
    before = len(s3.faults.requests)
    np.testing.assert_array_equal(reader[9, 5, 2], acts[9, 1, 2])
    got = [(m, p.rsplit("/", 1)[1]) for m, p, _ in s3.faults.requests[before:]]
    assert sorted(got) == [("GET", "acts000001.bin"), ("GET", BLOCKS)]  # digests: once
    before = len(s3.faults.requests)
    np.testing.assert_array_equal(reader[3, 2, 4], acts[3, 0, 4])
    assert [m for m, _, _ in s3.faults.requests[before:]] == ["GET"]


def test_reader_refuses_a_prefix_without_its_manifest(s3, saev_local):
    local, _ = saev_local
    url = s3.url("partial")
    upload(local, url)
    s3.client().delete_object(Bucket=s3.bucket, Key="partial/metadata.json")
    with pytest.raises(StoreNotFoundError, match="no metadata.json"):
        SaevReader(url)
    with pytest.raises(StoreNotFoundError, match="not an actstore-readable store"):
        open_store(url)


def test_loader_over_s3_serves_every_row_exactly_once(s3, saev_local):
    local, acts = saev_local
    url = s3.url("acts", local.name)
    upload(local, url)
    loader = ActivationLoader(url, site=5, batch_size=16, pool_blocks=3, return_index=True)
    xs, rows = zip(*[(b.acts.numpy(), b.rows.numpy()) for b in loader])
    rows = np.concatenate(rows)
    assert sorted(rows.tolist()) == list(range(len(acts) * T))
    np.testing.assert_array_equal(np.concatenate(xs), acts[:, 1].reshape(-1, acts.shape[-1])[rows])


def test_a_loader_dropped_after_its_epoch_stops_reading_ahead(s3, saev_local):
    """The next epoch's first window, read ahead as an epoch ends, is read no further once
    the loader is gone: a loader used for one epoch makes no GET after it is dropped."""
    local, _ = saev_local
    url = s3.url("acts", local.name)
    upload(local, url)
    loader = ActivationLoader(SaevReader(url), site=5, batch_size=16, io_threads=1)
    assert sum(len(batch) for batch in loader) == 23 * T
    assert loader.read_ahead == 1  # the next epoch's first window is being read
    del loader
    gc.collect()
    dropped = gets(s3)
    time.sleep(0.5)
    assert gets(s3) == dropped


def test_dataloader_workers_over_s3_with_a_shared_cache(s3, saev_local, tmp_path):
    """Worker processes (forked after the parent read blocks: its threads and client must
    not be reused) serve every row once, sharing one cache directory."""
    from actstore.loader import ActivationDataLoader

    local, acts = saev_local
    url = s3.url("acts", local.name)
    upload(local, url)
    reader = SaevReader(url, cache_dir=tmp_path / "cache")
    reader.read_block(reader.blocks(5)[-1])  # the parent has a client and a cache entry
    options = {"site": 5, "batch_size": 16, "pool_blocks": 3, "return_index": True}
    for _ in range(2):  # the second epoch comes from the cache
        data = ActivationDataLoader(ActivationLoader(reader, **options), num_workers=2)
        rows = np.concatenate([b.rows.numpy() for b in data])
        assert sorted(rows.tolist()) == list(range(len(acts) * T))
    assert BlockCache(tmp_path / "cache").usage()[0] == len(reader.blocks(5))


def test_cache_serves_a_second_epoch_and_evicts_least_recently_used(s3, saev_local, tmp_path):
    local, _ = saev_local
    url = s3.url("acts", local.name)
    upload(local, url)
    here = SaevReader(local)
    reader = SaevReader(url, cache_dir=tmp_path / "cache", cache_bytes="1M")
    blocks = reader.blocks(2)
    first = gets(s3)
    for block in blocks:
        reader.read_block(block)
    assert gets(s3) - first == len(blocks)
    for block in blocks:  # second epoch: no request reaches the server
        np.testing.assert_array_equal(reader.read_block(block), here.read_block(block))
    cache = reader.files.cache
    assert gets(s3) - first == len(blocks) and cache.stats.hits == len(blocks)
    # A damaged entry is dropped and fetched again.
    victim = next(p for p in (tmp_path / "cache").rglob("*.blk"))
    data = bytearray(victim.read_bytes())
    data[0] ^= 0xFF
    victim.write_bytes(bytes(data))
    for block in blocks:
        np.testing.assert_array_equal(reader.read_block(block), here.read_block(block))
    assert cache.stats.damaged == 1 and gets(s3) - first == len(blocks) + 1
    # The loader's scatter reads map cache entries (no copy) and check them the same way.
    victim.write_bytes(bytes(data))
    for block in blocks:
        rows = np.random.default_rng(0).permutation(block.n_rows)
        rows[0] = -1  # a row the loader drops
        out = np.full((block.n_rows, reader.d_model), np.nan, dtype=np.float32)
        reader.read_block_scatter(block, out, rows)
        expect = here.read_block(block)
        np.testing.assert_array_equal(out[rows[1:]], expect[1:])
    assert cache.stats.damaged == 2 and gets(s3) - first == len(blocks) + 2
    # Eviction: a cap of three blocks keeps the three used last.
    block_bytes = blocks[0].n_rows * reader.d_model * 4 + 16
    small = BlockCache(tmp_path / "small", max_bytes=3 * block_bytes)
    reader.files.cache = small
    for block in blocks:
        reader.read_block(block)
    small.evict()
    entries, size = small.usage()
    assert entries == 3 and size <= small.max_bytes and small.stats.evicted >= len(blocks) - 3
    before = gets(s3)
    for block in blocks[-3:]:
        reader.read_block(block)
    assert gets(s3) == before
    reader.read_block(blocks[0])
    assert gets(s3) == before + 1


def _read_all(url: str, cache_dir: str) -> int:
    reader = SaevReader(url, cache_dir=cache_dir)
    for block in reader.blocks(2):
        reader.read_block(block)
    return reader.files.cache.stats.stores


def test_processes_share_one_cache(s3, saev_local, tmp_path):
    local, _ = saev_local
    url = s3.url("acts", local.name)
    upload(local, url)
    cache_dir = str(tmp_path / "shared")
    # spawned, not forked: a fork copies locks other threads of this test process hold
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        stores = pool.starmap(_read_all, [(url, cache_dir)] * 2)
    n_blocks = len(SaevReader(local).blocks(2))
    assert n_blocks <= sum(stores) <= 2 * n_blocks
    assert BlockCache(cache_dir).usage()[0] == n_blocks  # one entry per block, whole
    before = gets(s3)
    _read_all(url, cache_dir)
    assert gets(s3) == before


def test_cp_both_ways_publishes_last_resumes_and_verifies(s3, saev_local, tmp_path):
    local, _ = saev_local
    url = s3.url("copy", local.name)
    start = len(s3.faults.requests)
    report = upload(local, url)
    assert "SaevReader.verify()" in report.verified and "ETags" in report.verified
    puts = [p for m, p, _ in s3.faults.requests[start:] if m == "PUT"]
    assert puts[-1].endswith(f"/{MANIFEST}")  # the root manifest last
    names = {p.name: p.stat().st_size for p in local.iterdir()}
    assert s3.keys(f"copy/{local.name}/") == {f"copy/{local.name}/{n}": s for n, s in names.items()}
    # Resume: only the missing object is sent again.
    s3.client().delete_object(Bucket=s3.bucket, Key=f"copy/{local.name}/acts000002.bin")
    again = copy_store(local, url)
    assert (again.copied, again.skipped) == (1, len(names) - 1)
    # Download and compare bytes.
    back = tmp_path / "back" / local.name
    copy_store(url, back, part_bytes=5 << 20)
    for name in names:
        assert (back / name).read_bytes() == (local / name).read_bytes()
    # A same-sized but different file at the destination is found by content and replaced,
    # in both directions; the rest is kept.
    damaged = bytearray((back / "acts000001.bin").read_bytes())
    damaged[100] ^= 1
    (back / "acts000001.bin").write_bytes(bytes(damaged))
    again = copy_store(url, back, check_store=verify_store)
    assert (again.copied, again.skipped) == (1, len(names) - 1)
    assert f"{len(names) - 1} files already there matched by content" in again.verified
    assert (back / "acts000001.bin").read_bytes() == (local / "acts000001.bin").read_bytes()
    key = f"copy/{local.name}/acts000002.bin"
    zeros = bytes(len((local / "acts000002.bin").read_bytes()))
    s3.client().put_object(Bucket=s3.bucket, Key=key, Body=zeros)  # same size, all zero
    again = copy_store(local, url, check_store=verify_store)
    assert (again.copied, again.skipped) == (1, len(names) - 1)
    assert open_files(url).read_bytes("acts000002.bin") == (local / "acts000002.bin").read_bytes()


def test_cp_multipart_upload_carries_the_etags_of_the_bytes_sent(s3, tmp_path):
    src = tmp_path / "blob"
    src.mkdir()
    data = np.random.default_rng(1).integers(0, 255, 11 << 20, dtype=np.uint8).tobytes()
    (src / "big.bin").write_bytes(data)
    report = copy_store(src, s3.url("blob"), part_bytes=5 << 20)
    assert report.bytes_copied == len(data) and "1 ETags" in report.verified
    head = s3.client().head_object(Bucket=s3.bucket, Key="blob/big.bin")
    assert head["ETag"].strip('"').endswith("-3")
    out = bytearray(len(data))
    open_files(s3.url("blob")).read_range("big.bin", 0, len(data), out)
    assert bytes(out) == data


def test_cli_cp_ls_verify_on_s3(s3, saev_local, tmp_path):
    local, _ = saev_local
    url = s3.url("cli", local.name)
    runner = CliRunner()
    result = runner.invoke(app, ["cp", str(local), url, "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "copied" in result.output
    result = runner.invoke(app, ["ls", url])
    assert result.exit_code == 0, result.output
    assert "saev protocol 2.1" in result.output and "11 files" in result.output
    result = runner.invoke(app, ["verify", url, "--no-progress"])
    assert result.exit_code == 0 and "OK:" in result.output, result.output
    result = runner.invoke(app, ["cp", url, str(tmp_path / "down"), "--no-progress"])
    assert result.exit_code == 0, result.output


def test_pickle_store_on_s3(s3, tmp_path):
    plan = make_plan()
    store, plan, _ = write_pickle(tmp_path / "pkl", plan)
    url = s3.url("pkl")
    upload(store, url)
    remote, here = open_store(url), PickleReader(store)
    assert isinstance(remote, PickleReader) and not remote.location.is_local
    site = remote.sites[0]
    for a, b in zip(remote.blocks(site), here.blocks(site)):
        np.testing.assert_array_equal(remote.read_block(a), here.read_block(b))
    assert remote.verify().ok
    loader = ActivationLoader(url, site=site, batch_size=7, return_index=True)
    rows = np.concatenate([b.rows.numpy() for b in loader])
    assert sorted(rows.tolist()) == list(range(sum(b.n_rows for b in here.blocks(site))))


def test_reads_survive_connection_resets_through_the_proxy(s3_proxy, saev_local):
    local, acts = saev_local
    url = s3_proxy.url("acts", local.name)
    upload(local, url)
    reader = SaevReader(url)
    here = SaevReader(local)
    s3_proxy.proxy.reset_connections(times=3, after_bytes=200)
    for block in reader.blocks(5):
        np.testing.assert_array_equal(reader.read_block(block), here.read_block(block))
    assert reader.files.store.retries >= 1
    np.testing.assert_array_equal(reader[[3, 20], 2], acts[[3, 20], 0])


_KILLED_WRITER = """
import os, signal, sys
from saev_fixtures import saev_plan
from test_saev_store import batches, make_acts, make_metadata
from actstore.formats.registry import get_format
plan, options = saev_plan(make_metadata(), has_tokens=True)
writer = get_format("saev").open_writer(plan, sys.argv[1], options)
for i, batch in enumerate(batches(make_acts())):
    writer.write(batch)
    if i == 3:  # 16 examples: shards 0-2 finished (and queued for upload), 1 in the open one
        writer.sync()  # shards 0-2 committed (the commit stage would record them a moment later)
        os.kill(os.getpid(), signal.SIGKILL)
"""


def test_saev_writer_to_s3_resumes_exactly_after_kill_9(s3, tmp_path, monkeypatch):
    from saev_fixtures import saev_plan
    from test_saev_store import batches, make_metadata

    from actstore.formats.registry import get_format

    monkeypatch.setenv("ACTSTORE_CACHE", str(tmp_path / "cache"))  # staging goes under it
    plan, options = saev_plan(make_metadata(), has_tokens=True)
    acts = make_acts()
    url = s3.url("captures")
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    # a process of its own, forked from a helper that imported torch once (tests/forked.py)
    done = run_python("-c", _KILLED_WRITER, url, env=env, text=False)
    assert done.returncode == -9, done.stderr.decode()[-2000:]
    assert not any(k.endswith((MANIFEST, "metadata.json")) for k in s3.keys("captures/"))
    resumed = get_format("saev").open_writer(plan, url, options)
    assert resumed.resume_from == 15
    for batch in batches(acts, start=12):
        resumed.write(batch)
    resumed.sync()  # the finished shards committed and queued for upload
    reference = write_store(tmp_path / "ref", acts)
    shard3 = f"captures/{reference.name}/acts000003.bin"
    for _ in range(300):  # the finished shard goes up in the background, before close()
        if shard3 in s3.keys("captures/"):
            break
        time.sleep(0.1)
    assert shard3 in s3.keys("captures/")
    published = resumed.close()
    assert published == f"{url}/{reference.name}"
    assert not resumed.staging.exists()
    remote = open_files(published)
    assert remote.list() == {p.name: p.stat().st_size for p in reference.iterdir()}
    for f in reference.iterdir():
        assert remote.read_bytes(f.name) == f.read_bytes(), f.name
    again = get_format("saev").open_writer(plan, url, options)
    assert again.complete and again.close() == published


def test_cli_capture_saev_straight_to_s3(s3, model_dir, text_file, tmp_path, monkeypatch):
    monkeypatch.setenv("ACTSTORE_CACHE", str(tmp_path / "cache"))  # staging goes under it
    args = ["capture", "--model", str(model_dir("gpt2")), "--dataset", str(text_file)]
    args += ["--layers", "0,-1", "--context-length", "8", "--max-examples", "12"]
    result = CliRunner().invoke(app, [*args, "--out", s3.url("cap"), "--no-progress"])
    assert result.exit_code == 0, result.output
    reader = open_store(next(line.strip() for line in result.output.split() if "s3://" in line))
    assert isinstance(reader, SaevReader) and not reader.location.is_local and reader.verify().ok
    local = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "here"), "--no-progress"])
    assert local.exit_code == 0, local.output
    here = SaevReader(next((tmp_path / "here").iterdir()))
    assert reader.files.list() == {p.name: p.stat().st_size for p in here.path.iterdir()}
    np.testing.assert_allclose(reader[:], here[:], rtol=0, atol=1e-6)


def test_pickle_writer_to_s3_resumes_and_publishes_only_when_complete(s3, tmp_path):
    from test_pickle_store import PER_SHARD

    from actstore.formats.pickle import PickleOptions, PickleWriter
    from actstore.formats.staged import StagedWriter
    from actstore.testing import make_acts as make_plan_acts
    from actstore.testing import make_batches

    plan = make_plan()
    batches = make_batches(plan, make_plan_acts(plan))
    url, staging = s3.url("pk"), tmp_path / "staging"

    def make(directory):
        return PickleWriter(plan, Path(directory), PickleOptions(samples_per_shard=PER_SHARD))

    crashed = StagedWriter(url, make, staging=staging)
    for batch in batches[:3]:
        crashed.write(batch)
    crashed.abort()
    # Finished shards may already be up (background upload); nothing a reader opens, no lock.
    assert set(s3.keys("pk/")) <= {"pk/shard_0001.pkl.gz", "pk/shard_0002.pkl.gz"}
    with pytest.raises(StoreNotFoundError):
        open_store(url)
    resumed = StagedWriter(url, make, staging=staging)
    assert resumed.resume_from == 10 and not resumed.complete
    for batch in batches:
        resumed.write(batch)
    assert resumed.close() == url and not staging.exists()
    reference, *_ = write_pickle(tmp_path / "ref", plan)
    remote = open_store(url)
    assert isinstance(remote, PickleReader) and remote.verify().ok
    for name in (f"shard_{i:04d}.pkl.gz" for i in range(1, 6)):
        assert remote.files.read_bytes(name) == (reference / name).read_bytes(), name
    again = StagedWriter(url, make, staging=staging)
    assert again.complete and again.close() == url


def test_cp_mistakes_give_one_line_and_exit_2(s3, saev_local, tmp_path):
    local, _ = saev_local
    env = {**os.environ, "PYTHONPATH": pythonpath(), "TQDM_DISABLE": "1"}

    def cp(*args):
        # a process of its own, forked from a helper that imported torch once (tests/forked.py)
        return run_actstore("cp", *args, env=env, timeout=None)

    for args, message in (
        ((tmp_path / "nothing", s3.url("x")), "holds no files; check the source location"),
        ((local, "s3://no-such-bucket/x"), "bucket 'no-such-bucket' does not exist"),
        ((local, s3.url("x"), "--part-mb", "1"), "part_bytes must be >= 5 MiB"),
    ):
        proc = cp(*args)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


# --------------------------------------------------------------- identity on s3:// (issue 38)

#: format -> capture options; saev names its store under the URL by its record, the
#: others write theirs at the URL (zarr: URL/activations.zarr)
S3_FORMATS = {
    "saev": (),
    "pickle": ("--format", "pickle"),
    "saelens": ("--format", "saelens"),
    "zarr": ("--format", "zarr"),
    "activault": ("--format", "activault"),
}


@pytest.mark.slow
@pytest.mark.parametrize("fmt", list(S3_FORMATS))
def test_s3_out_answers_only_the_same_capture(s3, model_dir, tmp_path, fmt):
    """What is at ``--out s3://...`` answers "Already captured" only for its own record, as
    on a local disk: after a corpus edit, or with another model and layer at the same URL,
    saev captures anew beside it and every other format refuses in one line saying what
    differs, its store left as it was (``inspect`` still shows the model it holds)."""
    env = {
        **os.environ,
        "ACTSTORE_CACHE": str(tmp_path / "cache"),
        "TQDM_DISABLE": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": pythonpath(),
    }
    data, url = tmp_path / "tokens.npy", s3.url("acts")
    np.save(data, np.random.default_rng(0).integers(4, 300, size=(6, 16)))

    def capture(model: str = "gpt2", layer: str = "1"):
        args = ["capture", "--model", str(model_dir(model)), "--dataset", str(data)]
        args += ["--layers", layer, "--context-length", "16", "--batch-size", "2"]
        args += ["--out", url, "--no-progress", *S3_FORMATS[fmt]]
        return run_actstore(*args, env=env, timeout=300)

    def one_error_line(proc) -> str:
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
        return line

    first = capture()
    assert first.returncode == 0, first.stderr
    again = capture()
    assert again.returncode == 0 and "Already captured" in again.stdout, again.stderr
    held = s3.keys("acts/")
    ids = np.load(data)
    ids[3, 5] = 7 if ids[3, 5] != 7 else 8
    np.save(data, ids)
    edited = capture()
    other = capture("llama", "2")
    assert "Already captured" not in edited.stdout + other.stdout
    if fmt == "saev":  # named under the URL: each capture its own store
        assert edited.returncode == 0 and other.returncode == 0, edited.stderr + other.stderr
        stores = {k.split("/")[1] for k in s3.keys("acts/") if k.endswith(MANIFEST)}
        assert len(stores) == 3
        return
    assert "the data changed (the digest of its token ids" in one_error_line(edited)
    line = one_error_line(other)
    assert "another model" in line and "other sites (resid.1 there, resid.2 now)" in line
    assert s3.keys("acts/") == held
    shown = run_actstore("inspect", url, env=env, timeout=300)
    assert shown.returncode == 0 and str(model_dir("gpt2")) in shown.stdout, shown.stderr


@pytest.mark.slow
def test_the_local_s3_server_recipe_runs(tmp_path):
    """docs/s3.md's recipe, run as it is written: the suite's S3 server on its own, a
    bucket, a capture of the embedded model to it, listed back."""
    import subprocess
    import sys

    text = (Path(__file__).resolve().parents[1] / "docs" / "s3.md").read_text()
    block = text.split("<!-- s3-test-server -->\n```bash\n", 1)[1].split("```", 1)[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}
    env.update(
        PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""),
        PYTHONPATH=pythonpath(),
        ACTSTORE_CACHE=str(tmp_path / "cache"),
        TQDM_DISABLE="1",
        HF_HUB_OFFLINE="1",
    )
    proc = subprocess.run(
        ["bash", "-e", "-c", block],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    captured, listed = proc.stdout.split("python -c", 1)  # capture's last line, then ls
    assert "Captured 16 examples" in captured
    listed = listed.split("\n", 1)[1]
    assert "s3://acts/minilm" in listed and "saelens" in listed.lower(), proc.stdout
