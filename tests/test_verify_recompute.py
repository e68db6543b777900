"""``actstore verify`` recomputes what it can from the data and compares (issue 30, item 10).

Each case edits a store the way the careless tool or the attacker without the HMAC key
would: files edited, then the root manifest rewritten over them (:func:`resign`), so every
size and digest matches again. ``verify`` must still exit 1 with a ``FAULT:`` line, from
what it recomputes: statistics from the stored values (exactly: the writer folds them in a
fixed order, so one changed digit is a fault), per-site statistics in the right place,
zarr's texts against the sample keys the store records, and Activault's ``cfg.json``
against its commit record and its files. A file replaced by a symlink inside the store,
and a whitespace-only change of the manifest, are faults too (exit 1, never 2).
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from test_fault_property import BUILDERS, writable_copy

from actstore.storage.manifest import MANIFEST
from actstore.testing import resign


def actstore(*args: str, capsys) -> tuple[int, str]:
    """The real command (``actstore.cli.main``) in this process: exit code and stderr."""
    from actstore.cli import main

    capsys.readouterr()
    argv, sys.argv = sys.argv, ["actstore", *args]
    try:
        main()
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    finally:
        sys.argv = argv
    return code, capsys.readouterr().err


def faults_of(code: int, err: str) -> list[str]:
    assert "Traceback" not in err, err
    assert code == 1, f"exit {code}, expected 1 (a fault):\n{err}"
    faults = [line for line in err.splitlines() if line.startswith("FAULT: ")]
    assert faults, err
    return faults


def verify_faults(store: Path, capsys) -> list[str]:
    return faults_of(*actstore("verify", str(store), "--no-progress", capsys=capsys))


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Callable[[str], Path]:
    """Each format's store, written once (when a case first asks for it)."""
    stores: dict[str, Path] = {}

    def get(fmt: str) -> Path:
        if fmt not in stores:
            stores[fmt] = BUILDERS[fmt](tmp_path_factory.mktemp(f"r-{fmt}"), 0)
        return stores[fmt]

    return get


@pytest.fixture
def copy_of(built, tmp_path) -> Callable[[str], Path]:
    def copy(fmt: str) -> Path:
        return writable_copy(built(fmt), tmp_path / built(fmt).name)

    return copy


@pytest.mark.parametrize("fmt", list(BUILDERS))
def test_the_untouched_stores_verify(built, capsys, fmt):
    """The stores the cases edit pass: every fault below is the edit's."""
    code, err = actstore("verify", str(built(fmt)), "--no-progress", capsys=capsys)
    assert code == 0 and "FAULT" not in err, err


# ---------------------------------------------------------------------------- statistics

#: The file holding each format's statistics, and the words that open its per-site means.
STATISTICS = {
    "saev": ("statistics.json", '"mean": ['),
    "zarr": ("meta/statistics.json", '"mean": ['),
    "saelens": ("statistics.json", '"mean": ['),
    "pickle": ("metadata.json", '"mean": ['),
    "activault": ("models.layers.1.post/statistics.json", '"mean": ['),
}

NUMBER = re.compile(rb"-?\d+\.\d+(?:e-?\d+)?")


def _edit_one_digit(path: Path, anchor: str, *, late: bool) -> None:
    """One digit of one mean value changed in place (same size): an early digit, or one
    of the last a float64 repr holds (a relative change of about 1e-15)."""
    data = bytearray(path.read_bytes())
    start = data.index(anchor.encode())
    for found in NUMBER.finditer(bytes(data), start):
        text = found.group()
        mantissa = text.split(b"e")[0]
        digits = [i for i, c in enumerate(mantissa) if chr(c).isdigit()]
        significant = [i for i in digits if mantissa[i] != ord("0") or i > digits[0] + 1]
        if len(significant) < 14:
            continue  # a short number (Activault's position means): the next one
        i = significant[-3] if late else significant[1]
        at = found.start() + i
        data[at] = ord("0") + (data[at] - ord("0") + 3) % 10
        path.write_bytes(bytes(data))
        return
    raise AssertionError(f"no long number after {anchor!r} in {path}")


@pytest.mark.parametrize("late", [False, True], ids=["early-digit", "late-digit"])
@pytest.mark.parametrize("fmt", list(STATISTICS))
def test_a_same_size_edit_of_one_statistics_value_fails_verify(copy_of, capsys, fmt, late):
    store = copy_of(fmt)
    name, anchor = STATISTICS[fmt]
    before = (store / name).stat().st_size
    _edit_one_digit(store / name, anchor, late=late)
    assert (store / name).stat().st_size == before
    resign(store)
    faults = verify_faults(store, capsys)
    assert any("statistics" in f and "do not match the data" in f for f in faults), faults


#: A value the statistics files keep beside the exact ones, derived from them (the variance;
#: Activault's standard deviation): edited alone, it must fail too.
DERIVED = {
    fmt: (name, '"std": [' if fmt == "activault" else '"var": [')
    for fmt, (name, _) in STATISTICS.items()
}


@pytest.mark.parametrize("fmt", list(DERIVED))
def test_a_same_size_edit_of_a_derived_statistics_value_fails_verify(copy_of, capsys, fmt):
    store = copy_of(fmt)
    name, anchor = DERIVED[fmt]
    _edit_one_digit(store / name, anchor, late=False)
    resign(store)
    faults = verify_faults(store, capsys)
    assert any("statistics" in f and "do not match the data" in f for f in faults), faults


def _swap_sites(doc: dict) -> None:
    sites = doc["sites"]
    a, b = list(sites)[:2]
    sites[a], sites[b] = sites[b], sites[a]


def _swap_pickle_layers(doc: dict) -> None:
    stats = doc["statistics"]["activation_statistics"]
    a, b = list(stats)[:2]
    stats[a], stats[b] = stats[b], stats[a]


def _rewrite_json(path: Path, edit: Callable[[dict], None]) -> None:
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


def _swap_files(a: Path, b: Path) -> None:
    data = a.read_bytes()
    a.write_bytes(b.read_bytes())
    b.write_bytes(data)


SWAP_STATISTICS: dict[str, Callable[[Path], None]] = {
    "saev": lambda s: _rewrite_json(s / "statistics.json", _swap_sites),
    "zarr": lambda s: _rewrite_json(s / "meta/statistics.json", _swap_sites),
    "saelens": lambda s: _rewrite_json(s / "statistics.json", _swap_sites),
    "pickle": lambda s: _rewrite_json(s / "metadata.json", _swap_pickle_layers),
    "activault": lambda s: _swap_files(
        s / "models.layers.1.post/statistics.json", s / "models.layers.2.mlp.post/statistics.json"
    ),
}


@pytest.mark.parametrize("fmt", list(SWAP_STATISTICS))
def test_per_site_statistics_swapped_fail_verify(copy_of, capsys, fmt):
    store = copy_of(fmt)
    SWAP_STATISTICS[fmt](store)
    resign(store)
    faults = verify_faults(store, capsys)
    assert any("statistics" in f and "do not match the data" in f for f in faults), faults


# ---------------------------------------------------------------------------- zarr texts


def _edit_line(path: Path, index: int, edit: Callable[[dict], None]) -> None:
    lines = path.read_text().split("\n")
    record = json.loads(lines[index])
    edit(record)
    lines[index] = json.dumps(record, ensure_ascii=False)
    path.write_text("\n".join(lines))


ZARR_TEXT_EDITS: dict[str, Callable[[Path], None]] = {
    "prompt text": lambda s: _edit_line(
        s / "text/prompts.jsonl", 3, lambda r: r.update(prompt="prompt 9")
    ),
    "response text": lambda s: _edit_line(
        s / "text/responses.jsonl", 0, lambda r: r.update(response="an edited response")
    ),
    "two prompts swapped, keys kept": lambda s: (
        _edit_line(s / "text/prompts.jsonl", 1, lambda r: r.update(prompt="prompt 2")),
        _edit_line(s / "text/prompts.jsonl", 2, lambda r: r.update(prompt="prompt 1")),
    ),
    "a record's sample key": lambda s: _edit_line(
        s / "text/prompts.jsonl", 4, lambda r: r.update(sample_key="0" * 64)
    ),
}


@pytest.mark.parametrize("edit", list(ZARR_TEXT_EDITS))
def test_an_edited_zarr_text_fails_verify(copy_of, capsys, edit):
    store = copy_of("zarr")
    ZARR_TEXT_EDITS[edit](store)
    resign(store)
    faults = verify_faults(store, capsys)
    assert any(".jsonl" in f and "sample" in f for f in faults), faults


# ---------------------------------------------------------------------------- Activault


def _swap_dirs(a: Path, b: Path) -> None:
    tmp = a.with_name(a.name + ".swap")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


def _edit_cfg(store: Path, edit: Callable[[dict], None]) -> None:
    _rewrite_json(store / "cfg.json", edit)


def _drop_digests_and_reverse_hooks(cfg: dict) -> None:
    record = cfg["actstore"]
    record.pop("digests")
    record["hooks"] = dict(reversed(list(record["hooks"].items())))
    cfg["upload_config"]["hooks"] = list(record["hooks"])


ACTIVAULT_EDITS: dict[str, Callable[[Path], None]] = {
    # layer 2's folder served as resid.1 and the other way round
    "hook folders swapped": lambda s: _swap_dirs(
        s / "models.layers.1.post", s / "models.layers.2.mlp.post"
    ),
    "digests removed, hooks reversed": lambda s: _edit_cfg(s, _drop_digests_and_reverse_hooks),
    "digests removed, hook folders swapped": lambda s: (
        _edit_cfg(s, lambda c: c["actstore"].pop("digests")),
        _swap_dirs(s / "models.layers.1.post", s / "models.layers.2.mlp.post"),
    ),
    "one file's digest in cfg.json": lambda s: _edit_cfg(
        s,
        lambda c: c["actstore"]["digests"]["models.layers.1.post"].__setitem__(0, "0" * 16),
    ),
    "a hook mapped to another site": lambda s: _edit_cfg(
        s, lambda c: c["actstore"]["hooks"].update({"models.layers.1.post": "resid.5"})
    ),
    "cfg.json's own totals": lambda s: _edit_cfg(s, lambda c: c.update(n_total_files=2)),
    "cfg.json's hook list": lambda s: _edit_cfg(
        s, lambda c: c["upload_config"].update(hooks=c["upload_config"]["hooks"][::-1])
    ),
}


@pytest.mark.parametrize("edit", list(ACTIVAULT_EDITS))
def test_activault_cfg_json_is_checked_against_its_record_and_files(copy_of, capsys, edit):
    store = copy_of("activault")
    ACTIVAULT_EDITS[edit](store)
    resign(store)
    verify_faults(store, capsys)


# ---------------------------------------------------------------------------- symlinks

#: A file of each store, and another of the same store to point it at.
LINKED = {
    "saev": ("acts000001.bin", "acts000000.bin"),
    "zarr": ("arrays/hallu_label/1", "arrays/hallu_label/0"),
    "pickle": ("shard_0002.pkl.gz", "shard_0001.pkl.gz"),
    "saelens": ("dataset_info.json", "state.json"),
    "activault": ("models.layers.1.post/metadata.json", "models.layers.2.mlp.post/metadata.json"),
}


def _link_to_sibling(store: Path, fmt: str) -> str:
    name, target = LINKED[fmt]
    path = store / name
    path.unlink()
    path.symlink_to(os.path.relpath(store / target, path.parent))
    return name


def _link_to_own_copy(store: Path, fmt: str) -> str:
    """The file moved beside itself (still inside the store) and symlinked there."""
    name, _ = LINKED[fmt]
    path = store / name
    moved = path.with_name("." + path.name + ".orig")
    path.rename(moved)
    path.symlink_to(moved.name)
    return name


@pytest.mark.parametrize("link", [_link_to_sibling, _link_to_own_copy], ids=["sibling", "own"])
@pytest.mark.parametrize("fmt", list(LINKED))
def test_a_file_replaced_by_a_symlink_inside_the_store_is_a_fault(
    copy_of, tmp_path, capsys, fmt, link
):
    store = copy_of(fmt)
    name = link(store, fmt)
    faults = verify_faults(store, capsys)
    assert any(Path(name).name in f and "symlink" in f for f in faults), faults
    code, err = actstore("cp", str(store), str(tmp_path / "copy"), "--no-progress", capsys=capsys)
    faults = faults_of(code, err)
    assert any("symlink" in f for f in faults), faults


# ---------------------------------------------------------------------------- the manifest

WHITESPACE: dict[str, Callable[[bytes], bytes]] = {
    "final newline cut": lambda b: b[:-1],
    "a space added": lambda b: b.replace(b": ", b":  ", 1),
    "a space made a tab": lambda b: b.replace(b"\n ", b"\n\t", 1),
    "reindented": lambda b: (json.dumps(json.loads(b), indent=4, sort_keys=True) + "\n").encode(),
}


@pytest.mark.parametrize("fmt", list(BUILDERS))
@pytest.mark.parametrize("edit", list(WHITESPACE))
def test_a_whitespace_only_change_to_the_manifest_fails_verify(copy_of, capsys, fmt, edit):
    store = copy_of(fmt)
    path = store / MANIFEST
    before = path.read_bytes()
    path.chmod(0o644)
    path.write_bytes(WHITESPACE[edit](before))
    assert path.read_bytes() != before and json.loads(path.read_bytes()) == json.loads(before)
    faults = verify_faults(store, capsys)
    assert any(MANIFEST in f for f in faults), faults


# ---------------------------------------------------------------------------- the record

#: An edit of what the metadata says the store was captured from (model, dataset...), in
#: the file that holds each format's capture record.
RECORD_EDITS: dict[str, Callable[[Path], None]] = {
    "saev": lambda s: _rewrite_json(s / "metadata.json", lambda d: d.update(ckpt="other-model")),
    "saelens": lambda s: _rewrite_json(
        s / "actstore.json", lambda d: d["plan"].update(ckpt="other-model")
    ),
    "pickle": lambda s: _rewrite_json(
        s / "metadata.json", lambda d: d["extraction_config"].update(model_name="other-model")
    ),
    "activault": lambda s: _edit_cfg(s, lambda c: c["actstore"]["plan"].update(ckpt="other")),
}


@pytest.mark.parametrize("fmt", list(RECORD_EDITS))
def test_the_capture_record_the_metadata_holds_is_the_published_one(copy_of, capsys, fmt):
    store = copy_of(fmt)
    RECORD_EDITS[fmt](store)
    resign(store)
    verify_faults(store, capsys)
