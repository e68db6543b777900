"""Opening a SAELens cache: ``state.json``, ``dataset_info.json`` and, in actstore's
caches, the ``actstore.json`` sidecar, checked against each other and the root manifest
(:class:`SaelensIndex`, the first layer of :class:`~.reader.SaelensReader`); its sites and
shapes; its Arrow files, record batches and where their values lie."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ...errors import ConfigError, CorruptStoreError, StoreNotFoundError
from ...sites import Site
from ..base import ReaderBase
from ..metacheck import MAX_COUNT, Fields, is_int
from .layout import (
    INFO,
    SIDECAR,
    STATE,
    TOKENS,
    ColumnSite,
    SaelensLayout,
    dataset_state,
    hook_site,
)
from .writer import _ranges


def _features_text(features: Any) -> str:
    """A row's features in brief: ``column: shape dtype`` (``length`` for sequences)."""
    out = []
    for name, feature in features.items():
        shape = getattr(feature, "shape", None) or getattr(feature, "length", None)
        dtype = getattr(feature, "dtype", None) or getattr(
            getattr(feature, "feature", None), "dtype", "?"
        )
        out.append(f"{name}: {shape} {dtype}")
    return ", ".join(out)


class SaelensIndex(ReaderBase):
    """A cache's index files, checked, and its Arrow files."""

    def open_index(self) -> None:
        """state.json, dataset_info.json and (in actstore's caches) the sidecar, checked."""
        from datasets import Array2D, Features

        if not self.files.exists(STATE):
            raise StoreNotFoundError(
                f"{self.url} holds no saelens store (no {STATE}): a wrong path, a directory not "
                "written by Dataset.save_to_disk, or an unfinished copy (finish it with actstore cp)"
            )
        ours = self.files.exists(SIDECAR)
        self.open_checks(ours=ours)
        state = self.checks.read_json(STATE)
        try:
            self.arrow_files = tuple(str(e["filename"]) for e in state["_data_files"])
            features = Features.from_dict(self.checks.read_json(INFO)["features"])
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise CorruptStoreError(
                f"{self.url}: state.json or dataset_info.json is malformed ({err!r})"
            ) from err
        for name in self.arrow_files:
            if "/" in name or os.sep in name or name.startswith(".") or not self.files.exists(name):
                raise StoreNotFoundError(
                    f"{self.files.url_of(name)} is missing: restore it, finish the copy "
                    "(actstore cp) or re-capture"
                )
        self.columns = tuple(k for k, f in features.items() if isinstance(f, Array2D))
        if not self.columns:
            raise CorruptStoreError(
                f"{self.url} holds no Array2D activation column (columns: {list(features)})"
            )
        if ours:
            self._check_index_files(features)
        shapes = {tuple(features[c].shape) for c in self.columns}
        dtypes = {features[c].dtype for c in self.columns}
        if len(shapes) > 1 or len(dtypes) > 1:
            raise ConfigError(
                f"{self.url}: columns differ in shape or dtype ({shapes}, {dtypes}); "
                "actstore reads caches whose hooks share (context_size, d_in) and dtype"
            )
        (self.context_size, self._d_in), (dtype,) = shapes.pop(), dtypes
        self._dtype = np.dtype(dtype)
        self.has_tokens = TOKENS in features
        self.block_columns = (*self.columns, *((TOKENS,) if self.has_tokens else ()))
        self.record: dict[str, Any] | None = None
        self.layout: SaelensLayout | None = None
        if ours:
            sites = [Site.parse(s) for s in self._open_own().sites]
        else:  # Integrity.open warned once that it cannot be verified
            sites = [hook_site(c) or ColumnSite(c, -1) for c in self.columns]
        self._column_sites = dict(zip(self.columns, sites))
        self._tables: dict[int, Any] = {}
        self._batch_rows: list[list[int]] | None = None
        self._starts: np.ndarray | None = None
        self._statistics: dict[str, Any] | None = None

    def _check_index_files(self, features: Any) -> None:
        """In a cache actstore wrote, ``dataset_info.json``'s features and ``state.json``
        are what its writer derives from ``actstore.json``'s layout and the files' digests:
        an edited feature (a shape, the token ids' length) or file list is a fault, even
        with the manifest rewritten over it (``actstore.json`` itself is checked against
        the published summary and store id)."""
        source = self.files.url_of(SIDECAR)
        record = self.checks.read_json(SIDECAR)
        if not isinstance(record, dict):
            raise CorruptStoreError(f"{source} is not a JSON object; restore it or re-capture")
        layout = SaelensLayout.from_dict(record.get("layout"), source=source)
        if features != layout.features():
            raise CorruptStoreError(
                f"{self.files.url_of(INFO)}: its features "
                f"({_features_text(features)}) are not the ones {SIDECAR}'s layout gives "
                f"({_features_text(layout.features())}): the file was edited; restore it or "
                "re-capture"
            )
        manifest = self.checks.manifest
        if manifest is None:
            return
        try:
            digests = "".join(manifest.files[n].digest for n in self.arrow_files)
        except KeyError as err:
            raise CorruptStoreError(
                f"{self.files.url_of(STATE)} lists {err}, which the root manifest does not: "
                "the file was edited; restore it or re-capture"
            ) from None
        if self.checks.read_json(STATE) != dataset_state(list(self.arrow_files), digests):
            raise CorruptStoreError(
                f"{self.files.url_of(STATE)} is not what the writer derives from the store's "
                "files (its fingerprint or fields differ): the file was edited; restore it or "
                "re-capture"
            )

    def _open_own(self) -> SaelensLayout:
        source = self.files.url_of(SIDECAR)
        record = self.checks.read_json(SIDECAR)
        layout = SaelensLayout.from_dict(
            Fields(record, source).obj("layout"), source=self.files.url_of(SIDECAR)
        )
        listed = Fields(record, source).obj_list("files")
        for k, entry in enumerate(listed):
            e = Fields(entry, f"{source}: files[{k}]")
            e.text("name")
            e.count("n_examples")
            e.count("bytes")
            at = e._get("values_at", False)
            if not isinstance(at, list) or not all(
                isinstance(a, list) and all(is_int(x) and 0 <= x <= MAX_COUNT for x in a)
                for a in at
            ):
                raise e.fault("values_at", "a list of lists of byte offsets", at)
        if tuple(layout.columns) != self.columns or [e.get("name") for e in listed] != list(
            self.arrow_files
        ):
            raise CorruptStoreError(
                f"{self.url}: {SIDECAR} does not match state.json/dataset_info.json "
                "(files or columns differ); restore the store or re-capture"
            )
        sizes = self.files.list()  # one listing, not a stat per file
        for e in listed:
            if sizes.get(e["name"]) != e.get("bytes"):
                raise CorruptStoreError(
                    f"{self.files.url_of(e['name'])} has {sizes.get(e['name'])} bytes, expected "
                    f"{e.get('bytes')} (truncated or replaced); restore it or re-capture"
                )
        shards = [e["n_examples"] for e in listed]
        want = [layout.shard_range(i)[1] - layout.shard_range(i)[0] for i in range(len(listed))]
        if shards != want or sum(shards) != layout.n_examples:
            raise CorruptStoreError(
                f"{self.url}: {SIDECAR} records {sum(shards)} examples in {shards}, its layout "
                f"{layout.n_examples} in {want}: it was edited; restore it or re-capture"
            )
        self.record, self.layout = record, layout
        return layout

    # ------------------------------------------------------------------ properties

    @property
    def verified(self) -> bool:
        """True for stores with actstore's manifest and statistics."""
        return self.layout is not None and self.checks.manifest is not None

    @property
    def sites(self) -> tuple[Site, ...]:
        return tuple(self._column_sites[c] for c in self.columns)

    def native_site(self, name: Any) -> Site | None:
        return self._column_sites.get(str(name))

    def native_name(self, site: Site) -> str:
        return self.column(site)

    @property
    def family(self) -> str:
        if self.record is not None:
            return str(self.record["plan"].get("family", "unknown"))
        return "unknown"

    def column(self, site: Any) -> str:
        """The column of ``site`` (any spelling, or the column's hook name)."""
        wanted = self.site(site)
        return next(c for c, s in self._column_sites.items() if s == wanted)

    @property
    def d_model(self) -> int:
        return self._d_in

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def n_examples(self) -> int:
        if self.layout is not None:
            return self.layout.n_examples
        return sum(sum(rows) for rows in self._rows())

    tokens_per_example = property(lambda self: self.context_size)

    def n_rows(self, site: Any) -> int:
        self.site(site)
        return self.n_examples * self.context_size

    # ------------------------------------------------------------------ files

    def _table(self, index: int) -> Any:
        """File ``index`` as a pyarrow Table (foreign caches and verify): memory-mapped on
        local disk, fetched whole from object storage."""
        import pyarrow as pa

        table = self._tables.get(index)
        if table is None:
            name = self.arrow_files[index]
            try:
                table = pa.ipc.open_stream(pa.py_buffer(self.files.map(name))).read_all()
            except (pa.ArrowInvalid, OSError) as err:
                raise CorruptStoreError(
                    f"{self.files.url_of(name)} is not a readable Arrow stream ({err})"
                ) from err
            missing = [c for c in self.columns if c not in table.column_names]
            if missing:
                raise CorruptStoreError(f"{self.files.url_of(name)} lacks the columns {missing}")
            table = self._tables.setdefault(index, table)
        return table

    def _rows(self) -> list[list[int]]:
        """Examples in each record batch of each file."""
        if self._batch_rows is None:
            if self.layout is not None:
                lay = self.layout
                out = []
                for index in range(len(self.arrow_files)):
                    start, stop = lay.shard_range(index)
                    n, per = stop - start, lay.examples_per_block
                    out.append([min(per, n - lo) for lo in range(0, n, per)])
            else:
                out = [
                    [len(b) for b in self._table(i).to_batches()]
                    for i in range(len(self.arrow_files))
                ]
            self._batch_rows = out
        return self._batch_rows

    def _values_at(self, index: int) -> list[list[int]]:
        """Byte offsets of each block column's values per record batch of file ``index``."""
        at = self.record["files"][index]["values_at"]  # type: ignore[index]
        if len(at) != len(self._rows()[index]) or any(
            len(a) != len(self.block_columns) for a in at
        ):
            raise CorruptStoreError(
                f"{self.files.url_of(SIDECAR)}: values_at of {self.arrow_files[index]} does not "
                "match its record batches; restore the store or re-capture"
            )
        entry = self.checks.entry(self.arrow_files[index])
        if entry is not None and entry.ranges is not None and self.layout is not None:
            # each block's values where the published blocks are, in the writer's order
            flat = [x for a in at for x in a]
            blocks = _ranges(at, self.layout, self.record["files"][index]["n_examples"])  # type: ignore[index]
            if flat != sorted(set(flat)) or not set(blocks) <= set(entry.ranges):
                raise CorruptStoreError(
                    f"{self.files.url_of(SIDECAR)}: values_at of {self.arrow_files[index]} "
                    "does not point at the blocks the root manifest publishes: it was edited; "
                    "restore it or re-capture"
                )
        return at


def _chunk_values(chunk: Any, context_size: int, d_in: int) -> np.ndarray:
    """``[n * context_size, d_in]`` zero-copy view of an ``Array2D`` record-batch chunk."""
    storage = getattr(chunk, "storage", chunk)
    if storage.null_count:
        raise CorruptStoreError("an activation row is null")
    flat = storage.flatten().flatten()
    if flat.null_count or len(flat) != len(storage) * context_size * d_in:
        raise CorruptStoreError(
            f"a record batch holds {len(flat)} values for {len(storage)} rows of "
            f"({context_size}, {d_in})"
        )
    return flat.to_numpy(zero_copy_only=True).reshape(-1, d_in)
