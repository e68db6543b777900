"""Compare two stores file by file (distributed captures against one process)."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

#: files that follow from the activation bytes (checksums, statistics)
_DERIVED = ("checksums.xxh128", "statistics.json")


def files(store: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(store.iterdir())}


def assert_same_store(a: Path, b: Path, *, across_processes: bool = False) -> None:
    """``a`` and ``b`` hold byte-identical files.

    ``across_processes``: the stores were computed by different processes. Their activations
    are byte-identical in almost every run; rarely (about one full-suite run in six on the
    2-core CI machine, cause not found: docs/design.md) a shard differs by one float32 ulp.
    Then every
    other file must still be identical, the shards must agree to 1e-6, and a warning names
    the difference, so that the event stays visible without failing the run.
    """
    fa, fb = files(a), files(b)
    assert sorted(fa) == sorted(fb)
    differ = [name for name in fa if fa[name] != fb[name]]
    if not differ:
        return
    shards = [name for name in differ if name.startswith("acts")]
    gaps = {
        name: float(np.abs(np.frombuffer(fa[name], "<f4") - np.frombuffer(fb[name], "<f4")).max())
        for name in shards
    }
    message = f"differ: {differ}; max abs difference in shards: {gaps}"
    if not across_processes or not shards or set(differ) - set(shards) - set(_DERIVED):
        raise AssertionError(message)
    assert max(gaps.values()) <= 1e-6, message
    warnings.warn(
        f"stores computed in different processes differ by float rounding: {message}", stacklevel=2
    )
