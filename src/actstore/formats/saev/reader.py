"""Open and read a saev protocol 2.1 directory (either dialect).

Opening validates metadata.json against shards.json and every shard's file size, so a
missing or truncated shard is reported up front with the file named; files that are
symlinks out of the directory are refused. Random access goes through read-only memmaps
advised for random reads (no readahead of whole files); block reads for training use
``pread`` straight into the caller's buffer and are checked against the shard's block
checksums (``verify_reads=False`` skips that; stores without them read unverified, with
one warning). Random access (``reader[...]``, ``gather``) is not checked: run ``verify``.
At ``s3://bucket/prefix`` the same reads are ranged GETs through
:mod:`actstore.storage.files` (concurrent, straight into the caller's buffer, optionally
kept in the local cache tier), checked the same way; random access fetches only the
bytes of the rows asked for.

Example:
    >>> r = SaevReader("/scratch/acts/3f1c...")  # doctest: +SKIP
    >>> r[12, 6, 0].shape           # (example, layer, token) -> [d_model]  # doctest: +SKIP
    (768,)
    >>> r[0:4, 6].shape             # examples 0..3, all tokens  # doctest: +SKIP
    (4, 197, 768)
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import logging
import mmap
import os
import pickle
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ...batch import CapturePlan
from ...errors import (
    ConfigError,
    CorruptStoreError,
    IndexOutOfRangeError,
    StoreNotFoundError,
    UnsafeDataError,
)
from ...sites import Site
from ...stats import RunningStats
from ...storage import FileHasher, read_json
from ...storage.blocksums import SUFFIX, BlockHasher, BlockSums, parse_sidecar, sidecar_name
from ...storage.files import StoreFiles, open_files
from ...storage.local import IO_CHUNK
from ...storage.object import S3Config
from ..base import Block, ReaderBase, VerifyReport
from .layout import SAEV_FAMILIES, SaevMetadata, shard_name
from .writer import CHECKSUMS, LEGACY_CHECKSUMS, STATISTICS

log = logging.getLogger(__name__)
_SLAB_WARNED = threading.Event()  # the verified slab fallback is announced once per process

_HASH_NAME = re.compile(r"^[0-9a-f]{8}$|^[0-9a-f]{64}$")

#: Gaps up to this many bytes between gathered rows are read and discarded, not skipped.
GAP_BYTES = 1 << 16
_TRASH = np.empty(GAP_BYTES, dtype=np.uint8)  # destination of discarded bytes (any thread)
_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.preadv.restype = ctypes.c_ssize_t
_LIBC.preadv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX"))


class _Scratch(threading.local):
    """Per-thread block buffer for verified and remote reads (no fresh pages per block)."""

    buf = np.empty(0, dtype="<f4")

    def rows_for(self, n: int, d: int) -> np.ndarray:
        if self.buf.size < n * d:
            self.buf = np.empty(n * d, dtype="<f4")
        return self.buf[: n * d].reshape(n, d)


_SCRATCH = _Scratch()


def _place(out: np.ndarray, rows: np.ndarray, data: np.ndarray) -> None:
    """Row ``i`` of ``data`` into ``out[rows[i]]``, skipping ``rows[i] < 0``."""
    keep = rows >= 0
    if keep.all():
        out[rows] = data
    else:
        out[rows[keep]] = data[keep]


class SaevReader(ReaderBase):
    """Read access to one saev directory, local or ``s3://bucket/prefix``. Picklable: worker
    processes reopen files lazily.

    ``verify_reads``: check every block read against the store's block checksums.
    ``cache_dir`` / ``cache_bytes`` / ``s3``: the local cache tier and S3 settings of a remote
    store (see :func:`~actstore.storage.files.open_files`; default ``$ACTSTORE_CACHE``).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        verify_reads: bool = True,
        cache_dir: str | os.PathLike | None = None,
        cache_bytes: int | str | None = None,
        s3: S3Config | None = None,
    ) -> None:
        self.files: StoreFiles = open_files(
            path, cache_dir=cache_dir, cache_bytes=cache_bytes, s3=s3
        )
        self.remote = self.files.local_path is None
        self.path = self.files.local_path or Path(self.files.url.rstrip("/").rpartition("/")[2])
        if self.path.name.endswith(".partial"):
            raise CorruptStoreError(
                f"{self.files.url} is an unfinished capture (a .partial directory): rerun the "
                "same capture command to resume and publish it"
            )
        if not self.remote and not self.path.is_dir():
            raise StoreNotFoundError(f"{self.path} is not a directory of saev shards")
        if self.remote and not self.files.exists("metadata.json"):
            raise StoreNotFoundError(
                f"{self.files.url} holds no saev store (no metadata.json): an unfinished upload "
                "or a wrong URL; finish the copy (actstore cp) or fix the URL"
            )
        self.metadata = SaevMetadata.from_json_dict(
            self._json("metadata.json"), source=self.files.url_of("metadata.json")
        )
        self.shard_counts = self._read_shards_json()
        self._listed = self._read_manifest()
        for name in ("metadata.json", "shards.json"):
            self._check_listed(name)
        self._check_inside()
        self._check_sizes()
        self._sums = BlockSums(
            self.files, enabled=verify_reads, required=self.files.exists(CHECKSUMS)
        )
        self._memmaps: dict[int, np.memmap] = {}
        self._fds: dict[int, int] = {}
        self._pid = os.getpid()

    # ------------------------------------------------------------------ validation

    def _json(self, name: str) -> Any:
        """A JSON file of the store (the I/O seam: local path or remote object)."""
        return self.files.read_json(name) if self.remote else read_json(self.path / name)

    def _read_shards_json(self) -> list[int]:
        md, source = self.metadata, self.files.url_of("shards.json")
        doc = self._json("shards.json")
        if not isinstance(doc, list) or not all(
            isinstance(e, dict)
            and isinstance(e.get("name"), str)
            and isinstance(e.get("n_examples"), int)
            for e in doc
        ):
            raise CorruptStoreError(f"{source} must be a list of {{name, n_examples}} objects")
        if (
            md.dialect == "saev"
            and len(doc) == md.n_shards + 1
            and md.n_shards
            and md.n_examples % md.examples_per_shard == 0
            and doc[-1] == {"name": shard_name(md.n_shards), "n_examples": 0}
        ):
            # saev's own ShardWriter opens one more (all-zero) shard when the last one fills
            # exactly and lists it with 0 examples; its readers ignore it, and so do we.
            doc = doc[:-1]
        if len(doc) != md.n_shards:
            raise CorruptStoreError(
                f"{source} lists {len(doc)} shards; metadata ({md.n_examples} examples, "
                f"{md.examples_per_shard} per shard) implies {md.n_shards}"
            )
        for i, entry in enumerate(doc):
            if entry["name"] != shard_name(i) or entry["n_examples"] != md.shard_examples(i):
                raise CorruptStoreError(
                    f"{source} entry {i} is {entry}; expected name {shard_name(i)} with "
                    f"{md.shard_examples(i)} examples"
                )
        return [e["n_examples"] for e in doc]

    def _read_manifest(self) -> dict[str, str]:
        """checksums.xxh128 as {name: digest} ({} when absent)."""
        if not self.files.exists(CHECKSUMS):
            return {}
        listed = {}
        for line in self.files.read_bytes(CHECKSUMS).decode("utf-8").splitlines():
            digest, sep, name = line.partition("  ")
            if sep:
                listed[name] = digest
        return listed

    def _check_listed(self, name: str) -> None:
        """A small metadata file must match its manifest digest (cheap: checked on open)."""
        digest = self._listed.get(name)
        if digest is not None and _digest([self.files.read_bytes(name)], "xxh128") != digest:
            raise CorruptStoreError(
                f"{self.files.url_of(name)} does not match its digest in {CHECKSUMS}: it was edited "
                "after the store was published; restore it or re-capture"
            )

    def _check_inside(self) -> None:
        """Refuse files that resolve outside the store (symlinks out of it)."""
        if self.remote:
            return
        root = self.path.resolve()
        for child in self.path.iterdir():
            if child.is_symlink() and not child.resolve().is_relative_to(root):
                raise CorruptStoreError(
                    f"{child} is a symlink to {child.resolve()}, outside the store; a store's "
                    "files must lie inside it: copy the file in or re-capture"
                )

    def _check_sizes(self) -> None:
        md = self.metadata
        for i in range(md.n_shards):
            path = self.files.url_of(shard_name(i))
            size, want = self.files.size(shard_name(i)), md.shard_nbytes(i)
            if size is None:
                raise StoreNotFoundError(f"shard {path} is missing; restore it or re-capture")
            if size != want:
                raise CorruptStoreError(
                    f"shard {path} has {size} bytes, expected {want} "
                    f"({'truncated' if size < want else 'too long'}); restore it or re-capture"
                )
        for name, row in (("tokens.bin", md.tokens_per_ex * 4), ("labels.bin", md.patches_per_ex)):
            size = self.files.size(name)
            if size is not None and size != md.n_examples * row:
                raise CorruptStoreError(
                    f"{self.files.url_of(name)} has {size} bytes, expected {md.n_examples * row}"
                )

    # ------------------------------------------------------------------ properties

    @property
    def dialect(self) -> str:
        """``"protocol"`` (the document) or ``"saev"`` (saev's released code)."""
        return self.metadata.dialect

    @property
    def layers(self) -> tuple[int, ...]:
        return self.metadata.layers

    @property
    def sites(self) -> tuple[int, ...]:
        """Sites of this format are the stored residual-stream layers."""
        return self.metadata.layers

    @property
    def d_model(self) -> int:
        return self.metadata.d_model

    @property
    def dtype(self) -> np.dtype:
        return np.dtype("<f4")

    @property
    def n_examples(self) -> int:
        return self.metadata.n_examples

    @property
    def tokens_per_ex(self) -> int:
        return self.metadata.tokens_per_ex

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The logical tensor ``(n_examples, L, T, D)``."""
        md = self.metadata
        return (md.n_examples, len(md.layers), md.tokens_per_ex, md.d_model)

    def __len__(self) -> int:
        return self.metadata.n_examples

    def __repr__(self) -> str:
        n, _layers, t, d = self.shape
        return (
            f"SaevReader({self.files.url!r}, dialect={self.dialect!r}, n_examples={n}, "
            f"layers={list(self.layers)}, tokens={t}, d_model={d})"
        )

    # ------------------------------------------------------------------ file handles

    def _check_pid(self) -> None:
        if os.getpid() != self._pid:  # forked: handles belong to the parent
            self._memmaps, self._fds, self._pid = {}, {}, os.getpid()

    def _memmap(self, shard: int) -> np.memmap:
        self._check_pid()
        mm = self._memmaps.get(shard)
        if mm is None:
            md = self.metadata
            shape = (md.shard_file_examples(shard), len(md.layers), md.tokens_per_ex, md.d_model)
            mm = np.memmap(self.path / shard_name(shard), dtype="<f4", mode="r", shape=shape)
            try:  # random access: do not read ahead whole files
                mm._mmap.madvise(mmap.MADV_RANDOM)  # type: ignore[attr-defined]
            except (AttributeError, OSError):
                pass
            self._memmaps[shard] = mm
        return mm

    def _fd(self, shard: int) -> int:
        self._check_pid()
        fd = self._fds.get(shard)
        if fd is None:  # loader threads may race here: keep the first fd, close the other
            fd = os.open(self.path / shard_name(shard), os.O_RDONLY)
            kept = self._fds.setdefault(shard, fd)
            if kept != fd:
                os.close(fd)
            fd = kept
        return fd

    def close(self) -> None:
        """Release memmaps and file descriptors (reopened on next use)."""
        if os.getpid() == self._pid:
            for fd in self._fds.values():
                os.close(fd)
            self.files.close()
        self._memmaps, self._fds = {}, {}

    def _read_into(self, shard: int, out: np.ndarray, offset: int) -> None:
        """``out``'s bytes from shard ``shard`` at byte ``offset`` (the I/O seam)."""
        if self.remote:
            self.files.read_range(shard_name(shard), offset, out.nbytes, out)
        else:
            _pread_into(self._fd(shard), out, offset)

    def _rows_remote(self, shard: int, rows: np.ndarray, layer_sel: Any, token: Any) -> np.ndarray:
        """``memmap[rows, layer_sel][..., token, :]`` of a remote shard, fetching only the
        span of tokens asked for of each (row, layer)."""
        md = self.metadata
        n_tok, n_lay = md.tokens_per_ex, len(md.layers)
        layer_ids = range(n_lay) if isinstance(layer_sel, slice) else [layer_sel]
        picked = _as_indices(token, n_tok, "token")
        t0, t1 = (int(picked.min()), int(picked.max()) + 1) if picked.size else (0, 0)
        buf = np.empty((len(rows), len(layer_ids), t1 - t0, md.d_model), dtype="<f4")
        ranges = [
            (((int(r) * n_lay + li) * n_tok + t0) * md.d_model * 4, buf[i, j])
            for i, r in enumerate(rows)
            for j, li in enumerate(layer_ids)
        ]
        if t1 > t0:
            self.files.read_ranges(shard_name(shard), ranges)
        if isinstance(token, (int, np.integer)):
            tok: Any = 0
        elif isinstance(token, slice):
            tok = picked - t0
        else:
            tok = np.asarray(token) % n_tok - t0
        return buf[:, :, tok] if isinstance(layer_sel, slice) else buf[:, 0][:, tok]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_memmaps": {}, "_fds": {}}

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.close()

    # ------------------------------------------------------------------ random access

    def __getitem__(self, key: Any) -> np.ndarray:
        """``reader[example, layer, token]``; example and token take ints, slices or int
        arrays; layer takes a stored layer value or ``:`` for all layers."""
        if not isinstance(key, tuple):
            key = (key,)
        if len(key) > 3:
            raise IndexError("index as reader[example, layer, token]")
        ex, layer, token = (*key, *(slice(None),) * (3 - len(key)))
        md = self.metadata
        examples = _as_indices(ex, md.n_examples, "example")
        if isinstance(layer, slice):
            if layer != slice(None):
                raise IndexError("layers are selected by value (reader[ex, 6]) or all (:)")
            layer_sel: Any = slice(None)
        else:
            layer_sel = md.layer_index(int(layer))
        token_sel: Any = token
        if (
            isinstance(token, (int, np.integer))
            and not -md.tokens_per_ex <= token < md.tokens_per_ex
        ):
            raise IndexOutOfRangeError(f"token {token} out of range (0..{md.tokens_per_ex - 1})")
        out = []
        shard_of = examples // md.examples_per_shard
        for shard in np.unique(shard_of):
            rows = examples[shard_of == shard] - shard * md.examples_per_shard
            if self.remote:
                out.append(self._rows_remote(int(shard), rows, layer_sel, token_sel))
                continue
            part = self._memmap(int(shard))[rows, layer_sel]  # copies just these rows
            out.append(
                part[:, :, token_sel] if isinstance(layer_sel, slice) else part[:, token_sel]
            )
        result = np.concatenate(out) if len(out) > 1 else out[0]
        if len(out) > 1:  # restore the caller's order
            order = np.argsort(np.argsort(shard_of, kind="stable"), kind="stable")
            result = result[order]
        return result[0] if isinstance(ex, (int, np.integer)) else result

    def vector(self, example: int, layer: int, token: int) -> np.ndarray:
        """One activation vector via the spec's offset arithmetic (section 4.2)."""
        shard, offset = self.metadata.locate(example, layer, token)
        out = np.empty(self.metadata.d_model, dtype="<f4")
        self._read_into(shard, out, offset)
        return out

    @property
    def tokens(self) -> np.ndarray | None:
        """Token ids ``[n_examples, T]`` (int32 memmap) for text captures, else None."""
        if self.remote:
            return self._remote_array("tokens.bin", "<i4", self.tokens_per_ex)
        path = self.path / "tokens.bin"
        if not path.exists():
            return None
        return np.memmap(path, dtype="<i4", mode="r", shape=(self.n_examples, self.tokens_per_ex))

    @property
    def labels(self) -> np.ndarray | None:
        """Per-patch labels ``[n_examples, patches_per_ex]`` (uint8 memmap), else None."""
        if self.remote:
            return self._remote_array("labels.bin", "u1", self.metadata.patches_per_ex)
        path = self.path / "labels.bin"
        if not path.exists():
            return None
        md = self.metadata
        return np.memmap(path, dtype=np.uint8, mode="r", shape=(md.n_examples, md.patches_per_ex))

    def _remote_array(self, name: str, dtype: str, width: int) -> np.ndarray | None:
        """A small side file of a remote store, fetched once and kept in memory."""
        kept = self.__dict__.setdefault("_side_files", {})
        if name not in kept:
            data = self.files.read_bytes(name) if self.files.exists(name) else None
            kept[name] = (
                None
                if data is None
                else np.frombuffer(data, dtype=dtype).reshape(self.n_examples, width)
            )
        return kept[name]

    @property
    def classes(self) -> list[str] | None:
        return self._json("classes.json") if self.files.exists("classes.json") else None

    def statistics(self, site: int) -> RunningStats | None:
        """Running statistics of stored layer ``site`` (None if the file is absent)."""
        if not self.files.exists(STATISTICS):
            return None
        self.metadata.layer_index(int(site))
        self._check_listed(STATISTICS)
        try:
            return RunningStats.from_dict(self._json(STATISTICS)["sites"][str(int(site))])
        except (KeyError, TypeError) as err:
            raise CorruptStoreError(
                f"{self.files.url_of(STATISTICS)} has no statistics of layer {site}"
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
        md = self.metadata
        tokens, labels = self.tokens, self.labels
        return CapturePlan(
            ckpt=md.ckpt,
            family=md.family,
            modality="image" if md.family in SAEV_FAMILIES else "text",
            sites=tuple(Site("resid", layer) for layer in md.layers),
            n_model_layers=max(md.layers) + 1,
            d_model=md.d_model,
            tokens_per_example=md.tokens_per_ex,
            has_cls=md.cls_token,
            n_examples=md.n_examples,
            dataset_root=md.dataset,
            data=_decode_data(md.data),
            classes=self.classes,
            has_labels=labels is not None,
            has_tokens=tokens is not None,
            batch_size=32,
        )

    # ------------------------------------------------------------------ blocks (loader)

    def blocks(self, site: int, *, target_bytes: int = 1 << 20) -> list[Block]:
        """Blocks of layer ``site``: one per example (its ``T`` tokens are contiguous); with a
        single stored layer consecutive examples are contiguous too and are grouped up to
        ``target_bytes``. ``loc = (shard, first example in shard, n examples, layer index)``."""
        md = self.metadata
        layer_idx = md.layer_index(int(site))
        per_block = 1
        if len(md.layers) == 1:
            per_block = max(1, target_bytes // (md.tokens_per_ex * md.d_model * 4))
        out = []
        for shard, count in enumerate(self.shard_counts):
            for first in range(0, count, per_block):
                n = min(per_block, count - first)
                out.append(
                    Block(
                        site=int(site),
                        n_rows=n * md.tokens_per_ex,
                        loc=(shard, first, n, layer_idx),
                    )
                )
        return out

    def read_block(self, block: Block, out: np.ndarray | None = None) -> np.ndarray:
        """Rows of ``block`` as ``[n_rows, D]`` float32, read with one ``pread``."""
        md = self.metadata
        shard, first, _n, layer_idx = block.loc
        if out is None:
            out = np.empty((block.n_rows, md.d_model), dtype="<f4")
        vectors = (first * len(md.layers) + layer_idx) * md.tokens_per_ex
        self._read_into(shard, out, vectors * md.d_model * 4)
        self._sums.check(shard_name(shard), vectors * md.d_model * 4, out)
        return out

    def read_block_scatter(self, block: Block, out: np.ndarray, rows: np.ndarray) -> None:
        """Row ``i`` of ``block`` into ``out[rows[i]]`` (skipped where ``rows[i] < 0``).
        Unverified local reads are one vectored pread straight into place; verified ones
        read the block whole, check it, then place its rows."""
        md = self.metadata
        shard, first, _, layer_idx = block.loc
        if (
            len(rows) != block.n_rows
            or out.dtype != np.float32
            or out.ndim != 2
            or out.shape[1] != md.d_model
            or out.strides[1] != 4
            or (len(rows) and rows.max() >= out.shape[0])
        ):
            raise ConfigError(
                f"read_block_scatter needs one destination row (< {len(out)}) "
                f"per block row and a float32 [n, {md.d_model}] out with "
                "contiguous rows"
            )
        row_bytes = md.d_model * 4
        vectors = (first * len(md.layers) + layer_idx) * md.tokens_per_ex
        if self.remote:  # one ranged read (or a mapped cache entry), then rows to their places
            start = vectors * row_bytes
            view = self.files.read_view(shard_name(shard), start, block.n_rows * row_bytes)
            self._sums.check(shard_name(shard), start, view)
            _place(out, rows, np.frombuffer(view, dtype="<f4").reshape(block.n_rows, md.d_model))
            return
        if self._sums.enabled and self._sums.sums(shard_name(shard)) is not None:
            # Verified: one pread into a per-thread scratch block (hot in cache), checked
            # there, then rows to their places. Checking rows already scattered would need
            # one more pass over cold memory (measured 1.5x slower warm).
            _place(out, rows, self.read_block(block, _SCRATCH.rows_for(block.n_rows, md.d_model)))
            return
        addr = np.where(rows >= 0, out.ctypes.data + rows * out.strides[0], _trash_addr())
        iov = np.empty((block.n_rows, 2), dtype=np.uint64)
        iov[:, 0], iov[:, 1] = addr, row_bytes
        _preadv(self._fd(shard), iov, vectors * row_bytes)

    def example_rows(self, site: int) -> int:
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
        (skipped where ``dest < 0``): one vectored ``preadv`` per stretch of consecutive
        file rows (a loader slab: one per example), each row straight into place.

        Block checksums cover whole examples, so a slab cannot be checked on its own:
        when reads are verified (and remotely) each whole block is read and checked, then
        its rows are copied (a slab then costs a block's I/O; one warning says so)."""
        md = self.metadata
        pieces = [p for p in pieces if len(p[1]) or len(p[2])]
        if not pieces:
            return
        n_rows = np.concatenate([np.full(len(r), b.n_rows) for b, r, _ in pieces])
        rows = np.concatenate([r for _, r, _ in pieces])
        dest = np.concatenate([d for _, _, d in pieces])
        piece = np.repeat(np.arange(len(pieces)), [len(r) for _, r, _ in pieces])
        steps = np.diff(rows)
        if (
            len(rows) != len(dest)
            or out.dtype != np.float32
            or out.ndim != 2
            or out.shape[1] != md.d_model
            or out.strides[1] != 4
            or dest.max() >= out.shape[0]
            or rows.min() < 0
            or (rows >= n_rows).any()
            or ((steps <= 0) & (piece[1:] == piece[:-1])).any()
        ):
            raise ConfigError(
                "read_rows_scatter needs ascending rows of the block, one destination row "
                f"(< {len(out)}) each, and a float32 [n, {md.d_model}] out with contiguous rows"
            )
        shards = [b.loc[0] for b, _, _ in pieces]
        if self.remote or (
            self._sums.enabled
            and any(self._sums.sums(shard_name(s)) is not None for s in set(shards))
        ):
            if not self.remote and not _SLAB_WARNED.is_set():
                _SLAB_WARNED.set()
                log.warning(
                    "%s: slab reads (mix > 1) cannot be checked against per-example "
                    "checksums, so whole blocks are read and checked (mix times the bytes); "
                    "open the store with verify_reads=False to read slabs alone",
                    self.files.url,
                )
            for block, r, d in pieces:
                ReaderBase.read_rows_scatter(self, block, r, out, d)
            return
        row_bytes = md.d_model * 4
        first = [(b.loc[1] * len(md.layers) + b.loc[3]) * md.tokens_per_ex for b, _, _ in pieces]
        file_row = np.asarray(first, dtype=np.int64)[piece] + rows
        shard = np.asarray(shards, dtype=np.int64)[piece]
        iov = np.empty((len(rows), 2), dtype=np.uint64)
        iov[:, 0] = np.where(dest >= 0, out.ctypes.data + dest * out.strides[0], _trash_addr())
        iov[:, 1] = row_bytes
        new = np.flatnonzero((np.diff(file_row) != 1) | (shard[1:] != shard[:-1])) + 1
        bounds = [0, *new.tolist(), len(rows)]
        base, offsets, shard_of = iov.ctypes.data, (file_row * row_bytes).tolist(), shard.tolist()
        for lo, hi in itertools.pairwise(bounds):  # one stretch of consecutive rows each
            fd = self._fd(shard_of[lo])
            n = hi - lo
            if n <= _IOV_MAX and _LIBC.preadv(fd, base + 16 * lo, n, offsets[lo]) == n * row_bytes:
                continue
            _preadv(fd, iov[lo:hi], offsets[lo])  # short read, error or long: the careful way

    def cls_rows(self, block: Block) -> np.ndarray:
        """Rows of ``block`` holding a CLS token (token 0 of each example, if stored)."""
        if not self.metadata.cls_token:
            return np.empty(0, dtype=np.int64)
        return np.arange(0, block.n_rows, self.metadata.tokens_per_ex, dtype=np.int64)

    def gather(
        self, indices: Any, layer: int | None = None, *, max_gap: int = GAP_BYTES
    ) -> np.ndarray:
        """Rows of stored ``layer`` at ``indices``, in the caller's order: ``[*shape, D]``.

        ``indices`` are flat rows ``example * T + token`` (an int array of any shape, as the
        loader's ``return_index`` gives them) or an ``(examples, tokens)`` pair of arrays.
        Reads are sorted and coalesced: rows less than ``max_gap`` bytes apart in a shard
        become one vectored read (gap bytes are discarded), each row is read once however
        often it is asked for, and it lands directly in its output slot.

        Example:
            >>> reader.gather([5, 0, 5], layer=6).shape  # doctest: +SKIP
            (3, 768)
            >>> cls = reader.gather((np.array([2, 9]), 0), 6)  # token 0  # doctest: +SKIP
        """
        md = self.metadata
        if layer is None:
            if len(md.layers) != 1:
                raise ConfigError(f"name the layer to gather from: one of {list(md.layers)}")
            layer = md.layers[0]
        layer_idx, n_tok = md.layer_index(int(layer)), md.tokens_per_ex
        if isinstance(indices, tuple):
            examples = _as_indices(np.asarray(indices[0]), md.n_examples, "example")
            tokens = _as_indices(np.asarray(indices[1]), n_tok, "token")
            examples, tokens = np.broadcast_arrays(examples, tokens)
            flat = examples * n_tok + tokens
            shape = flat.shape
        else:
            given = np.asarray(indices)
            shape = given.shape
            if given.size == 0:  # np.asarray([]) is float64
                given = given.astype(np.int64)
            flat = _as_indices(given.reshape(-1), md.n_examples * n_tok, "row")
        flat = flat.reshape(-1)
        row_bytes = md.d_model * 4
        out = np.empty((len(flat), md.d_model), dtype=np.float32)
        order = np.argsort(flat, kind="stable")
        ranked = flat[order]
        first = np.ones(len(ranked), dtype=bool)
        first[1:] = ranked[1:] != ranked[:-1]
        rows, slots = ranked[first], order[first]
        example, token = np.divmod(rows, n_tok)
        shard, in_shard = np.divmod(example, md.examples_per_shard)
        offset = ((in_shard * len(md.layers) + layer_idx) * n_tok + token) * row_bytes
        gap_bytes = np.diff(offset) - row_bytes
        new_run = np.ones(len(rows), dtype=bool)
        new_run[1:] = (shard[1:] != shard[:-1]) | (gap_bytes > min(max_gap, GAP_BYTES))
        starts = np.flatnonzero(new_run)
        if self.remote:  # each row straight into its slot; the file layer merges nearby rows
            for s in np.unique(shard):
                at = np.flatnonzero(shard == s)
                self.files.read_ranges(
                    shard_name(int(s)), [(int(offset[i]), out[slots[i]]) for i in at]
                )
            starts = starts[:0]
        for lo, hi in zip(starts, [*starts[1:], len(rows)]):
            gaps = gap_bytes[lo : hi - 1]
            iov = np.zeros((2 * (hi - lo) - 1, 2), dtype=np.uint64)
            iov[0::2, 0] = out.ctypes.data + slots[lo:hi] * row_bytes
            iov[0::2, 1] = row_bytes
            iov[1::2, 0], iov[1::2, 1] = _trash_addr(), gaps
            iov = iov[iov[:, 1] > 0]
            _preadv(self._fd(int(shard[lo])), iov, int(offset[lo]))
        if not first.all():  # repeated rows: copy from the slot that was read
            source = np.maximum.accumulate(np.where(first, np.arange(len(ranked)), 0))
            out[order[~first]] = out[order[source[~first]]]
        return out.reshape(*shape, md.d_model)

    def block_rows(self, block: Block) -> tuple[np.ndarray, np.ndarray]:
        """(example index, token index) of every row of ``block``."""
        md = self.metadata
        shard, first, n, _ = block.loc
        examples = shard * md.examples_per_shard + first + np.arange(n)
        return np.repeat(examples, md.tokens_per_ex), np.tile(np.arange(md.tokens_per_ex), n)

    def describe(self) -> dict[str, Any]:
        """Summary for ``actstore inspect``."""
        md = self.metadata
        files = {n: size for n, size in self.files.list().items() if "/" not in n}
        out: dict[str, Any] = {
            "path": self.files.url,
            "format": f"saev protocol {md.protocol} ({self.dialect} dialect)",
            "model": f"{md.ckpt} ({md.family})",
            "dataset": md.dataset,
            "sites": [f"layer {layer}" for layer in md.layers],
            "shape": (
                f"{md.n_examples} examples x {len(md.layers)} layers {list(md.layers)} x "
                f"{md.tokens_per_ex} tokens{' (CLS at 0)' if md.cls_token else ''} x "
                f"{md.d_model} dims"
            ),
            "n_examples": md.n_examples,
            "layers": list(md.layers),
            "tokens_per_example": md.tokens_per_ex,
            "cls_token": md.cls_token,
            "d_model": md.d_model,
            "shards": f"{md.n_shards} x up to {md.examples_per_shard} examples",
            "bytes": sum(files.values()),
            "files": list(files),
        }
        if self.tokens is not None and md.n_examples:
            out["token_ids[0][:16]"] = self.tokens[0, :16].tolist()
        if self.classes is not None:
            out["classes"] = self.classes
        return out

    # ------------------------------------------------------------------ verify

    def verify(self, *, progress: Callable[[int], None] | None = None) -> VerifyReport:
        """Check every file against the manifest checksums.xxh128 (and every shard block
        against its sidecar), that the manifest covers every file in the directory, that
        no file leads outside it, the statistics, the directory name against the content
        hash, zero padding (saev dialect) and non-finite values. Stores of older actstore
        versions are checked against checksums.sha256. ``progress(n_bytes)`` is called as
        data is read."""
        md, report = self.metadata, VerifyReport(self.files.url)
        expected_hash = md.content_hash()
        if _HASH_NAME.match(self.path.name) and self.path.name != expected_hash:
            report.faults.append(
                f"directory name {self.path.name} differs from the metadata hash "
                f"{expected_hash}: metadata.json was edited after publication"
            )
        if not self.remote:
            root = self.path.resolve()
            for child in sorted(self.path.iterdir()):
                if not child.resolve().is_relative_to(root):
                    report.faults.append(f"{child.name} is a symlink out of the store")
        self._verify_statistics(report)
        if self.files.exists(CHECKSUMS):
            self._verify_blocks(report, progress)
        elif self.files.exists(LEGACY_CHECKSUMS):
            self._verify_legacy(report, progress)
        else:
            report.faults.append(
                f"no checksum manifest ({CHECKSUMS}): the contents cannot be verified "
                "(deleted, or a store written by another tool)"
            )
        return report

    def _verify_statistics(self, report: VerifyReport) -> None:
        if not self.files.exists(STATISTICS):
            return
        md = self.metadata
        try:
            doc = self._json(STATISTICS)
            sites = doc["sites"]
            if sorted(sites) != sorted(str(layer) for layer in md.layers):
                raise CorruptStoreError(f"layers {sorted(sites)}, expected {list(md.layers)}")
            for layer in md.layers:
                stats = RunningStats.from_dict(sites[str(layer)])
                if stats.count != md.n_examples * md.tokens_per_ex or stats.d != md.d_model:
                    raise CorruptStoreError(
                        f"layer {layer} counts {stats.count} rows of width {stats.d}, expected "
                        f"{md.n_examples * md.tokens_per_ex} of {md.d_model}"
                    )
                if stats.mean.shape != (md.d_model,) or stats.m2.shape != (md.d_model,):
                    raise CorruptStoreError(f"layer {layer} has vectors of the wrong length")
        except (CorruptStoreError, KeyError, TypeError, AttributeError) as err:
            report.faults.append(f"{STATISTICS} is malformed: {err}")

    def _verify_blocks(self, report: VerifyReport, progress: Callable[[int], None] | None):
        md = self.metadata
        expected: dict[str, str] = {}
        for line in self.files.read_bytes(CHECKSUMS).decode("utf-8").splitlines():
            digest, sep, name = line.partition("  ")
            if not sep or "/" in name or name in ("", ".", ".."):
                report.faults.append(f"{CHECKSUMS}: malformed line {line!r}")
                continue
            expected[name] = digest
        shards = {shard_name(i) for i in range(md.n_shards)}
        for name in sorted(n for n in self.files.list() if "/" not in n):
            covered = name in expected or (name in shards and sidecar_name(name) in expected)
            if name != CHECKSUMS and not covered:
                report.faults.append(f"{name} is not covered by {CHECKSUMS}")
        non_finite = 0
        for name, digest in expected.items():
            size = self.files.size(name)
            if size is None:
                report.faults.append(f"{name} is listed in {CHECKSUMS} but missing")
                continue
            report.files_checked += 1
            report.bytes_checked += size
            if _digest(self.files.iter_chunks(name), "xxh128") != digest:
                report.faults.append(f"{name}: checksum mismatch (the file was changed)")
                continue
            shard = name[: -len(SUFFIX)] if name.endswith(SUFFIX) else None
            if shard not in shards:
                continue
            data_size = self.files.size(shard)
            try:
                if data_size is None:
                    raise StoreNotFoundError(f"{shard} is missing")
                unit, sums = parse_sidecar(
                    self.files.read_bytes(name), data_size, self.files.url_of(name)
                )
            except (CorruptStoreError, StoreNotFoundError) as err:
                report.faults.append(str(err))
                continue
            index = int(shard[4:10])
            digests, bad, pad_ok = _scan(
                self.files.iter_chunks(shard, _chunk_of(unit)),
                unit=unit,
                valid_bytes=self.shard_counts[index] * md.example_nbytes,
                progress=progress,
            )
            non_finite += bad
            report.files_checked += 1
            report.bytes_checked += data_size
            wrong = np.flatnonzero(digests != sums)
            if len(wrong):
                first = int(wrong[0])
                report.faults.append(
                    f"{shard}: checksum mismatch in {len(wrong)} blocks, first block {first} "
                    f"(bytes {first * unit}-{(first + 1) * unit}): stored data was changed"
                )
            if not pad_ok:
                report.faults.append(f"{shard}: padding after the last example is not zero")
        if non_finite:
            report.notes.append(f"{non_finite} activation values are NaN or infinite")

    def _verify_legacy(self, report: VerifyReport, progress: Callable[[int], None] | None):
        md = self.metadata
        expected = {}
        for line in self.files.read_bytes(LEGACY_CHECKSUMS).decode("utf-8").splitlines():
            digest, _, name = line.partition("  ")
            expected[name.strip()] = digest.strip()
        for i in range(md.n_shards):
            if shard_name(i) not in expected:
                report.faults.append(f"{shard_name(i)} has no checksum in {LEGACY_CHECKSUMS}")
        non_finite = 0
        for name, digest in expected.items():
            size = None if "/" in name else self.files.size(name)
            if size is None:
                report.faults.append(f"{name} is listed in {LEGACY_CHECKSUMS} but missing")
                continue
            is_shard = name.startswith("acts") and name.endswith(".bin")
            valid_bytes = None
            if is_shard:
                valid_bytes = self.shard_counts[int(name[4:10])] * md.example_nbytes
            hasher = FileHasher("sha256")
            _, bad, pad_ok = _scan(
                self.files.iter_chunks(name),
                unit=None,
                valid_bytes=valid_bytes,
                progress=progress,
                hasher=hasher,
                check_floats=is_shard,
            )
            non_finite += bad
            report.files_checked += 1
            report.bytes_checked += size
            if hasher.hexdigest() != digest:
                report.faults.append(f"{name}: checksum mismatch (stored data was changed)")
            if not pad_ok:
                report.faults.append(f"{name}: padding after the last example is not zero")
        if non_finite:
            report.notes.append(f"{non_finite} activation values are NaN or infinite")


def _decode_data(data: str) -> dict[str, Any]:
    """The dataset description in metadata's ``data`` (a base64 pickle), decoded with the
    restricted unpickler so a store cannot run code through it; {} if it is not a dict
    (e.g. saev's own ImgFolder object)."""
    if not data:
        return {}
    import base64

    from ... import safe_pickle
    from ...errors import UnsafeDataError

    try:
        decoded = safe_pickle.loads(base64.b64decode(data))
    except (UnsafeDataError, CorruptStoreError, ValueError):
        return {}
    return decoded if isinstance(decoded, dict) else {}


def _as_indices(index: Any, n: int, what: str) -> np.ndarray:
    if isinstance(index, slice):
        return np.arange(n)[index]
    arr = np.asarray(index)
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
        raise IndexError(f"{what} index must be an int, slice or int array")
    arr = np.atleast_1d(arr).astype(np.int64)
    bad = (arr < -n) | (arr >= n)
    if bad.any():
        raise IndexOutOfRangeError(
            f"{what} {int(arr[bad][0])} out of range (0..{n - 1}; negatives count from the end)"
        )
    return np.where(arr < 0, arr + n, arr)


def _pread_into(fd: int, out: np.ndarray, offset: int) -> None:
    view = memoryview(out).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise CorruptStoreError(f"unexpected end of file at byte {offset + done}")
        done += n


def _trash_addr() -> int:
    return _TRASH.ctypes.data


def _preadv(fd: int, iov: np.ndarray, offset: int) -> None:
    """Fill the ``(address, length)`` rows of ``iov`` (uint64 ``[n, 2]``, modified) from
    consecutive file bytes at ``offset``: libc ``preadv`` without the GIL, ``IOV_MAX`` at a
    time, resuming after short reads."""
    i = 0
    while i < len(iov):
        chunk = iov[i : i + _IOV_MAX]
        got = _LIBC.preadv(fd, chunk.ctypes.data, len(chunk), offset)
        if got < 0:
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            raise OSError(err, f"preadv failed at byte {offset}: {os.strerror(err)}")
        if got == 0:
            raise CorruptStoreError(f"unexpected end of file at byte {offset}")
        offset += got
        if got == int(chunk[:, 1].sum()):
            i += len(chunk)
            continue
        ends = np.cumsum(chunk[:, 1])  # a short read: skip the iovecs filled, trim the next
        full = int(np.searchsorted(ends, got, side="right"))
        i += full
        done = got - (int(ends[full - 1]) if full else 0)
        iov[i, 0] += np.uint64(done)
        iov[i, 1] -= np.uint64(done)


def _chunk_of(unit: int | None) -> int:
    """Read size for a scan: whole blocks of ``unit`` bytes, about ``IO_CHUNK`` at a time."""
    return IO_CHUNK if not unit else max(unit, IO_CHUNK // unit * unit)


def _digest(chunks: Iterable[memoryview], algorithm: str) -> str:
    hasher = FileHasher(algorithm)
    for chunk in chunks:
        hasher.update(chunk)
    return hasher.hexdigest()


def _scan(
    chunks: Iterable[memoryview],
    *,
    unit: int | None,
    valid_bytes: int | None,
    progress: Callable[[int], None] | None,
    hasher: FileHasher | None = None,
    check_floats: bool = True,
) -> tuple[np.ndarray | None, int, bool]:
    """Block digests of a file's ``chunks`` (``unit`` bytes each; None: none), its count of
    non-finite float32 values, and whether any bytes past ``valid_bytes`` are zero; one
    sequential read. ``hasher`` also digests the whole file."""
    blocks = BlockHasher(unit) if unit else None
    non_finite, pad_ok, pos = 0, True, 0
    for chunk in chunks:
        n = len(chunk)
        if blocks is not None:
            blocks.update(chunk)
        if hasher is not None:
            hasher.update(chunk)
        if check_floats:
            valid = n if valid_bytes is None else max(0, min(n, valid_bytes - pos))
            values = np.frombuffer(chunk[: valid - valid % 4], dtype="<f4")
            non_finite += int(values.size - np.count_nonzero(np.isfinite(values)))
            if valid < n and np.frombuffer(chunk[valid:], dtype=np.uint8).any():
                pad_ok = False
        pos += n
        if progress is not None:
            progress(n)
    return (blocks.digests() if blocks is not None else None), non_finite, pad_ok


def detect_remote(location: str) -> bool:
    """Whether ``s3://bucket/prefix`` holds a saev store (two HEADs and one small GET)."""
    from ...storage.object import join_key, open_location

    store, prefix = open_location(location)
    if any(store.size(join_key(prefix, n)) is None for n in ("shards.json", "metadata.json")):
        return False
    try:
        doc = store.get_json(join_key(prefix, "metadata.json"))
    except CorruptStoreError:
        return True  # let the reader report the damaged file
    return isinstance(doc, dict) and (
        "patches_per_ex" in doc or "content_tokens_per_example" in doc
    )
