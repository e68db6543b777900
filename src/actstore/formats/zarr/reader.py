"""Read prompt/response activation stores: one ``activations.zarr`` or a sharded run
(``manifest.json`` + ``shards/shard-XXXX.zarr``) through the same :class:`ZarrReader`.

Opening parses the consolidated metadata (``.zmetadata``) and checks every array against the
layout the attributes declare (dtype ``<f2``, no compressor, no filters, C order, chunks
``(1, 1, T_chunk, H)``), then loads the small per-sample arrays with zarr-python (read-only,
consolidated). Because the activation arrays are uncompressed Zarr v2, a chunk file holds
exactly ``T_chunk * H`` float16 values in C order; :meth:`ZarrReader.read` therefore reads the
``ceil(len / T_chunk)`` chunk files of one ``(sample, layer)`` straight into the output buffer
(``pread``), touching no other chunk and no other file. A missing chunk is the fill value 0,
as in zarr. The reader holds no open files between calls, so it pickles into DataLoader
workers and each worker reads independently.

At ``s3://bucket/prefix`` the same reads go through :mod:`actstore.storage.files`: the
metadata, lengths and chunk checksums are fetched when the reader opens, then each chunk
with one ranged GET (optionally kept in the local cache tier), checked as on disk.

Example:
    >>> r = ZarrReader("out/activations.zarr")  # doctest: +SKIP
    >>> r.read(12, 6, "response").shape        # sample 12, resid.6: (response_len[12], H)  # doctest: +SKIP
    (41, 4096)
    >>> batch = r.random_batch(32, np.random.default_rng(0))  # 32 samples x 2 random layers  # doctest: +SKIP
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from ...batch import CapturePlan
from ...errors import (
    ConfigError,
    CorruptStoreError,
    IndexOutOfRangeError,
    ProtocolVersionError,
    StoreNotFoundError,
)
from ...sites import Site
from ...stats import RunningStats, merge_all
from ...storage import read_json
from ...storage.files import StoreFiles, open_files
from ...storage.object import S3Config, is_remote
from ..base import Block, ReaderBase, VerifyReport
from .layout import (
    ACT_DTYPE,
    ACTIVATIONS,
    CHUNKSUMS,
    CONFIG_FILE,
    DIGEST,
    FORMAT_TAG,
    FULL_LENGTHS,
    LENGTHS,
    PARTS,
    RUN_FORMAT_TAG,
    SAMPLE_KEY,
    SCHEMA_VERSION,
    STATISTICS_FILE,
    STORE_NAME,
    TEXT_FILES,
    TOKEN_IDS,
    ZarrLayout,
    chunk_key,
    parse_chunk_key,
)
from .store import OPTIONAL_ARRAYS, byte_view, zarr_module

MANIFEST = "manifest.json"

log = logging.getLogger(__name__)


@dataclass
class StoreInfo:
    """One published store, validated; the unit a run is made of."""

    path: Path
    """The store directory (remote stores: ``rel`` as a path; messages use :attr:`where`)."""
    attrs: dict[str, Any]
    layout: ZarrLayout
    separators: dict[str, str]
    """Chunk key separator of each activation array (``.`` as written; ``/`` is accepted)."""
    offset: int = 0
    """Global index of this store's first sample."""
    lengths: dict[str, np.ndarray] = field(default_factory=dict)
    """Stored (capped) token lengths per part, int32 ``[n_samples]``."""
    chunksums: dict[str, np.ndarray] | None = None
    """xxh3-64 per activation chunk (``meta/chunksums.<part>.npy``); None: not checked."""
    files: StoreFiles | None = None
    """Remote stores: the files layer every byte is read through (None: local disk)."""
    rel: str = ""
    """Remote stores: this store's folder inside ``files`` (``""`` or ``"shards/x.zarr/"``)."""
    arrays_meta: dict[str, Any] = field(default_factory=dict, repr=False)
    """Remote stores: the consolidated metadata (how :func:`remote_array` decodes arrays)."""
    geometry: dict[str, tuple[str, str, int, int, int]] = field(init=False, repr=False)
    """Per part: (array directory + "/", key separator, T_chunk, chunk bytes, row bytes)."""

    def __post_init__(self) -> None:
        row = self.layout.hidden_size * ACT_DTYPE.itemsize
        base = f"{self.path}/" if self.files is None else self.rel
        self.geometry = {
            part: (
                f"{base}{ACTIVATIONS[part]}/",
                self.separators[part],
                self.layout.t_chunk(part),
                self.layout.chunk_nbytes(part),
                row,
            )
            for part in PARTS
        }

    @property
    def n_samples(self) -> int:
        return self.layout.n_samples

    def chunk_path(self, part: str, indices: Sequence[int]) -> str:
        prefix, separator = self.geometry[part][:2]
        return prefix + chunk_key(indices, separator)

    @property
    def where(self) -> str:
        """The store's location, for messages: its path or URL."""
        if self.files is None:
            return str(self.path)
        return self.files.url_of(self.rel).rstrip("/") if self.rel else self.files.url

    def url_of(self, name: str) -> str:
        return f"{self.where}/{name}"

    def exists(self, name: str) -> bool:
        """Whether file ``name`` (relative to the store) exists."""
        if self.files is None:
            return (self.path / name).is_file()
        return self.files.exists(self.rel + name)

    def read_json(self, name: str) -> Any:
        if self.files is None:
            return read_json(self.path / name)
        return self.files.read_json(self.rel + name)

    def read_bytes(self, name: str) -> bytes:
        if self.files is None:
            return (self.path / name).read_bytes()
        return self.files.read_bytes(self.rel + name)

    def listing(self, folder: str = "") -> dict[str, int]:
        """Files below ``folder`` of the store: name relative to ``folder`` -> size."""
        if self.files is None:
            top, out = self.path / folder, {}
            for dirpath, _, names in os.walk(top):
                for n in names:
                    p = Path(dirpath) / n
                    out[p.relative_to(top).as_posix()] = p.stat().st_size
            return out
        base = self.rel + (folder.rstrip("/") + "/" if folder else "")
        return {n[len(base) :]: size for n, size in self.files.list().items() if n.startswith(base)}


def open_store_info(path: Path, *, offset: int = 0, verify_reads: bool = True) -> StoreInfo:
    """Validate the store at ``path`` from its consolidated metadata and load its lengths
    (and, with ``verify_reads``, its chunk checksums)."""
    if path.name.endswith(".partial"):
        raise CorruptStoreError(
            f"{path} is an unfinished write (a .partial directory); "
            "rerun the capture to produce a published store"
        )
    if not path.is_dir():
        raise StoreNotFoundError(f"{path} does not exist or is not a directory")
    zmeta_path = path / ".zmetadata"
    if not zmeta_path.exists():
        raise CorruptStoreError(
            f"{path} has no consolidated metadata (.zmetadata): it is not a "
            "finished actstore zarr store; re-create it"
        )
    _, attrs, layout, separators = _parse_zmetadata(read_json(zmeta_path), str(path))
    info = StoreInfo(path=path, attrs=attrs, layout=layout, separators=separators, offset=offset)
    _check_inside(path)
    group = zarr_module().open_consolidated(str(path), mode="r", zarr_format=2)
    for part in PARTS:
        lengths = np.asarray(_array(group, LENGTHS[part], path)[:], dtype=np.int32)
        cap = layout.max_len(part)
        if lengths.shape != (layout.n_samples,) or lengths.min() < 0 or lengths.max() > cap:
            raise CorruptStoreError(
                f"{path}/{LENGTHS[part]} must hold {layout.n_samples} lengths "
                f"in 0..{cap}; it does not"
            )
        info.lengths[part] = lengths
    if verify_reads:
        info.chunksums = _load_chunksums(info)
    return info


def _parse_zmetadata(
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
    if attrs.get("format") != FORMAT_TAG:
        raise CorruptStoreError(
            f"{where} is a zarr store but not an actstore prompt/response "
            f"store (attribute format={attrs.get('format')!r})"
        )
    version = str(attrs.get("schema_version", ""))
    if version.split(".")[0] != SCHEMA_VERSION.split(".")[0]:
        raise ProtocolVersionError(
            f"{where} has schema_version {version!r}; this actstore reads "
            f"{SCHEMA_VERSION.split('.')[0]}.x; upgrade actstore"
        )
    layout = ZarrLayout.from_dict(attrs.get("layout", {}), source=f"{where}/.zattrs")
    separators = {}
    for part in PARTS:
        separators[part] = _check_zarray(
            meta, ACTIVATIONS[part], layout.shape(part), list(layout.chunk_shape(part)), where
        )
    return meta, attrs, layout, separators


def open_remote_info(
    files: StoreFiles, rel: str = "", *, offset: int = 0, verify_reads: bool = True
) -> StoreInfo:
    """:func:`open_store_info` of the store in folder ``rel`` of remote ``files``: its
    consolidated metadata, lengths and chunk checksums are fetched; chunks are not."""
    where = files.url_of(rel).rstrip("/") if rel else files.url
    if files.size(rel + ".zmetadata") is None:
        raise StoreNotFoundError(
            f"{where} holds no finished zarr store (no .zmetadata, the file uploaded last): an "
            "unfinished upload or a wrong URL; rerun the capture or copy (actstore cp) to "
            "finish it, or fix the URL"
        )
    meta, attrs, layout, separators = _parse_zmetadata(files.read_json(rel + ".zmetadata"), where)
    info = StoreInfo(
        path=Path(rel or "."),
        attrs=attrs,
        layout=layout,
        separators=separators,
        offset=offset,
        files=files,
        rel=rel,
    )
    info.arrays_meta = meta
    for part in PARTS:
        lengths = remote_array(info, LENGTHS[part])
        cap = layout.max_len(part)
        if (
            lengths is None
            or lengths.shape != (layout.n_samples,)
            or lengths.min() < 0
            or lengths.max() > cap
        ):
            raise CorruptStoreError(
                f"{where}/{LENGTHS[part]} must hold {layout.n_samples} lengths "
                f"in 0..{cap}; it does not"
            )
        info.lengths[part] = lengths.astype(np.int32)
    if verify_reads:
        info.chunksums = _load_chunksums(info)
        _check_uploaded(info)
    return info


def _check_uploaded(info: StoreInfo) -> None:
    """Refuse a remote store holding fewer activation chunks than its checksums record (a
    copy still under way, e.g. one that does not send ``.zmetadata`` last): one listing,
    no request."""
    if info.chunksums is None:
        return
    for part in PARTS:
        listed = sum(1 for n in info.listing(ACTIVATIONS[part]) if not n.startswith("."))
        recorded = int(np.count_nonzero(info.chunksums[part]))
        if listed < recorded:
            raise StoreNotFoundError(
                f"{info.url_of(ACTIVATIONS[part])} holds {listed} of the {recorded} chunk "
                "files the store records: an unfinished upload or copy; rerun it to finish"
            )


def remote_array(info: StoreInfo, name: str) -> np.ndarray | None:
    """A per-sample array (``arrays/prompt_len``...) of a remote store, read whole through
    the files layer (uncompressed, chunked along samples only, as actstore writes them), or
    None if the store lacks it."""
    zarray = info.arrays_meta.get(f"{name}/.zarray")
    if not isinstance(zarray, dict):
        return None
    source = info.url_of(name)
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
            f"{source} is compressed, filtered or chunked across its rows, which the "
            "object-storage reader does not decode; copy the store to local disk "
            "(actstore cp) and open the copy"
        )
    separator = zarray.get("dimension_separator", ".")
    fill = zarray.get("fill_value")
    if dtype.kind in "SUV" or fill is None:
        out = np.zeros(shape, dtype)
    else:
        out = np.full(shape, fill, dtype)
    rows = chunks[0]
    row_bytes = math.prod(shape[1:]) * dtype.itemsize
    for k in range(-(-shape[0] // rows)):
        key = f"{info.rel}{name}/" + separator.join([str(k)] + ["0"] * (len(shape) - 1))
        size = info.files.size(key)
        n = min(rows, shape[0] - k * rows)
        if size is None:
            continue  # never written: the fill value
        if size != rows * row_bytes:
            raise CorruptStoreError(
                f"{info.files.url_of(key)} has {size} bytes, expected {rows * row_bytes}; "
                "restore it or re-capture"
            )
        data = info.files.read_range(key, 0, n * row_bytes, cache=False)
        out[k * rows : k * rows + n] = np.frombuffer(data, dtype).reshape((n, *shape[1:]))
    return out


def _check_inside(path: Path) -> None:
    """Refuse a store whose folders or metadata files are symlinks out of it, and check
    that every zarr metadata file is valid JSON (zarr-python would raise a raw error).
    Chunk files are not listed here (there may be millions): reads open them with
    ``O_NOFOLLOW`` and ``verify`` checks them."""
    root = path.resolve()
    entries = [*path.iterdir()]
    for folder in ("arrays", "meta", "text"):
        if (path / folder).is_dir() and not (path / folder).is_symlink():
            entries += [*(path / folder).iterdir()]
    entries += [e / name for e in entries if e.is_dir() for name in (".zarray", ".zattrs")]
    for entry in entries:
        if entry.is_symlink() and not entry.resolve().is_relative_to(root):
            raise CorruptStoreError(
                f"{entry} is a symlink to {entry.resolve()}, outside the store; a store's "
                "files must lie inside it: copy the file in or re-capture"
            )
        if entry.name in (".zgroup", ".zattrs", ".zarray") and entry.is_file():
            read_json(entry)


_WARNED_UNVERIFIED: set[str] = set()


def _load_chunksums(info: StoreInfo) -> dict[str, np.ndarray] | None:
    layout = info.layout
    if not any(info.exists(CHUNKSUMS[p]) for p in PARTS):
        if info.where not in _WARNED_UNVERIFIED:
            _WARNED_UNVERIFIED.add(info.where)
            log.warning(
                "%s has no chunk checksums (written by another tool or an older actstore): "
                "its reads are not verified",
                info.where,
            )
        return None
    out = {}
    for part in PARTS:
        file = info.url_of(CHUNKSUMS[part])
        want = (layout.n_samples, layout.n_layers, layout.n_chunks(part))
        try:
            if info.files is None:
                sums = np.load(info.path / CHUNKSUMS[part], mmap_mode="r", allow_pickle=False)
            else:
                raw = info.read_bytes(CHUNKSUMS[part])
                sums = np.load(io.BytesIO(raw), allow_pickle=False)
        except (OSError, ValueError, StoreNotFoundError) as err:
            raise CorruptStoreError(
                f"{file} is missing or unreadable ({err}); restore it or re-capture"
            ) from err
        if sums.shape != want or sums.dtype != np.dtype("<u8"):
            raise CorruptStoreError(
                f"{file} holds {sums.dtype} {sums.shape}, expected uint64 {want}; restore it "
                "or re-capture"
            )
        out[part] = sums
    return out


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


def _array(group: Any, name: str, path: Path) -> Any:
    try:
        return group[name]
    except KeyError:
        raise CorruptStoreError(f"{path} lacks the array {name}; re-create the store") from None


def resolve_location(location: str | os.PathLike) -> tuple[Path, bool]:
    """``(path, is_run)``: a store, a run directory, or a folder holding activations.zarr."""
    path = Path(location).expanduser()
    if (path / MANIFEST).is_file():
        return path, True
    if (path / "shards").is_dir() and not (path / ".zgroup").exists():
        raise CorruptStoreError(
            f"{path} has shards but no manifest.json (no manifest yet: a "
            "writer is missing or unfinished); write it with write_manifest"
        )
    if not (path / ".zgroup").exists() and (path / STORE_NAME).is_dir():
        return path / STORE_NAME, False
    return path, False


def resolve_remote(files: StoreFiles) -> tuple[str, bool]:
    """:func:`resolve_location` of a remote prefix: ``(folder of the store, is_run)``."""
    if files.exists(MANIFEST):
        return "", True
    if files.exists(".zgroup") or files.exists(".zmetadata"):
        return "", False
    if files.exists(f"{STORE_NAME}/.zgroup") or files.exists(f"{STORE_NAME}/.zmetadata"):
        return f"{STORE_NAME}/", False
    if any(name.startswith("shards/") for name in files.list()):
        raise StoreNotFoundError(
            f"{files.url} has shards but no {MANIFEST} (the file uploaded last): an unfinished "
            "upload; rerun the copy (actstore cp) to finish it"
        )
    raise StoreNotFoundError(
        f"{files.url} holds no zarr store (no .zmetadata or {MANIFEST}): an unfinished upload "
        "or a wrong URL; finish the copy (actstore cp) or fix the URL"
    )


class ZarrReader(ReaderBase):
    """Random access, training batches and loader blocks over one store or a sharded run.

    Sites are named as captured (``"resid.6"``); wherever a layer is asked for, give the
    site name or, for the residual stream, the block index (``6``).

    ``location`` may be ``s3://bucket/prefix``: the reader then fetches the consolidated
    metadata, lengths and chunk checksums when it opens, and each chunk it needs with one
    ranged GET (checked against its checksum as on disk). ``cache_dir`` / ``cache_bytes`` /
    ``s3``: the local cache tier and S3 settings (see
    :func:`~actstore.storage.files.open_files`; default ``$ACTSTORE_CACHE``).
    """

    def __init__(
        self,
        location: str | os.PathLike,
        *,
        verify_reads: bool = True,
        cache_dir: str | os.PathLike | None = None,
        cache_bytes: int | str | None = None,
        s3: S3Config | None = None,
    ) -> None:
        self.manifest: dict[str, Any] | None = None
        self.files: StoreFiles | None = None
        self.path: Path | str
        if is_remote(str(location)):
            self.files = open_files(location, cache_dir=cache_dir, cache_bytes=cache_bytes, s3=s3)
            rel, is_run = resolve_remote(self.files)
            self.path = self.files.url_of(rel).rstrip("/") if rel else self.files.url
            if is_run:
                self.manifest, self.stores = _open_run(
                    Path("."), verify_reads=verify_reads, files=self.files
                )
            else:
                self.stores = [open_remote_info(self.files, rel, verify_reads=verify_reads)]
        else:
            path, is_run = resolve_location(location)
            self.path = path
            if is_run:
                self.manifest, self.stores = _open_run(path, verify_reads=verify_reads)
            else:
                self.stores = [open_store_info(path, verify_reads=verify_reads)]
        self.remote = self.files is not None
        first = self.stores[0]
        self.layout = first.layout.with_samples(sum(s.n_samples for s in self.stores))
        self._starts = np.array([s.offset for s in self.stores], dtype=np.int64)
        self.prompt_len = np.concatenate([s.lengths["prompt"] for s in self.stores])
        self.response_len = np.concatenate([s.lengths["response"] for s in self.stores])
        self._groups: dict[int, Any] = {}
        self._remote_arrays: dict[tuple[int, str], np.ndarray | None] = {}
        self._text_index: dict[tuple[int, str], np.ndarray] = {}
        self._stats: dict[str, RunningStats] = {}
        self._pid = os.getpid()

    # ------------------------------------------------------------------ properties

    @property
    def attrs(self) -> dict[str, Any]:
        """Global attributes (of the first store, for a run)."""
        return self.stores[0].attrs

    @property
    def sites(self) -> tuple[str, ...]:
        return self.layout.sites

    @property
    def layers(self) -> tuple[int, ...]:
        return self.layout.layers

    @property
    def d_model(self) -> int:
        return self.layout.hidden_size

    @property
    def dtype(self) -> np.dtype:
        return ACT_DTYPE

    @property
    def n_samples(self) -> int:
        return self.layout.n_samples

    def __len__(self) -> int:
        return self.layout.n_samples

    def lengths(self, part: str) -> np.ndarray:
        """Stored (capped) lengths of ``part`` for every sample."""
        if part not in PARTS:
            raise ConfigError(f"part must be 'prompt' or 'response', not {part!r}")
        return self.prompt_len if part == "prompt" else self.response_len

    def __repr__(self) -> str:
        lay = self.layout
        return (
            f"ZarrReader({str(self.path)!r}, n_samples={lay.n_samples}, sites={list(lay.sites)}, "
            f"P_max={lay.p_max}, R_max={lay.r_max}, H={lay.hidden_size}, "
            f"stores={len(self.stores)})"
        )

    # ------------------------------------------------------------------ locating

    def locate(self, index: int) -> tuple[int, int]:
        """``(store number, local index)`` of global sample ``index`` (the manifest mapping)."""
        n = self.layout.n_samples
        if not -n <= index < n:
            raise IndexOutOfRangeError(f"sample {index} out of range (0..{n - 1})")
        index = int(index) % n
        if len(self.stores) == 1:
            return 0, index
        k = int(np.searchsorted(self._starts, index, side="right")) - 1
        return k, index - self.stores[k].offset

    # ------------------------------------------------------------------ random access

    def read(
        self,
        i: int,
        layer: int | str,
        part: str = "prompt",
        *,
        trim: bool = True,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """Activations of sample ``i`` at ``layer`` for ``part``: ``(len_i, H)`` float16 with
        ``trim`` (the stored real tokens), else ``(P_max or R_max, H)`` zero-padded.

        Reads only the chunks of this ``(sample, layer)`` that hold the requested tokens.

        Example:
            >>> reader.read(0, "resid.3", "response").shape  # doctest: +SKIP
            (17, 4096)
        """
        return self.read_index(i, self.layout.layer_index(layer), part, trim=trim, out=out)

    def read_index(
        self,
        i: int,
        layer_idx: int,
        part: str = "prompt",
        *,
        trim: bool = True,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """:meth:`read` with the position on the ``L`` axis instead of the site."""
        lay = self.layout
        max_len = lay.max_len(part)  # checks part
        if not 0 <= layer_idx < lay.n_layers:
            raise IndexOutOfRangeError(
                f"layer position {layer_idx} out of range (0..{lay.n_layers - 1})"
            )
        k, local = self.locate(i)
        store = self.stores[k]
        n_real = int(store.lengths[part][local])
        n_rows = n_real if trim else max_len
        if out is None:
            out = np.empty((n_rows, lay.hidden_size), dtype=ACT_DTYPE)
        elif (
            out.shape != (n_rows, lay.hidden_size)
            or out.dtype != ACT_DTYPE
            or not out.flags.c_contiguous
        ):
            raise ConfigError(
                f"out must be a C-contiguous float16 array of shape "
                f"{(n_rows, lay.hidden_size)}, not {out.dtype} {out.shape}"
            )
        _read_rows(store, part, local, layer_idx, out[:n_real])
        out[n_real:] = 0  # padding is zeros (the writer stores it so; verify checks it)
        return out

    def read_batch(
        self,
        samples: Sequence[int] | np.ndarray,
        layers: Sequence[Sequence[int | str]] | np.ndarray,
        part: str = "response",
        *,
        trim: bool = False,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Stack ``read(samples[j], layers[j][m], part)`` into ``acts[b, k, T, H]`` (zero-padded
        to ``P_max``/``R_max``, or to the longest of these samples with ``trim``) and return it
        with the lengths ``[b]``. ``layers`` is ``[b, k]`` sites or block indices."""
        samples = np.asarray(samples, dtype=np.int64).reshape(-1)
        layer_idx = np.array(
            [[self.layout.layer_index(x) for x in row] for row in layers], dtype=np.int64
        ).reshape(len(samples), -1)
        return self.read_batch_index(samples, layer_idx, part, trim)

    def random_batch(
        self,
        b: int,
        rng: np.random.Generator,
        *,
        n_layers: int = 2,
        part: str = "response",
        trim: bool = False,
    ) -> dict[str, np.ndarray]:
        """The training pattern: ``b`` random samples, ``n_layers`` distinct random layers each.

        Returns ``acts [b, n_layers, T, H]``, ``lengths [b]``, ``samples [b]`` and
        ``layers [b, n_layers]`` (block indices; ``sites`` gives the names).
        """
        lay = self.layout
        if not 1 <= n_layers <= lay.n_layers:
            raise ConfigError(f"n_layers must lie in 1..{lay.n_layers}, not {n_layers}")
        samples = rng.integers(0, lay.n_samples, size=b)
        layer_idx = np.stack(
            [rng.choice(lay.n_layers, size=n_layers, replace=False) for _ in range(b)]
        )
        acts, lengths = self.read_batch_index(samples, layer_idx, part, trim)
        return {
            "acts": acts,
            "lengths": lengths,
            "samples": samples,
            "layers": np.asarray(lay.layers)[layer_idx],
            "sites": np.asarray(lay.sites)[layer_idx],
        }

    def read_batch_index(
        self, samples: np.ndarray, layer_idx: np.ndarray, part: str = "response", trim: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`read_batch` with positions on the ``L`` axis (``layer_idx [b, k]``)."""
        lengths = self.lengths(part)[samples]
        width = int(lengths.max(initial=0)) if trim else self.layout.max_len(part)
        acts = np.zeros(
            (len(samples), layer_idx.shape[1], width, self.layout.hidden_size), dtype=ACT_DTYPE
        )
        for j, i in enumerate(samples):
            k, local = self.locate(int(i))
            for m, idx in enumerate(layer_idx[j]):
                _read_rows(self.stores[k], part, local, int(idx), acts[j, m, : lengths[j]])
        return acts, lengths

    def dataset(
        self, part: str = "response", *, n_layers: int = 2, seed: int = 0, trim: bool = False
    ) -> ZarrPairDataset:
        """A torch map-style Dataset of the training pattern (see :class:`ZarrPairDataset`)."""
        return ZarrPairDataset(self, part=part, n_layers=n_layers, seed=seed, trim=trim)

    # ------------------------------------------------------------------ per-sample fields

    def group(self, store: int = 0) -> Any:
        """The zarr-python group of store ``store`` (read-only, consolidated), for raw access
        (local stores; for ``s3://`` ones open ``zarr.storage.ObjectStore`` yourself)."""
        if self.remote:
            raise ConfigError(
                f"{self.path} is on object storage; group() opens local stores only: use "
                "array(), token_ids(), text(), or open it with zarr.storage.ObjectStore"
            )
        self._check_pid()
        if store not in self._groups:
            self._groups[store] = zarr_module().open_consolidated(
                str(self.stores[store].path), mode="r", zarr_format=2
            )
        return self._groups[store]

    def _concat(self, name: str) -> np.ndarray | None:
        parts = []
        for k in range(len(self.stores)):
            part = self._store_array(k, name)
            if part is None:
                return None
            parts.append(part)
        return np.concatenate(parts)

    def _store_array(self, k: int, name: str) -> np.ndarray | None:
        """Per-sample array ``name`` of store ``k``, or None if it lacks it (remote arrays
        are fetched once and kept)."""
        if self.remote:
            kept = self._remote_arrays
            if (k, name) not in kept:
                kept[(k, name)] = remote_array(self.stores[k], name)
            return kept[(k, name)]
        try:
            return np.asarray(self.group(k)[name][:])
        except KeyError:
            return None

    def array(self, name: str) -> np.ndarray | None:
        """A per-sample array over all samples (``"sample_key"``, ``"hallu_label"``, ``"split"``,
        ``"prompt_len_full"``, ``"prompt_token_ids"``...), or None if the store lacks it."""
        return self._concat(f"arrays/{name}")

    @property
    def sample_keys(self) -> list[str]:
        keys = self._concat(SAMPLE_KEY)
        return [k.decode("ascii") for k in keys]

    def token_ids(self, i: int, part: str = "prompt") -> np.ndarray | None:
        """Stored token ids of sample ``i``'s ``part`` (its real tokens), or None."""
        k, local = self.locate(i)
        if self.remote:
            ids = self._store_array(k, TOKEN_IDS[part])
            if ids is None:
                return None
            row = ids[local]
        else:
            try:
                row = self.group(k)[TOKEN_IDS[part]][local]
            except KeyError:
                return None
        return np.asarray(row[: self.stores[k].lengths[part][local]])

    def text(self, i: int, part: str = "prompt") -> str | None:
        """The prompt or response text of sample ``i`` (from ``text/*.jsonl``), or None."""
        k, local = self.locate(i)
        store = self.stores[k]
        if not store.exists(TEXT_FILES[part]):
            return None
        offsets = self._text_index.get((k, part))
        if offsets is None:
            if self.remote:
                offsets = _line_offsets_of(store.read_bytes(TEXT_FILES[part]))
            else:
                offsets = _line_offsets(store.path / TEXT_FILES[part])
            if len(offsets) != store.n_samples:
                raise CorruptStoreError(
                    f"{store.url_of(TEXT_FILES[part])} has {len(offsets)} lines for "
                    f"{store.n_samples} samples"
                )
            self._text_index[(k, part)] = offsets
        if self.remote:
            name = store.rel + TEXT_FILES[part]
            end = int(offsets[local + 1]) if local + 1 < len(offsets) else store.files.size(name)
            line = bytes(
                store.files.read_range(name, int(offsets[local]), end - int(offsets[local]))
            )
            record = json.loads(line.split(b"\n", 1)[0])
        else:
            with open(store.path / TEXT_FILES[part], "rb") as f:
                f.seek(int(offsets[local]))
                record = json.loads(f.readline())
        return record[part]

    # ------------------------------------------------------------------ blocks (loader)

    def blocks(self, site: int | str) -> list[Block]:
        """One block per (sample, part) with at least one stored token, in storage order
        (sample 0 prompt, sample 0 response, sample 1 prompt, ...): the same list, up to the
        site, for every site. ``loc = (store, local sample, part 0/1, layer position)``."""
        layer_idx = self.layout.layer_index(site)
        name = self.layout.sites[layer_idx]
        out = []
        for k, store in enumerate(self.stores):
            p, r = store.lengths["prompt"], store.lengths["response"]
            for local in range(store.n_samples):
                if p[local]:
                    out.append(Block(site=name, n_rows=int(p[local]), loc=(k, local, 0, layer_idx)))
                if r[local]:
                    out.append(Block(site=name, n_rows=int(r[local]), loc=(k, local, 1, layer_idx)))
        return out

    def read_block(self, block: Block, out: np.ndarray | None = None) -> np.ndarray:
        """Rows of ``block`` as ``[n_rows, H]`` float16."""
        k, local, part_idx, layer_idx = block.loc
        store = self.stores[k]
        if out is None:
            out = np.empty((block.n_rows, self.layout.hidden_size), dtype=ACT_DTYPE)
        elif out.shape != (block.n_rows, self.layout.hidden_size) or out.dtype != ACT_DTYPE:
            raise ConfigError(
                f"out must be float16 of shape {(block.n_rows, self.layout.hidden_size)}, "
                f"not {out.dtype} {out.shape}"
            )
        _read_rows(store, PARTS[part_idx], local, layer_idx, out)
        return out

    def block_rows(self, block: Block) -> tuple[np.ndarray, np.ndarray]:
        """(global sample index, token position within its part) of each row of ``block``."""
        k, local, _, _ = block.loc
        return (
            np.full(block.n_rows, self.stores[k].offset + local, dtype=np.int64),
            np.arange(block.n_rows, dtype=np.int64),
        )

    # ------------------------------------------------------------------ conversion

    def capture_plan(self) -> CapturePlan:
        """The capture this store came from (``meta/config.json`` and the attributes).

        Conversion to a fixed-length format needs every sample to hold the same number of
        tokens; the plan says so only when they do."""
        lay, attrs = self.layout, self.attrs
        first = self.stores[0]
        config = first.read_json(CONFIG_FILE) if first.exists(CONFIG_FILE) else {}
        model, dataset = config.get("model") or {}, dict(config.get("dataset") or {})
        lengths = self.prompt_len + self.response_len
        if len(lengths) and (lengths != lengths[0]).any():
            raise ConfigError(
                f"{self.path}: its samples hold different numbers of tokens "
                f"({int(lengths.min())}..{int(lengths.max())}); only fixed-length stores "
                "convert to other formats"
            )
        family = str(model.get("family") or attrs.get("model_family") or "unknown")
        return CapturePlan(
            ckpt=str(model.get("ckpt") or attrs.get("model_id") or "unknown"),
            family=family,
            modality=str(model.get("modality") or "text"),
            sites=tuple(Site.parse(name) for name in lay.sites),
            n_model_layers=int(
                model.get("n_layers") or attrs.get("model_num_layers") or max(lay.layers) + 1
            ),
            d_model=lay.hidden_size,
            tokens_per_example=int(lengths[0]) if len(lengths) else 0,
            has_cls=bool(model.get("has_cls", False)),
            n_examples=lay.n_samples,
            dataset_root=str(dataset.pop("root", None) or attrs.get("dataset_root") or ""),
            data=dataset,
            classes=config.get("classes"),
            has_labels=False,
            has_tokens=False,
            batch_size=int(config.get("batch_size") or 32),
        )

    # ------------------------------------------------------------------ statistics

    def statistics(self, site: int | str) -> RunningStats | None:
        """Exact running statistics of ``site`` over every stored token (merged over shards)."""
        name = self.layout.sites[self.layout.layer_index(site)]
        if name not in self._stats:
            parts = []
            for store in self.stores:
                if not store.exists(STATISTICS_FILE):
                    return None
                doc = store.read_json(STATISTICS_FILE)
                try:
                    parts.append(RunningStats.from_dict(doc["sites"][name]))
                except (KeyError, TypeError) as err:
                    raise CorruptStoreError(
                        f"{store.url_of(STATISTICS_FILE)} has no statistics for {name}"
                    ) from err
            self._stats[name] = merge_all(parts)
        return self._stats[name]

    # ------------------------------------------------------------------ summary / verify

    def describe(self) -> dict[str, Any]:
        """Summary for ``actstore inspect``."""
        lay, attrs = self.layout, self.attrs
        n_files, n_bytes = 0, 0
        for store in self.stores:
            sizes = store.listing()
            n_files += len(sizes)
            n_bytes += sum(sizes.values())
        trunc = {p: sum(s.attrs.get(f"{p}_truncated_count", 0) for s in self.stores) for p in PARTS}
        out = {
            "path": str(self.path),
            "format": f"zarr v2 prompt/response store ({FORMAT_TAG} {attrs.get('schema_version')})",
            "model": f"{attrs.get('model_id')} ({attrs.get('model_family')})",
            "dataset": attrs.get("dataset"),
            "sites": list(lay.sites),
            "shape": (
                f"{lay.n_samples} samples x {lay.n_layers} sites {list(lay.sites)} x "
                f"(P_max {lay.p_max} + R_max {lay.r_max}) tokens x {lay.hidden_size} dims "
                "float16"
            ),
            "n_samples": lay.n_samples,
            "P_max": lay.p_max,
            "R_max": lay.r_max,
            "chunks": f"prompt (1, 1, {lay.t_chunk_prompt}, {lay.hidden_size}), response "
            f"(1, 1, {lay.t_chunk_response}, {lay.hidden_size})",
            "truncated": f"{trunc['prompt']} prompts, {trunc['response']} responses",
            "stored_tokens": f"{int(self.prompt_len.sum())} prompt, {int(self.response_len.sum())} "
            "response",
            "stores": len(self.stores),
            "bytes": n_bytes,
            "n_files": n_files,
        }
        return out

    def verify(self, *, progress: Callable[[int], None] | None = None) -> VerifyReport:
        """Check every chunk file (name, grid position, exact size), every sample's content
        digest, the per-sample arrays, the text files and non-finite values."""
        report = VerifyReport(str(self.path))
        non_finite = 0
        for k, store in enumerate(self.stores):
            non_finite += _verify_store(
                store, lambda name, k=k: self._store_array(k, name), report, progress
            )
        if non_finite:
            report.notes.append(f"{non_finite} activation values are NaN or infinite")
        return report

    # ------------------------------------------------------------------ handles

    def _check_pid(self) -> None:
        if os.getpid() != self._pid:  # a forked worker: rebuild zarr handles in this process
            self._groups, self._pid = {}, os.getpid()

    def close(self) -> None:
        """Drop zarr handles (reopened on next use). Activation reads hold no open files."""
        self._groups = {}
        if self.files is not None:
            self.files.close()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_groups": {}}


class ZarrPairDataset(torch.utils.data.Dataset):
    """torch map-style Dataset of the training pattern: item ``i`` is sample ``i`` at
    ``n_layers`` distinct layers drawn from ``(seed, epoch, i)``.

    Items are ``{"acts": float16 [n_layers, T, H], "length": int, "layers": int64
    [n_layers], "index": int}``, with ``T = R_max``/``P_max`` (fixed shape; the default
    collate stacks them) or the sample's own length with ``trim``. Indexing with a list of
    indices returns the batch directly (``acts [b, n_layers, T, H]``, read into one array,
    no stacking): :meth:`loader` builds that DataLoader. Call :meth:`set_epoch` to draw new
    layers each epoch. DataLoader workers each get their own pickled copy of the reader.

    Example:
        >>> ds = reader.dataset("response")  # doctest: +SKIP
        >>> loader = torch.utils.data.DataLoader(ds, batch_size=32, shuffle=True,
        ...                                      num_workers=4)  # per item  # doctest: +SKIP
        >>> loader = ds.loader(32, num_workers=4)  # per batch, faster  # doctest: +SKIP
    """

    def __init__(
        self,
        reader: ZarrReader,
        *,
        part: str = "response",
        n_layers: int = 2,
        seed: int = 0,
        trim: bool = False,
    ) -> None:
        if part not in PARTS:
            raise ConfigError(f"part must be 'prompt' or 'response', not {part!r}")
        if not 1 <= n_layers <= reader.layout.n_layers:
            raise ConfigError(f"n_layers must lie in 1..{reader.layout.n_layers}, not {n_layers}")
        self.reader, self.part, self.n_layers = reader, part, n_layers
        self.seed, self.trim, self.epoch = seed, trim, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.reader)

    def layers_of(self, i: int) -> np.ndarray:
        """Layer positions drawn for item ``i`` this epoch."""
        rng = np.random.default_rng((self.seed, self.epoch, int(i)))
        return rng.choice(self.reader.layout.n_layers, size=self.n_layers, replace=False)

    def __getitem__(self, index: int | Sequence[int]) -> dict[str, Any]:
        single = isinstance(index, (int, np.integer))
        samples = np.atleast_1d(np.asarray(index, dtype=np.int64))
        idx = np.stack([self.layers_of(i) for i in samples])
        acts, lengths = self.reader.read_batch_index(samples, idx, self.part, self.trim)
        layers = np.asarray(self.reader.layout.layers)[idx]
        if single:
            return {
                "acts": torch.from_numpy(acts[0]),
                "length": int(lengths[0]),
                "layers": torch.from_numpy(layers[0]),
                "index": int(index),
            }
        return {
            "acts": torch.from_numpy(acts),
            "length": torch.from_numpy(lengths.astype(np.int64)),
            "layers": torch.from_numpy(layers),
            "index": torch.from_numpy(samples),
        }

    def loader(
        self,
        batch_size: int,
        *,
        shuffle: bool = True,
        drop_last: bool = False,
        generator: torch.Generator | None = None,
        **kwargs: Any,
    ) -> torch.utils.data.DataLoader:
        """A DataLoader whose workers read whole batches (one array each, no collate copy);
        ``kwargs`` go to DataLoader (``num_workers``, ``pin_memory``...)."""
        order = (
            torch.utils.data.RandomSampler(self, generator=generator)
            if shuffle
            else torch.utils.data.SequentialSampler(self)
        )
        batches = torch.utils.data.BatchSampler(order, batch_size, drop_last)
        return torch.utils.data.DataLoader(self, sampler=batches, batch_size=None, **kwargs)


# ---------------------------------------------------------------------------- helpers


def _read_rows(
    store: StoreInfo, part: str, local: int, layer_idx: int, out: np.ndarray, *, cache: bool = True
) -> int:
    """Fill ``out`` (``[n, H]`` float16, C order) with tokens ``0..n`` of one (sample, layer),
    reading chunk files directly (on object storage: one ranged GET per chunk); a chunk not
    stored is zeros (the fill value). Where the store has chunk checksums, each chunk read
    is checked (a partly needed chunk is read whole into a scratch buffer) and a chunk they
    list but the store lacks is an error. Returns the number of bytes read from files.
    ``cache=False``: remote chunks bypass the local cache tier (a full scan such as
    ``verify``)."""
    n_rows = out.shape[0]
    prefix, sep, t_chunk, chunk_bytes, row_bytes = store.geometry[part]
    sums = None if store.chunksums is None else store.chunksums[part][local, layer_idx]
    view = byte_view(out)
    n_read = 0
    for c in range(-(-n_rows // t_chunk)):
        r0, r1 = c * t_chunk, min(n_rows, (c + 1) * t_chunk)
        name = f"{prefix}{local}{sep}{layer_idx}{sep}{c}{sep}0"
        where = name if store.files is None else store.files.url_of(name)
        whole = sums is not None and (r1 - r0) * row_bytes != chunk_bytes
        into = None if whole else view[r0 * row_bytes : r1 * row_bytes]
        target = _read_chunk(store, name, where, chunk_bytes, into, cache=cache)
        if target is None:  # not stored
            if sums is not None and sums[c]:
                raise CorruptStoreError(
                    f"chunk {where} (sample {local}, layer {layer_idx}, chunk {c}, bytes "
                    f"0-{chunk_bytes}) is missing: the store recorded it; restore it or "
                    "re-capture"
                )
            out[r0:r1] = 0
            continue
        n_read += len(target)
        if sums is not None:
            if (xxhash.xxh3_64_intdigest(target) or 1) != sums[c]:
                raise CorruptStoreError(
                    f"chunk {where} (sample {local}, layer {layer_idx}, chunk {c}, bytes "
                    f"0-{chunk_bytes}) fails its xxh3 checksum: the stored data was changed "
                    "or damaged; restore it or re-capture (verify_reads=False reads it anyway)"
                )
            if whole:
                view[r0 * row_bytes : r1 * row_bytes] = target[: (r1 - r0) * row_bytes]
    return n_read


def _read_chunk(
    store: StoreInfo,
    name: str,
    where: str,
    chunk_bytes: int,
    into: memoryview | None,
    *,
    cache: bool,
) -> memoryview | None:
    """Chunk file ``name`` (``where`` in messages), checked to hold ``chunk_bytes``: its
    first ``len(into)`` bytes read into ``into``, or (``into=None``) all of it into a new
    buffer. None if the chunk is not stored. Local chunks must be plain files in the store."""
    if store.files is not None:
        size = store.files.size(name)
    else:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as err:
            raise CorruptStoreError(
                f"chunk {name} cannot be opened ({err.strerror}): chunk files must be "
                "plain files inside the store; restore it or re-capture"
            ) from err
        size = os.fstat(fd).st_size
    try:
        if size is None:
            return None
        if size != chunk_bytes:
            raise CorruptStoreError(
                f"chunk {where} has {size} bytes, expected {chunk_bytes} "
                f"({'truncated' if size < chunk_bytes else 'too long'}): restore or re-capture"
            )
        if store.files is not None:
            length = chunk_bytes if into is None else len(into)
            return store.files.read_range(name, 0, length, into, cache=cache)
        target = memoryview(bytearray(chunk_bytes)) if into is None else into
        done = 0
        while done < len(target):
            got = os.preadv(fd, [target[done:]], done)
            if got == 0:
                raise CorruptStoreError(f"chunk {name} shrank while being read")
            done += got
        return target
    finally:
        if store.files is None:
            os.close(fd)


def _line_offsets_of(data: bytes) -> np.ndarray:
    """Start of each non-empty line of ``data`` (a text file fetched whole)."""
    offsets, pos = [], 0
    for line in data.split(b"\n"):
        if line.strip():
            offsets.append(pos)
        pos += len(line) + 1
    return np.asarray(offsets, dtype=np.int64)


def _line_offsets(path: Path) -> np.ndarray:
    offsets, pos = [], 0
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                offsets.append(pos)
            pos += len(line)
    return np.asarray(offsets, dtype=np.int64)


def _open_run(
    path: Path, *, verify_reads: bool = True, files: StoreFiles | None = None
) -> tuple[dict[str, Any], list[StoreInfo]]:
    """The manifest and stores of a run at ``path``, or at the root of remote ``files``."""
    where = str(path / MANIFEST) if files is None else files.url_of(MANIFEST)
    manifest = read_json(path / MANIFEST) if files is None else files.read_json(MANIFEST)
    if not isinstance(manifest, dict) or manifest.get("format") != RUN_FORMAT_TAG:
        raise CorruptStoreError(f"{where} is not an actstore zarr run manifest")
    try:
        entries = list(manifest["shards"])
        total = int(manifest["n_samples"])
    except (KeyError, TypeError, ValueError) as err:
        raise CorruptStoreError(f"{where} lacks {err}; re-create the manifest") from None
    stores, start = [], 0
    for entry in entries:
        if files is None:
            info = open_store_info(path / entry["path"], offset=start, verify_reads=verify_reads)
        else:
            rel = str(entry["path"]).strip("/") + "/"
            info = open_remote_info(files, rel, offset=start, verify_reads=verify_reads)
        if int(entry["start"]) != start or int(entry["n_samples"]) != info.n_samples:
            raise CorruptStoreError(
                f"{where}: shard {entry['path']} should start at "
                f"{start} with {info.n_samples} samples; it says {entry}"
            )
        if stores and not info.layout.same_bytes_as(stores[0].layout):
            raise CorruptStoreError(f"{info.where} has another layout than {stores[0].where}")
        stores.append(info)
        start += info.n_samples
    if not stores or start != total:
        raise CorruptStoreError(f"{where} declares {total} samples; its shards hold {start}")
    return manifest, stores


def _verify_statistics(store: StoreInfo, report: VerifyReport) -> None:
    path, lay = store.url_of(STATISTICS_FILE), store.layout
    if not store.exists(STATISTICS_FILE):
        report.faults.append(f"{path} is missing")
        return
    rows = int(store.lengths["prompt"].sum()) + int(store.lengths["response"].sum())
    try:
        sites = store.read_json(STATISTICS_FILE)["sites"]
        if sorted(sites) != sorted(lay.sites):
            raise CorruptStoreError(f"sites {sorted(sites)}, expected {sorted(lay.sites)}")
        for site in lay.sites:
            stats = RunningStats.from_dict(sites[site])
            if stats.count != rows or stats.d != lay.hidden_size:
                raise CorruptStoreError(
                    f"{site} counts {stats.count} rows of width {stats.d}; the store holds "
                    f"{rows} of {lay.hidden_size}"
                )
            if stats.mean.shape != (stats.d,) or stats.m2.shape != (stats.d,):
                raise CorruptStoreError(f"{site} has vectors of the wrong length")
    except (CorruptStoreError, KeyError, TypeError, AttributeError) as err:
        report.faults.append(f"{path} is malformed: {err}")


def _verify_store(
    store: StoreInfo,
    array: Callable[[str], np.ndarray | None],
    report: VerifyReport,
    progress: Callable[[int], None] | None,
) -> int:
    """Verify one store; ``array(name)`` gives its per-sample arrays (None: missing)."""
    lay, where = store.layout, store.where
    _verify_statistics(store, report)
    if store.chunksums is None:
        report.faults.append(
            f"{where} has no chunk checksums ({CHUNKSUMS['prompt']}): its chunks cannot be "
            "verified (deleted, or a store written by another tool)"
        )
    for part in PARTS:
        grid = (lay.n_samples, lay.n_layers, lay.n_chunks(part), 1)
        want = lay.chunk_nbytes(part)
        if store.files is not None:  # an object listing: no symlinks, sizes listed
            directory = store.url_of(ACTIVATIONS[part])
            for rel, size in store.listing(ACTIVATIONS[part]).items():
                if rel in (".zarray", ".zattrs"):
                    continue
                key = parse_chunk_key(rel, store.separators[part])
                if key is None or len(key) != 4 or any(k >= g for k, g in zip(key, grid)):
                    report.faults.append(f"{directory}/{rel}: not a chunk of this array")
                    continue
                report.files_checked += 1
                if size != want:
                    report.faults.append(f"{directory}/{rel}: {size} bytes, expected {want}")
            continue
        directory = store.path / ACTIVATIONS[part]
        for dirpath, _, names in os.walk(directory):
            for name in names:
                rel = os.path.relpath(os.path.join(dirpath, name), directory)
                if rel in (".zarray", ".zattrs"):
                    continue
                if os.path.islink(os.path.join(dirpath, name)):
                    report.faults.append(f"{directory}/{rel}: a symlink, not a chunk file")
                    continue
                key = parse_chunk_key(rel.replace(os.sep, "/"), store.separators[part])
                if key is None or len(key) != 4 or any(k >= g for k, g in zip(key, grid)):
                    report.faults.append(f"{directory}/{rel}: not a chunk of this array")
                    continue
                size = os.path.getsize(os.path.join(dirpath, name))
                report.files_checked += 1
                if size != want:
                    report.faults.append(f"{directory}/{rel}: {size} bytes, expected {want}")
    found = {name: array(name) for name in (DIGEST, *FULL_LENGTHS.values())}
    missing = [name for name, values in found.items() if values is None]
    if missing:
        report.faults.append(f"{where} lacks the array {missing[0]!r}")
        return 0
    digests = found[DIGEST]
    full = {p: found[FULL_LENGTHS[p]] for p in PARTS}
    for part in PARTS:
        bad = np.flatnonzero(np.minimum(full[part], lay.max_len(part)) != store.lengths[part])
        if bad.size:
            report.faults.append(
                f"{where}/{LENGTHS[part]} disagrees with the full lengths at "
                f"samples {bad[:5].tolist()}"
            )
    non_finite = 0
    prompt = np.empty((lay.n_layers, lay.p_max, lay.hidden_size), dtype=ACT_DTYPE)
    response = np.empty((lay.n_layers, lay.r_max, lay.hidden_size), dtype=ACT_DTYPE)
    for local in range(lay.n_samples):
        h = xxhash.xxh3_128()
        n_read = 0
        for part, slab in (("prompt", prompt), ("response", response)):
            for layer_idx in range(lay.n_layers):
                try:
                    n_read += _read_rows(
                        store, part, local, layer_idx, slab[layer_idx], cache=False
                    )
                except CorruptStoreError as err:
                    report.faults.append(str(err))
                    slab[layer_idx] = 0
            h.update(byte_view(slab))
            non_finite += int(slab.size - np.count_nonzero(np.isfinite(slab)))
        report.bytes_checked += n_read
        if progress is not None:
            progress(n_read)
        if h.hexdigest().encode("ascii") != digests[local]:
            report.faults.append(
                f"{where}: sample {local} does not match its stored digest "
                "(activation data was changed or lost)"
            )
    for part in PARTS:
        path = store.url_of(TEXT_FILES[part])
        if store.exists(TEXT_FILES[part]):
            report.files_checked += 1
            # split on "\n" only: str.splitlines() also splits at U+2028/U+0085, which
            # json.dumps(ensure_ascii=False) leaves raw inside a record
            text = store.read_bytes(TEXT_FILES[part]).decode("utf-8")
            lines = [json.loads(x) for x in text.split("\n") if x.strip()]
            if [rec.get("i") for rec in lines] != list(range(lay.n_samples)):
                report.faults.append(
                    f"{path}: expected one record per sample, i = 0..{lay.n_samples - 1}"
                )
    for name in store.attrs.get("optional_arrays", []):
        if array(OPTIONAL_ARRAYS[name][0]) is None:
            report.faults.append(f"{where} lacks {OPTIONAL_ARRAYS[name][0]} its attributes list")
    return non_finite
