"""saev stores on gs:// (fake-gcs-server) and az:// (Azurite), both on 127.0.0.1: ``cp``
both ways, readers and the loader over the remote store equal to the local one, ``verify``
and ``ls`` through the CLI, and every format's writer (capture, convert) publishing
straight to the bucket under its write lock."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
import time

import numpy as np
import pytest
from forked import pythonpath, run_actstore, run_python
from test_saev_store import T, make_acts, write_store
from typer.testing import CliRunner

from actstore.cli import app
from actstore.errors import StoreLockedError
from actstore.formats import open_store, verify_store
from actstore.formats.saev import SaevReader
from actstore.formats.staged import StagedWriter
from actstore.loader import ActivationLoader
from actstore.storage.copy import copy_store
from actstore.storage.files import open_files
from actstore.storage.location import Location
from actstore.storage.object import LOCK_NAME, AzureConfig, GCSConfig
from actstore.testing import FormatCase
from actstore.testing import make_acts as make_acts_kit
from actstore.testing.emulators import free_port, make_bucket, start_gcs
from actstore.testing.s3 import FaultyProxy


@pytest.fixture(params=["gcs", "azure"])
def remote(request):
    """A fresh bucket on one emulator (a BucketEnv), its variables set."""
    return request.getfixturevalue(request.param)


@pytest.fixture
def saev_local(tmp_path):
    acts = make_acts()
    return write_store(tmp_path / "local", acts), acts


def assert_same_store(url: str, local) -> None:
    """The store at ``url`` opens as the one at ``local`` does, serves the same values in
    every block of every site, and passes its own full verify."""
    there, here = open_store(url), open_store(local)
    assert type(there) is type(here) and there.shape == here.shape
    for site in here.sites:
        for a, b in zip(there.blocks(site), here.blocks(site), strict=True):
            np.testing.assert_array_equal(there.read_block(a), here.read_block(b))
    assert there.verify().ok


def test_cp_up_read_verify_and_cp_down(remote, saev_local, tmp_path):
    local, acts = saev_local
    url = remote.url("acts", local.name)
    report = copy_store(local, url, threads=4, check_store=verify_store)
    names = {p.name: p.stat().st_size for p in local.iterdir()}
    assert (report.copied, report.skipped, report.files) == (len(names), 0, len(names))
    # no MD5 ETags on these backends: the format's own checks read the copy back
    assert report.verified.startswith(f"{len(names)} sizes, SaevReader.verify() of {url}: ")
    assert open_files(url).list() == dict(sorted(names.items()))
    remote_reader, here = open_store(url), SaevReader(local)
    assert isinstance(remote_reader, SaevReader) and remote_reader.location.url == url
    assert remote_reader.shape == here.shape
    np.testing.assert_array_equal(remote_reader[7, 5, 3], acts[7, 1, 3])
    np.testing.assert_array_equal(remote_reader[3:9, :, 1:4], acts[3:9, :, 1:4])
    rows = np.array([5, 130, 5, 0, 137])
    np.testing.assert_array_equal(remote_reader.gather(rows, 5), here.gather(rows, 5))
    assert remote_reader.verify().ok
    # a rerun sends nothing; a missing object is sent again
    again = copy_store(local, url, check_store=verify_store)
    assert (again.copied, again.skipped) == (0, len(names))
    # GCS lists each object's MD5: compared with the local bytes, nothing read back
    how = "" if remote.scheme == "gs" else " (read back)"
    assert again.verified.endswith(f"; {len(names)} files already there matched by content{how}")
    Location.parse(url).object_store()[0].delete(
        Location.parse(url).object_store()[1] + "/acts000002.bin"
    )
    again = copy_store(local, url, check_store=verify_store)
    assert (again.copied, again.skipped) == (1, len(names) - 1)
    # download: the same bytes
    back = tmp_path / "back" / local.name
    down = copy_store(url, back, part_bytes=5 << 20, check_store=verify_store)
    assert down.copied == len(names)
    for name in names:
        assert (back / name).read_bytes() == (local / name).read_bytes()
    # a same-sized file with other bytes at the destination is found and replaced, both ways
    damaged = bytearray((back / "acts000001.bin").read_bytes())
    damaged[100] ^= 1
    (back / "acts000001.bin").write_bytes(bytes(damaged))
    again = copy_store(url, back, check_store=verify_store)
    assert (again.copied, again.skipped) == (1, len(names) - 1)
    assert (back / "acts000001.bin").read_bytes() == (local / "acts000001.bin").read_bytes()
    store, prefix = Location.parse(url).object_store()
    store.put(f"{prefix}/acts000002.bin", bytes((local / "acts000002.bin").stat().st_size))
    again = copy_store(local, url, check_store=verify_store)
    assert (again.copied, again.skipped) == (1, len(names) - 1)
    assert open_files(url).read_bytes("acts000002.bin") == (local / "acts000002.bin").read_bytes()


def test_large_file_streams_up_in_parts(remote, tmp_path):
    src = tmp_path / "blob"
    src.mkdir()
    data = np.random.default_rng(1).integers(0, 255, 11 << 20, dtype=np.uint8).tobytes()
    (src / "big.bin").write_bytes(data)
    report = copy_store(src, remote.url("blob"), part_bytes=5 << 20)
    assert report.bytes_copied == len(data)
    out = bytearray(len(data))
    open_files(remote.url("blob")).read_range("big.bin", 0, len(data), out)
    assert bytes(out) == data


def test_loader_serves_every_row_exactly_once(remote, saev_local, tmp_path, monkeypatch):
    local, acts = saev_local
    url = remote.url("acts", local.name)
    copy_store(local, url, threads=4)
    monkeypatch.setenv("ACTSTORE_CACHE", str(tmp_path / "cache"))  # the cache tier too
    for _ in range(2):  # the second epoch from the cache
        loader = ActivationLoader(url, site=5, batch_size=16, pool_blocks=3, return_index=True)
        xs, rows = zip(*[(b.acts.numpy(), b.rows.numpy()) for b in loader])
        rows = np.concatenate(rows)
        assert sorted(rows.tolist()) == list(range(len(acts) * T))
        np.testing.assert_array_equal(
            np.concatenate(xs), acts[:, 1].reshape(-1, acts.shape[-1])[rows]
        )


def test_cli_cp_ls_verify(remote, saev_local, tmp_path):
    local, _ = saev_local
    url = remote.url("cli", local.name)
    runner = CliRunner()
    result = runner.invoke(app, ["cp", str(local), url, "--no-progress"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["ls", url])
    assert result.exit_code == 0, result.output
    assert "saev protocol 2.1" in result.output and "11 files" in result.output
    result = runner.invoke(app, ["ls", remote.url()])
    assert result.exit_code == 0 and "cli/" in result.output, result.output
    result = runner.invoke(app, ["verify", url, "--no-progress"])
    assert result.exit_code == 0 and "OK:" in result.output, result.output
    result = runner.invoke(app, ["cp", url, str(tmp_path / "down"), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert SaevReader(tmp_path / "down").verify().ok


@pytest.mark.parametrize("fmt", ["saev", "pickle", "saelens", "zarr", "activault"])
def test_every_format_is_written_straight_to_the_bucket(remote, fmt, tmp_path, monkeypatch):
    """A capture's writer pointed at gs:// or az:// publishes there what it publishes
    locally (the data byte for byte), releases its lock and drops its staged copy; opened
    again it has nothing to write."""
    monkeypatch.setenv("ACTSTORE_CACHE", str(tmp_path / "cache"))  # staging goes under it
    # the run's times fixed, so every write stamps the same (pickle's created_at is to the
    # second: a write that crossed a second the two local ones did not differed from them)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    case = FormatCase(fmt)
    plan = case.plan()
    batches = case.batches(plan, make_acts_kit(plan))
    local = case.write(tmp_path / "here", plan, batches)
    writer, given = case.open_writer(remote.url(fmt), plan, batches)
    for batch in given:
        writer.write(batch)
    url = str(writer.close())
    assert url.startswith(remote.url(fmt))
    if fmt != "activault":  # staged: what went up in the background is trusted by the
        # version its upload left; the closing copy sends the rest and reads nothing back
        assert isinstance(writer, StagedWriter) and writer.report is not None
        assert writer.report.skipped >= 1 and "read back" not in writer.report.verified
    assert_same_store(url, local)
    files, mine = open_files(url), open_files(local)
    assert set(files.list()) == set(mine.list())  # nothing added, nothing left out
    store, prefix = Location.parse(remote.url(fmt)).object_store()
    assert not [o.key for o in store.list(prefix + "/") if LOCK_NAME in o.key]  # released
    # byte for byte, but for what two local writes differ in (timings in metadata)
    twice = open_files(case.write(tmp_path / "twice", plan, batches))
    same = [n for n in mine.list() if mine.read_bytes(n) == twice.read_bytes(n)]
    assert len(same) >= len(mine.list()) - 4
    for name in same:
        assert files.read_bytes(name) == mine.read_bytes(name), name
    assert not list((tmp_path / "cache" / "staging").glob("*/*"))
    again, _ = case.open_writer(remote.url(fmt), plan, batches)
    assert again.complete and str(again.close()) == url


_KILLED = """
import os, signal, sys, time
from actstore.storage.files import open_files
from actstore.testing import FormatCase, make_acts

case = FormatCase("pickle", options={"samples_per_shard": 5})
plan = case.plan()
writer, batches = case.open_writer(sys.argv[1], plan, case.batches(plan, make_acts(plan)))
for batch in batches[:4]:
    writer.write(batch)
writer.sync()  # the finished shards committed and queued for upload
for _ in range(600):  # let the background upload send them
    if len([n for n in open_files(sys.argv[1]).list() if n.startswith("shard_")]) >= 2:
        break
    time.sleep(0.05)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_second_writer_is_refused_and_a_killed_one_resumes(remote, tmp_path, caplog):
    """The destination's write lock on these backends (conditional create): a second
    writer refused in one line naming the holder, the lock released by abort, and a
    capture killed with SIGKILL (its lock left behind) taken over and resumed to the same
    store."""
    case = FormatCase("pickle", options={"samples_per_shard": 5})
    plan = case.plan()
    batches = case.batches(plan, make_acts_kit(plan))
    url = remote.url("lk")
    first, _ = case.open_writer(url, plan, batches)
    with pytest.raises(StoreLockedError) as caught:
        case.open_writer(url, plan, batches)
    message = str(caught.value)
    assert f"pid {os.getpid()}" in message and "--break-lock" in message
    assert len(message.splitlines()) == 1
    store, prefix = Location.parse(url).object_store()
    assert store.size(f"{prefix}/{LOCK_NAME}") is not None  # held while writing
    first.abort()
    assert store.size(f"{prefix}/{LOCK_NAME}") is None
    env = {**os.environ, "PYTHONPATH": pythonpath(), "TQDM_DISABLE": "1"}
    env["ACTSTORE_CACHE"] = str(tmp_path / "cache")  # the killed capture stages here
    os.environ["ACTSTORE_CACHE"] = env["ACTSTORE_CACHE"]  # and so does its resumption
    try:
        done = run_python("-c", _KILLED, url, env=env, text=False)
        assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
        assert store.size(f"{prefix}/{LOCK_NAME}") is not None  # the dead holder's lock
        assert "metadata.json" not in open_files(url).list()
        sent = {o.key: o.version for o in store.list(f"{prefix}/") if "/shard_" in o.key}
        assert len(sent) >= 2
        with caplog.at_level(logging.WARNING, logger="actstore.storage.s3lock"):
            resumed, _ = case.open_writer(url, plan, batches)
        assert "that process is dead" in caplog.text
        assert resumed.resume_from > 0
        for batch in batches:
            resumed.write(batch)
        published = str(resumed.close())
    finally:
        del os.environ["ACTSTORE_CACHE"]
    now = {o.key: o.version for o in store.list(f"{prefix}/")}
    # GCS lists each object's MD5, so the shards the killed capture sent are kept (their
    # generations unchanged); Azure's listings say nothing of the bytes: sent again
    kept = [now[k] == v for k, v in sent.items()]
    assert all(kept) if remote.scheme == "gs" else not any(kept)
    reference = case.write(tmp_path / "ref", plan, batches)
    there, here = open_files(published), open_files(reference)
    assert set(there.list()) == set(here.list())
    for name in here.list():
        if name.startswith("shard_"):
            assert there.read_bytes(name) == here.read_bytes(name), name
    assert open_store(published).verify().ok


def test_cli_capture_and_convert_straight_to_the_bucket(
    remote, model_dir, text_file, saev_local, tmp_path
):
    env = {**os.environ, "PYTHONPATH": pythonpath(), "TQDM_DISABLE": "1"}
    env["ACTSTORE_CACHE"] = str(tmp_path / "cache")
    args = ["capture", "--model", str(model_dir("gpt2")), "--dataset", str(text_file)]
    args += ["--layers", "0", "--context-length", "8", "--max-examples", "6"]
    proc = run_actstore(*args, "--out", remote.url("cap"), env=env, timeout=None)
    assert proc.returncode == 0, proc.stderr[-2000:]
    here = run_actstore(*args, "--out", str(tmp_path / "here"), env=env, timeout=None)
    assert here.returncode == 0, here.stderr[-2000:]
    local = next((tmp_path / "here").iterdir())
    url = remote.url("cap", local.name)
    assert open_files(url).list() == open_files(local).list()
    np.testing.assert_array_equal(open_store(url)[:], open_store(local)[:])
    saev, _ = saev_local
    proc = run_actstore(
        "convert", saev, remote.url("conv"), "--to", "pickle", env=env, timeout=None
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert open_store(remote.url("conv")).verify().ok
    word = "bucket" if remote.scheme == "gs" else "container"
    for args, message in (
        (
            ("cp", saev, f"{remote.scheme}://no-such-bucket/x"),
            f"{word} 'no-such-bucket' does not exist",
        ),
        (("cp", saev, f"{remote.scheme}://acc@box/x"), f"give the {word} alone"),
        (("cp", saev, remote.url("x"), "--endpoint-url", "http://127.0.0.1:1"), "is for s3://"),
    ):
        proc = run_actstore(*args, env=env, timeout=None)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_reads_survive_connection_resets_through_the_proxy(remote, saev_local, monkeypatch):
    local, acts = saev_local
    server = remote.emulator
    if remote.scheme == "gs":
        # fake-gcs-server answers path-style reads only for the Host it was started with:
        # a server of its own, whose public host is the proxy
        port = free_port()
        proxy = FaultyProxy(port)
        server = start_gcs(port=port, public_host=f"127.0.0.1:{proxy.port}")
        make_bucket(server, remote.bucket)
    else:
        port = int(server.endpoint.split(":")[2].split("/")[0])
        proxy = FaultyProxy(port)
    try:
        for name, value in server.env.items():  # the server, through the proxy
            monkeypatch.setenv(name, value.replace(f":{port}", f":{proxy.port}"))
        url = remote.url("acts", local.name)
        proxy.reset_connections(times=2, after_bytes=100)  # uploads whose reply is cut
        copy_store(local, url, threads=4, check_store=verify_store)
        assert proxy.injected["reset"] == 2
        reader, here = SaevReader(url), SaevReader(local)
        proxy.reset_connections(times=3, after_bytes=200)
        for block in reader.blocks(5):
            np.testing.assert_array_equal(reader.read_block(block), here.read_block(block))
        np.testing.assert_array_equal(reader[[3, 20], 2], acts[[3, 20], 0])
        assert proxy.injected["reset"] == 5
        proxy.refuse(2)
        assert SaevReader(url).verify().ok  # a new reader: new clients, new connections
        assert proxy.injected["refuse"] == 2
        # a stalled response: given up after read_timeout_s, tried again
        quick = {"read_timeout_s": 1.0, "backoff_s": 0.01}
        options = (
            GCSConfig(endpoint_url=proxy.endpoint, **quick)
            if remote.scheme == "gs"
            else AzureConfig(
                connection_string=os.environ["AZURE_STORAGE_CONNECTION_STRING"], **quick
            )
        )
        files = open_files(url, storage=options, cache=False)
        files.list()  # listed before the stall: the stalled response is the read's
        proxy.stall(1, 4.0)
        start = time.monotonic()
        assert files.read_bytes("acts000001.bin") == (local / "acts000001.bin").read_bytes()
        assert proxy.injected["stall"] == 1 and time.monotonic() - start < 4.0
    finally:
        proxy.close()
        if server is not remote.emulator:
            server.stop()


@pytest.mark.parametrize("fmt", ["pickle", "saelens", "zarr", "activault"])
def test_every_format_reads_back_from_the_remote_copy(remote, fmt, tmp_path):
    """Each built-in format written locally, copied up, read and verified there (saev:
    above)."""
    case = FormatCase(fmt)
    plan = case.plan()
    acts = make_acts_kit(plan)
    local = case.write(tmp_path / fmt, plan, case.batches(plan, acts))
    url = remote.url(fmt)
    copy_store(local, url, threads=4, check_store=verify_store)
    assert_same_store(url, local)


@pytest.mark.slow
def test_ray_capture_of_an_activault_run_onto_gcs(gcs, model_dir, text_file, tmp_path):
    """`capture --ray local` with two workers writes its parts to gs:// and the last
    merges them: the run equals one process's capture of the same examples."""
    pytest.importorskip("ray")
    ray_tmp = tempfile.mkdtemp(prefix="ray-")  # short: Ray's socket paths have a limit
    env = {**os.environ, "PYTHONPATH": pythonpath(), "TQDM_DISABLE": "1"}
    env.update(
        RAY_AUTH_MODE="disabled",
        RAY_USAGE_STATS_ENABLED="0",
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        RAY_TMPDIR=ray_tmp,
    )
    args = ["capture", "--model", str(model_dir("gpt2")), "--dataset", str(text_file)]
    args += ["--layers", "1", "--context-length", "8", "--max-examples", "12"]
    # no token cleaning: every example keeps its 8 tokens, so files of 2 examples tile
    # each machine's slice and the parts hold exactly one process's rows
    args += ["--format", "activault", "--opt", "rows_per_file=2", "--no-clean", "--no-progress"]
    try:
        proc = run_actstore(
            *args, "--out", gcs.url("ray"), "--ray", "local", "--workers", "2", env=env
        )
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "with 2 Ray workers; published" in proc.stdout + proc.stderr
    one = run_actstore(*args, "--out", str(tmp_path / "one"), env=env)
    assert one.returncode == 0, one.stderr[-3000:]
    run, single = open_store(gcs.url("ray")), open_store(tmp_path / "one")
    assert run.record.complete and run.record.dropped_tokens == 0
    for site in single.sites:
        got = np.concatenate([run.read_block(b) for b in run.blocks(site)])
        want = np.concatenate([single.read_block(b) for b in single.blocks(site)])
        np.testing.assert_array_equal(got, want)
    assert run.verify().ok
