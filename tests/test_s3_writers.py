"""Writers to ``s3://`` on the loopback moto server: shards go up while the capture runs,
kill -9 resumes exactly, the destination's write lock (refusal, stale takeover,
break-lock), and ``actstore cp`` resuming one large file part by part."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import time
from pathlib import Path

import numpy as np
import pytest
from forked import pythonpath, run_actstore, run_python
from saev_fixtures import saev_plan
from test_pickle_store import PER_SHARD
from test_pickle_store import write as write_pickle
from test_saev_store import batches, make_acts, make_metadata, write_store
from typer.testing import CliRunner

from actstore.cli import app
from actstore.errors import CaptureError, StoreLockedError
from actstore.formats import open_store, verify_store
from actstore.formats.pickle import PickleOptions, PickleReader, PickleWriter
from actstore.formats.registry import get_format
from actstore.formats.staged import StagedWriter
from actstore.storage.copy import copy_store
from actstore.storage.files import open_files
from actstore.storage.manifest import MANIFEST
from actstore.storage.object import LOCK_NAME, S3Store
from actstore.storage.s3lock import S3Lock
from actstore.testing import make_acts as make_plan_acts
from actstore.testing import make_batches, make_plan

MiB = 1 << 20


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": pythonpath(), "TQDM_DISABLE": "1"}


def _puts(s3, key: str, start: int = 0) -> int:
    """PUT requests (whole objects or parts) for ``key`` seen by the server since ``start``."""
    return sum(
        1
        for method, path, _ in s3.faults.requests[start:]
        if method == "PUT" and path.endswith(f"/{key}")
    )


def _wait_for(predicate, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def _pickle_maker(plan):
    def make(directory):
        return PickleWriter(plan, Path(directory), PickleOptions(samples_per_shard=PER_SHARD))

    return make


def _plant_lock(s3, prefix: str, *, host="gpu-node-7", pid=4242, lease_s=60.0) -> None:
    """A lock object as a capture on another machine would have written it."""
    record = {"host": host, "pid": pid, "start": "2026-01-01T00:00:00+00:00", "lease_s": lease_s}
    s3.client().put_object(
        Bucket=s3.bucket, Key=f"{prefix}/{LOCK_NAME}", Body=json.dumps(record).encode()
    )


# ---------------------------------------------------------------- background upload


def test_pickle_shards_are_on_s3_before_close_and_sent_once(s3, tmp_path):
    plan = make_plan()
    url = s3.url("pk")
    writer = StagedWriter(url, _pickle_maker(plan), staging=tmp_path / "staging")
    assert f"pk/{LOCK_NAME}" in s3.keys("pk/")  # the destination is locked while writing
    for batch in make_batches(plan, make_plan_acts(plan)):
        writer.write(batch)
    writer.sync()  # every finished shard committed, and queued for upload
    sealed = [f"pk/{name}" for name, _ in writer.inner.sealed_files()]
    assert len(sealed) >= 3
    assert _wait_for(lambda: set(sealed) <= set(s3.keys("pk/")))
    assert "pk/metadata.json" not in s3.keys("pk/")  # not published before close()
    assert f"pk/{MANIFEST}" not in s3.keys("pk/")
    assert writer.close() == url
    assert LOCK_NAME not in "".join(s3.keys("pk/"))  # released
    for key in sealed:  # the background upload's PUT, never again at close
        assert _puts(s3, key) == 1, key
    reference, *_ = write_pickle(tmp_path / "ref", plan)
    remote = open_store(url)
    assert isinstance(remote, PickleReader) and remote.verify().ok
    assert set(remote.files.list()) == {f.name for f in reference.iterdir()}
    for f in reference.glob("shard_*"):  # metadata.json differs: created_at, duration
        assert remote.files.read_bytes(f.name) == f.read_bytes(), f.name


def test_saev_shards_are_on_s3_before_close_and_sent_once(s3, tmp_path, monkeypatch):
    monkeypatch.setenv("ACTSTORE_CACHE", str(tmp_path / "cache"))  # staging goes under it
    acts = make_acts()
    md = make_metadata()
    url = s3.url("sv")
    plan, options = saev_plan(md, has_tokens=True)
    writer = get_format("saev").open_writer(plan, url, options)
    assert writer.url == f"{url}/{md.content_hash()}"
    for batch in batches(acts):
        writer.write(batch)
    writer.sync()  # every finished shard committed, and queued for upload
    prefix = f"sv/{md.content_hash()}"
    sealed = [f"sv/{name}" for name, _ in writer.inner.sealed_files()]
    assert f"{prefix}/acts000000.bin" in sealed and f"{prefix}/tokens.bin" not in sealed
    assert _wait_for(lambda: set(sealed) <= set(s3.keys("sv/")))
    assert f"{prefix}/{MANIFEST}" not in s3.keys("sv/")
    assert writer.close() == writer.url
    for key in sealed:
        assert _puts(s3, key) == 1, key
    reference = write_store(tmp_path / "ref", acts)
    remote = open_files(writer.url)
    assert remote.list() == {p.name: p.stat().st_size for p in reference.iterdir()}
    for f in reference.iterdir():
        assert remote.read_bytes(f.name) == f.read_bytes(), f.name
    assert open_store(writer.url).verify().ok


def test_upload_error_surfaces_at_close_and_a_rerun_publishes(s3, tmp_path):
    plan = make_plan()
    url, staging = s3.url("err"), tmp_path / "staging"
    s3.faults.fail(method="PUT", path_contains="shard_0002", status=403, code="AccessDenied")
    writer = StagedWriter(url, _pickle_maker(plan), staging=staging)
    for batch in make_batches(plan, make_plan_acts(plan)):
        writer.write(batch)  # the capture never sees the failing upload
    with pytest.raises(CaptureError) as caught:
        writer.close()
    message = str(caught.value)
    assert "shard_0002.pkl.gz" in message and "rerun the same capture" in message
    assert len(message.splitlines()) == 1
    assert "err/metadata.json" not in s3.keys("err/")
    assert f"err/{LOCK_NAME}" not in s3.keys("err/")
    again = StagedWriter(url, _pickle_maker(plan), staging=staging)
    assert again.complete  # the staged store was published locally: only uploads are left
    before = len(s3.faults.requests)
    assert again.close() == url
    assert _puts(s3, "err/shard_0001.pkl.gz", before) == 0  # already there: not sent again
    assert _puts(s3, "err/shard_0002.pkl.gz", before) == 1
    assert open_store(url).verify().ok


_KILLED_PICKLE = """
import os, signal, sys, time
from actstore.testing import make_acts, make_batches, make_plan
from test_pickle_store import PER_SHARD
from pathlib import Path
from actstore.formats.pickle import PickleOptions, PickleWriter
from actstore.formats.staged import StagedWriter
from actstore.storage.files import open_files

plan = make_plan()
writer = StagedWriter(
    sys.argv[1],
    lambda d: PickleWriter(plan, Path(d), PickleOptions(samples_per_shard=PER_SHARD)),
    staging=sys.argv[2],
)
for batch in make_batches(plan, make_acts(plan))[:4]:
    writer.write(batch)
writer.sync()  # the finished shards committed and queued for upload
for _ in range(600):  # let the background upload send the finished shards
    if len([n for n in open_files(sys.argv[1]).list() if n.startswith("shard_")]) >= 2:
        break
    time.sleep(0.05)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_kill_9_resumes_exactly_and_sends_no_shard_twice(s3, tmp_path, caplog):
    plan = make_plan()
    url, staging = s3.url("k9"), tmp_path / "staging"
    # a process of its own, forked from a helper that imported torch once (tests/forked.py)
    done = run_python("-c", _KILLED_PICKLE, url, staging, env=_env(), text=False)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    left = s3.keys("k9/")
    assert {"k9/shard_0001.pkl.gz", "k9/shard_0002.pkl.gz"} <= set(left)
    assert f"k9/{LOCK_NAME}" in left and "k9/metadata.json" not in left  # dead holder's lock
    before = len(s3.faults.requests)
    with caplog.at_level(logging.WARNING, logger="actstore.storage.s3lock"):
        resumed = StagedWriter(url, _pickle_maker(plan), staging=staging)
    assert "that process is dead" in caplog.text
    assert resumed.resume_from > 0
    for batch in make_batches(plan, make_plan_acts(plan)):
        resumed.write(batch)
    assert resumed.close() == url
    assert _puts(s3, "k9/shard_0001.pkl.gz", before) == 0
    assert _puts(s3, "k9/shard_0002.pkl.gz", before) == 0
    reference, *_ = write_pickle(tmp_path / "ref", plan)
    remote = open_store(url)
    assert remote.verify().ok
    assert set(remote.files.list()) == {f.name for f in reference.iterdir()}
    for f in reference.glob("shard_*"):
        assert remote.files.read_bytes(f.name) == f.read_bytes(), f.name


def test_a_changed_file_on_s3_is_sent_again_on_resume(s3, tmp_path):
    """Same size, different bytes (ETag differs): a resumed upload replaces it."""
    plan = make_plan()
    url, staging = s3.url("etag"), tmp_path / "staging"
    crashed = StagedWriter(url, _pickle_maker(plan), staging=staging)
    for batch in make_batches(plan, make_plan_acts(plan))[:3]:
        crashed.write(batch)
    crashed.abort()
    local = (tmp_path / ".staging.partial" / "shard_0001.pkl.gz").read_bytes()  # unfinished
    forged = bytes(b ^ 0xFF for b in local)
    s3.client().put_object(Bucket=s3.bucket, Key="etag/shard_0001.pkl.gz", Body=forged)
    resumed = StagedWriter(url, _pickle_maker(plan), staging=staging)
    for batch in make_batches(plan, make_plan_acts(plan)):
        resumed.write(batch)
    resumed.close()
    assert open_files(url).read_bytes("shard_0001.pkl.gz") == local
    assert open_store(url).verify().ok


# ---------------------------------------------------------------- the write lock


def test_a_second_writer_is_refused_with_one_line_naming_the_holder(s3, tmp_path):
    plan = make_plan()
    url = s3.url("lk")
    first = StagedWriter(url, _pickle_maker(plan), staging=tmp_path / "a")
    with pytest.raises(StoreLockedError) as caught:
        StagedWriter(url, _pickle_maker(plan), staging=tmp_path / "b")
    message = str(caught.value)
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in message
    assert url in message and "--break-lock" in message and len(message.splitlines()) == 1
    first.abort()
    assert f"lk/{LOCK_NAME}" not in s3.keys("lk/")
    StagedWriter(url, _pickle_maker(plan), staging=tmp_path / "b").abort()


def _cli_capture(model_dir, text_file, out, *extra):
    args = ["capture", "--model", str(model_dir("gpt2")), "--dataset", str(text_file)]
    args += ["--layers", "0", "--context-length", "8", "--max-examples", "6"]
    args += ["--format", "pickle", "--out", out, "--no-progress", *extra]
    # a process of its own, forked from a helper that imported torch once (tests/forked.py)
    return run_actstore(*args, env=_env(), timeout=None)


def test_cli_refuses_a_destination_another_machine_writes_and_break_lock_takes_it(
    s3, model_dir, text_file, tmp_path, monkeypatch
):
    monkeypatch.setenv("ACTSTORE_CACHE", str(tmp_path / "cache"))
    _plant_lock(s3, "cli")
    refused = _cli_capture(model_dir, text_file, s3.url("cli"))
    assert refused.returncode == 2, refused.stderr
    lines = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert "another capture (pid 4242 on host gpu-node-7" in lines[0]
    assert "--break-lock" in lines[0] and f"{s3.url('cli')};" in lines[0]
    assert s3.keys("cli/") == {f"cli/{LOCK_NAME}": s3.keys("cli/")[f"cli/{LOCK_NAME}"]}
    broken = _cli_capture(model_dir, text_file, s3.url("cli"), "--break-lock")
    assert broken.returncode == 0, broken.stderr[-3000:]
    assert "taking over the write lock" in broken.stderr and "--break-lock" in broken.stderr
    assert f"cli/{LOCK_NAME}" not in s3.keys("cli/")
    assert open_store(s3.url("cli")).verify().ok


def test_a_stale_lock_is_taken_over_with_a_warning(s3, tmp_path, caplog):
    _plant_lock(s3, "st", lease_s=1.0)
    plan = make_plan()
    with pytest.raises(StoreLockedError, match="gpu-node-7"):
        StagedWriter(s3.url("st"), _pickle_maker(plan), staging=tmp_path / "a")
    time.sleep(2.2)  # the holder's lease runs out (server clock: one-second resolution)
    with caplog.at_level(logging.WARNING, logger="actstore.storage.s3lock"):
        writer = StagedWriter(s3.url("st"), _pickle_maker(plan), staging=tmp_path / "a")
    assert "pid 4242 on host gpu-node-7" in caplog.text and "lease" in caplog.text
    record = json.loads(
        s3.client().get_object(Bucket=s3.bucket, Key=f"st/{LOCK_NAME}")["Body"].read()
    )
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    writer.abort()


def test_the_holder_refreshes_its_lock_and_learns_it_was_taken_over(s3, tmp_path, monkeypatch):
    plan = make_plan()
    url, key = s3.url("hb"), f"hb/{LOCK_NAME}"
    writer = StagedWriter(url, _pickle_maker(plan), staging=tmp_path / "a", lease_s=0.4)

    def etag() -> str:
        return s3.client().head_object(Bucket=s3.bucket, Key=key)["ETag"]

    first = etag()
    assert _wait_for(lambda: etag() != first, 5)  # heartbeats rewrite the object
    monkeypatch.setenv("ACTSTORE_BREAK_LOCK", "1")  # another capture takes it over
    thief = S3Lock.acquire(S3Store(s3.bucket), "hb")
    monkeypatch.delenv("ACTSTORE_BREAK_LOCK")
    batch = make_batches(plan, make_plan_acts(plan))[0]
    assert _wait_for(lambda: writer.lock.lost is not None, 5)
    with pytest.raises(StoreLockedError, match="lost the write lock"):
        writer.write(batch)
    writer.abort()
    assert (
        json.loads(s3.client().get_object(Bucket=s3.bucket, Key=key)["Body"].read())["token"]
        == thief.record["token"]
    )  # the loser did not remove the new holder's lock
    thief.release()
    assert key not in s3.keys("hb/")


def test_readers_copies_and_listings_leave_the_lock_object_out(s3, tmp_path):
    store, *_ = write_pickle(tmp_path / "pkl", make_plan())
    url = s3.url("ro")
    copy_store(store, url, check_store=verify_store)
    _plant_lock(s3, "ro")
    reader = open_store(url)
    assert LOCK_NAME not in reader.files.list() and reader.verify().ok
    back = tmp_path / "back"
    copy_store(url, back, check_store=verify_store)
    assert not (back / LOCK_NAME).exists()
    listed = CliRunner().invoke(app, ["ls", url])
    assert listed.exit_code == 0 and LOCK_NAME not in listed.output, listed.output


# ---------------------------------------------------------------- cp resumes one large file


def _big_file(tmp_path, n_mib: int = 26):
    src = tmp_path / "src"
    src.mkdir()
    data = np.random.default_rng(7).integers(0, 255, n_mib * MiB, dtype=np.uint8).tobytes()
    (src / "big.bin").write_bytes(data)
    return src, data


def _part_puts(s3, start: int) -> list[str]:
    return sorted(q for m, p, q in s3.faults.requests[start:] if m == "PUT" and "partNumber=" in q)


def test_cp_resumes_an_interrupted_multipart_upload_part_by_part(s3, tmp_path):
    src, data = _big_file(tmp_path)  # 6 parts of 5 MiB
    url = s3.url("up")
    s3.faults.fail(method="PUT", query_contains="partNumber=3", status=403, code="AccessDenied")
    args = ["cp", str(src), url, "--part-mb", "5", "--threads", "4", "--no-progress"]
    failed = CliRunner().invoke(app, args)
    assert failed.exit_code != 0 and "big.bin" not in "".join(s3.keys("up/"))
    pending = s3.client().list_multipart_uploads(Bucket=s3.bucket, Prefix="up/big.bin")
    (upload,) = pending["Uploads"]
    parts = s3.client().list_parts(Bucket=s3.bucket, Key="up/big.bin", UploadId=upload["UploadId"])
    assert sorted(p["PartNumber"] for p in parts["Parts"]) == [1, 2, 4, 5, 6]
    before = len(s3.faults.requests)
    report = copy_store(src, url, part_bytes=5 * MiB, threads=4)
    sent = _part_puts(s3, before)
    assert len(sent) == 1 and sent[0].endswith("partNumber=3")  # only the missing part
    assert report.parts_reused == 5 and "1 ETags" in report.verified
    head = s3.client().head_object(Bucket=s3.bucket, Key="up/big.bin")
    assert head["ETag"].strip('"').endswith("-6")
    assert open_files(url).read_bytes("big.bin") == data
    assert not s3.client().list_multipart_uploads(Bucket=s3.bucket).get("Uploads")


def test_cp_resumes_an_interrupted_download_from_the_bytes_on_disk(s3, tmp_path):
    src, data = _big_file(tmp_path)
    url = s3.url("down")
    copy_store(src, url, part_bytes=5 * MiB)
    dst = tmp_path / "dst"
    env = {**_env(), "ACTSTORE_CRASH_AT": "copy.part_sent:3"}
    args = ["cp", url, str(dst), "--part-mb", "5", "--threads", "1", "--no-progress"]
    # a process of its own, forked from a helper that imported torch once (tests/forked.py)
    killed = run_actstore(*args, env=env, timeout=None)
    assert killed.returncode == 137, killed.stderr
    assert not (dst / "big.bin").exists() and (dst / ".big.bin.partial.tmp").exists()
    journal = (dst / ".big.bin.parts.tmp").read_text().splitlines()
    assert [int(x) for x in journal[1:]] == [0, 5 * MiB, 10 * MiB]
    before = len(s3.faults.requests)
    report = copy_store(url, dst, part_bytes=5 * MiB, threads=1)
    gets = [p for m, p, _ in s3.faults.requests[before:] if m == "GET" and p.endswith("/big.bin")]
    assert len(gets) == 3 and report.parts_reused == 3  # parts 4-6 only
    assert (dst / "big.bin").read_bytes() == data
    assert sorted(p.name for p in dst.iterdir()) == ["big.bin"]


def test_a_download_journal_of_another_object_version_is_not_trusted(s3, tmp_path):
    src, data = _big_file(tmp_path, 11)
    url = s3.url("ver")
    copy_store(src, url, part_bytes=5 * MiB)
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / ".big.bin.partial.tmp").write_bytes(b"\0" * len(data))
    header = json.dumps({"size": len(data), "version": "stale", "part": 5 * MiB})
    (dst / ".big.bin.parts.tmp").write_text(f"{header}\n0\n{5 * MiB}\n")
    report = copy_store(url, dst, part_bytes=5 * MiB, check_store=None)
    assert report.parts_reused == 0 and (dst / "big.bin").read_bytes() == data


def test_a_service_without_conditional_writes_gets_the_logged_fallback(s3, tmp_path, caplog):
    s3.faults.fail(method="PUT", path_contains=LOCK_NAME, status=501, code="NotImplemented")
    plan = make_plan()
    with caplog.at_level(logging.WARNING, logger="actstore.storage.s3lock"):
        writer = StagedWriter(s3.url("nc"), _pickle_maker(plan), staging=tmp_path / "a")
    assert "does not support conditional writes" in caplog.text
    assert f"nc/{LOCK_NAME}" in s3.keys("nc/")
    with pytest.raises(StoreLockedError, match=f"pid {os.getpid()}"):
        StagedWriter(s3.url("nc"), _pickle_maker(plan), staging=tmp_path / "b")
    writer.abort()
    assert f"nc/{LOCK_NAME}" not in s3.keys("nc/")
