"""The bookkeeping of an unfinished sharded store: the journal (``.partial/progress.jsonl``:
a head line, then one line per durable shard, appended as each shard commits, so recording
costs O(1) per shard), and ``part.json`` of a distributed capture's parts.

Example:
    >>> import tempfile
    >>> d = tempfile.TemporaryDirectory()
    >>> write_journal(d.name, {"record": {}}, [])
    >>> append_journal(d.name, {"index": 0}); append_journal(d.name, {"index": 1})
    >>> recorded_shards(d.name)
    2
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CorruptStoreError
from ..stats import RunningStats
from ..storage import atomic_write_bytes
from ..storage.local import load_json

if TYPE_CHECKING:
    from ..storage.integrity import Integrity

log = logging.getLogger(__name__)

PROGRESS = "progress.jsonl"
PART = "part.json"
#: Files of the partial directory that are bookkeeping, never published.
BOOKKEEPING = (PROGRESS,)


def _line(doc: dict[str, Any]) -> bytes:
    return (json.dumps(doc, default=str, separators=(",", ":")) + "\n").encode()


def write_journal(
    partial: str | os.PathLike, head: dict[str, Any], shards: list[dict[str, Any]]
) -> None:
    """Write the journal of ``partial`` anew (atomically): ``head``, then ``shards``."""
    data = b"".join(_line(doc) for doc in [head, *shards])
    atomic_write_bytes(Path(partial) / PROGRESS, data)


def append_journal(partial: str | os.PathLike, entry: dict[str, Any]) -> None:
    """Record one durable shard: one line appended to the journal, after the shard's files
    are durable. The line itself is not fsynced (a flush of the disk's cache per shard,
    7-30 ms on the 2-core machine's disk): a process killed at any point keeps it (it is
    in the page cache), and a line lost with the machine's power only costs rewriting
    its shard, since :func:`read_journal` stops at the first line that is not whole."""
    with open(Path(partial) / PROGRESS, "ab") as f:
        f.write(_line(entry))


def read_journal(partial: str | os.PathLike) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The journal of an unfinished store: its head, and the shards recorded in order (a
    last line cut short by a crash is a shard not recorded)."""
    with open(Path(partial) / PROGRESS, "rb") as f:
        lines = f.read().split(b"\n")
    head = load_json(lines[0])
    shards: list[dict[str, Any]] = []
    for i, line in enumerate(lines[1:], 1):
        if not line.strip():
            continue
        try:
            entry = load_json(line)
        except ValueError:
            entry = None
        follows = not shards or entry_index(entry) == entry_index(shards[-1]) + 1
        if not isinstance(entry, dict) or not follows:
            # a crash cut this line short, or a power loss dropped it (unsynced appends):
            # the shards from here on are not recorded and are written again
            log.warning(
                "the journal's line %d is not whole: shards from %d on are not recorded",
                i,
                len(shards),
            )
            break
        shards.append(entry)
    if not isinstance(head, dict):
        raise CorruptStoreError(f"{partial}: the journal's head is not an object")
    return head, shards


def entry_index(entry: Any) -> int:
    """A journal line's shard index (-2 when it has none: it follows nothing)."""
    index = entry.get("index") if isinstance(entry, dict) else None
    return index if isinstance(index, int) else -2


def recorded_shards(partial: str | os.PathLike) -> int:
    """How many shards an unfinished store's journal records (0 when it has none)."""
    try:
        return len(read_journal(partial)[1])
    except (OSError, ValueError):
        return 0


def stats_doc(stats: RunningStats) -> dict[str, Any]:
    """A shard's statistics in the journal: :meth:`RunningStats.to_packed` (``var`` is
    derived, so left out; exact float64 in base64, cheap to encode for many sites)."""
    return stats.to_packed()


# ---------------------------------------------------------------------- parts


def read_part(part_dir: str | os.PathLike, checks: Integrity | None = None) -> dict[str, Any]:
    """``part.json`` of a published part, checked against the part's root manifest and to
    tile its example range."""
    part_dir = Path(part_dir)
    doc = (checks or part_checks(part_dir)).read_json(PART)
    try:
        start, stop = (int(x) for x in doc["example_range"])
        held = sum(int(e["n_examples"]) for e in doc["shards"])
        doc["record"], doc["plan"], doc["options"]
    except (KeyError, TypeError, ValueError) as err:
        raise CorruptStoreError(
            f"{part_dir / PART} is malformed ({err!r}); re-capture this part"
        ) from err
    if held != stop - start:
        raise CorruptStoreError(
            f"{part_dir / PART} lists {held} examples for [{start}, {stop}); re-capture this part"
        )
    return doc


def part_checks(part: Path) -> Integrity:
    """The integrity checks of a published part (its root manifest)."""
    from ..storage.files import LocalFiles
    from ..storage.integrity import Integrity

    return Integrity.open(LocalFiles(part))
