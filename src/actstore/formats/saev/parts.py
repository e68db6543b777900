"""saev in parts: each machine writes whole shards (global numbering) into
``<out>/.<hash>.parts/part-A-B/``; the merge hard-links them into ``<out>/<hash>`` under one
index, byte-identical to a single-process capture."""

from __future__ import annotations

from ..parts import PartFormat, sharded_part_format
from .writer import SaevWriter


def part_format() -> PartFormat:
    """How this format captures in parts and merges them."""
    return sharded_part_format("saev", SaevWriter)
