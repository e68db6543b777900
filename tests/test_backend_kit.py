"""Every object storage backend passes actstore.testing's backend kit against a real
server on 127.0.0.1: moto for s3://, fake-gcs-server for gs://, Azurite for az://."""

from __future__ import annotations

import os

import pytest

from actstore.errors import ConfigError
from actstore.storage.location import Location
from actstore.storage.object import (
    AzureConfig,
    GCSConfig,
    MiB,
    S3Config,
    S3Store,
    is_remote,
    open_bucket,
    open_location,
    split_location,
)
from actstore.testing import BackendSuite

#: What the kit asks of every store: a small listing page, parts over 5 MiB.
PAGE = BackendSuite.page_size
PARTS = {"part_size": 5 * MiB, "multipart_threshold": 5 * MiB}


class TestS3Backend(BackendSuite):
    @pytest.fixture
    def object_store(self, s3):
        return S3Store(s3.bucket, S3Config(endpoint_url=s3.endpoint, list_page_size=PAGE, **PARTS))


class TestGCSBackend(BackendSuite):
    @pytest.fixture
    def object_store(self, gcs):
        return open_bucket("gs", gcs.bucket, GCSConfig(list_page_size=PAGE, **PARTS))


class TestAzureBackend(BackendSuite):
    """obstore sets no page size: Azure's listing pages (5000 keys) are not crossed here."""

    @pytest.fixture
    def object_store(self, azure):
        return open_bucket("az", azure.bucket, AzureConfig(**PARTS))


# --------------------------------------------------------------- the scheme table


def test_schemes_parse_to_one_spelling_and_refuse_what_they_cannot_name():
    assert split_location("gcs://b/x/y/") == ("gs", "b", "x/y")
    assert split_location("abfs://box/x") == ("az", "box", "x")
    assert split_location("s3://b") == ("s3", "b", "")
    loc = Location.parse("abfs://box/runs/a")
    assert (loc.url, loc.scheme, loc.is_local) == ("az://box/runs/a", "az", False)
    assert (str(loc.parent), str(loc.child("x.bin"))) == ("az://box/runs", "az://box/runs/a/x.bin")
    assert is_remote("gs://b/x") and not is_remote("/tmp/x") and not is_remote("ftp://h/x")
    with pytest.raises(ConfigError, match="unsupported URL scheme 'ftp'.*gs://BUCKET/prefix"):
        split_location("ftp://host/x")
    with pytest.raises(ConfigError, match="names no container; write az://CONTAINER/prefix"):
        split_location("az:///x")
    with pytest.raises(ConfigError, match="give the container alone"):
        split_location("abfs://box@account.dfs.core.windows.net/x")


def test_each_backend_gets_its_own_options_and_ignores_another_s():
    gcs = GCSConfig(endpoint_url="http://127.0.0.1:1", list_page_size=7)
    store, prefix = open_location("gs://b/p", gcs)
    assert (store.scheme, prefix, store.config) == ("gs", "p", gcs)  # type: ignore[attr-defined]
    assert Location.parse("gs://b/p", storage=gcs).object_store()[0].config is gcs  # type: ignore[attr-defined]
    store, _ = open_location("az://box/p", gcs)  # another backend's settings: the defaults
    assert store.config == AzureConfig()  # type: ignore[attr-defined]
    assert store.capabilities.conditional_create and not store.capabilities.multipart
    assert open_location("s3://b/p")[0].capabilities.multipart
    assert open_location("/tmp/x")[0].local_root is not None


def test_a_backend_that_takes_no_writes_is_refused_by_writers_in_one_line(tmp_path, monkeypatch):
    """A backend registered with ``capabilities.writes`` False (a read-only mirror) serves
    reads; a capture or a distributed part pointed at it is refused before anything is
    written, in one line."""
    from actstore.capture import CaptureConfig
    from actstore.dist.run import capture_part
    from actstore.formats import get_format
    from actstore.storage.object import Capabilities, LocalStore, StorageOptions, registry
    from actstore.testing import make_plan

    class ReadOnly(LocalStore):
        scheme = "ro"
        capabilities = Capabilities(writes=False)

    monkeypatch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))
    monkeypatch.setattr(registry, "_SPELLINGS", dict(registry._SPELLINGS))
    registry.register_backend(
        registry.Backend(
            "ro", "a read-only mirror", StorageOptions, lambda b, _: ReadOnly(tmp_path / b)
        )
    )
    (tmp_path / "mirror" / "x").mkdir(parents=True)
    (tmp_path / "mirror" / "x" / "a.bin").write_bytes(b"abc")
    store, prefix = open_location("ro://mirror/x")
    assert store.get(f"{prefix}/a.bin") == b"abc"
    for attempt in (
        lambda: get_format("saev").open_writer(make_plan(), "ro://mirror/x"),
        lambda: capture_part(
            CaptureConfig(model="unused", dataset="unused"),
            "saev",
            "ro://mirror/x",
            None,
            machine_id=0,
            n_machines=2,
        ),
    ):
        with pytest.raises(ConfigError, match=r"^ro:// is read-only here: write the store"):
            attempt()
    assert sorted(p.name for p in (tmp_path / "mirror" / "x").iterdir()) == ["a.bin"]


def test_gs_without_usable_credentials_is_refused_in_one_line(tmp_path, monkeypatch):
    """No credentials anywhere, or a key file that is missing or not a key: one line
    (exit 2 from the CLI) naming what to set, never the SDK's traceback, and never asked
    again and again as if the network had failed."""
    from forked import pythonpath, run_actstore

    for name in ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no gcloud login in it
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
    monkeypatch.setenv("NO_GCE_CHECK", "True")  # the metadata server is not asked
    monkeypatch.setenv("GCE_METADATA_HOST", "127.0.0.1:9")  # (and would be on loopback)
    monkeypatch.setenv("GCE_METADATA_IP", "127.0.0.1:9")
    with pytest.raises(ConfigError, match=r"^no Google Cloud credentials for gs://somebucket: set"):
        open_location("gs://somebucket/x")[0].check_bucket()
    bad = tmp_path / "key.json"
    bad.write_text('{"not": "a key"}')
    for path in (bad, tmp_path / "missing.json"):
        env = {**os.environ, "GOOGLE_APPLICATION_CREDENTIALS": str(path)}
        env.update(PYTHONPATH=pythonpath(), TQDM_DISABLE="1")
        proc = run_actstore("ls", "gs://somebucket/x", env=env, timeout=None)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert f"credentials file {path} (from GOOGLE_APPLICATION_CREDENTIALS)" in lines[0]
        assert lines[0].endswith("give a service account key file")


@pytest.mark.parametrize("url", ["s3://bucket/acts", "gs://bucket/acts", "az://box/acts"])
def test_a_distributed_capture_of_a_directory_format_onto_object_storage_is_refused_at_once(
    url,
):
    """saev's parts live in a shared directory: refused in one line before any model or
    dataset is opened (neither exists here)."""
    from actstore.capture import CaptureConfig
    from actstore.dist.run import capture_part

    config = CaptureConfig(model="no-such-model", dataset="no-such-dataset")
    with pytest.raises(ConfigError, match=r"^a distributed saev capture writes its parts to a"):
        capture_part(config, "saev", url, None, machine_id=0, n_machines=2)
