"""A reusable test kit for storage formats: the rules every format keeps, as pytest tests.

A format (built in this package or outside it, registered with
:func:`actstore.formats.registry.register_format`) runs them with two lines in a test
module::

    from actstore.testing import ConformanceSuite, FormatCase

    class TestMyFormat(ConformanceSuite):
        case = FormatCase("myformat", MyOptions(rows_per_shard=5))

The rules (:class:`ConformanceSuite`): exact round trip through blocks; ``read_block``
into a caller's buffer; blocks cover every row once and align across sites; every spelling
of a site (name, layer, negative layer, TransformerLens hook) reads the same blocks;
``tokens`` follows ``capture_plan().has_tokens``; statistics match numpy; readers pickle
(DataLoader workers) and are thread-safe; scatter reads equal ``read_block``; the capture
plan comes back; detection finds the format and ``describe()`` has the keys the CLI reads;
an unpublished store is not readable, a damaged one is refused, a good one verifies; a
writer aborted and reopened resumes to the same store; parts merge into the one-process
store; conversion to another format and back is exact; and the same store written
straight to ``s3://`` reads back. A failing rule names what broke.

:mod:`.data` builds the synthetic capture (:func:`make_plan`, :func:`make_acts`,
:func:`make_batches`) and :func:`resign` rewrites a store's root manifest over edited files
(for tests of what the manifest can and cannot catch). Needs pytest.
"""

from .case import FormatCase
from .data import (
    CLASSES,
    D_MODEL,
    FEATURES,
    N_EXAMPLES,
    N_TOKENS,
    SITES,
    make_acts,
    make_batches,
    make_labels,
    make_plan,
    make_tokens,
    resign,
    rich_overrides,
)
from .suite import DESCRIBE_KEYS, ConformanceSuite

__all__ = [
    "CLASSES",
    "DESCRIBE_KEYS",
    "D_MODEL",
    "FEATURES",
    "N_EXAMPLES",
    "N_TOKENS",
    "SITES",
    "ConformanceSuite",
    "FormatCase",
    "make_acts",
    "make_batches",
    "make_labels",
    "make_plan",
    "make_tokens",
    "resign",
    "rich_overrides",
]
