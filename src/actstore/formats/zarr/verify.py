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
    lay, where = store.layout, store.location.url
    verify_statistics(store, report)
    if store.chunksums is None and store.checks.manifest is not None:
        try:  # opened unchecked (as `actstore verify` does to list every fault): load them
            store.chunksums = store._load_chunksums()
        except CorruptStoreError as err:
            report.faults.append(str(err))
    if store.chunksums is None and store.checks.manifest is None:
        report.faults.append(
            f"{where} has no chunk digests: its chunks cannot be verified (no root manifest: "
            "it was deleted, or another tool wrote the store)"
        )
    for part in PARTS:
        grid = (lay.n_samples, lay.n_layers, lay.n_chunks(part), 1)
        want = lay.chunk_nbytes(part)
        folder = ACTIVATIONS[part] + "/"
        recorded = set()
        if store.chunksums is not None:
            recorded = {
                tuple(int(x) for x in idx) for idx in zip(*np.nonzero(store.chunksums[part]))
            }
        for name, size in store.files.list().items():
            if not name.startswith(folder):
                continue
            rel = name[len(folder) :]
            if rel.rpartition("/")[2].startswith("."):
                continue
            key = parse_chunk_key(rel, store.separators[part])
            if key is None or len(key) != 4 or any(k >= g for k, g in zip(key, grid)):
                report.faults.append(f"{store.url_of(name)}: not a chunk of this array")
                continue
            report.files_checked += 1
            if size != want:
                report.faults.append(f"{store.url_of(name)}: {size} bytes, expected {want}")
            elif store.chunksums is not None and key[:3] not in recorded:
                report.faults.append(
                    f"{store.url_of(name)}: a chunk the store's digests do not record"
                )
        for name in store.files.symlinks():
            if name.startswith(folder):
                report.faults.append(f"{store.url_of(name)}: a symlink, not a chunk file")
    try:
        digests = store.array(DIGEST)
        full = {p: store.array(FULL_LENGTHS[p]) for p in PARTS}
    except CorruptStoreError as err:
        report.faults.append(str(err))
        return 0
    if digests is None or any(v is None for v in full.values()):
        report.faults.append(f"{where} lacks its per-sample digests or full lengths")
        return 0
    for part in PARTS:
        bad = np.flatnonzero(np.minimum(full[part], lay.max_len(part)) != store.lengths[part])  # type: ignore[arg-type]
        if bad.size:
            report.faults.append(
                f"{where}/{LENGTHS[part]} disagrees with the full lengths at samples {bad[:5].tolist()}"
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
                f"{where}: sample {local} does not match its stored digest (activation data was changed or lost)"
            )
    for part in PARTS:
        if store.exists(TEXT_FILES[part]):
            report.files_checked += 1
            # split on "\n" only: str.splitlines() also splits at U+2028/U+0085, which
            # json.dumps(ensure_ascii=False) leaves raw inside a record
            try:
                text = store.checks.read_bytes(TEXT_FILES[part]).decode("utf-8")
                lines = [json.loads(x) for x in text.split("\n") if x.strip()]
                ids = [rec.get("i") for rec in lines]
            except (CorruptStoreError, UnicodeDecodeError, ValueError, AttributeError) as err:
                report.faults.append(f"{store.url_of(TEXT_FILES[part])} is unreadable: {err}")
                continue
            if ids != list(range(lay.n_samples)):
                report.faults.append(
                    f"{store.url_of(TEXT_FILES[part])}: expected one record per sample, i = 0..{lay.n_samples - 1}"
                )
    for name in store.attrs.get("optional_arrays", []):
        try:
            if store.array(OPTIONAL_ARRAYS[name][0]) is None:
                report.faults.append(
                    f"{where} lacks {OPTIONAL_ARRAYS[name][0]} its attributes list"
                )
        except CorruptStoreError as err:
            report.faults.append(str(err))
    return non_finite


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
