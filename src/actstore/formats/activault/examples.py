"""An Activault run by example: where each example's tokens lie (the positions file),
``reader[...]``, token ids and masks, the capture plan and capture batches for convert."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ...batch import Batch, CapturePlan
from ...errors import ConfigError, CorruptStoreError
from ...sites import Site
from ...storage.object import join_key
from ..arrays import LazyRows
from .fetch import ActivaultFiles
from .metadata import POSITIONS_SINCE
from .positions import POSITIONS, Positions, decode

if TYPE_CHECKING:
    import torch
else:
    from ..._lazy import torch


class ActivaultExamples(ActivaultFiles):
    """Examples, token ids and the capture plan of a run."""

    def example_axis_error(self, site: Site, rows: int) -> str:
        plan = self.capture_plan()
        return (
            f"{self.url} holds {rows} tokens per hook, not {plan.n_examples} examples x "
            f"{plan.tokens_per_example}: token cleaning dropped some (or the last file was "
            f"partial), and the run has no {POSITIONS} (it was captured by an actstore that "
            "did not keep token positions), so reader[example, site, token] cannot place "
            "them; read blocks(site), or capture the run again"
        )

    @property
    def positions(self) -> Positions | None:
        """Where each example's tokens lie (:mod:`.positions`), for runs actstore wrote
        since it keeps them; None for older runs and Activault's own. Read (and checked)
        once, when first needed."""
        if self.record is None:
            return None
        found = self.__dict__.get("_positions", False)
        if found is not False:
            return found  # type: ignore[no-any-return]
        key = join_key(self.run_prefix, POSITIONS)
        found = None
        if self.store.size(key) is None and self.record.version >= POSITIONS_SINCE:
            raise CorruptStoreError(
                f"{self.store.url(key)} is missing: the run's token positions (where each "
                "example's tokens lie) are lost; restore it or capture again"
            )
        if self.store.size(key) is not None:
            plan = self.capture_plan_of_record()
            source = self.store.url(key)
            data = (
                self.checks.read_bytes(POSITIONS)
                if self.checks.enabled
                else bytes(self.store.get(key))
            )
            found = Positions(
                decode(data, plan.tokens_per_example, source, plan.n_examples),
                plan.tokens_per_example,
            )
            faults = found.faults(self.n_rows(self.sites[0]), source)
            if faults:
                raise CorruptStoreError(faults[0])
        self.__dict__["_positions"] = found
        return found

    def read_examples(
        self, examples: np.ndarray, sites: Sequence[Site], tokens: slice | np.ndarray
    ) -> np.ndarray:
        """``reader[...]``: each (example, position) read from the row the positions file
        places it at (checked like any block), NaN where nothing is stored (a token the
        cleaning dropped, or one in the tail past the last file). Runs without a positions
        file read by the base's layout (whole examples only)."""
        positions = self.positions
        if positions is None:
            return super().read_examples(examples, sites, tokens)
        picked = np.arange(positions.tokens)[tokens] if isinstance(tokens, slice) else tokens
        rows = positions.rows(examples, picked)
        out = np.full((len(examples), len(sites), len(picked), self.d_model), np.nan, self.dtype)
        stored = rows >= 0
        for j, site in enumerate(sites):
            blocks = self.site_blocks(site)
            per = blocks[0].n_rows if blocks else 1
            which = rows // per
            dest = out[:, j]
            for k in np.unique(which[stored]).tolist():
                mine = stored & (which == k)
                dest[mine] = self._read_into_scratch(blocks[k])[rows[mine] - k * per]
        return out

    @property
    def token_mask(self) -> LazyRows | None:
        """Bool ``[n_examples, T]``: the positions whose values the run stores (False where
        token cleaning dropped the token, or in the dropped tail), for runs with a positions
        file; ``reader[...]`` is NaN where it is False."""
        positions = self.positions
        return None if positions is None else _StoredMask(positions)

    @property
    def tokens(self) -> LazyRows | None:
        """Token ids ``[n_examples, T]`` (int64), from the ``input_ids`` of the first hook's
        files (each file read, checked and decoded when a row of it is indexed), for runs
        of whole examples; None when the capture kept no token ids or token positions were
        lost (token cleaning)."""
        if not self.capture_plan().has_tokens:
            return None
        positions = self.positions
        if positions is not None:
            return _PositionIds(positions)
        return _InputIds(self)

    def file_input_ids(self, index: int) -> np.ndarray:
        """The ``input_ids`` of file ``index`` of the first hook, flat (the last two files
        decoded are kept)."""
        ids = self._ids.get(index)
        if ids is None:
            first = self.hooks[0]
            got = self.megabatch(first, index)["input_ids"]
            if got is None:
                raise CorruptStoreError(
                    f"{self.store.url(self.listings[first].files[index].key)} holds no "
                    "input_ids (a very old Activault file): its token ids are not stored"
                )
            ids = got.reshape(-1).numpy()
            while len(self._ids) >= 2:
                self._ids.pop(next(iter(self._ids)))
            self._ids[index] = ids
        return ids

    def capture_plan(self) -> CapturePlan:
        """The capture this run came from: actstore's record of it in ``cfg.json`` (as
        planned, also when token cleaning or the dropped tail left fewer tokens stored;
        :meth:`example_batches` refuses to convert such a run), or, for a run Activault
        wrote, what its metadata says (one example per sequence)."""
        first = next(iter(self.listings.values()))
        rows = len(first.files) * first.metadata.tokens_per_file
        if self.record is not None:
            plan = self.capture_plan_of_record()
            # token ids are the positions file's, or the files' input_ids placed by example
            # (in whole examples only)
            whole = self.positions is not None or rows == plan.n_examples * plan.tokens_per_example
            return dataclasses.replace(plan, has_tokens=plan.has_tokens and whole, has_labels=False)
        md = first.metadata
        sites = self.sites
        return CapturePlan(
            ckpt=str(self.model_name or "unknown"),
            family="unknown",
            modality="text",
            sites=sites,
            n_model_layers=max(s.layer for s in sites) + 1,
            d_model=md.d_in,
            tokens_per_example=md.sequence_length,
            has_cls=False,
            n_examples=rows // md.sequence_length,
            dataset_root=str((self.cfg.get("data_config") or {}).get("data_key") or ""),
            data={},
            classes=None,
            has_labels=False,
            has_tokens=True,  # Activault keeps each row's input_ids
            batch_size=md.batch_size,
        )

    def example_batches(self, batch_size: int, start: int = 0) -> Iterator[Batch] | None:
        """With a positions file: the examples as capture batches, each position's value
        where the run stores one and NaN elsewhere, ``token_mask`` True where it stores
        one (so an Activault target stores exactly these tokens again), token ids from the
        positions file. Without one, None: conversion rebuilds examples from blocks, which
        holds only for a run that stores exactly its plan's examples (:class:`ConfigError`
        for one that does not)."""
        plan = self.capture_plan()
        positions = self.positions
        if positions is not None:
            return self._position_batches(positions, plan, batch_size, start)
        rows = self.n_rows(self.sites[0])
        if rows != plan.n_examples * plan.tokens_per_example:
            raise ConfigError(
                f"{self.url} holds {rows} tokens per hook, not {plan.n_examples} examples x "
                f"{plan.tokens_per_example} (token cleaning dropped some, or the last file was "
                "partial): only runs of whole examples convert; capture with --no-clean and "
                "a rows_per_file that divides the examples to convert it"
            )
        return None

    def _position_batches(
        self, positions: Positions, plan: CapturePlan, batch_size: int, start: int
    ) -> Iterator[Batch]:
        every = np.arange(positions.tokens)
        for lo in range(start, plan.n_examples, batch_size):
            ids = np.arange(lo, min(lo + batch_size, plan.n_examples))
            values = self.read_examples(ids, list(self.sites), every)
            yield Batch(
                acts={
                    str(site): torch.from_numpy(np.ascontiguousarray(values[:, j]))
                    for j, site in enumerate(self.sites)
                },
                example_ids=ids,
                token_ids=positions.ids(ids) if plan.has_tokens else None,
                token_mask=positions.stored(ids),
            )


class _PositionIds(LazyRows):
    """``reader.tokens`` of a run with a positions file: every example's ``T`` token ids."""

    def __init__(self, positions: Positions) -> None:
        super().__init__(np.int64, (len(positions), positions.tokens))
        self.positions = positions

    def rows(self, index: np.ndarray) -> np.ndarray:
        return self.positions.ids(index)


class _StoredMask(LazyRows):
    """``reader.token_mask``: the positions of each example the run stores values of."""

    def __init__(self, positions: Positions) -> None:
        super().__init__(np.bool_, (len(positions), positions.tokens))
        self.positions = positions

    def rows(self, index: np.ndarray) -> np.ndarray:
        return self.positions.stored(index)


class _InputIds(LazyRows):
    """``reader.tokens`` of an Activault run of whole examples: row ``i`` is example ``i``'s
    ``T`` token ids, from the files holding them."""

    def __init__(self, reader: ActivaultExamples) -> None:
        plan = reader.capture_plan()
        super().__init__(np.int64, (plan.n_examples, plan.tokens_per_example))
        self.reader = reader
        self.per_file = next(iter(reader.listings.values())).metadata.tokens_per_file

    def rows(self, index: np.ndarray) -> np.ndarray:
        t = self.row_shape[0]
        flat = index[:, None] * t + np.arange(t)[None, :]
        out = np.empty(flat.shape, dtype=self.dtype)
        which = flat // self.per_file
        for k in np.unique(which).tolist():
            mine = which == k
            out[mine] = self.reader.file_input_ids(k)[flat[mine] - k * self.per_file]
        return out
