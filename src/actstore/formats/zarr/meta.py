"""One published prompt/response store, opened and checked: :class:`StoreMeta`.

Opening reads the consolidated metadata (``.zmetadata``) through the store's root manifest
(so an edited ``.zattrs``, a reordered ``sites`` list or an altered ``.zarray`` fails before
anything is parsed), checks every array against the layout the attributes declare (dtype
``<f2``, no compressor, no filters, C order, chunks ``(1, 1, T_chunk, H)``), and loads the
stored lengths and the keyed chunk digests. Everything is read through the files layer, on
local disk and object storage alike, with actstore's own decoder for the uncompressed,
sample-chunked arrays the writer makes (zarr-python is not needed to read).

A chunk of ``(sample, layer, part)`` is read whole (one file, at most about 2 MiB) and
checked against its digest, keyed by its place, before any row is copied out; a chunk the
digests list but the store lacks is an error, one they do not list is padding (zeros).

Example:
    >>> import tempfile
    >>> from actstore.testing import FormatCase, make_acts, make_batches, make_plan
    >>> plan, out = make_plan(), tempfile.TemporaryDirectory()  # 6-token prompts
    >>> store = FormatCase("zarr").write(out.name, plan, make_batches(plan, make_acts(plan)))
    >>> meta = StoreMeta.open(Location.parse(store))
    >>> meta.layout.sites, meta.lengths["prompt"][:3]
    (('resid.1', 'resid.3'), array([6, 6, 6], dtype=int32))
"""

from __future__ import annotations

import io
import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import ConfigError, CorruptStoreError, ProtocolVersionError, StoreNotFoundError
from ...storage.files import StoreFiles
from ...storage.integrity import Integrity
from ...storage.location import Location, refuse_partial
from ...storage.manifest import present_digest
from ..blocks import PIECE_SLOT, scratch
from ..metacheck import Fields, is_int
from .layout import (
    ACT_DTYPE,
    ACTIVATIONS,
    FORMAT_TAG,
    LENGTHS,
    PARTS,
    SCHEMA_VERSION,
    TOKEN_IDS,
    ZarrLayout,
    chunk_id,
    chunk_key,
    chunksums_name,
)
from .store import OPTIONAL_ARRAYS, sample_arrays


@dataclass
class StoreMeta:
    """One published store: its files, checks, attributes, layout, lengths and digests."""

    location: Location
    files: StoreFiles
    checks: Integrity
    zmeta: dict[str, Any]
    attrs: dict[str, Any]
    layout: ZarrLayout
    separators: dict[str, str]
    offset: int = 0
    """Global index of this store's first sample (the stores of a run)."""
    lengths: dict[str, np.ndarray] = field(default_factory=dict)
    chunksums: dict[str, np.ndarray] | None = None
    """Keyed xxh3-64 per activation chunk ``[n, L, n_chunks]``; None: reads unchecked."""
    _arrays: dict[str, np.ndarray | None] = field(default_factory=dict, repr=False)

    @classmethod
    def open(
        cls,
        location: Location,
        *,
        offset: int = 0,
        verify_reads: bool = True,
        files: StoreFiles | None = None,
        cache: dict[str, Any] | None = None,
    ) -> StoreMeta:
        files = files or location.files(**(cache or {}))
        refuse_partial(location)
        if files.size(".zmetadata") is None:
            raise StoreNotFoundError(
                f"{location} holds no finished zarr store (no .zmetadata, written last): an "
                "unfinished capture or copy, or a wrong path; rerun it, or fix the path"
            )
        checks = Integrity.open(files, ours=True, verify_reads=verify_reads, format="zarr")
        zmeta = checks.read_json(".zmetadata")
        meta, attrs, layout, separators = parse_zmetadata(zmeta, location.url)
        store = cls(
            location=location,
            files=files,
            checks=checks,
            zmeta=meta,
            attrs=attrs,
            layout=layout,
            separators=separators,
            offset=offset,
        )
        store.check_sample_count()
        for part in PARTS:
            lengths = store.array(LENGTHS[part])
            cap = layout.max_len(part)
            if (
                lengths is None
                or lengths.shape != (layout.n_samples,)
                or (len(lengths) and (lengths.min() < 0 or lengths.max() > cap))
            ):
                raise CorruptStoreError(
                    f"{location}/{LENGTHS[part]} must hold {layout.n_samples} lengths "
                    f"in 0..{cap}; it does not"
                )
            store.lengths[part] = lengths.astype(np.int32)
        if checks.enabled:
            store.chunksums = store.load_chunksums()
        return store

    @property
    def n_samples(self) -> int:
        return self.layout.n_samples

    def check_sample_count(self) -> None:
        """The samples the layout declares are no more than the store's files can hold (its
        chunk digest files, one per writer shard, and the lengths' chunk files), before
        any per-sample array is allocated: a layout edited to claim 10**12 samples is an
        error, not a memory exhaustion."""
        names = self.files.list()
        held = max(sum(n.startswith(f"meta/chunksums/{part}.") for n in names) for part in PARTS)
        held = max(held, *(sum(n.startswith(LENGTHS[p] + "/") for n in names) for p in PARTS))
        if self.layout.n_samples > held * self.sample_rows:
            raise CorruptStoreError(
                f"{self.location}: the layout declares {self.layout.n_samples} samples, but "
                f"its files hold at most {held * self.sample_rows}: the metadata was edited; "
                "restore it or re-create the store"
            )

    def url_of(self, name: str) -> str:
        return self.files.url_of(name)

    def exists(self, name: str) -> bool:
        return self.files.exists(name)

    # ------------------------------------------------------------------ per-sample arrays

    @property
    def sample_rows(self) -> int:
        """Samples per chunk of the per-sample arrays (the writer's shard)."""
        zarray = self.zmeta.get(f"{LENGTHS['prompt']}/.zarray") or {}
        return int((zarray.get("chunks") or [1])[0]) or 1

    def array(self, name: str) -> np.ndarray | None:
        """Per-sample array ``name`` (``arrays/prompt_len``...) read whole and checked (kept
        once read), or None if the store lacks it."""
        if name not in self._arrays:
            self._arrays[name] = self._read_array(name)
        return self._arrays[name]

    def _read_array(self, name: str) -> np.ndarray | None:
        zarray = self.zmeta.get(f"{name}/.zarray")
        if not isinstance(zarray, dict):
            return None
        source = self.url_of(name)
        try:
            shape = tuple(int(x) for x in zarray["shape"])
            chunks = tuple(int(x) for x in zarray["chunks"])
            dtype = np.dtype(zarray["dtype"])
        except (KeyError, TypeError, ValueError) as err:
            raise CorruptStoreError(f"{source}/.zarray is malformed ({err}); re-create the store")
        if (
            zarray.get("compressor") is not None
            or zarray.get("filters")
            or zarray.get("order", "C") != "C"
            or len(chunks) != len(shape)
            or not shape
            or chunks[0] < 1
            or chunks[1:] != shape[1:]
        ):
            raise ConfigError(
                f"{source} is compressed, filtered or chunked across its rows, which actstore "
                "does not write; open it with zarr-python"
            )
        separator = zarray.get("dimension_separator", ".")
        fill = zarray.get("fill_value")
        if dtype.kind in "SUV" or fill is None:
            out = np.zeros(shape, dtype)
        else:
            out = np.full(shape, fill, dtype)
        rows = chunks[0]
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        if row_bytes == 0:
            return out
        for k in range(-(-shape[0] // rows)):
            key = f"{name}/" + separator.join([str(k)] + ["0"] * (len(shape) - 1))
            size = self.files.size(key)
            if size is None:
                continue  # never written: the fill value
            if size != rows * row_bytes:
                raise CorruptStoreError(
                    f"{self.url_of(key)} has {size} bytes, expected {rows * row_bytes}; "
                    "restore it or re-capture"
                )
            data = (
                self.checks.read_bytes(key) if self.checks.enabled else self.files.read_bytes(key)
            )
            n = min(rows, shape[0] - k * rows)
            values = np.frombuffer(data, dtype, count=n * (row_bytes // dtype.itemsize))
            out[k * rows : k * rows + n] = values.reshape((n, *shape[1:]))
        return out

    def load_chunksums(self) -> dict[str, np.ndarray]:
        """The keyed chunk digests of every writer shard, concatenated per part."""
        lay, rows = self.layout, self.sample_rows
        out = {}
        for part in PARTS:
            pieces = []
            for k in range(max(1, -(-lay.n_samples // rows))):
                name = chunksums_name(part, k)
                try:
                    pieces.append(
                        np.load(io.BytesIO(self.checks.read_bytes(name)), allow_pickle=False)
                    )
                except (OSError, ValueError, StoreNotFoundError) as err:
                    raise CorruptStoreError(
                        f"{self.url_of(name)} is missing or unreadable ({err}); restore it or re-capture"
                    ) from err
            sums = np.concatenate(pieces) if pieces else np.zeros((0,), "<u8")
            want = (lay.n_samples, lay.n_layers, lay.n_chunks(part))
            if sums.shape != want or sums.dtype != np.dtype("<u8"):
                raise CorruptStoreError(
                    f"{self.location}: the chunk digests of {part} hold {sums.dtype} {sums.shape}, "
                    f"expected uint64 {want}; restore them or re-capture"
                )
            out[part] = sums
        return out

    # ------------------------------------------------------------------ activation chunks

    def chunk_name(self, part: str, local: int, layer_idx: int, c: int) -> str:
        return f"{ACTIVATIONS[part]}/{chunk_key((local, layer_idx, c, 0), self.separators[part])}"

    def read_rows(self, part: str, local: int, layer_idx: int, out: np.ndarray) -> int:
        """Fill ``out`` (``[n, H]`` float16) with tokens ``0..n`` of one (sample, layer): each
        chunk read whole into a scratch buffer, checked against its keyed digest, then its
        rows copied; a chunk not stored is zeros (unless the digests say it was stored).
        Returns the bytes read."""
        lay = self.layout
        n_rows, t_chunk = out.shape[0], lay.t_chunk(part)
        chunk_bytes, row_bytes = lay.chunk_nbytes(part), lay.hidden_size * ACT_DTYPE.itemsize
        sums = None if self.chunksums is None else self.chunksums[part][local, layer_idx]
        n_read = 0
        for c in range(-(-n_rows // t_chunk)):
            r0, r1 = c * t_chunk, min(n_rows, (c + 1) * t_chunk)
            name = self.chunk_name(part, local, layer_idx, c)
            buf = scratch(1, chunk_bytes, np.uint8, PIECE_SLOT)[0]
            if not self.files.read_exact(name, buf):
                if sums is not None and sums[c]:
                    raise CorruptStoreError(
                        f"chunk {self.url_of(name)} (sample {local}, layer {layer_idx}, chunk "
                        f"{c}) is missing: the store recorded it; restore it or re-capture"
                    )
                out[r0:r1] = 0
                continue
            n_read += chunk_bytes
            if sums is not None:
                store_id = self.checks.manifest.store_id  # type: ignore[union-attr]
                ident = chunk_id(part, local, layer_idx, c)
                if present_digest(store_id, ident, buf) != sums[c]:
                    raise CorruptStoreError(
                        f"chunk {self.url_of(name)} (sample {local}, layer {layer_idx}, chunk {c}, "
                        f"bytes 0-{chunk_bytes}) is not the chunk published there (changed, "
                        "damaged, moved or from another store); restore it or re-capture "
                        "(verify_reads=False reads it anyway)"
                    )
            out[r0:r1] = buf[: (r1 - r0) * row_bytes].view(ACT_DTYPE).reshape(r1 - r0, -1)
        return n_read


def parse_zmetadata(
    zmeta: Any, where: str
) -> tuple[dict[str, Any], dict[str, Any], ZarrLayout, dict[str, str]]:
    """``(metadata, attrs, layout, separators)`` of a store's consolidated metadata, checked
    against the layout its attributes declare."""
    meta = zmeta.get("metadata") if isinstance(zmeta, dict) else None
    if not isinstance(meta, dict):
        raise CorruptStoreError(
            f"{where}/.zmetadata has no 'metadata' mapping; re-create the store"
        )
    attrs = meta.get(".zattrs") or {}
    if not isinstance(attrs, dict):
        raise CorruptStoreError(f"{where}/.zattrs is not a JSON object; re-create the store")
    if attrs.get("format") != FORMAT_TAG:
        raise CorruptStoreError(
            f"{where} is a zarr store but not an actstore prompt/response "
            f"store (attribute format={attrs.get('format')!r})"
        )
    version = attrs.get("schema_version")
    if not isinstance(version, str) or not re.fullmatch(r"\d+\.\d+", version):
        raise CorruptStoreError(
            f"{where}/.zattrs: schema_version {version!r} is not a version such as "
            f"{SCHEMA_VERSION!r}; the store was altered: restore it or re-create the store"
        )
    _check_attr_types(attrs, f"{where}/.zattrs")
    if version.split(".")[0] != SCHEMA_VERSION.split(".")[0]:
        raise ProtocolVersionError(
            f"{where} has schema_version {version!r}; this actstore reads "
            f"{SCHEMA_VERSION.split('.')[0]}.x; upgrade actstore"
        )
    layout = ZarrLayout.from_dict(attrs.get("layout", {}), source=f"{where}/.zattrs")
    if attrs.get("sites", list(layout.sites)) != list(layout.sites) or attrs.get(
        "layers", list(layout.layers)
    ) != list(layout.layers):
        raise CorruptStoreError(
            f"{where}/.zattrs lists sites {attrs.get('sites')} (layers {attrs.get('layers')}), "
            f"but its layout says {list(layout.sites)}: the attributes were edited; re-create it"
        )
    separators = {}
    for part in PARTS:
        separators[part] = _check_zarray(
            meta, ACTIVATIONS[part], layout.shape(part), list(layout.chunk_shape(part)), where
        )
    check_nodes(meta, attrs, layout, where)
    return meta, attrs, layout, separators


def _check_attr_types(attrs: dict[str, Any], where: str) -> None:
    """The attributes readers use, each of its type (a hostile value is one error)."""
    f = Fields(attrs, where)
    for key in ("model_id", "model_family", "dataset", "dataset_root", "fingerprint"):
        f.text(key, optional=True)
    f.count("model_num_layers", lo=1, optional=True)
    for part in PARTS:
        f.count(f"{part}_truncated_count", optional=True)
    f.texts("optional_arrays", optional=True)
    f.texts("text_files", optional=True)
    shard = f.obj("shard", optional=True)
    if shard is not None:
        s = Fields(shard, f"{where}: shard")
        for key in ("index", "start", "stop"):
            s.count(key)


def expected_nodes(
    layout: ZarrLayout, *, token_ids: bool, optional: Any, sample_rows: int, separator: str
) -> dict[str, Any]:
    """Every node of a store's consolidated metadata but the group's attributes, as the
    writer's zarr-python writes it (:func:`.store.create_arrays`): the groups, and each
    array's ``.zarray`` (shape, chunks, dtype, fill value, no compression) and ``.zattrs``."""
    arrays: dict[str, tuple[tuple[int, ...], tuple[int, ...], np.dtype, Any]] = {
        ACTIVATIONS[part]: (layout.shape(part), layout.chunk_shape(part), ACT_DTYPE, 0.0)
        for part in PARTS
    }
    rows = max(1, min(sample_rows, layout.n_samples))
    for name, (row, dtype, fill) in sample_arrays(
        layout, token_ids=token_ids, optional=optional
    ).items():
        arrays[name] = ((layout.n_samples, *row), (rows, *row), dtype, fill)
    out: dict[str, Any] = {".zgroup": {"zarr_format": 2}, "arrays/.zattrs": {}}
    out["arrays/.zgroup"] = {"zarr_format": 2}
    for name, (shape, chunks, dtype, fill) in arrays.items():
        out[f"{name}/.zarray"] = {
            "shape": list(shape),
            "chunks": list(chunks),
            "dtype": dtype.str,
            "fill_value": "" if dtype.kind == "S" else fill,  # zarr: b"" as base64
            "order": "C",
            "filters": None,
            "dimension_separator": separator,
            "compressor": None,
            "zarr_format": 2,
        }
        out[f"{name}/.zattrs"] = {}
    return out


def check_nodes(
    meta: dict[str, Any], attrs: dict[str, Any], layout: ZarrLayout, where: str
) -> None:
    """Every node the consolidated metadata lists is one actstore writes, with the metadata
    it writes (:func:`expected_nodes`): a per-sample array of another dtype, shape, fill
    value or chunking (which zarr-python would read as other values), or a node actstore
    does not write, is a :class:`CorruptStoreError`. Only the group's attributes are
    checked elsewhere (``verify``: against the store id)."""
    optional = attrs.get("optional_arrays", [])
    if not set(optional) <= set(OPTIONAL_ARRAYS):  # a list of strings: checked on parse
        raise CorruptStoreError(
            f"{where}/.zattrs: optional_arrays {optional!r} names arrays actstore does not "
            "write; the store was altered"
        )
    lengths = meta.get(f"{LENGTHS['prompt']}/.zarray")
    chunks = lengths.get("chunks") if isinstance(lengths, dict) else None
    if not (isinstance(chunks, list) and chunks and is_int(chunks[0]) and chunks[0] >= 1):
        raise CorruptStoreError(f"{where}/{LENGTHS['prompt']}: chunks {chunks!r} are malformed")
    separator = meta[f"{ACTIVATIONS['prompt']}/.zarray"].get("dimension_separator", ".")
    want = expected_nodes(
        layout,
        token_ids=f"{TOKEN_IDS['prompt']}/.zarray" in meta,
        optional=optional,
        sample_rows=chunks[0],
        separator=separator,
    )
    got = {k: v for k, v in meta.items() if k != ".zattrs"}
    inline = {"metadata": {}, "must_understand": False, "kind": "inline"}
    group = got.get("arrays/.zgroup")
    if isinstance(group, dict) and group.get("consolidated_metadata") == inline:
        # zarr-python 3 notes its (empty) inline index in the group's entry
        got["arrays/.zgroup"] = {k: v for k, v in group.items() if k != "consolidated_metadata"}
    extra, missing = sorted(set(got) - set(want)), sorted(set(want) - set(got))
    if extra or missing:
        raise CorruptStoreError(
            f"{where}/.zmetadata lists {extra[:3] or 'no'} nodes actstore does not write and "
            f"lacks {missing[:3] or 'none'} of those it does: the store was altered; restore "
            "it or re-create the store"
        )
    for key in sorted(want):
        if got[key] != want[key]:
            fields = sorted(
                k
                for k in {*want[key], *got[key]}
                if not isinstance(got[key], dict) or got[key].get(k) != want[key].get(k)
            )
            raise CorruptStoreError(
                f"{where}/{key}: {', '.join(fields)} {'is' if len(fields) == 1 else 'are'} not "
                "what actstore writes for this store's layout, so zarr-python would read other "
                "values: the store was altered; restore it or re-create the store"
            )


def _check_zarray(meta: dict, name: str, shape: tuple, chunks: list, path: str) -> str:
    zarray = meta.get(f"{name}/.zarray")
    if not isinstance(zarray, dict):
        raise CorruptStoreError(f"{path} lacks the array {name}; re-create the store")
    want = {
        "shape": list(shape),
        "chunks": chunks,
        "dtype": ACT_DTYPE.str,
        "compressor": None,
        "filters": None,
        "order": "C",
        "zarr_format": 2,
    }
    for key, value in want.items():
        if zarray.get(key) != value:
            raise CorruptStoreError(
                f"{path}/{name}: {key} is {zarray.get(key)!r}, the layout "
                f"requires {value!r}; the store was altered"
            )
    separator = zarray.get("dimension_separator", ".")
    if separator not in (".", "/"):
        raise CorruptStoreError(f"{path}/{name}: unknown dimension_separator {separator!r}")
    return separator
