"""The loopback S3 test server, for benchmarks that run it as a script
(``python tests/s3_server.py``) and modules that import it from here: it lives in the
conformance kit, :mod:`actstore.testing.s3` (its fixtures in :mod:`actstore.testing.plugin`,
which ``conftest.py`` enables)."""

from __future__ import annotations

from actstore.testing.s3 import (  # noqa: F401 - re-exported
    ACCESS_KEY,
    HOST,
    SECRET_KEY,
    FaultInjector,
    FaultyProxy,
    S3Env,
    new_env,
    serve,
    start_server,
)

if __name__ == "__main__":
    serve()
