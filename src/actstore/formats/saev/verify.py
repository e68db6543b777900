"""``verify`` of a saev directory beyond its files' bytes: non-finite values and the zero
padding after the last example, counted as the shards are read, and the statistics folded
from the same read; the directory name against the content hash; the statistics against
the shapes (:class:`SaevVerify`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from ...errors import CorruptStoreError, StoreNotFoundError
from ...sites import Site
from ...stats import RunningStats, merge_all
from ..report import VerifyReport
from ..shard import ShardStats
from .index import SaevIndex
from .writer import STATISTICS

_HASH_NAME = re.compile(r"^[0-9a-f]{8}$|^[0-9a-f]{64}$")


class SaevVerify(SaevIndex):
    """``verify``'s scan and content checks of a saev directory."""

    #: whether :meth:`scan_chunk` folds the statistics (set by its first call of a verify)
    _fold_scans: bool

    def scan_chunk(self, name: str, offset: int, data: memoryview) -> None:
        """Count non-finite values, check the zero padding after the last example, and fold
        the examples' statistics (each shard as the writer folded it)."""
        if not (name.startswith("acts") and name.endswith(".bin")):
            return
        md = self.metadata
        index = int(name[4:10])
        valid_bytes = self.shard_counts[index] * md.example_nbytes
        valid = max(0, min(len(data), valid_bytes - offset))
        values = np.frombuffer(data[: valid - valid % 4], dtype="<f4")
        scan = self.__dict__.setdefault("_scan", {"non_finite": 0, "bad_pad": set()})
        scan["non_finite"] += int(values.size - np.count_nonzero(np.isfinite(values)))
        if valid < len(data) and np.frombuffer(data[valid:], dtype=np.uint8).any():
            scan["bad_pad"].add(name)
        if "_fold_scans" not in self.__dict__:
            try:
                self._fold_scans = self.statistics_shards() is not None
            except (CorruptStoreError, StoreNotFoundError):  # reported by the checks
                self._fold_scans = False
        if self._fold_scans:
            folds: dict[int, _ShardFold] = self.__dict__.setdefault("_folds", {})
            if offset == 0 or index not in folds:  # a file read (again) from its start
                folds[index] = _ShardFold(
                    list(self.sites),
                    [self._layer_index(site) for site in self.sites],
                    (len(md.layers), md.tokens_per_ex, md.d_model),
                    valid_bytes,
                )
            if offset < valid_bytes:
                folds[index].feed(offset, data[:valid])

    def scanned_statistics(self) -> dict[Site, RunningStats] | None:
        """The statistics folded as :meth:`scan_chunk` saw every shard's examples whole and
        in order, merged in shard order as the writer merged them (shards without
        examples before the last one count as empty parts, as
        :func:`~actstore.formats.recompute.sharded_statistics` folds them); None when a
        shard was not seen whole."""
        folds: dict[int, _ShardFold] = self.__dict__.pop("_folds", {})
        self.__dict__.pop("_fold_scans", None)
        md = self.metadata
        last = max((i for i, count in enumerate(self.shard_counts) if count), default=-1)
        parts = []
        for index in range(last + 1):
            want = self.shard_counts[index] * md.example_nbytes
            fold = folds.get(index)
            if fold is None and not want:
                parts.append(ShardStats(self.sites, md.d_model).finish())
                continue
            if fold is None or fold.result is None:
                return None
            parts.append(fold.result)
        if not parts:
            return {s: RunningStats(md.d_model) for s in self.sites}
        return {s: merge_all([p[s] for p in parts]) for s in self.sites}

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


@dataclass
class _ShardFold:
    """One shard file's statistics, folded from its bytes as ``verify`` reads them in
    order (``feed``), each site on its own (:class:`ShardStats` per site: a site's result
    does not depend on the others'): whole examples (``[layers, tokens, d]`` float32) a
    read holds are folded together, an example a read cuts is folded slab by slab, and
    only a row cut in two is carried over. :attr:`result` once all ``want`` bytes of the
    shard's examples were fed in order."""

    sites: list[Site]
    #: each site's layer slot in an example, in the order of ``sites``
    slots: list[int]
    #: an example's shape: layers, tokens, d
    shape: tuple[int, int, int]
    #: bytes of the shard's examples (the padding after them is not folded)
    want: int
    at: int = 0
    carry: bytearray = field(default_factory=bytearray)
    broken: bool = False
    result: dict[Site, RunningStats] | None = None
    #: each site's fold, in the order of ``sites``
    folds: list[ShardStats] = field(init=False)
    #: layer slot -> index in ``sites``
    site_of: dict[int, int] = field(init=False)

    def __post_init__(self) -> None:
        self.folds = [ShardStats([site], self.shape[2]) for site in self.sites]
        self.site_of = {slot: k for k, slot in enumerate(self.slots)}

    def feed(self, offset: int, data: memoryview) -> None:
        """Fold the shard's bytes from ``offset`` (the next after those fed before)."""
        if offset != self.at or self.broken or self.result is not None:
            self.broken, self.result = True, None
            return
        layers, tokens, d = self.shape
        row = d * 4
        pos = self.at - len(self.carry)  # where the bytes not yet folded start
        self.at += len(data)
        if self.carry:  # a row cut by the previous read
            take = min(row - len(self.carry), len(data))
            self.carry += data[:take]
            data = data[take:]
            if len(self.carry) < row:
                return
            self._rows(pos, np.frombuffer(self.carry, "<f4"))
            pos, self.carry = pos + row, bytearray()
        example = layers * tokens * row
        head = min(len(data), -pos % example)  # to the next example's start
        self._rows(pos, np.frombuffer(data[: head - head % row], "<f4"))
        pos, data = pos + head - head % row, data[head - head % row :]
        if pos % example == 0:
            whole = len(data) // example
            if whole:
                self._examples(np.frombuffer(data[: whole * example], "<f4"), whole)
                pos, data = pos + whole * example, data[whole * example :]
            tail = len(data) - len(data) % row
            self._rows(pos, np.frombuffer(data[:tail], "<f4"))
            pos, data = pos + tail, data[tail:]
        self.carry = bytearray(data)  # less than a row
        if self.at == self.want and not self.carry:
            self.result = {
                site: fold.finish()[site] for site, fold in zip(self.sites, self.folds, strict=True)
            }

    def _rows(self, pos: int, values: np.ndarray) -> None:
        """Fold whole rows starting at byte ``pos`` of the shard, slab by slab (within one
        example: a slab is one layer's ``tokens`` rows)."""
        _layers, tokens, d = self.shape
        slab = tokens * d * 4
        at = 0
        while at < len(values):
            n = min(len(values) - at, (slab - pos % slab) // 4)
            k = self.site_of.get((pos // slab) % self.shape[0])
            if k is not None:
                self.folds[k].update({self.sites[k]: values[at : at + n].reshape(-1, d)})
            at, pos = at + n, pos + n * 4

    def _examples(self, values: np.ndarray, n: int) -> None:
        """Fold ``n`` whole examples: each site's rows of all of them at once."""
        layers, tokens, d = self.shape
        slabs = values.reshape(n, layers, tokens, d)
        for k, slot in enumerate(self.slots):
            rows = np.ascontiguousarray(slabs[:, slot]).reshape(n * tokens, d)
            self.folds[k].update({self.sites[k]: rows})
