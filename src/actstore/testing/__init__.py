"""A reusable test kit for storage formats: the rules every format keeps, as pytest tests.

A format (built in, or a package of its own declaring the ``actstore.formats`` entry point)
runs them with a test module::

    from actstore.testing import ConformanceSuite, FormatCase

    class TestMyFormat(ConformanceSuite):
        case = FormatCase("myformat", {"rows_per_shard": 5}, cannot_hold={"labels": "why"})

and, in its ``conftest.py``, the kit's pytest plugin (the loopback S3 server its S3 rule
writes to; needs moto): ``pytest_plugins = ["actstore.testing.plugin"]``.

The rules (:class:`ConformanceSuite`, listed in docs/design.md): exact round trips through
blocks and the README's read example (``shape``, ``reader[example, site, token]``,
``tokens``, ``statistics``); site spellings, tokens, statistics against numpy, pickling,
thread safety, scatter reads, CLS rows, the capture plan, detection (a damaged index
included) and ``describe()``; a bfloat16 capture of attention and MLP sites with CLS and
labels, less what the case declares it cannot hold (each of those refused or not
claimed); an unpublished store refused, damage refused, a good store verified; a writer
that keeps no reference to a batch, resumes to the same store, and, killed at each of its
fault points (:mod:`.crash`), reruns to the same bytes; one writer at a time; parts merged;
conversion both ways; a round trip through ``s3://``. A failing rule names what broke.

:class:`BackendSuite` (:mod:`.backend`) is the same for object storage backends: the
contract every backend (``s3://``, ``gs://``, ``az://``...) keeps, run against a real server
on 127.0.0.1 (:mod:`.emulators` starts fake-gcs-server and Azurite; the plugin's ``gcs`` and
``azure`` fixtures give a fresh bucket).

:mod:`.data` builds the synthetic captures (:func:`make_plan`, :func:`rich_overrides`,
:func:`make_acts`, :func:`make_batches`) and :func:`resign` rewrites a store's root
manifest over edited files (for tests of what the manifest can and cannot catch). Needs
pytest.
"""

from .backend import BackendSuite
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
from .reading_rules import DESCRIBE_KEYS
from .suite import ConformanceSuite

__all__ = [
    "CLASSES",
    "DESCRIBE_KEYS",
    "D_MODEL",
    "FEATURES",
    "N_EXAMPLES",
    "N_TOKENS",
    "SITES",
    "BackendSuite",
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
