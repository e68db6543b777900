"""pkl.gz in parts: each machine writes whole shards (numbered as in the whole store, its
items carrying its ``machine_id``) under ``<dir>/.<out>.parts/part-A-B/``; the merge links
the shards into ``<out>`` under one ``metadata.json`` (the spec's "merge metadata files")."""

from __future__ import annotations

from ..parts import PartFormat, sharded_part_format
from .writer import PickleWriter


def part_format() -> PartFormat:
    """How this format captures in parts and merges them."""
    return sharded_part_format("pickle", PickleWriter)
