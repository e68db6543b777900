"""``verify`` of a saev directory beyond its files' bytes: non-finite values and the zero
padding after the last example, counted as the shards are read; the directory name against
the content hash; the statistics against the shapes (:class:`SaevVerify`)."""

from __future__ import annotations

import re

import numpy as np

from ...errors import CorruptStoreError
from ..report import VerifyReport
from .index import SaevIndex
from .writer import STATISTICS

_HASH_NAME = re.compile(r"^[0-9a-f]{8}$|^[0-9a-f]{64}$")


class SaevVerify(SaevIndex):
    """``verify``'s scan and content checks of a saev directory."""

    def scan_chunk(self, name: str, offset: int, data: memoryview) -> None:
        """Count non-finite values and check the zero padding after the last example."""
        if not (name.startswith("acts") and name.endswith(".bin")):
            return
        md = self.metadata
        valid_bytes = self.shard_counts[int(name[4:10])] * md.example_nbytes
        valid = max(0, min(len(data), valid_bytes - offset))
        values = np.frombuffer(data[: valid - valid % 4], dtype="<f4")
        scan = self.__dict__.setdefault("_scan", {"non_finite": 0, "bad_pad": set()})
        scan["non_finite"] += int(values.size - np.count_nonzero(np.isfinite(values)))
        if valid < len(data) and np.frombuffer(data[valid:], dtype=np.uint8).any():
            scan["bad_pad"].add(name)

    def verify_content(self, report: VerifyReport) -> None:
        """The directory name against the content hash, the statistics against the shapes,
        zero padding (saev dialect) and non-finite values."""
        md = self.metadata
        expected_hash = md.content_hash()
        name = self.location.name
        if _HASH_NAME.match(name) and name != expected_hash:
            report.faults.append(
                f"directory name {name} differs from the metadata hash {expected_hash}: "
                "metadata.json was edited after publication"
            )
        if self.files.exists(STATISTICS):
            try:
                for site in self.sites:
                    stats = self.site_statistics(site)
                    want = md.n_examples * md.tokens_per_ex
                    if stats is None or stats.count != want or stats.d != md.d_model:
                        raise CorruptStoreError(
                            f"layer {site.layer} counts {stats and stats.count} rows of width "
                            f"{stats and stats.d}, expected {want} of {md.d_model}"
                        )
                    if stats.mean.shape != (md.d_model,) or stats.m2.shape != (md.d_model,):
                        raise CorruptStoreError(
                            f"layer {site.layer} has vectors of the wrong length"
                        )
            except (CorruptStoreError, KeyError, TypeError, AttributeError, ValueError) as err:
                report.faults.append(f"{STATISTICS} is malformed: {err}")
        scan = self.__dict__.pop("_scan", {"non_finite": 0, "bad_pad": set()})
        for shard in sorted(scan["bad_pad"]):
            report.faults.append(f"{shard}: padding after the last example is not zero")
        if scan["non_finite"]:
            report.notes.append(f"{scan['non_finite']} activation values are NaN or infinite")
