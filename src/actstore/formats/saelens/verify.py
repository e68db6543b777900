"""``verify`` of a SAELens cache beyond its files' bytes: non-finite values counted as
the files are read, row counts and statistics against the layout, each Arrow file parsed
(a foreign cache), and ``actstore.json``'s ``values_at`` recomputed from the files
(:class:`SaelensVerify`)."""

from __future__ import annotations

import numpy as np

from ...errors import CorruptStoreError
from ..report import VerifyReport
from .index import SaelensIndex, _chunk_values
from .layout import INFO, SIDECAR, STATISTICS
from .writer import _values_at as _values_at_of


class SaelensVerify(SaelensIndex):
    """``verify``'s scan and content checks of a SAELens cache."""

    def scan_chunk(self, name: str, offset: int, data: memoryview) -> None:
        """Count non-finite activation values in the value ranges the chunk overlaps."""
        if self.layout is None or name not in self.arrow_files:
            return
        f = self.arrow_files.index(name)
        item = self.dtype.itemsize
        column_bytes = self.context_size * self.d_model * item
        scan = self.__dict__.setdefault("_scan", {"non_finite": 0})
        end = offset + len(data)
        for b, starts in enumerate(self._values_at(f)):
            size = self._rows()[f][b] * column_bytes
            for start in starts[: len(self.columns)]:
                lo, hi = max(start, offset), min(start + size, end)
                if hi > lo:
                    values = np.frombuffer(data[lo - offset : hi - offset], dtype=self.dtype)
                    scan["non_finite"] += int(values.size - np.count_nonzero(np.isfinite(values)))

    def verify_content(self, report: VerifyReport) -> None:
        """Row counts against the layout (and, for foreign caches, each file parsed); in
        actstore's caches, what the sidecar says of each Arrow file against the file."""
        scan = self.__dict__.pop("_scan", {"non_finite": 0})
        non_finite = scan["non_finite"]
        if self.layout is not None:
            report.faults += self._sidecar_faults()
        if self.layout is None:
            for f, name in enumerate(self.arrow_files):
                try:
                    table = self._table(f)
                    for column in self.columns:
                        for chunk in table.column(column).chunks:
                            values = _chunk_values(chunk, self.context_size, self.d_model)
                            non_finite += int(values.size - np.count_nonzero(np.isfinite(values)))
                except CorruptStoreError as err:
                    report.faults.append(str(err))
                report.files_checked += 1
                report.bytes_checked += self.files.require(name)
        elif not self.files.exists(STATISTICS):
            report.faults.append(
                f"{STATISTICS} is missing: actstore's writer stores every site's statistics; "
                "restore it or re-capture"
            )
        else:  # the statistics against the shapes
            try:
                for site in self.sites:
                    stats = self.site_statistics(site)
                    want = self.n_rows(site)
                    if stats is None or stats.count != want or stats.d != self.d_model:
                        raise CorruptStoreError(
                            f"{site} counts {stats and stats.count} rows of width "
                            f"{stats and stats.d}, expected {want} of {self.d_model}"
                        )
                    if stats.mean.shape != (stats.d,) or stats.m2.shape != (stats.d,):
                        raise CorruptStoreError(f"{site} has vectors of the wrong length")
            except (CorruptStoreError, KeyError, TypeError, AttributeError, ValueError) as err:
                report.faults.append(f"{STATISTICS} is malformed: {err}")
        if non_finite:
            report.notes.append(f"{non_finite} activation values are NaN or infinite")

    def _sidecar_faults(self) -> list[str]:
        """``actstore.json``'s ``values_at`` recomputed from each Arrow file with the
        writer's own code, and ``dataset_info.json``'s fields besides the features empty
        (as the writer leaves them)."""
        faults = []
        info = self.files.read_json(INFO)
        text = ("citation", "description", "homepage", "license")  # "" as datasets writes
        filled = sorted(
            k
            for k, v in info.items()
            if k != "features" and (v != "" if k in text else v not in ("", None, {}, []))
        )
        if filled:
            faults.append(
                f"{INFO}: {', '.join(filled)} {'is' if len(filled) == 1 else 'are'} set, where "
                "actstore's writer leaves them empty: the file was edited; restore it or "
                "re-capture"
            )
        import pyarrow as pa

        if self.layout is None or self.record is None:
            return faults
        for f, name in enumerate(self.arrow_files):
            try:
                got = _values_at_of(self.files.map(name), self.layout)
            except (pa.ArrowException, ValueError, OSError, KeyError, IndexError) as err:
                faults.append(f"{name} is not a readable Arrow stream ({err!r})")
                continue
            if got != self.record["files"][f]["values_at"]:
                faults.append(
                    f"{SIDECAR}: values_at of {name} is not where the file holds its values: "
                    "it was edited; restore it or re-capture"
                )
        return faults
