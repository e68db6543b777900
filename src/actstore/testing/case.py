"""How the conformance suite drives one format: :class:`FormatCase`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..batch import Batch, CapturePlan
from ..formats.base import ReaderBase
from ..formats.registry import FormatSpec, get_format
from ..formats.writerbase import WriterBase
from ..sites import Site
from ..storage.location import Location
from ..storage.manifest import OWN_FILES
from .data import FEATURES, make_batches, make_plan, make_tokens


class FormatCase:
    """Adapter between :class:`~actstore.testing.ConformanceSuite` and one format, built on
    the format's registered :class:`~actstore.formats.registry.FormatSpec`: every method
    has a working default, so a new format's case is usually one line,
    ``FormatCase("myformat", MyOptions(...))``. Override a method only where the format
    needs something the suite's plain capture does not give (zarr: prompt/response lengths
    in :meth:`prepare`).
    """

    def __init__(
        self,
        format: str,
        options: Any = None,
        *,
        stored_dtype: str | None = None,
        round_trip_through: str | None = "saev",
        plan_overrides: dict[str, Any] | None = None,
        cannot_hold: Mapping[str, str] | None = None,
        check_crashes: bool | str = True,
    ) -> None:
        self.format = format
        self.options = options
        self.plan_overrides = dict(plan_overrides or {})
        unknown = set(cannot_hold or {}) - set(FEATURES)
        if unknown:
            raise ValueError(f"cannot_hold names {sorted(unknown)}; features: {list(FEATURES)}")
        self.cannot_hold = dict(cannot_hold or {})
        """Features of :data:`~actstore.testing.data.FEATURES` the format cannot hold ->
        why. The kit stores every other one (``test_bf16_attention_mlp_cls_and_labels_round_trip``)
        and checks that each of these is refused or not claimed
        (``test_what_the_format_cannot_hold_is_refused_or_not_claimed``)."""
        self.check_crashes = check_crashes
        """False or a reason (a string): the crash-and-resume rule is left to another case of
        the same format (it costs a process and a write per fault point)."""
        self._stored_dtype = stored_dtype
        self.round_trip_through = round_trip_through
        """The format :meth:`ConformanceSuite.test_converts_both_ways` converts through and
        back (None: the format does not take every plan a capture gives; not checked)."""

    def __repr__(self) -> str:
        return f"FormatCase({self.format!r}, {self.options!r})"

    @property
    def holds(self) -> list[str]:
        """The features of :data:`~actstore.testing.data.FEATURES` the format holds."""
        return [f for f in FEATURES if f not in self.cannot_hold]

    @property
    def spec(self) -> FormatSpec:
        return get_format(self.format)

    @property
    def stored_dtype(self) -> str:
        """The numpy dtype rows read back in (after the format's cast)."""
        if self._stored_dtype is not None:
            return self._stored_dtype
        return "float32" if self.spec.stored_dtype == "bfloat16" else self.spec.stored_dtype

    def writer_options(self) -> Any:
        """The writer's options: ``options`` as given, built from a mapping of field
        names (so a case needs nothing imported from the format), or the defaults."""
        if self.options is None:
            return self.spec.options()
        if isinstance(self.options, Mapping):
            return self.spec.options(**self.options)
        return self.options

    def plan(self, **overrides: Any) -> CapturePlan:
        """The capture the suite stores (default: :func:`~actstore.testing.make_plan`)."""
        return make_plan(**{**self.plan_overrides, **overrides})

    def batches(self, plan: CapturePlan, acts: dict[str, np.ndarray]) -> list[Batch]:
        """``acts`` as the batches a capture for this format gives its writer (default:
        :func:`~actstore.testing.make_batches`; zarr adds prompt/response lengths)."""
        return make_batches(plan, acts)

    def open_writer(
        self, out: str | os.PathLike, plan: CapturePlan, batches: list[Batch]
    ) -> tuple[WriterBase, list[Batch]]:
        """``(writer, batches)``: the writer of output ``out`` (a directory or an ``s3://``
        URL; reopening a store begun there resumes it) and the batches to give it."""
        return self.spec.open_writer(plan, out, self.writer_options()), batches

    def write(self, out: str | os.PathLike, plan: CapturePlan, batches: list[Batch]) -> str:
        """Write and publish a store; return its location."""
        writer, batches = self.open_writer(out, plan, batches)
        for batch in batches:
            writer.write(batch)
        return str(writer.close())

    def write_unpublished(
        self, out: str | os.PathLike, plan: CapturePlan, batches: list[Batch]
    ) -> str:
        """Write ``batches`` and abort, as after a crash; return where the store would be."""
        writer, given = self.open_writer(out, plan, batches)
        for batch in given:
            writer.write(batch)
        writer.abort()
        where = self.spec.writer.store_location(plan, Location.parse(out), self.writer_options())
        return where.url

    def damage(self, location: str) -> None:
        """Flip one byte in the middle of a data file (local stores): the largest file of
        the folder holding the most data, metadata left out (JSON, dot-files, the
        manifest's own files): a chunk of values in every format."""
        root = Path(location)
        data_files = [
            p
            for p in root.rglob("*")
            if p.is_file()
            and p.name not in OWN_FILES
            and not p.name.startswith(".")
            and p.suffix not in (".json", ".jsonl")
        ]
        folders: dict[Path, int] = {}
        for p in data_files:
            folders[p.parent] = folders.get(p.parent, 0) + p.stat().st_size
        folder = max(folders, key=lambda f: (folders[f], str(f)))
        victim = max(
            (p for p in data_files if p.parent == folder), key=lambda p: (p.stat().st_size, str(p))
        )
        victim.chmod(0o644)
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))

    def overwrite(self, location: str, name: str, data: bytes) -> bytes:
        """Replace file ``name`` of the store at ``location`` with ``data`` (as damage
        would); return what it held: a local store, or one on object storage (``s3://``,
        with the environment's credentials)."""
        if "://" in str(location) and not str(location).startswith("file://"):
            from ..storage.object import open_location

            store, prefix = open_location(location)
            key = f"{prefix}/{name}" if prefix else name
            original = store.get(key)
            store.put(key, data)
            return original
        path = Path(location) / name
        original = path.read_bytes()
        path.chmod(0o644)
        path.write_bytes(data)
        return original

    def open(self, location: str) -> ReaderBase:
        from ..formats import open_store

        return open_store(location)

    def expected_tokens(self, plan: CapturePlan) -> np.ndarray:
        """The ``tokens`` a reader gives back when the plan keeps them (default: the ids of
        :func:`~actstore.testing.make_tokens`, ``[N, T]``)."""
        return make_tokens(plan)

    def expected_rows(
        self, plan: CapturePlan, acts: dict[str, np.ndarray], site: Site
    ) -> np.ndarray:
        """Rows of ``site`` in storage order (example-major, then token), as stored."""
        return acts[str(site)].reshape(-1, plan.d_model).astype(self.stored_dtype)

    def expected_examples(
        self, plan: CapturePlan, acts: dict[str, np.ndarray], site: Site
    ) -> np.ndarray:
        """``reader[:, site]``: ``[N, T, D]`` as stored (default: :meth:`expected_rows` by
        example; zarr pads prompt and response)."""
        rows = self.expected_rows(plan, acts, site)
        return rows.reshape(plan.n_examples, -1, plan.d_model)
