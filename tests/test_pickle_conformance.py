"""The pkl.gz format runs the shared Writer/Reader conformance suite."""

from __future__ import annotations

import gzip
from pathlib import Path

from conformance import ConformanceSuite, FormatCase

from actstore.formats.pickle import PickleOptions, PickleWriter


class PickleCase(FormatCase):
    """Five samples per shard, so the 23-example store has several shards."""

    def open_writer(self, root, plan, batches):
        return PickleWriter(plan, root, PickleOptions(samples_per_shard=5)), batches

    def write_unpublished(self, root, plan, batches):
        writer, batches = self.open_writer(root, plan, batches)
        for batch in batches:
            writer.write(batch)
        writer.abort()
        return str(root)

    def damage(self, location):
        shard = sorted(Path(location).glob("*.pkl.gz"))[1]
        shard.chmod(0o644)
        data = gzip.decompress(shard.read_bytes())
        shard.write_bytes(gzip.compress(data[:-40]))

    def site_name(self, site):
        return site.layer


class TestPickleConformance(ConformanceSuite):
    case = PickleCase()
