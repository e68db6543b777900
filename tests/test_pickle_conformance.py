"""The pkl.gz format runs the shared Writer/Reader conformance suite (gzip and plain)."""

from __future__ import annotations

from pathlib import Path

from conformance import ConformanceSuite, FormatCase

from actstore.formats.pickle import PickleOptions, PickleWriter


class PickleCase(FormatCase):
    def __init__(self, compress: bool) -> None:
        self.options = PickleOptions(compress=compress, samples_per_shard=5)

    def open_writer(self, root, plan, batches):
        return PickleWriter(plan, root, self.options), batches

    def write_unpublished(self, root, plan, batches):
        writer = PickleWriter(plan, root, self.options)
        for batch in batches:
            writer.write(batch)
        writer.abort()
        return str(root)

    def damage(self, location):
        shard = min(Path(location).glob("shard_0002.pkl*"))
        shard.chmod(0o644)
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF  # same size, different bytes: only the checksum can tell
        shard.write_bytes(bytes(data))


class TestPickleConformance(ConformanceSuite):
    case = PickleCase(compress=True)


class TestPlainPickleConformance(ConformanceSuite):
    case = PickleCase(compress=False)
