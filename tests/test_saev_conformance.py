"""The saev format runs the shared Writer/Reader conformance suite (both dialects)."""

from __future__ import annotations

from pathlib import Path

from conformance import ConformanceSuite, FormatCase

from actstore.formats.saev import SaevOptions, SaevWriter


class SaevCase(FormatCase):
    def __init__(self, dialect: str = "protocol") -> None:
        self.dialect = dialect

    def _writer(self, root: Path, plan):
        if self.dialect == "saev":
            plan = type(plan)(**{**plan.__dict__, "family": "clip"})
        options = SaevOptions(
            dialect=self.dialect, patches_per_shard=5 * plan.tokens_per_example * len(plan.sites)
        )
        return SaevWriter.from_plan(plan, root, options)

    def open_writer(self, root, plan, batches):
        return self._writer(root, plan), batches

    def write_unpublished(self, root, plan, batches):
        writer = self._writer(root, plan)
        for batch in batches:
            writer.write(batch)
        writer.abort()
        return str(writer.final)

    def damage(self, location):
        shard = Path(location) / "acts000001.bin"
        shard.chmod(0o644)
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size - 4)


class TestSaevConformance(ConformanceSuite):
    case = SaevCase("protocol")


class TestSaevDialectConformance(ConformanceSuite):
    case = SaevCase("saev")
