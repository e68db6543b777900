"""The pkl.gz format keeps the storage rules (actstore.testing), gzipped and plain."""

from __future__ import annotations

from actstore.formats.pickle import PickleOptions
from actstore.testing import ConformanceSuite, FormatCase


class TestPickleConformance(ConformanceSuite):
    case = FormatCase("pickle", PickleOptions(compress=True, samples_per_shard=5))


class TestPlainPickleConformance(ConformanceSuite):
    case = FormatCase("pickle", PickleOptions(compress=False, samples_per_shard=5))
