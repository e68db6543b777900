"""The zarr reader's full verification of one store (beyond the root manifest's bytes):
every activation chunk against its keyed digest, each sample's content digest, lengths,
text files, statistics and non-finite values."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import xxhash

from ...batch import sample_key
from ...errors import CorruptStoreError, StoreNotFoundError
from ...stats import RunningStats, merge_all
from ...storage.local import load_json
from ...storage.manifest import store_id_of
from ..metacheck import Fields
from ..recompute import compare_statistics
from ..report import VerifyReport
from ..shard import ShardStats
from .layout import (
    ACT_DTYPE,
    ACTIVATIONS,
    CONFIG_FILE,
    DIGEST,
    FULL_LENGTHS,
    LENGTHS,
    PARTS,
    SAMPLE_KEY,
    STATISTICS_FILE,
    TEXT_FILES,
    TOKEN_IDS,
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
    stored = verify_statistics(store, report)
    _load_chunk_digests(store, report)
    for part in PARTS:
        _verify_chunk_files(store, part, report)
    fold = _StatisticsFold(store) if stored is not None else None
    non_finite = _verify_samples(store, report, progress, fold)
    if fold is not None and stored is not None and fold.complete:
        recomputed = fold.finish()
        records = store.files.read_json(STATISTICS_FILE)["sites"]
        for site in store.layout.sites:
            compare_statistics(
                report.faults,
                store.url_of(STATISTICS_FILE),
                site,
                stored[site],
                recomputed[site],
                record=records[site],
            )
    _verify_texts(store, report)
    _verify_optional_arrays(store, report)
    report.faults += [f for f in metadata_faults(store) if f not in report.faults]
    return non_finite


#: Attributes the writer adds after the fingerprint is taken (from the stored samples, the
#: clock, the files written), and those it leaves out of it (provenance).
_LATER = ("created_at", "optional_arrays", "text_files")
_UNHASHED = ("git_commit", "actstore_version", "fingerprint", "shard")


def metadata_faults(store: StoreMeta) -> list[str]:
    """Every metadata file of the store against what the data and the root manifest give:
    each node's own file (``.zattrs``, ``.zarray``, ``.zgroup``: what zarr-python reads
    without consolidated metadata) equal to its entry in ``.zmetadata``; the group's
    attributes and ``meta/config.json`` giving the fingerprint the attributes record, and
    that fingerprint with the layout, arrays and shard size giving the manifest's store id;
    the truncation counts, optional arrays and text files against the data; the provenance
    fields (creation time, version, commit) of their types."""
    from .options import ZarrOptions
    from .plan import fingerprint

    faults = _node_file_faults(store)
    manifest = store.checks.manifest
    if manifest is None:
        return faults
    attrs, where = store.attrs, store.url_of(".zattrs")
    edited = "the store's metadata was edited; restore it or re-create the store"
    try:
        config = store.files.read_json(CONFIG_FILE)
        data, options = _config_faults(store, config, faults)
    except (CorruptStoreError, StoreNotFoundError) as err:
        return [*faults, str(err)]
    shard = attrs.get("shard")
    if shard is None:  # one store: its attributes are those the fingerprint was taken of
        keep = {k: v for k, v in attrs.items() if k not in _LATER}
        # the dataset description is config.json's less its root, unless the source's own
        # description named a root (config.json keeps one key: the source's, then)
        root = data.pop("root", None)
        try:
            taken = [
                fingerprint(keep, data, ZarrOptions(**options)),  # root: the store's root
                fingerprint(keep, {**data, "root": root}, ZarrOptions(**options)),
            ]
        except (TypeError, ValueError) as err:
            return [
                *faults,
                f"{store.url_of(CONFIG_FILE)}: options are malformed ({err}): {edited}",
            ]
        if attrs.get("fingerprint") not in taken or (
            attrs.get("fingerprint") == taken[0] and root != attrs.get("dataset_root")
        ):
            faults.append(
                f"{where}: the attributes and {CONFIG_FILE} do not give the fingerprint the "
                f"store records (model, dataset, options, layout or length choice): {edited}"
            )
        samples = [0, store.layout.n_samples]
    else:
        try:
            samples = [int(shard["start"]), int(shard["stop"])]
        except (KeyError, TypeError, ValueError):
            return [*faults, f"{where}: shard {shard!r} is malformed: {edited}"]
    record = {
        "fingerprint": attrs.get("fingerprint"),
        "layout": store.layout.to_dict(),
        "optional": attrs.get("optional_arrays"),
        "token_ids": store.exists(f"{TOKEN_IDS['prompt']}/.zarray"),
        "samples": samples,
        "shard_rows": store.sample_rows,
    }
    if store_id_of(record) != manifest.store_id:
        faults.append(
            f"{where}: the capture record the attributes hold (fingerprint, layout, arrays, "
            f"shard size) is not the one the store was published with: {edited}"
        )
    faults += _derived_attr_faults(store, edited)
    return faults


def _node_file_faults(store: StoreMeta) -> list[str]:
    """Each node's metadata file against its entry in the consolidated metadata."""
    faults = []
    nodes = (".zarray", ".zattrs", ".zgroup")
    listed = {n for n in store.files.list() if n.rpartition("/")[2] in nodes}
    for key, entry in sorted(store.zmeta.items()):
        if key not in listed:
            faults.append(
                f"{store.url_of(key)} is missing (zarr-python reads it when it opens the store "
                "without consolidated metadata): restore it or re-create the store"
            )
            continue
        try:
            own = store.files.read_json(key)
        except CorruptStoreError as err:
            faults.append(str(err))
            continue
        if _node(own) != _node(entry):
            faults.append(
                f"{store.url_of(key)} differs from its entry in .zmetadata, so zarr-python "
                "would read the store differently without consolidated metadata: it was edited; "
                "restore it or re-create the store"
            )
    for name in sorted(listed - set(store.zmeta)):
        faults.append(f"{store.url_of(name)} is a node .zmetadata does not list: remove it")
    return faults


def _node(doc: Any) -> Any:
    """A node's metadata less zarr 3's inline index of a group (``consolidated_metadata``,
    kept in ``.zmetadata``'s copy only)."""
    if isinstance(doc, dict) and "consolidated_metadata" in doc:
        return {k: v for k, v in doc.items() if k != "consolidated_metadata"}
    return doc


def _config_faults(
    store: StoreMeta, config: Any, faults: list[str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``meta/config.json`` against the attributes and layout; returns its dataset
    description (less the root) and options, which the fingerprint covers."""
    where = store.url_of(CONFIG_FILE)
    f = Fields(config, where)
    model = Fields(f.obj("model"), f"{where}: model")
    dataset = dict(f.obj("dataset"))
    options = f.obj("options")
    model.text("modality")
    model.flag("has_cls")
    f.texts("classes", optional=True)
    f.count("batch_size", lo=1, optional=True)
    attrs, lay = store.attrs, store.layout
    want = {
        "model.ckpt": (model.doc.get("ckpt"), attrs.get("model_id")),
        "model.family": (model.doc.get("family"), attrs.get("model_family")),
        "model.n_layers": (model.doc.get("n_layers"), attrs.get("model_num_layers")),
        "model.d_model": (model.doc.get("d_model"), lay.hidden_size),
        "sites": (config.get("sites"), list(lay.sites)),
    }
    if attrs.get("shard") is None:
        want["layout"] = (config.get("layout"), lay.to_dict())
    differ = [k for k, (got, expected) in want.items() if got != expected]
    if differ:
        faults.append(
            f"{where}: {', '.join(differ)} {'does' if len(differ) == 1 else 'do'} not match the "
            "store's attributes and layout: it was edited; restore it or re-create the store"
        )
    return dataset, options


def _derived_attr_faults(store: StoreMeta, edited: str) -> list[str]:
    """The attributes the writer derives from the stored samples and files."""
    from .plan import truncation_attrs_from_counts

    attrs, lay, where = store.attrs, store.layout, store.url_of(".zattrs")
    faults = []
    try:
        full = {p: store.array(FULL_LENGTHS[p]) for p in PARTS}
    except CorruptStoreError as err:
        return [str(err)]
    if all(v is not None for v in full.values()):
        counts = {p: int(np.count_nonzero(np.asarray(full[p]) > lay.max_len(p))) for p in PARTS}
        want = truncation_attrs_from_counts(counts, lay.n_samples)
        wrong = sorted(k for k, v in want.items() if attrs.get(k) != v)
        if wrong:
            faults.append(f"{where}: {', '.join(wrong)} do not match the stored lengths: {edited}")
    texts = [TEXT_FILES[p] for p in PARTS if store.exists(TEXT_FILES[p])]
    if attrs.get("text_files") != texts:
        faults.append(f"{where}: text_files does not list the text files the store holds: {edited}")
    made = attrs.get("created_at")
    if not isinstance(made, str) or not re.fullmatch(
        r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d\d:\d\d", made
    ):
        faults.append(f"{where}: created_at {made!r} is not a time: {edited}")
    for key in ("actstore_version", "git_commit"):
        if attrs.get(key) is not None and not isinstance(attrs.get(key), str):
            faults.append(f"{where}: {key} {attrs.get(key)!r} is not a string: {edited}")
    return faults


def _load_chunk_digests(store: StoreMeta, report: VerifyReport) -> None:
    """The keyed chunk digests, loaded for verify when the store was opened unchecked (as
    ``actstore verify`` does to list every fault)."""
    if store.chunksums is None and store.checks.manifest is not None:
        try:
            store.chunksums = store.load_chunksums()
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


class _StatisticsFold:
    """The store's statistics recomputed as :func:`_verify_samples` reads each sample: the
    writer's own folding (:class:`ShardStats` per writer shard of ``sample_rows`` samples,
    each sample's kept prompt then response tokens, every site at once; shards merged in
    order), so the result is bit-identical to what the writer stored."""

    def __init__(self, store: StoreMeta) -> None:
        self.sites = list(store.layout.sites)
        self.d = store.layout.hidden_size
        self.per = max(1, int(store.sample_rows))
        self.parts: list[dict[Any, RunningStats]] = []
        self.shard: ShardStats | None = None
        self.complete = True
        """False once a read failed (the data's fault is listed; no comparison then)."""

    def start(self, local: int) -> None:
        """Sample ``local`` is next: a writer shard starts at every ``sample_rows``-th."""
        if local % self.per == 0:
            if self.shard is not None:
                self.parts.append(self.shard.finish())
            self.shard = ShardStats(self.sites, self.d)  # type: ignore[arg-type]

    def add(self, rows: dict[str, np.ndarray]) -> None:
        assert self.shard is not None
        self.shard.update(rows)  # type: ignore[arg-type]

    def finish(self) -> dict[Any, RunningStats]:
        if self.shard is not None:
            self.parts.append(self.shard.finish())
            self.shard = None
        if not self.parts:
            return {s: RunningStats(self.d) for s in self.sites}
        return {s: merge_all([p[s] for p in self.parts]) for s in self.sites}


def _verify_samples(
    store: StoreMeta, report: VerifyReport, progress: Any, fold: _StatisticsFold | None = None
) -> int:
    """Lengths against the full lengths, and every sample's chunks (each checked against
    its keyed digest) against the sample's content digest; ``fold`` recomputes the
    statistics from the same reads. Returns non-finite values."""
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
        if fold is not None:
            fold.start(local)
        h = xxhash.xxh3_128()
        n_read = 0
        for part, slab in slabs.items():
            for layer_idx in range(lay.n_layers):
                try:
                    n_read += store.read_rows(part, local, layer_idx, slab[layer_idx])
                except CorruptStoreError as err:
                    report.faults.append(str(err))
                    slab[layer_idx] = 0
                    if fold is not None:
                        fold.complete = False
            kept = int(store.lengths[part][local])
            if fold is not None and kept:
                fold.add({s: slab[k, :kept].astype("<f4") for k, s in enumerate(fold.sites)})
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
    """Each text file holds one record per sample, in order, each carrying the sample key
    the store records (``arrays/sample_key``); and the texts (with the stored token ids,
    where no token was cut) give those keys again, as the writer derived them."""
    n = store.layout.n_samples
    records: dict[str, list[dict[str, Any]]] = {}
    for part in PARTS:
        if not store.exists(TEXT_FILES[part]):
            continue
        report.files_checked += 1
        where = store.url_of(TEXT_FILES[part])
        # split on "\n" only: str.splitlines() also splits at U+2028/U+0085, which
        # json.dumps(ensure_ascii=False) leaves raw inside a record
        try:
            text = store.checks.read_bytes(TEXT_FILES[part]).decode("utf-8")
            lines = [load_json(x) for x in text.split("\n") if x.strip()]
            ids = [x.get("i") for x in lines]
        except (CorruptStoreError, UnicodeDecodeError, ValueError, AttributeError) as err:
            report.faults.append(f"{where} is unreadable: {err}")
            continue
        if ids != list(range(n)):
            report.faults.append(f"{where}: expected one record per sample, i = 0..{n - 1}")
            continue
        records[part] = lines
    if records:
        _verify_text_keys(store, records, report)


def _verify_text_keys(
    store: StoreMeta, records: dict[str, list[dict[str, Any]]], report: VerifyReport
) -> None:
    try:
        keys = store.array(SAMPLE_KEY)
    except CorruptStoreError as err:
        report.faults.append(str(err))
        return
    if keys is None:
        return
    stored = [bytes(k).decode("ascii", "replace") for k in keys]
    for part, lines in records.items():
        bad = [i for i, line in enumerate(lines) if line.get("sample_key") != stored[i]]
        if bad:
            report.faults.append(
                f"{store.url_of(TEXT_FILES[part])}: the sample_key of sample {bad[0]} "
                f"({len(bad)} record(s)) is not the one the store records in {SAMPLE_KEY}: "
                "the text file was edited; restore it or re-capture"
            )
    texts = {
        p: [line.get(p) if isinstance(line.get(p), str) else None for line in lines]
        for p, lines in records.items()
    }
    ids = _untruncated_ids(store)
    # which way the writer derived the keys (texts alone, or texts and token ids), told by
    # the samples whose texts give their keys; None for a store whose keys were given
    matched: list[set[str]] = []
    candidates: list[dict[str, str]] = []
    for i in range(len(stored)):
        prompt = texts["prompt"][i] if "prompt" in texts else None
        response = texts["response"][i] if "response" in texts else None
        cand = {"texts": sample_key(prompt=prompt, response=response)}
        both = ids[i] if ids is not None else None
        if both is not None:
            cand["texts+ids"] = sample_key(
                prompt=prompt, response=response, prompt_ids=both[0], response_ids=both[1]
            )
        candidates.append(cand)
        matched.append({mode for mode, key in cand.items() if key == stored[i]})
    modes = set().union(*matched) if matched else set()
    if not modes:
        report.notes.append(
            f"{store.location.url}: the sample keys are not derived from the texts (given by "
            "the capture), so the texts could not be checked against them"
        )
        return
    bad = [
        i
        for i, (cand, hit) in enumerate(zip(candidates, matched))
        if not hit and any(mode in cand for mode in modes)
    ]
    if bad:
        files = " / ".join(TEXT_FILES[p] for p in records)
        report.faults.append(
            f"{store.location.url}/{files}: the text of sample {bad[0]} ({len(bad)} sample(s)) "
            f"does not give the sample key the store records in {SAMPLE_KEY}: the text was "
            "edited or swapped; restore it or re-capture"
        )


def _untruncated_ids(store: StoreMeta) -> list[tuple[np.ndarray, np.ndarray] | None] | None:
    """Each sample's stored prompt and response token ids when none was cut (what the
    writer's sample key covers); None per sample that was cut, None for a store that keeps
    no token ids."""
    try:
        arrays = {p: store.array(TOKEN_IDS[p]) for p in PARTS}
        full = {p: store.array(FULL_LENGTHS[p]) for p in PARTS}
    except CorruptStoreError:
        return None  # listed by the other checks
    if any(a is None for a in arrays.values()) or any(f is None for f in full.values()):
        return None
    out: list[tuple[np.ndarray, np.ndarray] | None] = []
    for i in range(store.layout.n_samples):
        lengths = {p: int(store.lengths[p][i]) for p in PARTS}
        if any(int(full[p][i]) != lengths[p] for p in PARTS):  # type: ignore[index]
            out.append(None)
            continue
        p_ids, r_ids = (arrays[p][i, : lengths[p]] for p in PARTS)  # type: ignore[index]
        out.append((p_ids, r_ids))
    return out


def _verify_optional_arrays(store: StoreMeta, report: VerifyReport) -> None:
    for name in store.attrs.get("optional_arrays", []):
        path = OPTIONAL_ARRAYS[name][0]
        try:
            if store.array(path) is None:
                report.faults.append(f"{store.location.url} lacks {path} its attributes list")
        except CorruptStoreError as err:
            report.faults.append(str(err))


def verify_statistics(store: StoreMeta, report: VerifyReport) -> dict[str, RunningStats] | None:
    """The statistics file's shape against the store (a fault when it is malformed); the
    stored statistics per site, to compare with the data, or None."""
    path, lay = store.url_of(STATISTICS_FILE), store.layout
    if not store.exists(STATISTICS_FILE):
        report.faults.append(f"{path} is missing")
        return None
    rows = int(store.lengths["prompt"].sum()) + int(store.lengths["response"].sum())
    out = {}
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
            if stats.mean.shape != (stats.d,) or stats.m2.shape != (stats.d,):
                raise CorruptStoreError(f"{site} has vectors of the wrong length")
            out[site] = stats
    except (CorruptStoreError, KeyError, TypeError, AttributeError) as err:
        report.faults.append(f"{path} is malformed: {err}")
        return None
    # only a store actstore wrote (a root manifest) folds its statistics the writer's way
    return out if store.checks.manifest is not None else None
