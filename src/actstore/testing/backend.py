"""The contract every object storage backend keeps, as pytest tests: :class:`BackendSuite`.

A backend's test module subclasses it and gives a fixture ``object_store`` that returns
a fresh :class:`~actstore.storage.object.ObjectStore` on an empty bucket of a real server
(on 127.0.0.1), set to list :attr:`BackendSuite.page_size` keys per request and to upload
objects over 5 MiB in parts, where the backend has those settings::

    from actstore.testing import BackendSuite

    class TestMyBackend(BackendSuite):
        @pytest.fixture
        def object_store(self, my_server):
            return MyStore(my_server.new_bucket(), MyConfig(list_page_size=4))

The rules: whole objects round trip (any buffer type, empty ones too); ranged reads at the
start, middle and end, and past the end refused (:class:`~actstore.errors.CorruptStoreError`);
listings by string prefix across several pages, with "folders"; overwrite and delete;
missing keys and buckets (:class:`~actstore.errors.StoreNotFoundError`); a conditional
create that refuses an existing key, updates and deletes only at the version held, and the
write lock built on them; large uploads in parts, streamed or resumable as the backend's
:class:`~actstore.storage.object.Capabilities` say (and the optional methods it lacks
refused with :class:`~actstore.errors.UnsupportedError`); server-side copies; stores that
pickle. Every error is one of :mod:`actstore.errors`.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from ..errors import (
    CorruptStoreError,
    StoreLockedError,
    StoreNotFoundError,
    UnsupportedError,
)
from ..storage.object import MiB, ObjectStore, open_bucket, split_location


def _data(n: int, seed: int = 0) -> bytes:
    """``n`` bytes that differ at every offset (a misplaced range shows)."""
    return bytes((i * 7 + seed + (i >> 8)) % 251 for i in range(n))


class BackendSuite:
    """Subclass it and give an ``object_store`` fixture (see the module's docstring)."""

    #: Keys per listing request the ``object_store`` fixture's store is set to.
    page_size = 4
    #: Size of the "large" object: over the 5 MiB the fixture sets as the part threshold.
    large_size = 11 * MiB + 123

    # ------------------------------------------------------------------ whole objects

    def test_put_get_whole(self, object_store: ObjectStore) -> None:
        data = _data(100_000)
        object_store.put("kit/whole.bin", data)
        assert object_store.get("kit/whole.bin") == data
        assert object_store.size("kit/whole.bin") == len(data)

    def test_put_any_buffer_and_empty(self, object_store: ObjectStore) -> None:
        data = _data(5000, 1)
        object_store.put("kit/ba.bin", bytearray(data))
        object_store.put("kit/mv.bin", memoryview(data)[1000:3000])
        object_store.put("kit/empty.bin", b"")
        assert object_store.get("kit/ba.bin") == data
        assert object_store.get("kit/mv.bin") == data[1000:3000]
        assert object_store.get("kit/empty.bin") == b""
        assert object_store.size("kit/empty.bin") == 0

    def test_json_round_trip(self, object_store: ObjectStore) -> None:
        object_store.put_json("kit/doc.json", {"a": [1, 2], "b": "x"})
        assert object_store.get_json("kit/doc.json") == {"a": [1, 2], "b": "x"}

    def test_overwrite_replaces(self, object_store: ObjectStore) -> None:
        first = object_store.put("kit/over.bin", b"first version")
        before = {o.key: o.version for o in object_store.list("kit/over")}
        second = object_store.put("kit/over.bin", b"second")
        assert object_store.get("kit/over.bin") == b"second"
        assert object_store.size("kit/over.bin") == 6
        after = {o.key: o.version for o in object_store.list("kit/over")}
        if before["kit/over.bin"]:  # a version that changes with the bytes, where kept
            assert after["kit/over.bin"] != before["kit/over.bin"]
        if object_store.capabilities.content_md5:  # listed MD5s are the bytes' own
            listed = next(iter(object_store.list("kit/over")))
            assert listed.md5 == hashlib.md5(b"second").hexdigest()
        # a version put returns is the one listings report (what uploaders trust at close)
        assert first in ("", before["kit/over.bin"]) and second in ("", after["kit/over.bin"])
        streamed = object_store.put_chunks("kit/over.bin", [b"thi", b"rd"])
        assert streamed in ("", next(iter(object_store.list("kit/over"))).version)

    # ------------------------------------------------------------------ ranged reads

    def test_ranged_reads(self, object_store: ObjectStore) -> None:
        data = _data(300_000, 2)
        object_store.put("kit/range.bin", data)
        assert object_store.get_range("kit/range.bin", 0, 10) == data[:10]
        assert object_store.get_range("kit/range.bin", 123_457, 200_001) == data[123_457:200_001]
        assert object_store.get_range("kit/range.bin", 299_990, 300_000) == data[-10:]
        out = bytearray(4096)
        object_store.get_range_into("kit/range.bin", out, 77_777, total=len(data))
        assert bytes(out) == data[77_777 : 77_777 + 4096]

    def test_get_into_in_parallel_chunks(self, object_store: ObjectStore) -> None:
        data = _data(1_000_003, 3)
        object_store.put("kit/chunks.bin", data)
        out = bytearray(len(data))
        with ThreadPoolExecutor(4) as pool:
            object_store.get_into("kit/chunks.bin", out, chunk_size=65_536, pool=pool)
        assert bytes(out) == data

    def test_ranges_past_the_end_are_refused(self, object_store: ObjectStore) -> None:
        object_store.put("kit/short.bin", _data(1000))
        with pytest.raises(CorruptStoreError):
            object_store.get_range("kit/short.bin", 990, 1010)  # ends past the end
        with pytest.raises(CorruptStoreError):
            object_store.get_range("kit/short.bin", 2000, 2010)  # starts past the end
        with pytest.raises(CorruptStoreError):  # the object is not the size expected
            object_store.get_range_into("kit/short.bin", bytearray(10), 0, total=2000)

    # ------------------------------------------------------------------ missing

    def test_missing_keys(self, object_store: ObjectStore) -> None:
        with pytest.raises(StoreNotFoundError):
            object_store.get("kit/absent.bin")
        with pytest.raises(StoreNotFoundError):
            object_store.get_range("kit/absent.bin", 0, 10)
        assert object_store.size("kit/absent.bin") is None
        object_store.delete("kit/absent.bin")  # no error
        assert list(object_store.list("kit/absent")) == []

    def test_missing_bucket(self, object_store: ObjectStore) -> None:
        config = getattr(object_store, "config", None)
        missing = open_bucket(object_store.scheme, "actstore-kit-no-such-bucket", config)
        with pytest.raises(StoreNotFoundError, match="actstore-kit-no-such-bucket"):
            missing.check_bucket()
        object_store.check_bucket()  # the fixture's bucket is there

    # ------------------------------------------------------------------ listing

    def test_listing_by_prefix(self, object_store: ObjectStore) -> None:
        for key in ("kit/a/1", "kit/a/2", "kit/a/sub/3", "kit/ab/4", "kit/b/5", "kit/top"):
            object_store.put(key, key.encode())
        listed = {o.key: o.size for o in object_store.list("kit/a/")}
        assert listed == {"kit/a/1": 7, "kit/a/2": 7, "kit/a/sub/3": 11}
        # a prefix without a trailing "/" is a string prefix, as on S3
        assert {o.key for o in object_store.list("kit/a")} == {*listed, "kit/ab/4"}
        assert object_store.list_dirs("kit") == ["a", "ab", "b"]
        assert object_store.list_dirs("kit/a") == ["sub"]
        assert object_store.list_dirs("kit/b") == []

    def test_listing_spans_pages(self, object_store: ObjectStore) -> None:
        n = 2 * self.page_size + 1
        keys = [f"kit/many/{i:03d}.bin" for i in range(n)]
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda k: object_store.put(k, k.encode()), keys))
        listed = [o.key for o in object_store.list("kit/many/")]
        assert sorted(listed) == keys  # each once
        dirs = [f"kit/dirs/d{i:03d}/x" for i in range(n)]
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda k: object_store.put(k, b"x"), dirs))
        assert object_store.list_dirs("kit/dirs") == [f"d{i:03d}" for i in range(n)]

    def test_delete_and_delete_tree(self, object_store: ObjectStore) -> None:
        for key in ("kit/del/1", "kit/del/2/3", "kit/delete-me-not"):
            object_store.put(key, b"x")
        object_store.delete("kit/del/1")
        assert object_store.size("kit/del/1") is None
        object_store.delete_tree("kit/del")
        assert list(object_store.list("kit/del/")) == []
        assert object_store.get("kit/delete-me-not") == b"x"

    # ------------------------------------------------------------------ conditional writes

    def test_conditional_create_and_update(self, object_store: ObjectStore) -> None:
        if not object_store.capabilities.conditional_create:
            with pytest.raises(UnsupportedError):
                object_store.put_if("kit/cond", b"1", etag=None)
            return
        first = object_store.put_if("kit/cond", b"1", etag=None)
        assert first
        assert object_store.put_if("kit/cond", b"2", etag=None) is None  # exists: refused
        assert object_store.get("kit/cond") == b"1"
        second = object_store.put_if("kit/cond", b"3", etag=first)
        assert second and second != first
        assert object_store.put_if("kit/cond", b"4", etag=first) is None  # stale version
        found = object_store.get_with_age("kit/cond")
        assert found is not None
        body, version, age = found
        assert (body, version) == (b"3", second) and 0 <= age < 600
        assert object_store.delete_if("kit/cond", first) is False
        assert object_store.get("kit/cond") == b"3"
        assert object_store.delete_if("kit/cond", second) is True
        assert object_store.size("kit/cond") is None
        assert object_store.get_with_age("kit/cond") is None
        assert object_store.put_if("kit/cond", b"5", etag=second) is None  # gone

    def test_concurrent_creates_one_wins(self, object_store: ObjectStore) -> None:
        if not object_store.capabilities.conditional_create:
            pytest.skip("the backend has no conditional create")
        with ThreadPoolExecutor(8) as pool:
            won = list(
                pool.map(
                    lambda i: object_store.put_if("kit/race", str(i).encode(), etag=None),
                    range(8),
                )
            )
        winners = [i for i, v in enumerate(won) if v is not None]
        assert len(winners) == 1
        assert object_store.get("kit/race") == str(winners[0]).encode()

    def test_write_lock(self, object_store: ObjectStore) -> None:
        lock = object_store.acquire_lock("kit/locked")
        try:
            with pytest.raises(StoreLockedError):
                object_store.clone().acquire_lock("kit/locked")
        finally:
            lock.release()
        again = object_store.acquire_lock("kit/locked")
        again.release()
        assert [o.key for o in object_store.list("kit/locked/")] == []

    # ------------------------------------------------------------------ large objects

    def test_large_upload(self, object_store: ObjectStore) -> None:
        data = os.urandom(self.large_size)
        object_store.put("kit/large.bin", data)
        assert object_store.size("kit/large.bin") == len(data)
        assert (
            object_store.get_range("kit/large.bin", 5 * MiB - 10, 5 * MiB + 10)
            == (data[5 * MiB - 10 : 5 * MiB + 10])
        )
        assert object_store.get("kit/large.bin") == data

    def test_streamed_upload(self, object_store: ObjectStore) -> None:
        data = os.urandom(self.large_size)
        step = 3 * MiB
        object_store.put_chunks(
            "kit/stream.bin", (data[i : i + step] for i in range(0, len(data), step))
        )
        assert object_store.get("kit/stream.bin") == data

    def test_streamed_upload_failing_publishes_nothing(self, object_store: ObjectStore) -> None:
        def chunks() -> Any:
            yield os.urandom(6 * MiB)
            raise OSError("the source failed")

        with pytest.raises(OSError):
            object_store.put_chunks("kit/broken.bin", chunks())
        assert object_store.size("kit/broken.bin") is None

    def test_resumable_parts(self, object_store: ObjectStore) -> None:
        if not object_store.capabilities.multipart:
            with pytest.raises(UnsupportedError):
                object_store.create_upload("kit/parts.bin")
            return
        parts = [os.urandom(5 * MiB), os.urandom(1000)]
        upload = object_store.create_upload("kit/parts.bin")
        first = object_store.upload_part("kit/parts.bin", upload, 1, parts[0])
        pending = object_store.pending_upload("kit/parts.bin")
        assert pending is not None and pending[0] == upload
        assert pending[1][1] == (first, len(parts[0]))
        assert object_store.size("kit/parts.bin") is None  # nothing published yet
        second = object_store.upload_part("kit/parts.bin", upload, 2, parts[1])
        object_store.complete_upload("kit/parts.bin", upload, [first, second], 5 * MiB + 1000)
        assert object_store.get("kit/parts.bin") == b"".join(parts)

    # ------------------------------------------------------------------ the rest

    def test_server_side_copy(self, object_store: ObjectStore) -> None:
        object_store.put("kit/src.bin", b"copied bytes")
        object_store.copy("kit/src.bin", "kit/dst.bin")
        assert object_store.get("kit/dst.bin") == b"copied bytes"

    def test_pickles_and_clones(self, object_store: ObjectStore) -> None:
        object_store.put("kit/p.bin", b"pickled")
        assert pickle.loads(pickle.dumps(object_store)).get("kit/p.bin") == b"pickled"
        assert object_store.clone().get("kit/p.bin") == b"pickled"

    def test_urls_parse_back(self, object_store: ObjectStore) -> None:
        url = object_store.url("kit/x/y.bin")
        assert url == f"{object_store.root_url}/kit/x/y.bin"
        assert split_location(url) == (object_store.scheme, object_store.bucket_name, "kit/x/y.bin")
