"""Distributed capture of the saelens format: parts of whole files, merged by linking.

Machine ``i`` writes its slice (aligned on ``examples_per_shard``, files numbered as in
the whole store) to ``<dir>/.<name>.parts/part-A-B/`` with a ``part.json``; the merge
hard-links every part's files into ``<dir>/<name>`` under one index and merged
statistics, byte-identical to a one-process capture, then removes the parts.
"""

from __future__ import annotations

from ..parts import PartFormat, sharded_part_format
from .writer import SaelensWriter


def part_format() -> PartFormat:
    """The :class:`~actstore.formats.parts.PartFormat` of the saelens format."""
    return sharded_part_format("saelens", SaelensWriter)
