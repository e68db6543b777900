"""A real S3-compatible server on 127.0.0.1 for tests and benchmarks, with fault injection
(needs ``moto[server]`` and ``boto3``, the ``test`` extra).

* :class:`S3Server` is moto's ``ThreadedMotoServer`` (bound to 127.0.0.1, port 0) whose WSGI
  app is wrapped in :class:`FaultInjector`, which can answer chosen requests with server-side
  errors (``500 InternalError``, ``503 SlowDown``...) instead of passing them to moto.
* :class:`FaultyProxy` is a loopback TCP proxy in front of it that can reset connections
  mid-response, stall responses (client read timeouts) or refuse connections.
* :class:`S3Env` is what a test gets: the endpoint, a fresh bucket, a boto3 client, the
  fault knobs.

The pytest fixtures over them (``s3_server``, ``s3``, ``s3_proxy``, ``conformance_s3_url``)
are in :mod:`actstore.testing.plugin`. Run as a script (``python -m actstore.testing.s3``)
it serves until killed and prints the endpoint, for benchmarks that want the server in
another process.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

HOST = "127.0.0.1"
logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
ACCESS_KEY, SECRET_KEY = "testing", "testing"
_bucket_ids = itertools.count()


# ---------------------------------------------------------------------------- server side


@dataclass
class _Rule:
    method: str | None
    path_contains: str | None
    query_contains: str | None
    status: int
    code: str
    times: int
    hits: int = 0


class FaultInjector:
    """WSGI middleware: answer matching requests with an S3 error instead of moto's reply."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._rules: list[_Rule] = []
        self._lock = threading.Lock()
        #: (method, path, query) of every request seen, for assertions.
        self.requests: list[tuple[str, str, str]] = []

    def fail(
        self,
        *,
        method: str | None = None,
        path_contains: str | None = None,
        query_contains: str | None = None,
        status: int = 503,
        code: str = "SlowDown",
        times: int = 1,
    ) -> _Rule:
        """Fail the next ``times`` matching requests with ``status``/``code``."""
        rule = _Rule(method, path_contains, query_contains, status, code, times)
        with self._lock:
            self._rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()
            self.requests.clear()

    def _match(self, method: str, path: str, query: str) -> _Rule | None:
        with self._lock:
            self.requests.append((method, path, query))
            for rule in self._rules:
                if rule.times <= 0:
                    continue
                if rule.method and rule.method != method:
                    continue
                if rule.path_contains and rule.path_contains not in path:
                    continue
                if rule.query_contains and rule.query_contains not in query:
                    continue
                rule.times -= 1
                rule.hits += 1
                return rule
        return None

    def __call__(self, environ: dict, start_response: Any) -> Any:
        rule = self._match(
            environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""), environ.get("QUERY_STRING", "")
        )
        if rule is None:
            return self.app(environ, start_response)
        length = int(environ.get("CONTENT_LENGTH") or 0)
        if length:
            environ["wsgi.input"].read(length)  # drain the upload so the connection stays sane
        body = (
            f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{rule.code}</Code>'
            f"<Message>injected fault</Message><RequestId>fault</RequestId></Error>"
        ).encode()
        start_response(
            f"{rule.status} Injected",
            [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))],
        )
        return [body]


def _moto_server_class():
    from moto.moto_server.threaded_moto_server import ThreadedMotoServer
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    class S3Server(ThreadedMotoServer):
        """moto's threaded server on 127.0.0.1 with a :class:`FaultInjector` in front."""

        def __init__(self) -> None:
            super().__init__(ip_address=HOST, port=0, verbose=False)
            self.faults = FaultInjector(DomainDispatcherApplication(create_backend_app))

        def _server_entry(self) -> None:
            self._server = make_server(
                self._ip_address, self._port, self.faults, True, request_handler=MotoRequestHandler
            )
            self._server_ready_event.set()
            self._server.serve_forever()

        @property
        def endpoint(self) -> str:
            host, port = self.get_host_and_port()
            return f"http://{host}:{port}"

    return S3Server


def start_server():
    """Start an :class:`S3Server` and return it (call ``.stop()`` when done)."""
    server = _moto_server_class()()
    server.start()
    return server


# ---------------------------------------------------------------------------- network side


class FaultyProxy:
    """TCP proxy on 127.0.0.1 that forwards to ``target_port`` and injects network faults."""

    def __init__(self, target_port: int) -> None:
        self.target = (HOST, target_port)
        self._listener = socket.create_server((HOST, 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._resets_left = 0
        self._reset_after = 0
        self._budget = 0
        self._stalls_left = 0
        self._stall_s = 0.0
        self._refuse_left = 0
        #: Faults actually injected so far, by kind.
        self.injected = {"reset": 0, "stall": 0, "refuse": 0}
        self._closed = False
        self._sockets: set[socket.socket] = set()
        threading.Thread(target=self._accept, daemon=True, name="faulty-proxy").start()

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    def reset_connections(self, times: int, after_bytes: int) -> None:
        """Reset (TCP RST) the connection carrying a response each time ``after_bytes``
        more response bytes have passed, ``times`` times."""
        with self._lock:
            self._resets_left, self._reset_after, self._budget = times, after_bytes, after_bytes

    def stall(self, times: int, seconds: float) -> None:
        """Hold the next ``times`` response chunks for ``seconds`` each (read timeouts)."""
        with self._lock:
            self._stalls_left, self._stall_s = times, seconds

    def refuse(self, times: int) -> None:
        """Close the next ``times`` new connections without forwarding anything."""
        with self._lock:
            self._refuse_left = times

    def clear(self) -> None:
        with self._lock:
            self._resets_left = self._stalls_left = self._refuse_left = 0

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                refuse = self._refuse_left > 0
                if refuse:
                    self._refuse_left -= 1
                    self.injected["refuse"] += 1
            if refuse:
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                _reset(client)
                continue
            self._sockets.update((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, response: bool) -> None:
        try:
            while True:
                chunk = src.recv(65536)
                if not chunk:
                    break
                if response:
                    cut, stall = self._response_faults(len(chunk))
                    if stall:
                        time.sleep(stall)
                    if cut is not None:
                        dst.sendall(chunk[:cut])
                        _reset(dst)
                        _reset(src)
                        return
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _response_faults(self, n: int) -> tuple[int | None, float]:
        with self._lock:
            stall = 0.0
            if self._stalls_left > 0:
                self._stalls_left -= 1
                self.injected["stall"] += 1
                stall = self._stall_s
            if self._resets_left > 0:
                if n >= self._budget:
                    cut = self._budget
                    self._resets_left -= 1
                    self._budget = self._reset_after
                    self.injected["reset"] += 1
                    return cut, stall
                self._budget -= n
            return None, stall

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        for s in list(self._sockets):
            try:
                s.close()
            except OSError:
                pass


def _reset(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0), like a peer that dropped the connection."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RD)  # wake the other pump thread blocked in recv()
    except OSError:
        pass
    sock.close()


# ---------------------------------------------------------------------------- test environments


@dataclass
class S3Env:
    """What a test needs: the endpoint, its bucket, a raw boto3 client, the fault knobs."""

    endpoint: str
    bucket: str
    server: Any
    proxy: FaultyProxy | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def url(self, *parts: str) -> str:
        return "/".join([f"s3://{self.bucket}", *[p.strip("/") for p in parts if p]])

    @property
    def faults(self) -> FaultInjector:
        return self.server.faults

    def client(self, endpoint: str | None = None):
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=endpoint or self.server.endpoint,
            region_name="us-east-1",
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            config=Config(s3={"addressing_style": "path"}, retries={"total_max_attempts": 1}),
        )

    def keys(self, prefix: str = "") -> dict[str, int]:
        """Every object in the bucket (through the server, not the proxy) -> its size."""
        out = {}
        for page in (
            self.client()
            .get_paginator("list_objects_v2")
            .paginate(Bucket=self.bucket, Prefix=prefix)
        ):
            out.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
        return out


def aws_env(endpoint: str) -> dict[str, str]:
    return {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": "us-east-1",
        "S3_ENDPOINT_URL": endpoint,
    }


def new_env(s3_server, monkeypatch, endpoint: str, proxy: FaultyProxy | None = None) -> S3Env:
    """A fresh bucket on ``s3_server`` reached through ``endpoint``; the AWS variables set
    with ``monkeypatch`` (a pytest ``MonkeyPatch``)."""
    s3_server.faults.clear()
    for key in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in aws_env(endpoint).items():
        monkeypatch.setenv(key, value)
    env = S3Env(
        endpoint=endpoint, bucket=f"test-bucket-{next(_bucket_ids)}", server=s3_server, proxy=proxy
    )
    env.client().create_bucket(Bucket=env.bucket)
    return env


def serve() -> None:
    """Serve until killed (or until the process that started this one exits), after
    printing the endpoint: ``python -m actstore.testing.s3`` (benchmarks)."""
    parent = os.getppid()
    server = start_server()
    print(server.endpoint, flush=True)
    try:
        while os.getppid() == parent:  # never outlive the process that started us
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    server.stop()


if __name__ == "__main__":
    serve()
