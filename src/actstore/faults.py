"""Fault points: named places where a writer can be made to crash, for crash tests.

Writers call :func:`point` at every step of their crash protocol. With the environment
variable ``ACTSTORE_CRASH_AT=<name>`` (or ``<name>:<n>`` for the n-th time the point is
reached, counting from 1) the process dies there at once with ``os._exit(CRASH_EXIT)``,
like a ``kill -9``: no cleanup, no buffered writes flushed. Unset, a point costs two dict
lookups. With ``ACTSTORE_FAULT_TRACE=<file>`` each point reached is appended to that file,
one name a line (how :mod:`actstore.testing` finds a format's points to crash at).

Example:
    >>> point("saev.shard_written")  # no-op unless ACTSTORE_CRASH_AT names it
"""

from __future__ import annotations

import os
import sys

#: Exit status of an injected crash (what a SIGKILLed shell child reports).
CRASH_EXIT = 137
ENV = "ACTSTORE_CRASH_AT"
TRACE_ENV = "ACTSTORE_FAULT_TRACE"

_hits: dict[str, int] = {}


def point(name: str) -> None:
    """Crash here if ``ACTSTORE_CRASH_AT`` names this point (and this is the n-th hit)."""
    trace = os.environ.get(TRACE_ENV)
    if trace:
        with open(trace, "a", encoding="utf-8") as f:
            f.write(name + "\n")
    target = os.environ.get(ENV)
    if not target:
        return
    want, _, nth = target.partition(":")
    if want != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] >= int(nth or 1):
        sys.stderr.write(f"actstore: injected crash at {name}\n")
        sys.stderr.flush()
        os._exit(CRASH_EXIT)
