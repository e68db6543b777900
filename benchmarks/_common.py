"""Small helpers shared by the benchmark scripts: timing, page-cache eviction, tables.

Example:
    >>> with Timer() as t:
    ...     sum(range(10))
    45
    >>> t.seconds >= 0
    True
    >>> print(table(["what", "GB/s"], [["read", 1.5]]))
    what | GB/s
    ---- | ----
    read | 1.50
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from actstore.formats.writerbase import WriterBase

if TYPE_CHECKING:
    from actstore.batch import CapturePlan
    from actstore.formats.saev import SaevMetadata, SaevOptions, SaevWriter


#: The shard files of a saev store (``acts000000.bin``...), not ``actstore-blocks.xxh3``.
SAEV_SHARDS = "acts[0-9]*.bin"


class Timer:
    """``with Timer() as t: ...`` then ``t.seconds`` (wall clock) and ``t.cpu`` (user + system
    CPU seconds of this process, its threads and its child processes, live or reaped: a
    measure of work that other load on the machine does not inflate much)."""

    def __enter__(self) -> Self:
        self.start = time.perf_counter()
        self._cpu0 = _cpu()
        self.seconds = self.cpu = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = self.elapsed()
        self.cpu = _cpu() - self._cpu0

    def elapsed(self) -> float:
        """Seconds since the ``with`` block began (also inside it)."""
        return time.perf_counter() - self.start


def _cpu() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime + _live_children_cpu()


def _live_children_cpu() -> float:
    """CPU seconds of this process's children still running (persistent DataLoader
    workers): ``RUSAGE_CHILDREN`` counts a child only once it has exited and been reaped."""
    total, me = 0, os.getpid()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited meanwhile
        if int(fields[1]) == me:  # fields after the command name: state, ppid, ...
            total += int(fields[11]) + int(fields[12])  # utime, stime in clock ticks
    return total / os.sysconf("SC_CLK_TCK")


def evict(paths: Iterable[str | os.PathLike]) -> None:
    """Drop ``paths`` from the page cache (``POSIX_FADV_DONTNEED``; needs no root, works on
    clean pages), so the next read comes from the disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def files_under(root: str | os.PathLike, pattern: str = "*") -> list[Path]:
    """Regular files under ``root`` matching ``pattern``, sorted."""
    return sorted(p for p in Path(root).rglob(pattern) if p.is_file())


def sequential_read(paths: Sequence[str | os.PathLike], chunk: int = 8 << 20) -> tuple[int, Timer]:
    """``dd``-style read of ``paths`` into one reused buffer: (bytes, timer)."""
    buf = bytearray(chunk)
    total = 0
    with Timer() as t:
        for path in paths:
            with open(path, "rb", buffering=0) as f:
                while n := f.readinto(buf):
                    total += n
    return total, t


def fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}"
    return str(value)


def table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A Markdown table (pipes, aligned columns) of ``rows`` under ``header``."""
    cells = [list(header)] + [[fmt(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, " | ".join("-" * w for w in widths))
    return "\n".join(lines)


class DiscardWriter(WriterBase):
    """Accepts batches and drops them: capture with no storage cost (the baseline)."""

    def write(self, batch: Any) -> None:
        pass

    def close(self) -> None:
        return None

    def abort(self) -> None:
        pass


def saev_plan(
    md: SaevMetadata,
    *,
    has_tokens: bool = False,
    has_labels: bool = False,
    classes: list[str] | None = None,
    batch_size: int = 32,
) -> tuple[CapturePlan, SaevOptions]:
    """``(plan, options)`` of a capture whose saev metadata is ``md``: what
    ``SaevWriter.from_plan`` takes to write the store ``md`` describes (same content hash)."""
    from actstore.formats.saev import SaevOptions

    plan = md.capture_plan(
        has_tokens=has_tokens, has_labels=has_labels, classes=classes, batch_size=batch_size
    )
    return plan, SaevOptions(dialect=md.dialect, patches_per_shard=md.patches_per_shard)


def saev_writer(md: SaevMetadata, root: str | os.PathLike, **plan: Any) -> SaevWriter:
    """The writer of the saev store ``md`` describes, under ``root`` (published at
    ``root/<content hash>``); ``plan`` goes to :func:`saev_plan`."""
    from actstore.formats.saev import SaevWriter
    from actstore.storage.location import Location

    capture_plan, options = saev_plan(md, **plan)
    return SaevWriter.from_plan(capture_plan, Location.parse(root), options)
