"""The write side's contracts: :class:`WriterBase` (what capture and convert drive) and
:class:`FormatWriter` (a format's own writer, built from a capture plan)."""

from __future__ import annotations

import abc
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..storage.location import Location

if TYPE_CHECKING:
    import os

    from ..batch import Batch, CapturePlan


class WriterBase(abc.ABC):
    """What capture and convert drive: batches in, one atomic publication at :meth:`close`.
    Nothing is visible to readers until then. Use as a context manager to publish on
    success and abort on error. A format's own writer is a :class:`FormatWriter`; wrappers
    (uploading to S3, re-basing a slice) are plain writers around one.
    """

    resume_from: int = 0
    """Examples already durable (capture restarts at the batch holding this example)."""
    complete: bool = False
    """The store is already published: capture and convert only report it."""
    example_range: tuple[int, int] | None = None
    """``(start, stop)`` of the examples this writer owns (one slice of a distributed
    capture); None: all of them."""
    wants_texts: bool = False
    """The writer stores decoded text, so capture decodes each example's tokens."""

    @abc.abstractmethod
    def write(self, batch: Batch) -> None: ...

    @abc.abstractmethod
    def close(self) -> Path | str:
        """Finish, publish atomically, and return where the store is: its directory (a
        ``Path``) on local disk, its URL on object storage."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Stop without publishing; durable progress is kept for a later resume."""

    def sync(self) -> None:
        """Wait until everything written so far that the writer makes durable before
        publishing is durable (and :meth:`sealed_files` lists it). Default: nothing waits."""

    def sealed_files(self) -> list[tuple[str, os.PathLike]]:
        """Files that are durable and will never change again, for an uploader to send while
        the capture goes on: ``(name, path)`` pairs, ``name`` relative to the output
        location the writer was given, as the file will be named once published; ``path``
        where it is now. Each call lists every sealed file so far (callers skip ones
        already sent). The default, none, means everything is uploaded when the store is
        published."""
        return []

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class FormatWriter(WriterBase):
    """A format's own writer, built as ``Writer.from_plan(plan, location, options)``;
    constructing one creates nothing on disk (the first :meth:`write` does).

    Example:
        >>> import os, tempfile
        >>> from actstore.formats.saev import SaevOptions, SaevWriter
        >>> from actstore.testing import make_acts, make_batches, make_plan
        >>> plan, out = make_plan(), tempfile.TemporaryDirectory()
        >>> with SaevWriter.from_plan(plan, Location.parse(out.name), SaevOptions()) as w:
        ...     print(os.listdir(out.name))  # only its write lock so far  # doctest: +ELLIPSIS
        ...     for batch in make_batches(plan, make_acts(plan)):
        ...         w.write(batch)
        ['.3fc6....lock']
        >>> os.listdir(out.name) == [w.final.name]  # published as the block ended, unlocked
        True
    """

    @classmethod
    @abc.abstractmethod
    def from_plan(cls, plan: CapturePlan, location: Location, options: Any) -> FormatWriter:
        """The writer of capture ``plan`` for output ``location`` (what ``--out`` names)
        with the format's ``options``."""

    @classmethod
    def store_location(cls, plan: CapturePlan, location: Location, options: Any) -> Location:
        """Where the published store will be for output ``location`` (default: there)."""
        return location

    @classmethod
    def convert_options(cls, plan: CapturePlan, options: Any) -> Any:
        """The options a conversion into this format uses for ``plan`` (whole examples of
        ``tokens_per_example`` rows, no token cleaning), so the target keeps every row of
        the source: a format that stores fixed-size files (Activault) picks a size that
        divides the rows, or refuses in one line, before anything is written. Default:
        ``options`` unchanged (every row is kept)."""
        return options
