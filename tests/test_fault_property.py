"""Damage any one file of a store of each format (a flipped byte, a truncation, or its bytes
swapped with another file of the same size, of the same store or of a store of the same
capture written with other values), then read it back every way there is: each read either
raises an :class:`ActstoreError` or returns exactly what the undamaged store returns, and
``verify()`` reports the damage (docs/reliability.md)."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from actstore.batch import Batch
from actstore.errors import ActstoreError
from actstore.formats import open_store
from actstore.loader import ActivationLoader
from actstore.testing import make_acts, make_batches, make_plan


class _Refused:
    def __repr__(self) -> str:
        return "REFUSED"


#: What a read path gave when it refused the store (raised an ActstoreError).
REFUSED = _Refused()

# ---------------------------------------------------------------------------- the stores


def _saev(out: Path, seed: int) -> Path:
    from test_saev_store import make_acts as saev_acts
    from test_saev_store import write_store

    return Path(write_store(out, saev_acts(seed=seed)))


def _zarr(out: Path, seed: int) -> Path:
    from test_zarr_store import P_FULL, R_FULL, SITES, H, N, make_writer

    writer = make_writer(out / "activations.zarr")
    for lo in range(0, N, 3):
        ids = np.arange(lo, min(N, lo + 3))
        width = int(max(P_FULL[ids] + R_FULL[ids]))
        acts = np.zeros((len(ids), len(SITES), width, H), dtype=np.float32)
        tokens = np.full((len(ids), width), 99, dtype=np.int32)
        for b, i in enumerate(ids.tolist()):
            n = int(P_FULL[i] + R_FULL[i])
            rng = np.random.default_rng((seed, i))
            acts[b, :, :n] = rng.standard_normal((len(SITES), n, H)).astype(np.float32)
            tokens[b, :n] = np.arange(n) + 10 * i
        writer.write(
            Batch(
                acts={s: torch.from_numpy(acts[:, k].copy()) for k, s in enumerate(SITES)},
                example_ids=ids,
                token_ids=tokens,
                extras={
                    "prompt_len": P_FULL[ids],
                    "response_len": R_FULL[ids],
                    "prompt_text": [f"prompt {i}" for i in ids],
                    "response_text": [f"response {i}" for i in ids],
                    "hallu_label": (ids % 2).astype(np.int8),
                },
            )
        )
    return Path(writer.close())


def _pickle(out: Path, seed: int) -> Path:
    from actstore.formats.pickle import PickleOptions, PickleWriter

    plan = make_plan()
    writer = PickleWriter(plan, out / "acts", PickleOptions(samples_per_shard=5))
    for batch in make_batches(plan, make_acts(plan, seed)):
        writer.write(batch)
    return Path(writer.close())


def _activault(out: Path, seed: int) -> Path:
    from test_activault_s3 import make_run_data, write_run

    plan, acts = make_run_data(seed=seed)
    return Path(write_run(str(out / "run"), plan, acts, rows_per_file=4))


def _saelens(out: Path, seed: int) -> Path:
    from actstore.formats.saelens import SaelensOptions, SaelensWriter

    plan = make_plan()
    options = SaelensOptions(examples_per_shard=10, block_kb=1)
    writer = SaelensWriter.from_plan(plan, out / "acts", options)
    for batch in make_batches(plan, make_acts(plan, seed)):
        writer.write(batch)
    return Path(writer.close())


BUILDERS: dict[str, Callable[[Path, int], Path]] = {
    "saev": _saev,
    "zarr": _zarr,
    "pickle": _pickle,
    "activault": _activault,
    "saelens": _saelens,
}


def _files(store: Path) -> dict[str, int]:
    """Every file of ``store`` (relative name -> size)."""
    return {
        p.relative_to(store).as_posix(): p.stat().st_size
        for p in sorted(store.rglob("*"))
        if p.is_file()
    }


def _is_data(fmt: str, name: str) -> bool:
    return {
        "saev": name.startswith("acts"),
        "zarr": name.startswith("arrays/") and "_activations/" in name,
        "pickle": name.startswith("shard_"),
        "activault": name.endswith(".pt"),
        "saelens": name.endswith(".arrow"),
    }[fmt] and not name.endswith((".zarray", ".zattrs"))


def writable_copy(store: Path, dest: Path) -> Path:
    shutil.copytree(store, dest, symlinks=True)
    for p in [dest, *dest.rglob("*")]:
        p.chmod(p.stat().st_mode | stat.S_IWUSR)
    return dest


# ---------------------------------------------------------------------------- every read


def _attempt(read: Callable[[], Any]) -> Any:
    """What ``read`` returns, or REFUSED if it raises an actstore error (anything else
    escapes: a damaged store must never surface as an unwrapped numpy/pickle/OS error)."""
    try:
        return read()
    except ActstoreError:
        return REFUSED


def _stats(reader, site) -> Any:
    st_ = reader.statistics(site)
    if st_ is None:
        return None
    return (int(st_.count), st_.mean.copy(), st_.var.copy(), float(st_.norm_mean))


def _blocks(reader, site) -> np.ndarray:
    return np.concatenate([reader.read_block(b).copy() for b in reader.blocks(site)])


def _loader(reader, site) -> np.ndarray:
    """One epoch's rows put back in storage order (each row must come exactly once)."""
    loader = ActivationLoader(reader, site=site, batch_size=7, io_threads=2, return_index=True)
    acts, rows = [], []
    for batch in loader:
        acts.append(batch.acts.numpy().copy())
        rows.append(batch.rows.numpy().copy())
    rows_ = np.concatenate(rows)
    out = np.full((len(rows_), reader.d_model), np.nan, dtype=np.float32)
    assert sorted(rows_.tolist()) == list(range(len(rows_))), "a row served twice or missed"
    out[rows_] = np.concatenate(acts)
    return out


def _random_access(reader, fmt: str) -> Any:
    if fmt == "activault":  # one megabatch file of each hook at a time
        return [
            {k: v.clone() for k, v in reader.megabatch(site, i).items()}
            for site in reader.sites
            for i in range(len(reader.data_files(site)))
        ]
    everything = np.asarray(reader[:]).copy()
    picked = np.asarray(reader[[3, 0, 7], reader.sites[-1]]).copy()
    return everything, picked


def _tokens(reader) -> Any:
    tokens = reader.tokens
    if tokens is None:
        return None
    if isinstance(tokens, np.ndarray):
        return tokens.copy()
    return np.asarray(tokens[:]).copy(), np.asarray(tokens[[2, 0, 2]]).copy()


def observe(location: Path, fmt: str) -> dict[str, Any]:
    """What every read path of the store at ``location`` returns (REFUSED where it refused)."""
    try:
        reader = open_store(location)
    except ActstoreError:
        return {"open": REFUSED}
    seen: dict[str, Any] = {"open": True}
    try:
        for site in reader.sites:
            seen[f"blocks {site}"] = _attempt(lambda site=site: _blocks(reader, site))
            seen[f"loader {site}"] = _attempt(lambda site=site: _loader(reader, site))
            seen[f"statistics {site}"] = _attempt(lambda site=site: _stats(reader, site))
        seen["random access"] = _attempt(lambda: _random_access(reader, fmt))
        if fmt == "saev":
            rows = np.array([[5, 0, 137], [3, 3, 60]])
            for site in reader.sites:
                seen[f"gather {site}"] = _attempt(
                    lambda site=site: reader.gather(rows, site).copy()
                )
        if fmt == "zarr":
            seen["text"] = _attempt(
                lambda: [reader.text(i, part) for i in (0, 7) for part in ("prompt", "response")]
            )
        if hasattr(type(reader), "tokens"):
            seen["tokens"] = _attempt(lambda: _tokens(reader))
    finally:
        reader.close()
    return seen


#: Formats whose verify() may raise (instead of reporting a fault) on some damage: none.
VERIFY_MAY_RAISE: dict[str, tuple[type[BaseException], ...]] = {}


def verify_ok(location: Path, fmt: str) -> bool:
    """``verify()``'s verdict, with the reader opened unchecked when a checked open refuses
    (what ``actstore verify`` does); a store not even that opens is not ok."""
    try:
        reader = open_store(location)
    except ActstoreError:
        try:
            reader = open_store(location, verify_reads=False)
        except ActstoreError:
            return False
    try:
        return reader.verify().ok
    except VERIFY_MAY_RAISE.get(fmt, ()):
        return False
    finally:
        reader.close()


def _refused(seen: dict[str, Any]) -> list[str]:
    return [path for path, got in seen.items() if got is REFUSED]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return (
            isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
        )
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


# ---------------------------------------------------------------------------- the property


class Built:
    """A store, a store of the same capture with other values, and what reads return."""

    def __init__(self, fmt: str, store: Path, other: Path) -> None:
        self.fmt, self.store, self.other = fmt, store, other
        self.files, self.other_files = _files(store), _files(other)
        self.reference = observe(store, fmt)
        #: files of activation values (the rest is metadata, statistics, tokens, manifest)
        self.data_files = {n for n in self.files if _is_data(fmt, n)}

    def __repr__(self) -> str:
        return f"Built({self.fmt}: {self.store})"


@pytest.fixture(scope="module", params=list(BUILDERS))
def built(request, tmp_path_factory) -> Built:
    fmt = request.param
    store = BUILDERS[fmt](tmp_path_factory.mktemp(f"{fmt}-a"), 0)
    other = BUILDERS[fmt](tmp_path_factory.mktemp(f"{fmt}-b"), 1)
    b = Built(fmt, store, other)
    assert not _refused(b.reference) and verify_ok(store, fmt)
    return b


def damage(b: Built, copy: Path, draw) -> None:
    """Damage one file of ``copy``: flip a byte, truncate it, or swap its bytes."""
    names = sorted(n for n, size in b.files.items() if size)
    name = draw(st.sampled_from(names), label="file")
    path = copy / name
    data = path.read_bytes()
    size = len(data)
    partners = [("same store", n) for n, s in b.files.items() if s == size and n != name]
    partners += [("other store", n) for n, s in b.other_files.items() if s == size]
    kinds = ["flip", "truncate"] + (["swap"] if partners else [])
    kind = draw(st.sampled_from(kinds), label="kind")
    event(f"{kind} {'data' if name in b.data_files else 'metadata'}")
    if kind == "flip":
        offset = draw(st.integers(0, size - 1), label="offset")
        out = bytearray(data)
        out[offset] ^= draw(st.integers(1, 255), label="xor")
        path.write_bytes(bytes(out))
    elif kind == "truncate":
        os.truncate(path, draw(st.integers(0, size - 1), label="length"))
    else:
        where, partner = draw(st.sampled_from(partners), label="partner")
        if where == "same store":
            path.write_bytes((copy / partner).read_bytes())
            (copy / partner).write_bytes(data)
        else:
            path.write_bytes((b.other / partner).read_bytes())


def changed(b: Built, copy: Path) -> bool:
    """Whether the damage changed the store's content: any byte of any file, the root
    manifest's included (a whitespace-only change of it, its final newline cut off or a
    space flipped into a tab, reads the same but is a change ``verify`` reports)."""
    return any((b.store / name).read_bytes() != (copy / name).read_bytes() for name in b.files)


#: Examples per format (raise it to hunt: ACTSTORE_FAULT_EXAMPLES=2000 pytest ...).
EXAMPLES = int(os.environ.get("ACTSTORE_FAULT_EXAMPLES", "25"))


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_any_damage_is_refused_or_harmless_on_every_read_path(built, data):
    with tempfile.TemporaryDirectory(prefix=f"fault-{built.fmt}-") as tmp:
        copy = writable_copy(built.store, Path(tmp) / built.store.name)
        damage(built, copy, data.draw)
        seen = observe(copy, built.fmt)
        refused = _refused(seen)
        event("refused at open" if refused == ["open"] else f"{len(refused)} paths refused")
        for path, got in seen.items():
            if got is REFUSED:
                continue
            assert path in built.reference, f"{path} read from a store that has none"
            assert _same(built.reference[path], got), f"{path} served other values"
        if seen["open"] is not REFUSED:
            assert seen.keys() == built.reference.keys()
        if changed(built, copy):
            assert not verify_ok(copy, built.fmt), "verify() passed a damaged store"
        else:  # nothing changed (same bytes swapped in): nothing may be refused either
            assert not refused and verify_ok(copy, built.fmt)


# ---------------------------------------------------------------------------- found here


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_activault_verify_reports_a_damaged_statistics_file(tmp_path, how):
    """verify() once raised the CorruptStoreError of a damaged hook statistics.json (read to
    compare with the data) instead of listing it with the other faults."""
    run = writable_copy(_activault(tmp_path / "built", 0), tmp_path / "run")
    stats = run / "models.layers.1.post" / "statistics.json"
    if how == "flip":
        _flip_byte(stats, 0, 0x01)
    else:
        os.truncate(stats, 1)
    reader = open_store(run, verify_reads=False)
    faults = reader.verify().faults
    assert any("models.layers.1.post/statistics.json" in f for f in faults), faults


# ---------------------------------------------------------------------------- known bugs


@pytest.fixture
def zarr_copy(tmp_path) -> Path:
    return writable_copy(_zarr(tmp_path / "built", 0), tmp_path / "activations.zarr")


def _flip_byte(path: Path, offset: int, xor: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= xor
    path.write_bytes(bytes(data))


def test_zarr_verify_reports_a_damaged_digest_array_instead_of_raising(zarr_copy):
    _flip_byte(zarr_copy / "arrays" / "content_xxh128" / "0", 5, 0x01)
    reader = open_store(zarr_copy)
    report = reader.verify()
    assert any("content_xxh128/0" in f for f in report.faults)


def test_zarr_verify_reports_a_damaged_text_file_instead_of_raising(zarr_copy):
    _flip_byte(zarr_copy / "text" / "prompts.jsonl", 0, 0x80)
    reader = open_store(zarr_copy)
    report = reader.verify()
    assert any("prompts.jsonl" in f for f in report.faults)
