"""The upload path on the loopback S3 server (issue 28): ``S3Store`` sends straight from the
caller's buffer (no copy of the bytes) and still sends the whole body again after a fault;
``BackgroundUploader`` keeps several files in flight, skips files already there, and
reports a failed file."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from actstore.storage.object import S3Config, S3Store
from actstore.storage.object.body import ViewBody
from actstore.storage.upload import BackgroundUploader

MiB = 1 << 20


def _body(s3, key: str) -> bytes:
    return s3.client().get_object(Bucket=s3.bucket, Key=key)["Body"].read()


def _etag(s3, key: str) -> str:
    return s3.client().head_object(Bucket=s3.bucket, Key=key)["ETag"].strip('"')


def test_view_body_reads_slices_seeks_and_says_what_is_left():
    body = ViewBody(bytearray(b"0123456789"))
    assert len(body) == 10 and body.tell() == 0 and body
    assert bytes(body.read(4)) == b"0123" and len(body) == 6
    assert bytes(body.read()) == b"456789" and bytes(body.read(3)) == b""
    assert body.seek(-3, 2) == 7 and bytes(body.read(None)) == b"789"
    assert body.seek(2) == 2 and body.seek(1, 1) == 3 and bytes(body.read(2)) == b"34"
    assert ViewBody(b"") and len(ViewBody(b"")) == 0  # an empty body is still a body


def test_put_sends_a_buffer_slice_as_is_and_whole_again_after_a_server_fault(s3):
    store = S3Store(s3.bucket, S3Config(backoff_s=0.01))
    data = np.random.default_rng(0).integers(0, 256, 3 * MiB + 5, dtype=np.uint8)
    view = memoryview(data)[3:]  # a slice of a numpy buffer, neither bytes nor aligned
    s3.faults.fail(method="PUT", path_contains="one/k", status=503, code="SlowDown")
    store.put("one/k", view)
    assert store.retries == 1
    assert _body(s3, "one/k") == bytes(view)
    assert _etag(s3, "one/k") == hashlib.md5(view).hexdigest()


def test_multipart_parts_come_from_the_buffer_and_a_failed_part_is_sent_whole_again(s3):
    cfg = S3Config(backoff_s=0.01, multipart_threshold=5 * MiB, part_size=5 * MiB)
    store = S3Store(s3.bucket, cfg)
    data = bytearray(np.random.default_rng(1).integers(0, 256, 11 * MiB, dtype=np.uint8))
    s3.faults.fail(method="PUT", query_contains="partNumber=2", status=500, code="InternalError")
    store.put("big/k", data)
    assert store.retries == 1
    assert _body(s3, "big/k") == bytes(data)
    parts = [hashlib.md5(data[o : o + 5 * MiB]).digest() for o in range(0, len(data), 5 * MiB)]
    assert _etag(s3, "big/k") == f"{hashlib.md5(b''.join(parts)).hexdigest()}-3"


class _SlowStore(S3Store):
    """Counts the PUTs in flight (each held a little), and fails the PUT of ``fail``."""

    def __init__(self, bucket: str, fail: str = "") -> None:
        super().__init__(bucket, S3Config(backoff_s=0.01, max_attempts=1))
        self.fail, self.in_flight, self.most = fail, 0, 0
        self._count = threading.Lock()

    def put(self, key, data):
        with self._count:
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
        try:
            time.sleep(0.2)
            if self.fail and key.endswith(self.fail):
                raise OSError(f"refused {key}")
            return super().put(key, data)
        finally:
            with self._count:
                self.in_flight -= 1


def _files(tmp_path: Path, n: int) -> list[tuple[str, Path]]:
    rng = np.random.default_rng(2)
    out = []
    for i in range(n):
        path = tmp_path / f"shard{i}.bin"
        path.write_bytes(rng.integers(0, 256, 4096 + i, dtype=np.uint8).tobytes())
        out.append((path.name, path))
    return out


def test_background_uploader_keeps_several_files_in_flight_and_skips_files_already_there(
    s3, tmp_path
):
    files = _files(tmp_path, 6)
    store = _SlowStore(s3.bucket)
    up = BackgroundUploader(store, "run", threads=4)
    up.offer(files)
    etags = up.finish()
    assert not up.errors and sorted(up.sent) == sorted(n for n, _ in files)
    assert store.most >= 2  # one file at a time before: a small file used one connection
    for name, path in files:
        assert _body(s3, f"run/{name}") == path.read_bytes()
        assert etags[name] == _etag(s3, f"run/{name}") == hashlib.md5(path.read_bytes()).hexdigest()
    again = BackgroundUploader(_SlowStore(s3.bucket), "run", threads=4)  # a rerun
    again.offer(files)
    assert again.finish() == etags and sorted(again.found) == sorted(etags) and not again.sent


def test_background_uploader_reports_the_failed_file_and_starts_no_more(s3, tmp_path):
    files = _files(tmp_path, 3)
    store = _SlowStore(s3.bucket, fail="shard0.bin")
    up = BackgroundUploader(store, "bad", threads=2)
    up.offer(files[:1])
    up.finish()
    assert [name for name, _ in up.errors] == ["shard0.bin"]
    with pytest.raises(OSError):
        raise up.errors[0][1]
    up.offer(files[1:])  # after a failure nothing more is sent
    up.finish()
    assert up.sent == [] and "bad/shard1.bin" not in s3.keys("bad/")


def test_unchanged_leaves_out_a_file_rewritten_after_it_was_sent(s3, tmp_path):
    files = _files(tmp_path, 2)
    up = BackgroundUploader(S3Store(s3.bucket), "chg", threads=2)
    up.offer(files)
    etags = up.finish()
    assert up.unchanged() == etags
    path = files[1][1]
    stat = path.stat()
    path.write_bytes(bytes(reversed(path.read_bytes())))  # same size, other bytes
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert up.unchanged() == {files[0][0]: etags[files[0][0]]}
