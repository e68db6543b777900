"""Where each example's tokens lie in an Activault run: ``actstore-positions.npy``.

Activault's files hold a stream of kept tokens (token cleaning drops padding, special
tokens and the chat template's prefix) packed into equal-sized files, so the files alone no
longer say which example and position a row is. actstore keeps that in a file of its own at
the run's root, which Activault's reader never reads (it reads hook folders) and the root
manifest covers: one record per example, in example order:

- ``first``: the stream row of the example's first kept token;
- ``stored``: how many of its kept tokens are stored (fewer than kept only in the tail a
  run drops, under one file, and at the end of each part of a run captured in parts);
- ``kept``: which of its ``T`` positions cleaning kept (bits, ``numpy.packbits``);
- ``ids``: its ``T`` token ids (all of them, kept or not; -1 where the capture had none).

Position ``t`` of example ``i`` is stored row ``first[i] + r`` when it was kept and its rank
``r`` among the example's kept positions is below ``stored[i]``; otherwise it was not
stored. While a capture runs, the records of examples whose tokens a committed file ends
past are put under ``actstore-positions.parts/`` (one piece per commit, written before
``cfg.json`` records the commit); completion joins them into the one file and removes them.

Example:
    >>> kept = np.array([[True, False, True], [False, True, True]])
    >>> table = build(kept, np.arange(6).reshape(2, 3), first=0, total=3)
    >>> Positions(table, 3).rows(np.array([0, 1]), np.array([0, 1, 2])).tolist()
    [[0, -1, 1], [-1, 2, -1]]
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import CorruptStoreError

if TYPE_CHECKING:
    from ...storage.object import ObjectStore

POSITIONS = "actstore-positions.npy"
PIECES = "actstore-positions.parts"
#: Examples unpacked at once when the records are checked.
CHUNK = 1 << 16


def positions_dtype(tokens: int) -> np.dtype:
    """The record of one example of ``tokens`` positions."""
    return np.dtype(
        [
            ("first", "<i8"),
            ("stored", "<i4"),
            ("kept", "u1", (-(-tokens // 8),)),
            ("ids", "<i4", (tokens,)),
        ]
    )


def build(
    kept: np.ndarray, ids: np.ndarray | None, *, first: int, total: int | None = None
) -> np.ndarray:
    """Records of consecutive examples whose kept-token masks are ``kept`` (bool
    ``[n, T]``) and token ids ``ids`` (``[n, T]``, or None), the first of them starting at
    stream row ``first``; ``total``: rows stored in all (None: every kept token is)."""
    n, t = kept.shape
    table = np.zeros(n, dtype=positions_dtype(t))
    counts = kept.sum(axis=1, dtype=np.int64)
    starts = first + np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    table["first"] = starts
    stored = counts if total is None else np.clip(total - starts, 0, counts)
    table["stored"] = stored
    table["kept"] = np.packbits(kept, axis=1)
    table["ids"] = -1 if ids is None else np.asarray(ids, dtype=np.int64)
    return table


def encode(table: np.ndarray) -> bytes:
    """The ``.npy`` bytes of ``table``."""
    out = io.BytesIO()
    np.save(out, table, allow_pickle=False)
    return out.getvalue()


def decode(data: bytes, tokens: int, source: str, n: int | None = None) -> np.ndarray:
    """A positions file's records, checked to be ``n`` records of ``tokens`` positions."""
    try:
        table = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise CorruptStoreError(f"{source} is not a positions file ({err}); restore it") from err
    if (
        table.dtype != positions_dtype(tokens)
        or table.ndim != 1
        or (n is not None and len(table) != n)
    ):
        raise CorruptStoreError(
            f"{source} holds {table.dtype} {table.shape}, not {n} records of {tokens} "
            "positions: it was edited or belongs to another run; restore it or capture again"
        )
    return table


class Positions:
    """The stored row of each (example, position) of a run, from its positions records."""

    def __init__(self, table: np.ndarray, tokens: int) -> None:
        self.table, self.tokens = table, tokens

    def __len__(self) -> int:
        return len(self.table)

    def kept(self, examples: np.ndarray) -> np.ndarray:
        """Bool ``[len(examples), T]``: the positions cleaning kept."""
        bits = self.table["kept"][examples]
        return np.unpackbits(bits, axis=1, count=self.tokens).astype(bool)

    def stored(self, examples: np.ndarray) -> np.ndarray:
        """Bool ``[len(examples), T]``: the positions whose values the run stores."""
        kept = self.kept(examples)
        rank = np.cumsum(kept, axis=1) - 1
        return kept & (rank < self.table["stored"][examples][:, None])

    def rows(self, examples: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """int64 ``[len(examples), len(positions)]``: the stream row of each position of
        each example, -1 where nothing is stored."""
        kept = self.kept(examples)
        rank = np.cumsum(kept, axis=1) - 1
        where = kept & (rank < self.table["stored"][examples][:, None])
        rows = np.where(where, self.table["first"][examples][:, None] + rank, -1)
        return rows[:, positions]

    def ids(self, examples: np.ndarray) -> np.ndarray:
        """int64 ``[len(examples), T]``: the examples' token ids."""
        return self.table["ids"][examples].astype(np.int64)

    def ids_of_rows(self, lo: int, hi: int) -> np.ndarray:
        """int64 ``[hi - lo]``: the token id the records place at each stream row
        ``lo .. hi`` (-2 where they place none), to compare with a file's ``input_ids``."""
        first, stored = self.table["first"], self.table["stored"].astype(np.int64)
        examples = np.flatnonzero((stored > 0) & (first < hi) & (first + stored > lo))
        out = np.full(hi - lo, -2, dtype=np.int64)
        kept = self.kept(examples)
        rank = np.cumsum(kept, axis=1) - 1
        rows = first[examples][:, None] + rank
        pick = kept & (rank < stored[examples][:, None]) & (rows >= lo) & (rows < hi)
        out[rows[pick] - lo] = self.ids(examples)[pick]
        return out

    def record_faults(
        self,
        total: int,
        next_example: int,
        next_skip: int,
        dropped: int,
        mask: Any,
        *,
        merged: bool = False,
    ) -> list[str]:
        """The commit record's stream position, dropped tail and cleaning flag against the
        records: every example before ``next_example`` wholly stored, ``next_skip`` of its
        kept tokens before row ``total``, ``dropped`` the kept tokens past the files. A
        run ``merged`` from parts (each dropped its own tail) records no position."""
        kept_all = self.kept(np.arange(len(self.table)))
        counts = kept_all.sum(axis=1, dtype=np.int64)
        stored = self.table["stored"].astype(np.int64)
        out = []
        n = len(self.table)
        if merged:
            pass
        elif not 0 <= next_example <= n or (stored[:next_example] != counts[:next_example]).any():
            out.append(f"next_example {next_example} is not where the stored tokens end")
        elif next_example < n and not (
            0 <= next_skip <= counts[next_example]
            and int(self.table["first"][next_example]) + next_skip == total
        ):
            out.append(f"next_skip {next_skip} is not where the stored tokens end")
        if dropped != int(counts.sum()) - total:
            out.append(
                f"dropped_tokens {dropped} is not the {int(counts.sum()) - total} kept past the files"
            )
        if mask is not True and not kept_all.all():
            out.append(f"token_mask is {mask!r}, but cleaning dropped tokens")
        return out

    def faults(self, total: int, source: str) -> list[str]:
        """What the records say that cannot be: rows outside the ``total`` stored, an
        example's rows overlapping the next one's, more stored than kept."""
        table = self.table
        counts = np.concatenate(
            [
                np.unpackbits(table["kept"][i : i + CHUNK], axis=1).sum(axis=1, dtype=np.int64)
                for i in range(0, len(table), CHUNK)
            ]
            or [np.zeros(0, np.int64)]
        )
        stored, first = table["stored"].astype(np.int64), table["first"]
        bad = []
        if (stored < 0).any() or (stored > counts).any():
            bad.append("an example stores more tokens than cleaning kept")
        held = stored > 0
        ends = first + stored
        if (first[held] < 0).any() or (ends[held] > total).any():
            bad.append(f"rows outside the {total} the run stores")
        if (np.diff(first[held]) < stored[held][:-1]).any():
            bad.append("examples whose rows overlap")
        if int(stored.sum()) != total:
            bad.append(f"{int(stored.sum())} stored tokens, where the files hold {total}")
        return [f"{source}: {b}: it was edited; restore it or capture again" for b in bad]


def piece_name(start: int, stop: int) -> str:
    """The name of the piece holding examples ``start .. stop``."""
    return f"{start:012d}-{stop:012d}.npy"


def piece_start(key: str) -> int | None:
    """The first example of the piece at ``key`` (None: not a piece)."""
    name = key.rpartition("/")[2]
    head, _, rest = name.partition("-")
    if not (head.isdigit() and rest.endswith(".npy") and rest[:-4].isdigit()):
        return None
    return int(head)


def join(pieces: list[tuple[int, int, np.ndarray]], tokens: int, n: int, source: str) -> Any:
    """The records of examples ``0..n`` from ``(start, stop, records)`` pieces, which must
    tile the range in order."""
    at, parts = 0, []
    for start, stop, table in sorted(pieces, key=lambda p: p[0]):
        if start != at or len(table) != stop - start or table.dtype != positions_dtype(tokens):
            raise CorruptStoreError(
                f"{source}: the positions of examples {at}.. are missing or damaged; capture "
                "the run again"
            )
        parts.append(table)
        at = stop
    if at != n:
        raise CorruptStoreError(f"{source}: positions end at example {at}, not {n}")
    return np.concatenate(parts) if parts else np.zeros(0, positions_dtype(tokens))


class PositionLog:
    """The positions of the examples a capture hands an Activault run, kept as it goes: the
    records of examples no committed piece holds yet, a piece put at each commit
    (:data:`PIECES`), the whole table (:data:`POSITIONS`) at close. ``key(*parts)``: a key
    below the run; ``first``: the first example not yet in a piece."""

    def __init__(
        self, store: ObjectStore, key: Callable[..., str], tokens_per_example: int, first: int
    ) -> None:
        self.store, self.key, self.tokens = store, key, tokens_per_example
        self._lock = threading.Lock()
        self._pending: list[np.ndarray] = []  # records of examples from _lo on
        self._lo = first

    def add(self, table: np.ndarray) -> None:
        """The records of the next examples handed to the writer (:func:`build`)."""
        with self._lock:
            self._pending.append(table)

    def _take(self, upto: int) -> np.ndarray:
        """The records of examples ``_lo .. upto``, taken off the pending ones."""
        with self._lock:
            table = (
                np.concatenate(self._pending)
                if self._pending
                else np.zeros(0, positions_dtype(self.tokens))
            )
            n = upto - self._lo
            taken, rest = table[:n], table[n:]
            self._pending = [rest] if len(rest) else []
            self._lo = upto
        return taken

    def put_piece(self, upto: int) -> None:
        """Put the positions of the examples a commit ends past (``_lo .. upto``)."""
        if upto <= self._lo:
            return
        start = self._lo
        self.store.put(self.key(PIECES, piece_name(start, upto)), encode(self._take(upto)))

    def write_table(self, total: int, end: int) -> None:
        """Put the whole run's table: the committed pieces, then the examples after the
        last commit up to ``end`` (their tokens stored only up to the files' ``total``)."""
        start = self._lo
        tail = self._take(end)
        kept = np.unpackbits(tail["kept"], axis=1, count=self.tokens)
        counts = kept.sum(axis=1, dtype=np.int64)
        tail["stored"] = np.clip(total - tail["first"], 0, counts)
        pieces = [(start, end, tail)]
        for obj in self.store.list(self.key(PIECES) + "/"):
            begin = piece_start(obj.key)
            if begin is None:
                continue
            table = decode(self.store.get(obj.key), self.tokens, self.store.url(obj.key))
            pieces.append((begin, begin + len(table), table))
        joined = join(pieces, self.tokens, end, self.store.url(self.key()))
        self.store.put(self.key(POSITIONS), encode(joined))
