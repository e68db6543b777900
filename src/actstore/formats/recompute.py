"""What ``verify`` recomputes from a store's data and compares with what the store says.

Statistics are recomputed with the writer's own code, on the rows read back (checked):
a :class:`~actstore.formats.writer.ShardedWriter` folds each shard's rows with
:class:`~actstore.formats.shard.ShardStats` and merges the shards in order
(:func:`~actstore.stats.merge_all`), so :func:`sharded_statistics` does the same with the
shard sizes the store's index records. The result is then **exactly** the stored
statistics (the same float64 operations in the same order), and :func:`compare_statistics`
compares bit for bit: one changed digit, or two sites' statistics swapped, is a fault,
although the manifest was rewritten over the edit.

Example:
    >>> import numpy as np
    >>> from actstore.stats import RunningStats
    >>> a = RunningStats.of(np.ones((2, 3)))
    >>> faults = []
    >>> compare_statistics(faults, "statistics.json", "resid.1", a, RunningStats.of(np.ones((2, 3))))
    >>> faults
    []
    >>> compare_statistics(faults, "statistics.json", "resid.1", a, RunningStats.of(np.zeros((2, 3))))
    >>> faults[0].split(" (")[0]
    'statistics.json: the statistics of resid.1 do not match the data'
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..errors import CorruptStoreError, StoreNotFoundError
from ..stats import RunningStats, merge_all
from ..storage.manifest import jsonable
from .shard import ShardStats

if TYPE_CHECKING:
    from ..sites import Site


class ReaderBase(Protocol):
    """What recomputing needs of a reader (every
    :class:`~actstore.formats.base.ReaderBase` has it; named here, not imported, so base.py
    and this module form no import cycle)."""

    @property
    def sites(self) -> tuple[Site, ...]: ...

    @property
    def d_model(self) -> int: ...

    def blocks(self, site: Any) -> list[Any]: ...

    def read_block(self, block: Any, out: np.ndarray | None = None) -> np.ndarray: ...


def sharded_statistics(
    reader: ReaderBase, shard_rows: Sequence[int], sites: Sequence[Site] | None = None
) -> dict[Site, RunningStats]:
    """Per-site statistics of the rows ``reader`` serves, folded the way a sharded writer
    folds them: the rows of each site in storage order, cut into shards of
    ``shard_rows[k]`` rows, each shard folded by :class:`ShardStats` (every site at once,
    as the writer calls it), the shards merged in order.

    Raises :class:`CorruptStoreError` when the rows do not add up to the shards, and
    whatever the checked reads raise."""
    sites = list(reader.sites if sites is None else sites)
    blocks = {s: reader.blocks(s) for s in sites}
    layouts = {tuple(b.n_rows for b in bl) for bl in blocks.values()}
    groups = [sites] if len(layouts) <= 1 else [[s] for s in sites]
    out: dict[Site, RunningStats] = {}
    for group in groups:
        out.update(_fold(reader, group, [blocks[s] for s in group], shard_rows))
    return out


def _fold(
    reader: ReaderBase, sites: list[Site], blocks: list[list], shard_rows: Sequence[int]
) -> dict[Site, RunningStats]:
    d = int(reader.d_model)
    shards = iter(shard_rows)
    parts: list[dict[Site, RunningStats]] = []
    shard: ShardStats | None = None
    left = 0
    for i, rows in enumerate(_read_ahead(reader, sites, blocks)):
        n, pos = blocks[0][i].n_rows, 0
        while pos < n:
            while left == 0:
                if shard is not None:
                    parts.append(shard.finish())
                left = next(shards, -1)
                if left < 0:
                    raise CorruptStoreError(
                        f"the stored rows outnumber the {len(shard_rows)} shards' "
                        f"{sum(shard_rows)} the index records"
                    )
                shard = ShardStats(sites, d)
            take = min(left, n - pos)
            assert shard is not None
            shard.update({s: r[pos : pos + take] for s, r in rows.items()})
            pos += take
            left -= take
    if shard is not None:
        parts.append(shard.finish())
    rest = left + sum(max(0, k) for k in shards)
    if rest:
        raise CorruptStoreError(f"the index records {rest} rows more than the store holds")
    if not parts:
        return {s: RunningStats(d) for s in sites}
    return {s: merge_all([p[s] for p in parts]) for s in sites}


#: Blocks read ahead of the fold (each on its own thread): object storage answers one
#: ranged GET at a time per connection, so a fold that waited for each block in turn would
#: read at one request's speed.
READ_AHEAD = 8


def _read_ahead(
    reader: ReaderBase, sites: list[Site], blocks: list[list]
) -> Iterator[dict[Site, np.ndarray]]:
    """``{site: rows}`` of block ``i`` of every site, in order, up to :data:`READ_AHEAD`
    blocks read ahead on a pool (a read's error is raised when its block's turn comes)."""
    n = len(blocks[0]) if blocks else 0

    def read(i: int) -> dict[Site, np.ndarray]:
        return {
            s: np.asarray(reader.read_block(bl[i]), dtype="<f4") for s, bl in zip(sites, blocks)
        }

    if n <= 1:
        yield from (read(i) for i in range(n))
        return
    with ThreadPoolExecutor(min(READ_AHEAD, n), thread_name_prefix="actstore-recompute") as pool:
        ahead: deque[Future[dict[Site, np.ndarray]]] = deque()
        try:
            for i in range(n):
                while len(ahead) < READ_AHEAD and i + len(ahead) < n:
                    ahead.append(pool.submit(read, i + len(ahead)))
                yield ahead.popleft().result()
        finally:
            for future in ahead:
                future.cancel()


def fold_shards(
    sites: Sequence[Site], d: int, shards: Iterable[Iterable[dict[Site, np.ndarray]]]
) -> dict[Site, RunningStats]:
    """Statistics of ``shards`` (each an iterable of ``{site: rows}`` pieces, in storage
    order), each shard folded by :class:`ShardStats` and the shards merged in order: what a
    sharded writer stores, for a format that reads its rows itself (zarr)."""
    parts = []
    for pieces in shards:
        shard = ShardStats(sites, d)
        for rows in pieces:
            shard.update({s: np.asarray(r, dtype="<f4") for s, r in rows.items()})
        parts.append(shard.finish())
    if not parts:
        return {s: RunningStats(d) for s in sites}
    return {s: merge_all([p[s] for p in parts]) for s in sites}


def same_statistics(a: RunningStats, b: RunningStats) -> bool:
    """Bit-identical statistics (NaN equal to NaN: non-finite data gives them)."""
    return (
        a.count == b.count
        and a.d == b.d
        and np.array_equal(a.mean, b.mean, equal_nan=True)
        and np.array_equal(a.m2, b.m2, equal_nan=True)
        and np.array_equal(np.float64(a.norm_mean), np.float64(b.norm_mean), equal_nan=True)
    )


def close_statistics(a: RunningStats, b: RunningStats, rtol: float = 1e-9) -> bool:
    """Equal up to float64 rounding of a different merge order (see
    :data:`MERGE_ORDER_RTOL`); counts and widths exactly."""
    scale = max(float(np.abs(a.mean).max(initial=0.0)), 1e-300)
    return (
        a.count == b.count
        and a.d == b.d
        and np.allclose(a.mean, b.mean, rtol=rtol, atol=rtol * scale, equal_nan=True)
        and np.allclose(a.m2, b.m2, rtol=rtol, atol=0.0, equal_nan=True)
        and bool(np.isclose(a.norm_mean, b.norm_mean, rtol=rtol, atol=0.0, equal_nan=True))
    )


#: Tolerance for statistics whose merge order the store does not record (an Activault run
#: merged from parts: each part's totals were merged, in part order, and where the parts
#: ended is not kept). Reassociating Chan et al.'s merges changes results by a few float64
#: ulps per merge (relative ~1e-16 each, ~1e-13 for millions of merges); 1e-9 is far above
#: that and far below any edit a reader would notice.
MERGE_ORDER_RTOL = 1e-9


def compare_statistics(
    faults: list[str],
    where: str,
    site: object,
    stored: RunningStats | None,
    recomputed: RunningStats,
    *,
    exact: bool = True,
    record: Any = None,
    to_record: Callable[[RunningStats], Any] = RunningStats.to_dict,
) -> None:
    """Append a fault unless ``stored`` (the statistics file ``where`` holds for ``site``)
    equals ``recomputed`` from the data: bit for bit, or with ``exact=False`` up to
    :data:`MERGE_ORDER_RTOL`. ``stored`` None: nothing to compare. ``record``, given, is
    the site's record as the file holds it, values derived from the exact ones included
    (a variance, a standard deviation): compared (when ``exact``) with
    ``to_record(recomputed)``, as the writer would write it."""
    if stored is None:
        return
    ok = same_statistics if exact else close_statistics
    if ok(stored, recomputed):
        if exact and record is not None:
            want, got = jsonable(to_record(recomputed)), jsonable(record)
            if _text(want) != _text(got):  # as JSON text: a NaN equals a NaN
                if isinstance(want, dict) and isinstance(got, dict):
                    keys = sorted(
                        k for k in {*want, *got} if _text(want.get(k)) != _text(got.get(k))
                    )
                else:
                    keys = ["the record"]
                faults.append(
                    f"{where}: the statistics of {site} do not match the data ({', '.join(keys)} "
                    "differ from what the stored values give): the statistics were edited; "
                    "re-create the store"
                )
        return
    if stored.count != recomputed.count or stored.d != recomputed.d:
        detail = (
            f"they count {stored.count} rows of width {stored.d}, the store holds "
            f"{recomputed.count} of {recomputed.d}"
        )
    else:
        differ = [
            name
            for name, x, y in (
                ("mean", stored.mean, recomputed.mean),
                ("m2", stored.m2, recomputed.m2),
                ("norm_mean", np.float64(stored.norm_mean), np.float64(recomputed.norm_mean)),
            )
            if not np.array_equal(x, y, equal_nan=True)
        ]
        detail = f"{', '.join(differ)} differ from what the stored values give"
    faults.append(
        f"{where}: the statistics of {site} do not match the data ({detail}): the statistics "
        "or the data were edited; re-create the store"
    )


def _text(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def recompute_into(
    faults: list[str],
    reader: ReaderBase,
    shard_rows: Sequence[int] | None,
    where: str,
    stored_of: Callable[[Site], RunningStats | None],
    record_of: Callable[[Site], Any] | None = None,
    *,
    computed: dict[Site, RunningStats] | None = None,
) -> None:
    """:func:`sharded_statistics` of every site (or ``computed``, when the caller folded
    them the same way already) compared with ``stored_of(site)`` (the stored statistics,
    or None) and ``record_of(site)`` (the site's record as stored); what cannot be read is
    a fault (unless the data's faults are already listed)."""
    if shard_rows is None:
        return
    try:
        got = sharded_statistics(reader, shard_rows) if computed is None else computed
        for site, stats in got.items():
            record = None if record_of is None else record_of(site)
            compare_statistics(faults, where, site, stored_of(site), stats, record=record)
    except (CorruptStoreError, StoreNotFoundError) as err:
        # data that cannot be read back is already listed (verify read every byte first);
        # only a store that failed nothing else gets this fault of its own
        if not faults:
            faults.append(f"{where}: the statistics could not be recomputed from the data: {err}")


__all__ = [
    "MERGE_ORDER_RTOL",
    "close_statistics",
    "compare_statistics",
    "fold_shards",
    "recompute_into",
    "same_statistics",
    "sharded_statistics",
]
