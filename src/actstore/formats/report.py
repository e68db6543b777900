"""What a store says of itself and what ``verify`` finds: :func:`summary_of` (what a root
manifest records of a store's metadata, written by writers and checked by readers on open)
and :class:`VerifyReport`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..sites import Site


@dataclass
class VerifyReport:
    """Outcome of ``Reader.verify()``: any ``faults`` make it fail; ``notes`` inform."""

    location: str
    faults: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    files_checked: int = 0
    bytes_checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.faults


def summary_of(
    *, sites: Sequence[Site | str], d_model: int, dtype: str, rows: int, **extra: Any
) -> dict[str, Any]:
    """What a root manifest records of a store's metadata and a reader checks on open:
    the sites in storage order, the row width, the stored dtype and the rows each site
    holds, plus any format facts in ``extra``.

    Example:
        >>> summary_of(sites=[Site("resid", 3)], d_model=8, dtype="float32", rows=12)
        {'sites': ['resid.3'], 'd_model': 8, 'dtype': 'float32', 'rows': 12}
    """
    return {
        "sites": [str(s) for s in sites],
        "d_model": int(d_model),
        "dtype": str(dtype),
        "rows": int(rows),
        **extra,
    }
