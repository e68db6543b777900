"""The conformance kit's pytest plugin: a real S3 server on 127.0.0.1 (moto, with fault
injection; :mod:`actstore.testing.s3`) and the fixtures every rule of
:class:`~actstore.testing.ConformanceSuite` needs, so another project's format suite runs
every rule, the S3 round trip included. Enable it in that project's ``conftest.py``::

    pytest_plugins = ["actstore.testing.plugin"]

Fixtures:

* ``s3_server``: one server per test session.
* ``s3``: a fresh bucket per test (an :class:`~actstore.testing.s3.S3Env`), with the AWS
  variables and ``S3_ENDPOINT_URL`` set to the server (so ``open_store("s3://...")`` just
  works); injected faults are cleared.
* ``s3_proxy``: like ``s3`` but the endpoint is a :class:`~actstore.testing.s3.FaultyProxy`.
* ``conformance_s3_url``: ``name -> s3://...`` in the test's bucket, what the kit's S3 rule
  writes to (staging goes under the test's tmp directory).
* ``gcs_server`` / ``azurite_server``: one fake-gcs-server / Azurite on 127.0.0.1 per
  session (:mod:`actstore.testing.emulators`), started on first use.
* ``gcs`` / ``azure``: a fresh bucket (container) per test (a
  :class:`~actstore.testing.emulators.BucketEnv`), with ``STORAGE_EMULATOR_HOST`` /
  ``AZURE_STORAGE_CONNECTION_STRING`` set to the server.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .emulators import BucketEnv, new_bucket, start_azurite, start_gcs
from .s3 import FaultyProxy, S3Env, new_env, start_server


def pytest_configure(config: pytest.Config) -> None:
    """The kit marks its slowest rule ``timeout`` (pytest-timeout's marker; declared here
    too, so a project without that plugin runs the kit under ``--strict-markers``)."""
    config.addinivalue_line("markers", "timeout(seconds): a time limit (pytest-timeout)")


@pytest.fixture(scope="session")
def s3_server():
    """One moto S3 server on 127.0.0.1 for the whole session."""
    server = start_server()
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch) -> Iterator[S3Env]:
    """A fresh bucket; the AWS variables and S3_ENDPOINT_URL point at the server."""
    env = new_env(s3_server, monkeypatch, s3_server.endpoint)
    yield env
    s3_server.faults.clear()


@pytest.fixture
def conformance_s3_url(s3, tmp_path, monkeypatch):
    """``name -> s3://...`` on the loopback server: what actstore.testing's S3 rule needs
    (staging goes under the test's tmp directory)."""
    monkeypatch.setenv("ACTSTORE_CACHE", str(tmp_path / "cache"))
    return lambda name: s3.url(name.replace("[", "-").replace("]", ""))


@pytest.fixture
def s3_proxy(s3_server, monkeypatch) -> Iterator[S3Env]:
    """Like ``s3``, but the endpoint is a :class:`FaultyProxy` in front of the server."""
    _, port = s3_server.get_host_and_port()
    proxy = FaultyProxy(port)
    env = new_env(s3_server, monkeypatch, proxy.endpoint, proxy)
    yield env
    proxy.close()
    s3_server.faults.clear()


@pytest.fixture(scope="session")
def gcs_server():
    """One fake-gcs-server on 127.0.0.1 (in memory) for the whole session."""
    server = start_gcs()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def azurite_server():
    """One Azurite blob service on 127.0.0.1 (in memory) for the whole session."""
    server = start_azurite()
    yield server
    server.stop()


@pytest.fixture
def gcs(gcs_server, monkeypatch) -> BucketEnv:
    """A fresh bucket; STORAGE_EMULATOR_HOST points at the server."""
    return new_bucket(gcs_server, monkeypatch)


@pytest.fixture
def azure(azurite_server, monkeypatch) -> BucketEnv:
    """A fresh container; AZURE_STORAGE_CONNECTION_STRING points at the server."""
    return new_bucket(azurite_server, monkeypatch)
