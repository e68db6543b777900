"""Zarr prompt/response stores on the loopback S3 server: the reader over ranged GETs (exact
values, only the chunks it needs, checksums checked), the loader exactly once, ``actstore
cp``/``ls``/``inspect``/``verify``, capture straight to ``s3://`` resuming after ``kill -9``,
and zarr-python reading the store on S3 through obstore."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from forked import pythonpath, run_actstore, run_python
from test_zarr_store import (
    SITES,
    H,
    N,
    SyntheticBatches,
    expected,
    layout,
    write_store,
    zarr_options,
    zarr_plan,
)
from typer.testing import CliRunner

from actstore.cli import app
from actstore.errors import CorruptStoreError, StoreNotFoundError
from actstore.faults import CRASH_EXIT
from actstore.formats import open_store, verify_store
from actstore.formats.registry import get_format
from actstore.formats.staged import StagedWriter
from actstore.formats.zarr import ZarrReader, ZarrWriter, shard_ranges, write_manifest
from actstore.loader import ActivationLoader
from actstore.storage.copy import copy_store
from actstore.storage.files import open_files

PARTS = ("prompt", "response")


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> Path:
    return write_store(tmp_path_factory.mktemp("zarr") / "activations.zarr")


def upload(store: Path, url: str) -> None:
    report = copy_store(store, url, threads=4, check_store=verify_store)
    assert report.copied == report.files and report.skipped == 0


def gets(s3, since: int) -> list[str]:
    return [p for m, p, _ in s3.faults.requests[since:] if m == "GET"]


def local_files(store: Path) -> dict[str, int]:
    return {
        p.relative_to(store).as_posix(): p.stat().st_size for p in store.rglob("*") if p.is_file()
    }


def make_run(run: Path, n_shards: int) -> Path:
    """A sharded run of the synthetic samples, written in this process."""
    for index in range(n_shards):
        writer = ZarrWriter.for_shard(zarr_plan(), run, index, n_shards, zarr_options())
        for batch in SyntheticBatches()(*writer.example_range):
            writer.write(batch)
        writer.close()
    write_manifest(run)
    return run


def test_reader_over_s3_matches_the_local_reader(s3, local):
    url = s3.url("acts", "activations.zarr")
    upload(local, url)
    remote, here = open_store(url), ZarrReader(local)
    assert isinstance(remote, ZarrReader) and not remote.location.is_local
    assert remote.url == f"{url}" and remote.layout == here.layout
    assert [str(s) for s in remote.sites] == list(SITES)
    lay = layout()
    for i in range(N):
        for k, site in enumerate(SITES):
            for part in PARTS:
                got = remote.read(i, site, part)
                np.testing.assert_array_equal(got, expected(i, k, part, lay))
                padded = remote.read(i, site, part, trim=False)
                np.testing.assert_array_equal(padded, here.read(i, site, part, trim=False))
    samples, layers = np.array([3, 9, 0]), np.array([[0, 2], [1, 0], [2, 1]])
    for a, b in zip(
        remote.read_batch_index(samples, layers, "response"),
        here.read_batch_index(samples, layers, "response"),
    ):
        np.testing.assert_array_equal(a, b)
    for site in SITES:
        assert remote.blocks(site) == here.blocks(site)
        for block in remote.blocks(site):
            np.testing.assert_array_equal(remote.read_block(block), here.read_block(block))
        assert remote.statistics(site).to_dict() == here.statistics(site).to_dict()
    assert remote.sample_keys == here.sample_keys
    assert remote.array("hallu_label").tolist() == [i % 2 for i in range(N)]
    assert remote.array("no_such_array") is None
    assert remote.token_ids(2, "prompt").tolist() == list(range(20, 28))
    assert [remote.text(i, "response") for i in range(N)] == [f"response {i}" for i in range(N)]
    assert remote.text(N - 1, "prompt") == f"prompt {N - 1}"
    described, there = remote.describe(), here.describe()
    assert (described["files"], described["bytes"]) == (there["files"], there["bytes"])
    report, ref = remote.verify(), here.verify()
    assert report.ok, report.faults
    assert (report.files_checked, report.bytes_checked) == (ref.files_checked, ref.bytes_checked)
    # The folder holding activations.zarr opens too, as on disk.
    assert open_store(s3.url("acts")).layout == here.layout


def test_one_sample_layer_costs_one_ranged_get_per_chunk(s3, local):
    url = s3.url("acts")
    upload(local, url)
    reader = ZarrReader(url)
    start = len(s3.faults.requests)
    reader.read(8, "resid.3", "prompt")  # 6 tokens, chunks of 3: chunks 0 and 1
    reader.read(8, "resid.3", "response")  # 6 stored tokens: the one chunk
    bucket = f"/{s3.bucket}/acts/"
    assert [m for m, _, _ in s3.faults.requests[start:]] == ["GET"] * 3
    assert [p.removeprefix(bucket) for p in gets(s3, start)] == [
        "arrays/prompt_activations/8.1.0.0",
        "arrays/prompt_activations/8.1.1.0",
        "arrays/response_activations/8.1.0.0",
    ]
    start = len(s3.faults.requests)
    reader.read(1, "resid.1", "prompt")  # 1 token: a partly needed chunk, fetched whole once
    assert len(gets(s3, start)) == 1


def test_reader_refuses_a_prefix_without_its_manifest(s3, local, tmp_path):
    url = s3.url("partial")
    upload(local, url)
    s3.client().delete_object(Bucket=s3.bucket, Key="partial/.zmetadata")
    with pytest.raises(StoreNotFoundError, match=r"no \.zmetadata, written last"):
        ZarrReader(url)
    with pytest.raises(StoreNotFoundError, match="no .zmetadata") as err:
        open_store(url)  # ours by its .zattrs: the reader says what is missing
    assert "\n" not in str(err.value)
    with pytest.raises(StoreNotFoundError, match="not an actstore-readable store"):
        open_store(s3.url("nothing-here"))
    # A copy still under way (one that sent .zmetadata early) is refused, not read as zeros.
    assert copy_store(local, url).copied == 1
    s3.client().delete_object(Bucket=s3.bucket, Key="partial/arrays/response_activations/3.1.0.0")
    with pytest.raises(
        StoreNotFoundError, match="response_activations holds 29 of the 30 chunk files"
    ):
        ZarrReader(url)
    # A sharded run without its manifest.json.
    run = make_run(tmp_path / "run", 2)
    upload(run, s3.url("run"))
    assert len(ZarrReader(s3.url("run")).stores) == 2
    s3.client().delete_object(Bucket=s3.bucket, Key="run/manifest.json")
    with pytest.raises(StoreNotFoundError, match="has shards but no manifest.json"):
        ZarrReader(s3.url("run"))


def test_sharded_run_on_s3_reads_like_the_local_run(s3, tmp_path):
    run = make_run(tmp_path / "run", 3)
    upload(run, s3.url("run"))
    remote, here = ZarrReader(s3.url("run")), ZarrReader(run)
    assert len(remote.stores) == len(shard_ranges(N, 3)) and remote.manifest == here.manifest
    for i in range(N):
        for part in PARTS:
            np.testing.assert_array_equal(
                remote.read_index(i, 2, part), here.read_index(i, 2, part)
            )
    assert remote.array("hallu_label").tolist() == here.array("hallu_label").tolist()
    assert remote.statistics("resid.1").to_dict() == here.statistics("resid.1").to_dict()
    assert remote.verify().ok


def test_loader_over_s3_serves_every_row_exactly_once(s3, local):
    url = s3.url("acts")
    upload(local, url)
    here = ZarrReader(local)
    loader = ActivationLoader(
        url, sites=("resid.1", "mlp_out.3"), batch_size=7, pool_blocks=3, return_index=True
    )
    acts, rows = zip(*[(b.acts, b.rows) for b in loader])
    acts, rows = torch.cat(acts).numpy(), torch.cat(rows).numpy()
    stored = {
        site: np.concatenate([here.read_block(b) for b in here.blocks(site)])
        for site in ("resid.1", "mlp_out.3")
    }
    assert sorted(rows.tolist()) == list(range(len(stored["resid.1"])))
    np.testing.assert_array_equal(acts[:, 0], stored["resid.1"][rows])
    np.testing.assert_array_equal(acts[:, 1], stored["mlp_out.3"][rows])


def test_second_epoch_comes_from_the_cache_tier(s3, local, tmp_path):
    url = s3.url("cached")
    upload(local, url)
    here = ZarrReader(local)
    reader = ZarrReader(url, cache_dir=tmp_path / "cache")
    blocks = reader.blocks("resid.3")
    start = len(s3.faults.requests)
    for block in blocks:
        reader.read_block(block)
    fetched = len(gets(s3, start))
    assert fetched >= len(blocks)
    for block in blocks:  # the second epoch: no request reaches the server
        np.testing.assert_array_equal(reader.read_block(block), here.read_block(block))
    assert len(gets(s3, start)) == fetched and reader.files.cache.stats.hits >= len(blocks)


def test_reads_survive_connection_resets_through_the_proxy(s3_proxy, local):
    url = s3_proxy.url("acts")
    upload(local, url)
    reader, here = ZarrReader(url), ZarrReader(local)
    s3_proxy.proxy.reset_connections(times=3, after_bytes=200)
    for block in reader.blocks("mlp_out.3"):
        np.testing.assert_array_equal(reader.read_block(block), here.read_block(block))
    assert reader.files.store.retries >= 1


def test_cp_both_ways_then_cli_ls_inspect_verify(s3, local, tmp_path):
    url = s3.url("copy")
    runner = CliRunner()
    result = runner.invoke(app, ["cp", str(local), url, "--no-progress"])
    assert result.exit_code == 0, result.output
    assert s3.keys("copy/") == {f"copy/{n}": size for n, size in local_files(local).items()}
    for command in (["ls", url], ["inspect", url]):
        result = runner.invoke(app, command)
        assert result.exit_code == 0, result.output
        assert "zarr v2 prompt/response store" in result.output, result.output
    result = runner.invoke(app, ["verify", url, "--no-progress"])
    assert result.exit_code == 0 and "OK:" in result.output, result.output
    back = tmp_path / "back"
    result = runner.invoke(app, ["cp", url, str(back), "--no-progress"])
    assert result.exit_code == 0, result.output
    for name in local_files(local):
        assert (back / name).read_bytes() == (local / name).read_bytes(), name
    assert copy_store(local, s3.url("copy2"), check_store=verify_store).copied == len(
        local_files(local)
    )


def test_a_flipped_byte_on_s3_fails_the_read_and_verify(s3, local):
    url = s3.url("flip")
    upload(local, url)
    key = "flip/arrays/prompt_activations/4.2.1.0"
    data = bytearray(s3.client().get_object(Bucket=s3.bucket, Key=key)["Body"].read())
    data[5] ^= 0x10
    s3.client().put_object(Bucket=s3.bucket, Key=key, Body=bytes(data))
    reader = ZarrReader(url)
    with pytest.raises(CorruptStoreError, match=r"4\.2\.1\.0 .*is not the chunk published there"):
        reader.read(4, "mlp_out.3", "prompt")
    np.testing.assert_array_equal(
        reader.read(4, "mlp_out.3", "response"), ZarrReader(local).read_index(4, 2, "response")
    )
    report = reader.verify()
    assert not report.ok
    assert any("4.2.1.0" in f and "not the chunk" in f for f in report.faults), report.faults
    assert any("sample 4 does not match its stored digest" in f for f in report.faults)
    result = CliRunner().invoke(app, ["verify", url, "--no-progress"])
    assert result.exit_code != 0 and "4.2.1.0" in result.output


_KILLED_WRITER = """
import sys
from test_zarr_store import SyntheticBatches, zarr_options, zarr_plan
from actstore.formats.registry import get_format
writer = get_format("zarr").open_writer(zarr_plan(), sys.argv[1], zarr_options())
for batch in SyntheticBatches()(0, 11):
    writer.write(batch)
# dies once its second shard is recorded (ACTSTORE_CRASH_AT), on the commit stage: wait for
# it (the script's end would not: a shard still queued there was left unrecorded)
writer.sync()
"""


def _open(url: str) -> StagedWriter:
    writer = get_format("zarr").open_writer(zarr_plan(), url, zarr_options())
    assert isinstance(writer, StagedWriter)
    return writer


def test_writer_to_s3_resumes_exactly_after_kill_9(s3, local, tmp_path, monkeypatch):
    monkeypatch.setenv("ACTSTORE_CACHE", str(tmp_path / "cache"))  # staging goes under it
    url = s3.url("captures")
    env = {
        **os.environ,
        "PYTHONPATH": pythonpath(),
        "ACTSTORE_CRASH_AT": "zarr.shard_recorded:2",
    }
    # a process of its own, forked from a helper that imported torch once (tests/forked.py)
    done = run_python("-c", _KILLED_WRITER, url, env=env, timeout=300, text=False)
    assert done.returncode == CRASH_EXIT, done.stderr.decode()[-2000:]
    # sealed shards may be up already (background upload), the store is not published
    assert not any(k.endswith(".zmetadata") for k in s3.keys("captures/"))
    resumed = _open(url)
    assert resumed.resume_from == 8 and not resumed.complete  # two shards of 4 recorded
    sealed = resumed.inner.sealed_files()
    assert sealed and all(Path(p).is_file() for _, p in sealed)
    names = {name for name, _ in sealed}
    assert "activations.zarr/arrays/prompt_activations/7.2.2.0" in names
    assert not any(n.split("/")[-1].startswith("8.") for n in names)  # not yet recorded
    for name, path in sealed:
        published = local / name.removeprefix("activations.zarr/")
        assert Path(path).read_bytes() == published.read_bytes(), name
    start = len(s3.faults.requests)
    for batch in SyntheticBatches()(resumed.resume_from, N):
        resumed.write(batch)
    assert resumed.close() == f"{url}/activations.zarr"
    assert not (resumed.staging / "activations.zarr").exists()
    puts = [p for m, p, _ in s3.faults.requests[start:] if m == "PUT"]
    assert puts[-1].endswith("/activations.zarr/actstore-manifest.json")  # published last
    remote = ZarrReader(url)
    assert remote.verify().ok
    want = local_files(local)
    assert open_files(f"{url}/activations.zarr").list() == want
    for name in want:  # every file but the creation time and the files recording it
        if name not in (".zattrs", ".zmetadata", "actstore-manifest.json"):
            got = open_files(f"{url}/activations.zarr").read_bytes(name)
            assert got == (local / name).read_bytes(), name
    again = _open(url)
    assert again.complete  # published: nothing is staged or written again
    assert again.close() == f"{url}/activations.zarr"


def test_unfinished_upload_is_resumed_and_publishes_the_manifest_last(
    s3, local, tmp_path, monkeypatch
):
    """A capture killed while uploading: its staged store is published locally; the rerun
    sends only what is missing, ``.zmetadata`` then the root manifest after everything."""
    monkeypatch.setenv("ACTSTORE_CACHE", str(tmp_path / "cache"))
    url = s3.url("up")
    writer = _open(url)
    for batch in SyntheticBatches()(0, N):
        writer.write(batch)
    writer.inner.close()  # published in staging, then stopped before the upload finished
    writer.abort()  # (its background uploads stop; the staged store stays)
    staged = writer.staging / "activations.zarr"
    sent = sorted(local_files(local))[5:15]
    client = s3.client()
    for name in sent:
        client.put_object(
            Bucket=s3.bucket, Key=f"up/activations.zarr/{name}", Body=(staged / name).read_bytes()
        )
    with pytest.raises(StoreNotFoundError):
        ZarrReader(url)
    present = {k.split("/activations.zarr/")[1] for k in s3.keys("up/activations.zarr/")}
    rerun = _open(url)
    assert rerun.complete is True and rerun.resume_from == N  # staged store is whole
    start = len(s3.faults.requests)
    assert rerun.close() == f"{url}/activations.zarr"
    puts = [
        p.split("/activations.zarr/")[1] for m, p, _ in s3.faults.requests[start:] if m == "PUT"
    ]
    assert sorted(puts) == sorted(set(local_files(local)) - present)
    assert puts[-2:] == [".zmetadata", "actstore-manifest.json"]
    assert ZarrReader(url).verify().ok


def test_a_url_ending_in_zarr_is_the_store_itself(s3, local, tmp_path, monkeypatch):
    monkeypatch.setenv("ACTSTORE_CACHE", str(tmp_path / "cache"))  # staging goes under it
    url = s3.url("named.zarr")
    writer = _open(url)
    assert writer.staging.name == "named.zarr"
    assert writer.staging.is_relative_to(tmp_path / "cache")
    for batch in SyntheticBatches()(0, N):
        writer.write(batch)
    assert writer.close() == url and not writer.staging.exists()
    assert sorted(s3.keys("named.zarr/")) == sorted(f"named.zarr/{n}" for n in local_files(local))
    reader = open_store(url)
    assert reader.url == url and reader.verify().ok
    np.testing.assert_array_equal(reader.read(2, "resid.3"), ZarrReader(local).read(2, "resid.3"))
    assert _open(url).complete


QA = [
    {"prompt": "What is the capital of France?", "response": "Paris is."},
    {"prompt": "Name a color.", "response": "Blue, like the sky on a clear day."},
    {"prompt": "Two plus two?", "response": "Four."},
    {"prompt": "Say hello in a long sentence please.", "response": "Hello there."},
    {"prompt": "Count to three.", "response": "One two three."},
]


@pytest.mark.slow
def test_cli_capture_straight_to_s3_resumes_after_kill_9(s3, model_dir, tmp_path):
    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps(r) + "\n" for r in QA), encoding="utf-8")
    args = ["capture", "--model", str(model_dir("gpt2")), "--dataset", str(qa)]
    args += ["--layers", "0,2", "--format", "zarr", "--mode", "prompt-response"]
    args += ["--opt", "r_max=6", "--batch-size", "2", "--no-progress"]
    url = s3.url("cap")
    env = {
        **os.environ,
        "PYTHONPATH": pythonpath(),
        "TQDM_DISABLE": "1",
        "ACTSTORE_CACHE": str(tmp_path / "cache"),  # staging goes under it
    }

    def cli(*extra: str, crash: str | None = None) -> subprocess.CompletedProcess:
        run_env = {**env, "ACTSTORE_CRASH_AT": crash} if crash else env
        # a process of its own, forked from a helper that imported torch once (tests/forked.py)
        return run_actstore(*args, *extra, env=run_env, timeout=300)

    killed = cli("--out", url, crash="zarr.published")  # whole store staged, not published
    assert killed.returncode == CRASH_EXIT, killed.stderr[-2000:]
    # sealed shards may be up (background upload); the index and root manifest are not
    keys = set(s3.keys("cap/"))
    assert "cap/activations.zarr/.zmetadata" not in keys
    assert "cap/activations.zarr/actstore-manifest.json" not in keys
    done = cli("--out", url)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"{url}/activations.zarr" in done.stdout + done.stderr
    reader = open_store(url)
    assert isinstance(reader, ZarrReader) and not reader.location.is_local and reader.verify().ok
    here_out = tmp_path / "here"
    assert cli("--out", str(here_out)).returncode == 0
    here = ZarrReader(here_out)
    assert reader.layout == here.layout and len(reader) == len(QA)
    for i in range(len(QA)):
        for site in reader.sites:
            for part in PARTS:
                np.testing.assert_array_equal(reader.read(i, site, part), here.read(i, site, part))
    assert open_files(reader.url).list() == local_files(here.path)
    again = cli("--out", url)
    assert again.returncode == 0 and "Already captured" in again.stdout + again.stderr


def test_zarr_python_reads_the_store_on_s3_through_obstore(s3, local):
    obstore = pytest.importorskip("obstore.store")
    import zarr
    from zarr.storage import ObjectStore

    upload(local, s3.url("peer", "activations.zarr"))
    remote = obstore.S3Store(
        s3.bucket,
        prefix="peer/activations.zarr",
        endpoint=os.environ["S3_ENDPOINT_URL"],
        region="us-east-1",
        access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
        secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
        client_options={"allow_http": True},
    )
    root = zarr.open_consolidated(ObjectStore(remote, read_only=True), mode="r", zarr_format=2)
    assert root.attrs["format"] == "actstore-zarr-logger"
    prompt, response = root["arrays/prompt_activations"], root["arrays/response_activations"]
    assert prompt.shape == (N, len(SITES), 8, H) and prompt.dtype == np.float16
    p_len, r_len = root["arrays/prompt_len"][:], root["arrays/response_len"][:]
    lay = layout()
    for i in range(N):
        for k in range(len(SITES)):
            np.testing.assert_array_equal(prompt[i, k, : p_len[i]], expected(i, k, "prompt", lay))
            np.testing.assert_array_equal(
                response[i, k, : r_len[i]], expected(i, k, "response", lay)
            )
            assert not prompt[i, k, p_len[i] :].any() and not response[i, k, r_len[i] :].any()
    assert root["arrays/hallu_label"][:].tolist() == [i % 2 for i in range(N)]
