"""saelens stores on the loopback S3 server: the reader over ranged GETs of just a block's
values, random access, the manifest, the loader exactly once, verify, ``actstore cp`` both
ways (sae_lens trains from the downloaded copy), and captures straight to ``s3://`` that
resume exactly after ``kill -9``."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from forked import pythonpath, run_actstore, run_python
from test_saelens import files, rows, sae_lens_store, unverified_warnings
from typer.testing import CliRunner

from actstore.cli import app
from actstore.errors import CorruptStoreError, StoreNotFoundError
from actstore.formats import open_store, verify_store
from actstore.formats.journal import recorded_shards
from actstore.formats.registry import get_format
from actstore.formats.saelens import SaelensOptions, SaelensReader, SaelensWriter
from actstore.formats.staged import StagedWriter
from actstore.loader import ActivationLoader
from actstore.sites import Site
from actstore.storage.copy import copy_store
from actstore.storage.files import open_files
from actstore.storage.manifest import BLOCKS, MANIFEST
from actstore.testing import make_acts, make_batches, make_plan

OPTIONS = SaelensOptions(examples_per_shard=10, block_kb=1)  # 3 files, blocks of 5 examples
FILE1 = "data-00001-of-00003.arrow"


def write_local(directory: Path, plan=None, acts=None) -> tuple[Path, dict[str, np.ndarray]]:
    plan = plan or make_plan()
    acts = make_acts(plan) if acts is None else acts
    writer = SaelensWriter.from_plan(plan, directory, OPTIONS)
    for batch in make_batches(plan, acts):
        writer.write(batch)
    return writer.close(), acts


@pytest.fixture
def local(tmp_path):
    return write_local(tmp_path / "local")


def upload(store: Path, url: str) -> None:
    report = copy_store(store, url, threads=4, check_store=verify_store)
    assert report.copied == report.files and "SaelensReader.verify()" in report.verified


def arrow_gets(s3, since: int) -> list[str]:
    return [p for m, p, _ in s3.faults.requests[since:] if m == "GET" and p.endswith(".arrow")]


def requests(s3, since: int) -> list[tuple[str, str]]:
    """``(method, file name)`` of each request to the server since request ``since``."""
    return [(m, p.rpartition("/")[2]) for m, p, _ in s3.faults.requests[since:]]


def open_writer(url: str, plan) -> StagedWriter:
    """What capture opens for an ``s3://`` output: the local writer, staged and uploaded."""
    writer = get_format("saelens").open_writer(plan, url, OPTIONS)
    assert isinstance(writer, StagedWriter)
    return writer


def test_reader_over_s3_matches_the_local_reader(s3, local):
    store, acts = local
    url = s3.url("acts", "sl")
    upload(store, url)
    remote, here = open_store(url), SaelensReader(store)
    assert isinstance(remote, SaelensReader) and not remote.location.is_local and remote.verified
    assert (remote.sites, remote.n_examples, remote.d_model) == (here.sites, 23, 8)
    for site in ("resid.1", "resid.3"):
        assert len(remote.blocks(site)) == len(here.blocks(site)) == 5
        for a, b in zip(remote.blocks(site), here.blocks(site)):
            np.testing.assert_array_equal(remote.read_block(a), here.read_block(b))
        block = remote.blocks(site)[2]
        out = np.zeros((block.n_rows, 8), dtype=np.float32)
        order = np.random.default_rng(0).permutation(block.n_rows)
        remote.read_block_scatter(block, out, order)
        np.testing.assert_array_equal(out[order], here.read_block(block))
        assert remote.statistics(site).to_dict() == here.statistics(site).to_dict()
    np.testing.assert_array_equal(np.asarray(remote.tokens), np.asarray(here.tokens))
    np.testing.assert_array_equal(remote[7, "resid.3"], acts["resid.3"][7])
    np.testing.assert_array_equal(remote[[21, 2, 7], "resid.1", 4], acts["resid.1"][[21, 2, 7], 4])
    np.testing.assert_array_equal(remote[3:14, :, 1:4], here[3:14, :, 1:4])
    np.testing.assert_array_equal(
        remote[3:14, :, 1:4], np.stack([acts["resid.1"], acts["resid.3"]], 1)[3:14, :, 1:4]
    )
    np.testing.assert_array_equal(remote[-1, 3, -1], acts["resid.3"][-1, -1])
    summary = remote.describe()
    assert summary["files"] == here.describe()["files"] and summary["path"] == url
    assert summary["bytes"] == here.describe()["bytes"]
    report = remote.verify()
    # 3 Arrow files, state, dataset_info, actstore.json, statistics, the root manifest's two
    assert report.ok and report.files_checked == here.verify().files_checked == 9


def test_one_row_costs_one_small_ranged_get(s3, local):
    store, acts = local
    url = s3.url("acts", "sl")
    upload(store, url)
    reader = SaelensReader(url)
    before = len(s3.faults.requests)
    np.testing.assert_array_equal(reader[13, "resid.3", 2], acts["resid.3"][13, 2])
    # one GET of the values, and (for the first check) one of every file's block digests
    assert sorted(requests(s3, before)) == sorted([("GET", FILE1), ("GET", BLOCKS)])
    before = len(s3.faults.requests)
    np.testing.assert_array_equal(reader[14, "resid.1", 2], acts["resid.1"][14, 2])
    assert requests(s3, before) == [("GET", FILE1)]
    before = len(s3.faults.requests)
    np.testing.assert_array_equal(
        reader[13, :], np.stack([acts["resid.1"][13], acts["resid.3"][13]])
    )
    assert requests(s3, before) == [("GET", FILE1)]  # every site of a row: one GET
    # A block is one GET of its values; the block digests came with the first check.
    before = len(s3.faults.requests)
    for block in reader.blocks("resid.1"):
        reader.read_block(block)
    got = requests(s3, before)
    assert len(got) == len(reader.blocks("resid.1")) == 5
    assert all(m == "GET" and n.endswith(".arrow") for m, n in got)


def test_reader_refuses_a_prefix_without_its_manifest(s3, local):
    store, _ = local
    url = s3.url("partial")
    upload(store, url)
    s3.client().delete_object(Bucket=s3.bucket, Key=f"partial/{FILE1}")
    with pytest.raises(
        StoreNotFoundError, match=f"{FILE1} is missing; restore it, finish the copy"
    ):
        SaelensReader(url)
    s3.client().delete_object(Bucket=s3.bucket, Key="partial/state.json")
    with pytest.raises(StoreNotFoundError, match=r"holds no saelens store \(no state.json\)"):
        SaelensReader(url)
    with pytest.raises(StoreNotFoundError, match="not an actstore-readable store"):
        open_store(url)
    result = CliRunner().invoke(app, ["inspect", url])
    assert result.exit_code != 0


def test_loader_over_s3_serves_every_row_exactly_once(s3, local):
    store, acts = local
    url = s3.url("acts", "sl")
    upload(store, url)
    loader = ActivationLoader(url, site="resid.3", batch_size=7, pool_blocks=3, return_index=True)
    xs, idx = zip(*[(b.acts.numpy(), b.rows.numpy()) for b in loader])
    got = np.concatenate(idx)
    assert sorted(got.tolist()) == list(range(23 * 6))
    np.testing.assert_array_equal(np.concatenate(xs), acts["resid.3"].reshape(-1, 8)[got])


def test_dataloader_workers_over_s3_share_a_cache(s3, local, tmp_path):
    """Forked workers (after the parent read a block: its client and threads must not be
    reused) serve every row once; the second epoch comes from the cache, no GET of data."""
    from actstore.loader import ActivationDataLoader

    store, _ = local
    url = s3.url("acts", "sl")
    upload(store, url)
    reader = SaelensReader(url, cache_dir=tmp_path / "cache")
    reader.read_block(reader.blocks("resid.1")[-1])
    options = {"site": "resid.1", "batch_size": 7, "pool_blocks": 2, "return_index": True}
    for epoch in range(2):
        before = len(s3.faults.requests)
        data = ActivationDataLoader(ActivationLoader(reader, **options), num_workers=2)
        got = np.concatenate([b.rows.numpy() for b in data])
        assert sorted(got.tolist()) == list(range(23 * 6))
        if epoch:
            assert arrow_gets(s3, before) == []


def test_reads_survive_connection_resets_through_the_proxy(s3_proxy, local):
    store, acts = local
    url = s3_proxy.url("acts", "sl")
    upload(store, url)
    reader, here = SaelensReader(url), SaelensReader(store)
    s3_proxy.proxy.reset_connections(times=3, after_bytes=200)
    for a, b in zip(reader.blocks("resid.3"), here.blocks("resid.3")):
        np.testing.assert_array_equal(reader.read_block(a), here.read_block(b))
    assert reader.files.store.retries >= 1
    np.testing.assert_array_equal(reader[[3, 20], "resid.1"], acts["resid.1"][[3, 20]])


def test_verify_and_reads_catch_a_flipped_byte_on_s3(s3, local):
    store, _ = local
    url = s3.url("flip")
    upload(store, url)
    record = json.loads((store / "actstore.json").read_text())
    at = record["files"][1]["values_at"][1][0]  # batch 1 of file 1, column resid.1
    data = bytearray((store / FILE1).read_bytes())
    data[at + 100] ^= 0x01
    s3.client().put_object(Bucket=s3.bucket, Key=f"flip/{FILE1}", Body=bytes(data))
    # the manifest block of those values: one record batch's values of one column
    ranges = json.loads((store / MANIFEST).read_text())["files"][FILE1]["ranges"]
    block, n = next((k, size) for k, (o, size) in enumerate(ranges) if o == at)
    assert n == 5 * 6 * 8 * 4  # 5 examples x 6 tokens x 8 dims of float32
    reader = SaelensReader(url)
    report = reader.verify()
    assert report.faults == [
        (
            f"{FILE1}: 1 block(s) differ from the manifest, first block {block} "
            f"(bytes {at}-{at + n}): the file was changed, damaged or replaced"
        )
    ]
    damaged = reader.blocks("resid.1")[3]  # file 1, batch 1, column 0
    assert damaged.loc == (1, 1, 0, 5, 0)
    with pytest.raises(
        CorruptStoreError,
        match=rf"{FILE1}: block {block} \(bytes {at}-{at + n}\) is not the block published there",
    ):
        reader.read_block(damaged)
    with pytest.raises(CorruptStoreError, match=f"block {block} "):
        reader[17, "resid.1"]  # random access reads (and checks) that batch too
    reader.read_block(reader.blocks("resid.3")[3])  # the other column of that batch is intact
    np.testing.assert_array_equal(reader[17, "resid.3"], SaelensReader(store)[17, "resid.3"])
    assert SaelensReader(url, verify_reads=False).read_block(damaged).shape == (30, 8)
    result = CliRunner().invoke(app, ["verify", url, "--no-progress"])
    assert result.exit_code != 0 and "differ from the manifest" in result.output


def test_cli_cp_both_ways_and_sae_lens_reads_the_download_exactly(s3, local, tmp_path):
    store, acts = local
    url = s3.url("cli", "sl")
    runner = CliRunner()
    result = runner.invoke(app, ["cp", str(store), url, "--no-progress"])
    assert result.exit_code == 0, result.output
    assert s3.keys("cli/sl/") == {f"cli/sl/{n}": len(b) for n, b in files(store).items()}
    result = runner.invoke(app, ["ls", url])
    assert result.exit_code == 0, result.output
    assert "SAELens activation cache" in result.output and "23 examples" in result.output
    assert "9 files, sites resid.1, resid.3" in result.output
    result = runner.invoke(app, ["inspect", url, "--json"])
    assert result.exit_code == 0 and json.loads(result.output)["n_examples"] == 23
    result = runner.invoke(app, ["verify", url, "--no-progress"])
    assert result.exit_code == 0 and "OK:" in result.output, result.output
    down = tmp_path / "down"
    result = runner.invoke(app, ["cp", url, str(down), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert files(down) == files(store)
    for site in ("resid.1", "resid.3"):
        column = f"blocks.{site[-1]}.hook_resid_post"
        theirs = sae_lens_store(down, column, 6, 8, batch=4)
        got = [theirs.get_raw_llm_batch() for _ in range(5)]
        values = torch.cat([a for a, _ in got]).numpy()
        np.testing.assert_array_equal(values, acts[site][:20].reshape(-1, 8))
        ids = torch.cat([t for _, t in got]).numpy()
        np.testing.assert_array_equal(ids, SaelensReader(store).tokens[:20].reshape(-1))


def test_convert_from_s3_to_a_local_saev_store(s3, local, tmp_path):
    from actstore.convert import convert

    store, acts = local
    url = s3.url("acts", "sl")
    upload(store, url)
    result = convert(url, tmp_path / "saev", to="saev", progress=False)
    assert result.lossless and result.verified
    saev = open_store(result.location)
    for layer in (1, 3):
        np.testing.assert_array_equal(rows(saev, layer), acts[f"resid.{layer}"].reshape(-1, 8))
    np.testing.assert_array_equal(np.asarray(saev.tokens), np.asarray(SaelensReader(store).tokens))


def test_a_cache_sae_lens_wrote_reads_from_s3_whole_files(s3, tmp_path, caplog):
    import datasets

    from actstore.formats.saelens import ColumnSite

    n, t, d = 9, 5, 6
    acts = np.random.default_rng(1).standard_normal((n, t, d)).astype(np.float32)
    ids = np.arange(n * t, dtype=np.int32).reshape(n, t)
    features = datasets.Features(
        {
            "blocks.2.hook_resid_post": datasets.Array2D(shape=(t, d), dtype="float32"),
            "token_ids": datasets.Sequence(datasets.Value(dtype="int32"), length=t),
        }
    )
    datasets.Dataset.from_dict(
        {"blocks.2.hook_resid_post": acts, "token_ids": ids}, features=features
    ).save_to_disk(str(tmp_path / "theirs"), num_shards=2)
    url = s3.url("theirs")
    # (no check_store: with no root manifest, there is nothing to verify the copy by)
    copy_store(tmp_path / "theirs", url, threads=4)
    with caplog.at_level(logging.WARNING):
        reader = open_store(url)
    assert unverified_warnings(caplog, url) == 1
    assert isinstance(reader, SaelensReader) and not reader.location.is_local
    assert not reader.verified and reader.sites == (Site("resid", 2),)
    assert not any(isinstance(s, ColumnSite) for s in reader.sites)
    np.testing.assert_array_equal(rows(reader, "resid.2"), acts.reshape(-1, d))
    np.testing.assert_array_equal(reader[[7, 1], "resid.2", 3], acts[[7, 1], 3])
    np.testing.assert_array_equal(np.asarray(reader.tokens), ids)
    # nothing to check its bytes against: verify fails, though both files parse
    report = reader.verify()
    assert not report.ok and report.files_checked == 2
    assert [f for f in report.faults if "no root manifest" not in f] == []


def test_cp_and_the_writer_put_the_manifest_last(s3, local, tmp_path, monkeypatch):
    """``actstore cp`` and a capture to s3:// both send ``state.json`` (what ``datasets``
    opens), then the root manifest, after every other file, so a prefix is openable (by
    sae_lens or actstore) only once it is whole."""
    monkeypatch.setenv("ACTSTORE_CACHE", str(tmp_path / "cache"))  # staging goes under it
    store, _ = local
    start = len(s3.faults.requests)
    result = CliRunner().invoke(app, ["cp", str(store), s3.url("order"), "--no-progress"])
    assert result.exit_code == 0, result.output
    puts = [p for m, p, _ in s3.faults.requests[start:] if m == "PUT"]
    assert [p.rpartition("/order/")[2] for p in puts[-2:]] == ["state.json", MANIFEST]
    assert len(puts) == len(files(store))  # each file once
    plan = make_plan()
    writer = open_writer(s3.url("captured"), plan)
    for batch in make_batches(plan, make_acts(plan)):
        writer.write(batch)
    assert "captured/state.json" not in s3.keys("captured/")
    writer.close()
    puts = [p for m, p, _ in s3.faults.requests[start:] if m == "PUT" and "/captured/" in p]
    assert [p.rpartition("/captured/")[2] for p in puts[-2:]] == ["state.json", MANIFEST]


def test_sealed_files_are_the_finished_arrow_files(tmp_path):
    plan = make_plan()
    batches = make_batches(plan, make_acts(plan))
    writer = SaelensWriter.from_plan(plan, tmp_path / "s", OPTIONS)
    assert writer.sealed_files() == []
    for batch in batches[:3]:  # 12 examples: file 0 done, file 1 open
        writer.write(batch)
    writer.sync()  # file 0 is sealed once its commit (fsync + journal line) is done
    partial = tmp_path / ".s.partial"
    assert writer.sealed_files() == [
        ("data-00000-of-00003.arrow", partial / "data-00000-of-00003.arrow")
    ]
    sealed = (partial / "data-00000-of-00003.arrow").read_bytes()
    writer.abort()
    again = SaelensWriter.from_plan(plan, tmp_path / "s", OPTIONS)
    assert [n for n, _ in again.sealed_files()] == ["data-00000-of-00003.arrow"]
    for batch in batches:
        again.write(batch)
    published = again.close()
    names = [f"data-0000{i}-of-00003.arrow" for i in range(3)]
    assert sorted(p.name for p in published.glob("data-*.arrow")) == names
    assert (published / names[0]).read_bytes() == sealed  # the resume kept the sealed file
    # published: nothing is left for an uploader to send early (the publish sends the rest)
    assert again.sealed_files() == []
    done = SaelensWriter.from_plan(plan, tmp_path / "s", OPTIONS)
    assert done.complete and done.sealed_files() == []


_KILLED_WRITER = """
import os, signal, sys
from actstore.testing import make_acts, make_batches, make_plan
from actstore.formats.registry import get_format
from actstore.formats.saelens import SaelensOptions
OPTIONS = SaelensOptions(examples_per_shard=10, block_kb=1)
plan = make_plan()
writer = get_format("saelens").open_writer(plan, sys.argv[1], OPTIONS)
for i, batch in enumerate(make_batches(plan, make_acts(plan))):
    writer.write(batch)
    if i == 3:  # 16 examples: file 0 finished, file 1 half written
        writer.sync()  # file 0 committed (the commit stage would record it a moment later)
        os.kill(os.getpid(), signal.SIGKILL)
"""


def test_writer_to_s3_resumes_exactly_after_kill_9(s3, tmp_path, monkeypatch):
    monkeypatch.setenv("ACTSTORE_CACHE", str(tmp_path / "cache"))  # staging goes under it
    plan = make_plan()
    url = s3.url("captures")
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    # a process of its own, forked from a helper that imported torch once (tests/forked.py)
    done = run_python("-c", _KILLED_WRITER, url, env=env, text=False)
    assert done.returncode == -9, done.stderr.decode()[-2000:]
    keys = s3.keys("captures/")
    assert not any(k.endswith(("state.json", MANIFEST)) for k in keys)  # not published

    resumed = open_writer(url, plan)
    assert resumed.resume_from == 10 and not resumed.complete
    assert [n for n, _ in resumed.inner.sealed_files()] == ["data-00000-of-00003.arrow"]
    for batch in make_batches(plan, make_acts(plan)):
        resumed.write(batch)
    assert resumed.close() == url and not resumed.staging.exists()
    reference, _ = write_local(tmp_path / "ref", plan)
    remote = open_files(url)
    assert remote.list() == {n: len(b) for n, b in files(reference).items()}
    for name, data in files(reference).items():
        assert remote.read_bytes(name) == data, name
    assert SaelensReader(url).verify().ok
    again = open_writer(url, plan)
    assert again.complete and again.close() == url


def capture_args(model: Path, text: Path, n: int, out: str) -> list[str]:
    args = ["capture", "--model", str(model), "--dataset", str(text), "--format", "saelens"]
    args += ["--sites", "resid.1,mlp_out.3", "--context-length", "8", "--batch-size", "2"]
    args += ["--max-examples", str(n), "--opt", "examples_per_shard=2", "--opt", "block_kb=1"]
    return [*args, "--out", out, "--no-progress"]


def test_cli_capture_saelens_straight_to_s3(s3, model_dir, text_file, tmp_path, monkeypatch):
    monkeypatch.setenv("ACTSTORE_CACHE", str(tmp_path / "cache"))  # staging goes under it
    url = s3.url("cap")
    runner = CliRunner()
    result = runner.invoke(app, capture_args(model_dir("gpt2"), text_file, 9, url))
    assert result.exit_code == 0, result.output
    here = tmp_path / "here"
    result = runner.invoke(app, capture_args(model_dir("gpt2"), text_file, 9, str(here)))
    assert result.exit_code == 0, result.output
    reader = open_store(url)
    assert isinstance(reader, SaelensReader) and not reader.location.is_local
    assert reader.verify().ok
    remote = open_files(url)
    assert remote.list() == {n: len(b) for n, b in files(here).items()}
    for name, data in files(here).items():
        assert remote.read_bytes(name) == data, name
    assert not list((tmp_path / "cache" / "staging").iterdir())


@pytest.mark.slow
def test_cli_capture_to_s3_killed_with_sigkill_resumes_exactly(s3, model_dir, text_file, tmp_path):
    url = s3.url("killed")
    env = {
        **os.environ,
        "TQDM_DISABLE": "1",
        "ACTSTORE_CACHE": str(tmp_path / "cache"),
        "PYTHONPATH": pythonpath(),
    }
    args = capture_args(model_dir("gpt2"), text_file, 60, url)

    def run():
        return subprocess.Popen(
            [sys.executable, "-m", "actstore", *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )

    def finished() -> int:  # staging/<destination hash>/.killed.partial
        found = list((tmp_path / "cache" / "staging").glob("*/.*.partial/progress.jsonl"))
        return recorded_shards(found[0].parent) if found else 0

    proc = run()
    deadline = time.monotonic() + 120
    while finished() < 3:
        assert proc.poll() is None, "finished before the kill:\n" + proc.stdout.read().decode()
        assert time.monotonic() < deadline, "capture made no progress"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not any(k.endswith("state.json") for k in s3.keys("killed/"))
    with pytest.raises(StoreNotFoundError):
        SaelensReader(url)
    # the killed run above is started as the console script is; the reruns are processes
    # of their own, forked from a helper that imported torch once (tests/forked.py)
    resumed = run_actstore(*args, env=env, timeout=300)
    log = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0 and "resuming at example" in log, log
    result = CliRunner().invoke(
        app, capture_args(model_dir("gpt2"), text_file, 60, str(tmp_path / "clean"))
    )
    assert result.exit_code == 0, result.output
    remote = open_files(url)
    reference = files(tmp_path / "clean")
    assert remote.list() == {n: len(b) for n, b in reference.items()}
    for name, data in reference.items():
        assert remote.read_bytes(name) == data, name
    reader = SaelensReader(url)
    assert reader.verify().ok and len(rows(reader, "resid.1")) == 60 * 8
