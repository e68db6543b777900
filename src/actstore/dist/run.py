"""Capture one machine's slice of a dataset, and merge when every slice is done.

:func:`capture_part` is what each Slurm array task or Ray worker runs: it loads its own
model copy, works out the split from the dataset size and the format's shard size, and
writes its slice as a part (resuming a crashed one, skipping a finished one).
:func:`capture_distributed` adds the step the last machine to finish takes: the merge.

Example:
    >>> from actstore.capture import CaptureConfig
    >>> cfg = CaptureConfig(model="gpt2", dataset="corpus.jsonl", sites=("resid.6",))
    >>> capture_distributed(cfg, "saev", "acts", machine_id=3, n_machines=8)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..capture import CaptureConfig, capture
from ..errors import ConfigError
from ..formats.registry import get_format
from ..storage.location import Location, refuse_unwritable
from .parts import MissingPartsError, is_published, merge_store, part_format
from .split import Slice

log = logging.getLogger(__name__)


class _NothingToWrite:
    """Writer stand-in for a machine whose slice is empty: capture sees it complete and
    stops after planning."""

    complete = True

    def __init__(self, example_range: tuple[int, int]) -> None:
        self.example_range = example_range
        self.resume_from = example_range[1]

    def close(self) -> None:
        return None

    def abort(self) -> None:
        pass


@dataclass(frozen=True, kw_only=True)
class PartResult:
    """What one machine did."""

    slice: Slice
    part: Path | str | None
    """The published part (None for an empty slice or an already merged store)."""
    final: Path | str
    """Where the merged store goes (a path, or a URL for object storage)."""
    store_examples: int
    """Examples in the whole store (all slices)."""
    n_examples_run: int
    seconds: float
    already_complete: bool
    slices: tuple[Slice, ...] = ()
    """Every machine's slice of this capture (the split every machine computes alike)."""


def capture_part(
    config: CaptureConfig, fmt: str, out: str, options: Any, *, machine_id: int, n_machines: int
) -> PartResult:
    """Capture slice ``machine_id`` of ``n_machines`` into its part (see module docstring)."""
    if not 0 <= machine_id < n_machines:
        raise ConfigError(f"machine id {machine_id} is outside 0..{n_machines - 1}")
    location = Location.parse(out)
    refuse_unwritable(location)
    spec, layout = get_format(fmt), part_format(fmt)
    if not location.is_local and not layout.remote:  # before the model loads
        raise ConfigError(
            f"a distributed {fmt} capture writes its parts to a directory all machines share, "
            f"not to {location.scheme}://: give --out such a directory, then `actstore cp` the "
            "store up (Activault runs go to object storage directly)"
        )
    seen: dict[str, Any] = {}

    def open_writer(plan):
        final = layout.final_location(plan, out, options)
        slices = layout.slices(plan, options, n_machines)
        sl = slices[machine_id]
        seen.update(final=final, slice=sl, n=plan.n_examples, slices=tuple(slices))
        if is_published(final, layout):  # merged already: the format's writer checks it is ours
            log.info("%s is already published; machine %d has nothing to do", final, machine_id)
            return spec.open_writer(plan, out, options)
        if sl.empty:
            log.info("%s: nothing to capture (the other machines' slices cover the dataset)", sl)
            return _NothingToWrite((sl.start, sl.stop))
        log.info("capturing %s of %s", sl, final)
        return layout.part_writer(plan, final, options, sl)

    result = capture(config, open_writer)
    sl, final = seen["slice"], seen["final"]
    part = None if result.output is None or str(result.output) == str(final) else result.output
    return PartResult(
        slice=sl,
        part=part,
        final=final,
        store_examples=seen["n"],
        n_examples_run=result.n_examples_run,
        seconds=result.seconds,
        already_complete=result.already_complete,
        slices=seen["slices"],
    )


@dataclass(frozen=True, kw_only=True)
class DistributedResult:
    """One machine's work and, if it completed the set, the published store."""

    part: PartResult
    published: Path | str | None
    """The merged store, or None while other slices are still missing."""
    waiting_for: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    """Example ranges ``[start, stop)`` other machines have not finished yet."""


def capture_distributed(
    config: CaptureConfig, fmt: str, out: str, options: Any, *, machine_id: int, n_machines: int
) -> DistributedResult:
    """:func:`capture_part`, then merge if every slice is finished (the last machine to
    finish publishes the store; the others report what is still missing)."""
    part = capture_part(config, fmt, out, options, machine_id=machine_id, n_machines=n_machines)
    try:
        published = merge_store(part.final, fmt)
    except MissingPartsError as err:
        return DistributedResult(part=part, published=None, waiting_for=err.missing)
    return DistributedResult(part=part, published=published)
