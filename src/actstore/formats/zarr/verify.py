"""The zarr reader's full verification of one store (beyond the root manifest's bytes):
every activation chunk against its keyed digest, each sample's content digest, lengths,
text files, statistics and non-finite values."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import xxhash

from ...errors import CorruptStoreError
from ...stats import RunningStats
from ..base import VerifyReport
from .layout import (
    ACT_DTYPE,
    ACTIVATIONS,
    DIGEST,
    FULL_LENGTHS,
    LENGTHS,
    PARTS,
    STATISTICS_FILE,
    TEXT_FILES,
    parse_chunk_key,
)
from .meta import StoreMeta
from .store import OPTIONAL_ARRAYS, byte_view


def verify_store_content(store: StoreMeta, report: VerifyReport, progress: Any) -> int:
    """The format's checks of one store beyond its listed files: the chunk files present
    against the digests, every chunk's bytes, each sample's content digest, lengths,
    statistics, text files. Returns the count of non-finite values."""
    opened_with = store.chunksums
    try:
        return _verify_store(store, report, progress)
    finally:
        store.chunksums = opened_with  # an unchecked reader stays unchecked after verify


def _verify_store(store: StoreMeta, report: VerifyReport, progress: Any) -> int:
    verify_statistics(store, report)
    _load_chunk_digests(store, report)
    for part in PARTS:
        _verify_chunk_files(store, part, report)
    non_finite = _verify_samples(store, report, progress)
    _verify_texts(store, report)
    _verify_optional_arrays(store, report)
    return non_finite


def _load_chunk_digests(store: StoreMeta, report: VerifyReport) -> None:
    """The keyed chunk digests, loaded for verify when the store was opened unchecked (as
    ``actstore verify`` does to list every fault)."""
    if store.chunksums is None and store.checks.manifest is not None:
        try:
            store.chunksums = store._load_chunksums()
        except CorruptStoreError as err:
            report.faults.append(str(err))
    if store.chunksums is None and store.checks.manifest is None:
        report.faults.append(
            f"{store.location.url} has no chunk digests: its chunks cannot be verified (no "
            "root manifest: it was deleted, or another tool wrote the store)"
        )


def _verify_chunk_files(store: StoreMeta, part: str, report: VerifyReport) -> None:
    """Every chunk file present is a chunk of the array, of the right size, and one the
    digests record; none is a symlink."""
    lay = store.layout
    grid = (lay.n_samples, lay.n_layers, lay.n_chunks(part), 1)
    want = lay.chunk_nbytes(part)
    folder = ACTIVATIONS[part] + "/"
    recorded = set()
    if store.chunksums is not None:
        recorded = {tuple(int(x) for x in idx) for idx in zip(*np.nonzero(store.chunksums[part]))}
    for name, size in store.files.list().items():
        rel = name[len(folder) :]
        if not name.startswith(folder) or rel.rpartition("/")[2].startswith("."):
            continue
        key = parse_chunk_key(rel, store.separators[part])
        if key is None or len(key) != 4 or any(k >= g for k, g in zip(key, grid)):
            report.faults.append(f"{store.url_of(name)}: not a chunk of this array")
            continue
        report.files_checked += 1
        if size != want:
            report.faults.append(f"{store.url_of(name)}: {size} bytes, expected {want}")
        elif store.chunksums is not None and key[:3] not in recorded:
            report.faults.append(f"{store.url_of(name)}: a chunk the store's digests do not record")
    for name in store.files.symlinks():
        if name.startswith(folder):
            report.faults.append(f"{store.url_of(name)}: a symlink, not a chunk file")


def _verify_samples(store: StoreMeta, report: VerifyReport, progress: Any) -> int:
    """Lengths against the full lengths, and every sample's chunks (each checked against
    its keyed digest) against the sample's content digest. Returns non-finite values."""
    lay, where = store.layout, store.location.url
    try:
        digests = store.array(DIGEST)
        found = {p: store.array(FULL_LENGTHS[p]) for p in PARTS}
    except CorruptStoreError as err:
        report.faults.append(str(err))
        return 0
    full = {p: v for p, v in found.items() if v is not None}
    if digests is None or len(full) != len(found):
        report.faults.append(f"{where} lacks its per-sample digests or full lengths")
        return 0
    for part in PARTS:
        bad = np.flatnonzero(np.minimum(full[part], lay.max_len(part)) != store.lengths[part])
        if bad.size:
            report.faults.append(
                f"{where}/{LENGTHS[part]} disagrees with the full lengths at samples "
                f"{bad[:5].tolist()}"
            )
    non_finite = 0
    slabs = {
        "prompt": np.empty((lay.n_layers, lay.p_max, lay.hidden_size), dtype=ACT_DTYPE),
        "response": np.empty((lay.n_layers, lay.r_max, lay.hidden_size), dtype=ACT_DTYPE),
    }
    for local in range(lay.n_samples):
        h = xxhash.xxh3_128()
        n_read = 0
        for part, slab in slabs.items():
            for layer_idx in range(lay.n_layers):
                try:
                    n_read += store.read_rows(part, local, layer_idx, slab[layer_idx])
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
                f"{where}: sample {local} does not match its stored digest (activation data "
                "was changed or lost)"
            )
    return non_finite


def _verify_texts(store: StoreMeta, report: VerifyReport) -> None:
    """Each text file holds one record per sample, in order."""
    n = store.layout.n_samples
    for part in PARTS:
        if not store.exists(TEXT_FILES[part]):
            continue
        report.files_checked += 1
        where = store.url_of(TEXT_FILES[part])
        # split on "\n" only: str.splitlines() also splits at U+2028/U+0085, which
        # json.dumps(ensure_ascii=False) leaves raw inside a record
        try:
            text = store.checks.read_bytes(TEXT_FILES[part]).decode("utf-8")
            ids = [json.loads(x).get("i") for x in text.split("\n") if x.strip()]
        except (CorruptStoreError, UnicodeDecodeError, ValueError, AttributeError) as err:
            report.faults.append(f"{where} is unreadable: {err}")
            continue
        if ids != list(range(n)):
            report.faults.append(f"{where}: expected one record per sample, i = 0..{n - 1}")


def _verify_optional_arrays(store: StoreMeta, report: VerifyReport) -> None:
    for name in store.attrs.get("optional_arrays", []):
        path = OPTIONAL_ARRAYS[name][0]
        try:
            if store.array(path) is None:
                report.faults.append(f"{store.location.url} lacks {path} its attributes list")
        except CorruptStoreError as err:
            report.faults.append(str(err))


def verify_statistics(store: StoreMeta, report: VerifyReport) -> None:
    path, lay = store.url_of(STATISTICS_FILE), store.layout
    if not store.exists(STATISTICS_FILE):
        report.faults.append(f"{path} is missing")
        return
    rows = int(store.lengths["prompt"].sum()) + int(store.lengths["response"].sum())
    try:
        sites = store.files.read_json(STATISTICS_FILE)["sites"]
        if sorted(sites) != sorted(lay.sites):
            raise CorruptStoreError(f"sites {sorted(sites)}, expected {sorted(lay.sites)}")
        for site in lay.sites:
            stats = RunningStats.from_dict(sites[site])
            if stats.count != rows or stats.d != lay.hidden_size:
                raise CorruptStoreError(
                    f"{site} counts {stats.count} rows of width {stats.d}; the store holds {rows} of {lay.hidden_size}"
                )
    except (CorruptStoreError, KeyError, TypeError, AttributeError) as err:
        report.faults.append(f"{path} is malformed: {err}")
