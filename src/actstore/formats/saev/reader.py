"""Open and read a saev protocol 2.1 directory (either dialect), local or on ``s3://``.

Every byte comes through the store's files layer (:mod:`actstore.storage.files`: ``pread``
on local disk, ranged GETs on object storage) and, for a store actstore wrote, is checked
against its root manifest (:mod:`actstore.storage.manifest`) before it is returned: block
reads, scatter reads, ``reader[...]``, :meth:`SaevReader.gather`, token ids, labels,
classes and statistics alike. A block of the manifest is one example's tokens at one
layer, so random access reads (and checks) whole (example, layer) slabs.

Opening validates metadata.json against shards.json and every shard's size, so a missing or
truncated shard is reported up front with the file named. Stores saev itself wrote have no
manifest: they open with one warning and read unverified (``verify_reads=False`` does the
same for any store, and then random access reads only the rows asked for).

:class:`SaevReader` is built in layers: :mod:`.index` (metadata.json and shards.json,
checked), :mod:`.verify` (``verify``'s scan and content checks); this module adds reads,
blocks, scatter reads, ``gather``, token ids, labels, statistics and ``describe``.

Example:
    >>> import tempfile
    >>> from actstore.testing import FormatCase, make_acts, make_batches, make_plan
    >>> plan, out = make_plan(), tempfile.TemporaryDirectory()  # 23 examples x 6 tokens x 8
    >>> store = FormatCase("saev").write(out.name, plan, make_batches(plan, make_acts(plan)))
    >>> r = SaevReader(store)
    >>> r[12, "resid.3", 0].shape   # (example, site, token) -> [d_model]
    (8,)
    >>> r[0:4, 3].shape             # examples 0..3, all tokens (site by layer)
    (4, 6, 8)
"""

from __future__ import annotations

import logging
import pickle
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ...batch import CapturePlan
from ...errors import ConfigError, CorruptStoreError, UnsafeDataError
from ...sites import Site
from ...stats import RunningStats
from ..arrays import RowFile
from ..base import ReaderBase
from ..blocks import Block, Extent, as_indices, place, scratch
from .layout import shard_name
from .verify import SaevVerify
from .writer import STATISTICS

log = logging.getLogger(__name__)
_SLAB_WARNED = threading.Event()  # the verified slab fallback is announced once per process


def detect(files) -> bool:
    """Whether ``files`` hold a saev directory (metadata.json with saev's keys and
    shards.json; a damaged metadata.json is claimed, so the reader names the fault)."""
    if not files.exists("shards.json") or not files.exists("metadata.json"):
        return False
    try:
        doc = files.read_json("metadata.json")
    except CorruptStoreError:
        return True
    return isinstance(doc, dict) and (
        "patches_per_ex" in doc or "content_tokens_per_example" in doc
    )


class SaevReader(SaevVerify):
    """Read access to one saev directory, local or ``s3://bucket/prefix``. Picklable: worker
    processes reopen files lazily.

    ``verify_reads``: check everything read against the store's root manifest.
    ``cache_dir`` / ``cache_bytes`` / ``s3``: the local cache tier and S3 settings of a remote
    store (see :func:`~actstore.storage.files.open_files`; default ``$ACTSTORE_CACHE``).
    """

    format_name = "saev"

    def __repr__(self) -> str:
        n, _layers, t, d = self.shape
        return (
            f"SaevReader({self.url!r}, dialect={self.dialect!r}, n_examples={n}, "
            f"layers={list(self.layers)}, tokens={t}, d_model={d})"
        )

    # ------------------------------------------------------------------ reads

    def _slab_offset(self, example: int, layer_idx: int) -> tuple[str, int]:
        """(shard file, byte offset) of one example's tokens at one stored layer."""
        md = self.metadata
        shard, in_shard = divmod(example, md.examples_per_shard)
        vectors = (in_shard * len(md.layers) + layer_idx) * md.tokens_per_ex
        return shard_name(shard), vectors * md.d_model * 4

    def _read_checked(self, name: str, offset: int, out: np.ndarray) -> np.ndarray:
        self.files.read_range(name, offset, out.nbytes, out)
        self.checks.check(name, offset, out)
        return out

    def _slabs(self, examples: np.ndarray, layer_ids: Sequence[int]) -> np.ndarray:
        """``[len(examples), len(layer_ids), T, D]``: whole (example, layer) slabs, checked."""
        md = self.metadata
        out = np.empty((len(examples), len(layer_ids), md.tokens_per_ex, md.d_model), "<f4")
        for i, example in enumerate(examples.tolist()):
            for j, li in enumerate(layer_ids):
                name, offset = self._slab_offset(example, li)
                self._read_checked(name, offset, out[i, j])
        return out

    def read_examples(
        self, examples: np.ndarray, sites: Sequence[Site], tokens: slice | np.ndarray
    ) -> np.ndarray:
        """Checked: whole (example, layer) slabs (the manifest's blocks), then the tokens
        asked for; unchecked: only the token rows asked for, each straight into place."""
        layer_ids = [self._layer_index(site) for site in sites]
        if self.checks.enabled:
            return self._slabs(examples, layer_ids)[:, :, tokens]
        return self._rows_unchecked(examples, layer_ids, tokens)

    def _rows_unchecked(
        self, examples: np.ndarray, layer_ids: list[int], tokens: slice | np.ndarray
    ) -> np.ndarray:
        """Only the token rows asked for, each straight into place (no whole-slab reads)."""
        md = self.metadata
        picked = np.atleast_1d(np.arange(md.tokens_per_ex)[tokens])
        out = np.empty((len(examples), len(layer_ids), len(picked), md.d_model), "<f4")
        flat = out.reshape(-1, md.d_model)
        row_bytes = md.d_model * 4
        by_shard: dict[str, list[tuple[int, int]]] = {}
        slot = 0
        for example in examples.tolist():
            for li in layer_ids:
                name, offset = self._slab_offset(example, li)
                for t in picked.tolist():
                    by_shard.setdefault(name, []).append((offset + t * row_bytes, slot))
                    slot += 1
        for name, pairs in by_shard.items():
            pairs.sort()
            offsets = np.array([o for o, _ in pairs], dtype=np.int64)
            slots = np.array([s for _, s in pairs], dtype=np.int64)
            unique = np.ones(len(offsets), dtype=bool)
            unique[1:] = offsets[1:] != offsets[:-1]
            self.files.read_rows(name, offsets[unique], row_bytes, flat, slots[unique])
            if not unique.all():  # the same row asked for twice: copy the slot read
                src = slots[np.maximum.accumulate(np.where(unique, np.arange(len(slots)), 0))]
                flat[slots[~unique]] = flat[src[~unique]]
        return out

    def vector(self, example: int, layer: Any, token: int) -> np.ndarray:
        """One activation vector (checked with its whole slab)."""
        return self[example, layer, token]

    @property
    def tokens(self) -> RowFile | None:
        """Token ids ``[n_examples, T]`` (int32, read and checked by row) of text
        captures, else None."""
        if not self.files.exists("tokens.bin"):
            return None
        return RowFile(
            self.files, self.checks, "tokens.bin", "<i4", (self.n_examples, self.tokens_per_ex)
        )

    @property
    def labels(self) -> RowFile | None:
        """Per-patch labels ``[n_examples, patches_per_ex]`` (uint8, checked), else None."""
        if not self.files.exists("labels.bin"):
            return None
        md = self.metadata
        return RowFile(
            self.files, self.checks, "labels.bin", np.uint8, (md.n_examples, md.patches_per_ex)
        )

    @property
    def classes(self) -> list[str] | None:
        if not self.files.exists("classes.json"):
            return None
        names = self.checks.read_json("classes.json")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise CorruptStoreError(
                f"{self.files.url_of('classes.json')} must hold a list of class names; it was "
                "edited or damaged: restore it or re-create the store"
            )
        return names

    def stored_record(self) -> tuple[str, Any] | None:
        """The writer's capture record (what the store id is the digest of): metadata.json
        as published and the side files it wrote (token ids, labels, class names). So an
        edited metadata.json is a fault wherever the store lies, not only when its
        directory is named by the content hash."""
        if self.checks.manifest is None:
            return None
        return "metadata.json", {
            "metadata": self.files.read_json("metadata.json"),
            "tokens": self.files.exists("tokens.bin"),
            "labels": self.files.exists("labels.bin"),
            "classes": self.classes,
        }

    def statistics_shards(self) -> list[int] | None:
        """Rows of each shard file (its examples' tokens): how the writer folded the
        statistics; None for a store without actstore's statistics and manifest."""
        if self.checks.manifest is None or not self.files.exists(STATISTICS):
            return None
        return [count * self.metadata.tokens_per_ex for count in self.shard_counts]

    def statistics_record(self, site: Site) -> Any:
        if self.site_statistics(site) is None:
            return None
        return self._statistics["sites"][str(site.layer)]  # type: ignore[index]

    def site_statistics(self, site: Site) -> RunningStats | None:
        """Running statistics of stored ``site`` (None if the file is absent)."""
        if not self.files.exists(STATISTICS):
            return None
        if self._statistics is None:
            self._statistics = self.checks.read_json(STATISTICS)
        try:
            return RunningStats.from_dict(self._statistics["sites"][str(site.layer)])
        except (KeyError, TypeError) as err:
            raise CorruptStoreError(
                f"{self.files.url_of(STATISTICS)} has no statistics of layer {site.layer}"
            ) from err

    def dataset_description(self, *, allow_pickle: bool = False) -> Any:
        """Decode metadata's ``data`` field. It is a pickle, and unpickling can run code,
        so this refuses unless ``allow_pickle=True`` (only for stores you trust)."""
        if not allow_pickle:
            raise UnsafeDataError(
                "the 'data' field is a base64 pickle and unpickling it can run arbitrary "
                "code; pass allow_pickle=True only if you trust this store"
            )
        import base64

        return pickle.loads(base64.b64decode(self.metadata.data))

    def capture_plan(self) -> CapturePlan:
        """The capture this store came from, as far as saev's metadata records it."""
        return self.metadata.capture_plan(
            has_tokens=self.files.exists("tokens.bin"),
            has_labels=self.files.exists("labels.bin"),
            classes=self.classes,
        )

    # ------------------------------------------------------------------ blocks (loader)

    def site_blocks(self, site: Site, *, target_bytes: int = 1 << 20) -> list[Block]:
        """Blocks of ``site``: one per example (its ``T`` tokens are contiguous); with a
        single stored layer consecutive examples are contiguous too and are grouped up to
        ``target_bytes``. ``loc = (shard, first example in shard, n examples, layer index)``."""
        md = self.metadata
        layer_idx = self._layer_index(site)
        per_block = 1
        if len(md.layers) == 1:
            per_block = max(1, target_bytes // (md.tokens_per_ex * md.d_model * 4))
        out = []
        for shard, count in enumerate(self.shard_counts):
            for first in range(0, count, per_block):
                n = min(per_block, count - first)
                out.append(
                    Block(site=site, n_rows=n * md.tokens_per_ex, loc=(shard, first, n, layer_idx))
                )
        return out

    def _block_offset(self, block: Block) -> tuple[str, int]:
        md = self.metadata
        shard, first, _n, layer_idx = block.loc
        vectors = (first * len(md.layers) + layer_idx) * md.tokens_per_ex
        return shard_name(shard), vectors * md.d_model * 4

    def read_block(self, block: Block, out: np.ndarray | None = None) -> np.ndarray:
        """Rows of ``block`` as ``[n_rows, D]`` float32: one read, checked."""
        if out is None:
            out = np.empty((block.n_rows, self.metadata.d_model), dtype="<f4")
        name, offset = self._block_offset(block)
        return self._read_checked(name, offset, out)

    def block_extent(self, block: Block) -> Extent:
        """Every block is raw little-endian float32 rows of one shard file."""
        name, offset = self._block_offset(block)
        return Extent(name=name, offset=offset, dtype=torch.float32)

    def _check_out(self, out: np.ndarray, n_dest: int, dest_max: int) -> None:
        d = self.metadata.d_model
        if (
            out.dtype != np.float32
            or out.ndim != 2
            or out.shape[1] != d
            or out.strides[1] != 4
            or dest_max >= out.shape[0]
        ):
            raise ConfigError(
                f"scatter reads need one destination row (< {len(out)}) per row read and a "
                f"float32 [n, {d}] out with contiguous rows"
            )

    def read_block_scatter(self, block: Block, out: np.ndarray, rows: np.ndarray) -> None:
        """Row ``i`` of ``block`` into ``out[rows[i]]`` (skipped where ``rows[i] < 0``).
        Checked reads read the block into a per-thread scratch buffer, check it while it
        is hot, then place its rows; unchecked ones read each row straight into place."""
        if len(rows) != block.n_rows:
            raise ConfigError("read_block_scatter needs one destination row per block row")
        self._check_out(out, len(rows), int(rows.max()) if len(rows) else -1)
        if self.checks.enabled:
            place(
                out,
                rows,
                self.read_block(block, scratch(block.n_rows, self.metadata.d_model, "<f4")),
            )
            return
        name, offset = self._block_offset(block)
        row_bytes = self.metadata.d_model * 4
        offsets = offset + np.arange(block.n_rows, dtype=np.int64) * row_bytes
        self.files.read_rows(name, offsets, row_bytes, out, rows)

    def example_rows(self, site: Any) -> int:
        """Every block is whole examples of ``T`` contiguous rows (tokens in order)."""
        return self.metadata.tokens_per_ex

    def read_rows_scatter(
        self, block: Block, rows: np.ndarray, out: np.ndarray, dest: np.ndarray
    ) -> None:
        """Rows ``rows`` of ``block`` (ascending) into ``out[dest]`` (skipped where
        ``dest < 0``); see :meth:`read_slabs_scatter`."""
        self.read_slabs_scatter([(block, rows, dest)], out)

    def read_slabs_scatter(
        self, pieces: Sequence[tuple[Block, np.ndarray, np.ndarray]], out: np.ndarray
    ) -> None:
        """Rows ``rows`` (ascending) of each ``(block, rows, dest)`` into ``out[dest]``
        (skipped where ``dest < 0``). Unchecked: the rows alone, straight into place.
        Checked: blocks are the unit the manifest digests, so each whole block is read and
        checked, then its rows are copied (a slab costs a block's I/O; one warning says so)."""
        pieces = [p for p in pieces if len(p[1]) or len(p[2])]
        if not pieces:
            return
        for block, rows, dest in pieces:
            if len(rows) != len(dest) or (
                len(rows)
                and (rows.min() < 0 or rows.max() >= block.n_rows or (np.diff(rows) <= 0).any())
            ):
                raise ConfigError(
                    "read_rows_scatter needs ascending rows of the block, one destination row each"
                )
            self._check_out(out, len(dest), int(dest.max()) if len(dest) else -1)
        if self.checks.enabled:
            if not _SLAB_WARNED.is_set():
                _SLAB_WARNED.set()
                log.warning(
                    "%s: slab reads (mix > 1) are checked per whole block, so whole blocks are "
                    "read (mix times the bytes); open the store with verify_reads=False to read "
                    "slabs alone",
                    self.url,
                )
            for block, rows, dest in pieces:
                ReaderBase.read_rows_scatter(self, block, rows, out, dest)
            return
        row_bytes = self.metadata.d_model * 4
        by_shard: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {}
        for block, rows, dest in pieces:
            name, offset = self._block_offset(block)
            offsets, slots = by_shard.setdefault(name, ([], []))
            offsets.append(offset + rows.astype(np.int64) * row_bytes)
            slots.append(dest.astype(np.int64))
        for name, (offsets, slots) in by_shard.items():
            o, s = np.concatenate(offsets), np.concatenate(slots)
            order = np.argsort(o, kind="stable")
            self.files.read_rows(name, o[order], row_bytes, out, s[order])

    def cls_rows(self, block: Block) -> np.ndarray:
        """Rows of ``block`` holding a CLS token (token 0 of each example, if stored)."""
        if not self.metadata.cls_token:
            return np.empty(0, dtype=np.int64)
        return np.arange(0, block.n_rows, self.metadata.tokens_per_ex, dtype=np.int64)

    def gather(self, indices: Any, site: Any = None) -> np.ndarray:
        """Rows of ``site`` at ``indices``, in the caller's order: ``[*shape, D]``.

        ``indices`` are flat rows ``example * T + token`` (an int array of any shape, as the
        loader's ``return_index`` gives them) or an ``(examples, tokens)`` pair of arrays.
        Checked reads read each (example, layer) slab holding a row once, check it, then
        copy the rows out; unchecked reads coalesce nearby rows into vectored reads, each
        row straight into its slot.

        Example:
            >>> import tempfile
            >>> from actstore.testing import FormatCase, make_acts, make_batches, make_plan
            >>> plan, out = make_plan(), tempfile.TemporaryDirectory()
            >>> acts = make_acts(plan)  # [23 examples, 6 tokens, 8] per site
            >>> store = FormatCase("saev").write(out.name, plan, make_batches(plan, acts))
            >>> reader = SaevReader(store)
            >>> rows = reader.gather([5, 0, 5], site="resid.3")  # flat rows example * 6 + token
            >>> rows.shape, bool((rows[0] == acts["resid.3"][0, 5]).all())
            ((3, 8), True)
            >>> reader.gather((np.array([2, 9]), 0), 3).shape  # token 0 of examples 2 and 9
            (2, 8)
        """
        md = self.metadata
        if site is None:
            if len(md.layers) != 1:
                raise ConfigError(
                    f"name the site to gather from: one of {', '.join(map(str, self.sites))}"
                )
            site = self.sites[0]
        layer_idx, n_tok = self._layer_index(self.site(site)), md.tokens_per_ex
        if isinstance(indices, tuple):
            examples = as_indices(np.asarray(indices[0]), md.n_examples, "example")
            tokens = as_indices(np.asarray(indices[1]), n_tok, "token")
            examples, tokens = np.broadcast_arrays(examples, tokens)
            flat = examples * n_tok + tokens
            shape = flat.shape
        else:
            given = np.asarray(indices)
            shape = given.shape
            if given.size == 0:  # np.asarray([]) is float64
                given = given.astype(np.int64)
            flat = as_indices(given.reshape(-1), md.n_examples * n_tok, "row")
        flat = flat.reshape(-1)
        out = np.empty((len(flat), md.d_model), dtype=np.float32)
        example, token = np.divmod(flat, n_tok)
        if self.checks.enabled:
            wanted = np.unique(example)
            slabs = self._slabs(wanted, [layer_idx])[:, 0]
            out[:] = slabs[np.searchsorted(wanted, example), token]
            return out.reshape(*shape, md.d_model)
        row_bytes = md.d_model * 4
        shard, in_shard = np.divmod(example, md.examples_per_shard)
        offset = ((in_shard * len(md.layers) + layer_idx) * n_tok + token) * row_bytes
        slots = np.arange(len(flat))
        for s in np.unique(shard).tolist():
            at = np.flatnonzero(shard == s)
            order = at[np.argsort(offset[at], kind="stable")]
            o = offset[order]
            unique = np.ones(len(o), dtype=bool)
            unique[1:] = o[1:] != o[:-1]
            self.files.read_rows(shard_name(s), o[unique], row_bytes, out, slots[order][unique])
            if not unique.all():
                src = slots[order][np.maximum.accumulate(np.where(unique, np.arange(len(o)), 0))]
                out[slots[order][~unique]] = out[src[~unique]]
        return out.reshape(*shape, md.d_model)

    def block_rows(self, block: Block) -> tuple[np.ndarray, np.ndarray]:
        """(example index, token index) of every row of ``block``."""
        md = self.metadata
        shard, first, n, _ = block.loc
        examples = shard * md.examples_per_shard + first + np.arange(n)
        return np.repeat(examples, md.tokens_per_ex), np.tile(np.arange(md.tokens_per_ex), n)

    def describe_format(self) -> dict[str, Any]:
        md = self.metadata
        return {
            "format": f"saev protocol {md.protocol} ({self.dialect} dialect)",
            "shape": (
                f"{md.n_examples} examples x {len(md.layers)} layers {list(md.layers)} x "
                f"{md.tokens_per_ex} tokens{' (CLS at 0)' if md.cls_token else ''} x "
                f"{md.d_model} dims"
            ),
            "n_examples": md.n_examples,
            "layers": list(md.layers),
            "tokens_per_example": md.tokens_per_ex,
            "cls_token": md.cls_token,
            "shards": f"{md.n_shards} x up to {md.examples_per_shard} examples",
        }
