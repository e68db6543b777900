"""Hostile or damaged metadata in every format (issue 38, items 5-8): a FAULT line, never a
traceback.

Every JSON and metadata file of a store is parsed by one bounded parser
(:func:`actstore.storage.local.load_json`: depth, number size, length), and every field of
metadata that describes the data is checked against the data or against what the root
manifest publishes. So deep nesting, a 5,000-digit number, a non-ASCII signature, or a
metadata field edited with the manifest rewritten over it (:func:`resign`, what a tool or an
attacker without ``ACTSTORE_MANIFEST_KEY`` can do) end as ``FAULT:`` lines of ``actstore
verify`` (exit 1), one ``error:`` line of ``actstore inspect`` (exit 2) and an
:class:`ActstoreError` from :func:`open_store`.

The fuzz test at the end edits every JSON and metadata file of every format (the whole file,
and each field, with hostile values, nesting, sizes and types), with and without a rewritten
manifest, and reads the store back every way; it lists, in :data:`GETS_PAST`, exactly the
fields a rewrite without a key can still change unnoticed (docs/reliability.md lists them).
"""

from __future__ import annotations

import json
import sys
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_fault_property import BUILDERS, writable_copy

from actstore.errors import ActstoreError
from actstore.formats import open_store
from actstore.storage.manifest import KEY_ENV, MANIFEST
from actstore.testing import resign


def actstore(*args: str, capsys) -> tuple[int, str]:
    """The real command (``actstore.cli.main``) in this process: exit code and stderr. An
    exception escaping ``main`` (a traceback) fails the test."""
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


def verify_faults(store: Path, capsys) -> list[str]:
    code, err = actstore("verify", str(store), "--no-progress", capsys=capsys)
    assert "Traceback" not in err, err
    assert code == 1, f"verify exit {code}, expected 1 (a fault):\n{err}"
    faults = [line for line in err.splitlines() if line.startswith("FAULT: ")]
    assert faults, err
    return faults


def inspect_error(store: Path, capsys) -> str:
    code, err = actstore("inspect", str(store), capsys=capsys)
    assert "Traceback" not in err, err
    assert code == 2, f"inspect exit {code}, expected 2:\n{err}"
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def refused_at_open(store: Path) -> None:
    with pytest.raises(ActstoreError):
        open_store(store).close()


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Callable[[str], Path]:
    """Each format's store, written once (when a case first asks for it)."""
    stores: dict[str, Path] = {}

    def get(fmt: str) -> Path:
        if fmt not in stores:
            stores[fmt] = BUILDERS[fmt](tmp_path_factory.mktemp(f"h-{fmt}"), 0)
        return stores[fmt]

    return get


@pytest.fixture
def copy_of(built, tmp_path) -> Callable[[str], Path]:
    def copy(fmt: str) -> Path:
        return writable_copy(built(fmt), tmp_path / built(fmt).name)

    return copy


#: Each format's index: the metadata file its reader parses first.
INDEX = {
    "saev": "metadata.json",
    "zarr": ".zmetadata",
    "pickle": "metadata.json",
    "activault": "cfg.json",
    "saelens": "state.json",
}

DEEP = b"[" * 100_000 + b"]" * 100_000
BIG_NUMBER = b'{"n": ' + b"7" * 5000 + b"}"


# ---------------------------------------------------------------------------- item 5


@pytest.mark.parametrize("hostile", ["deep", "5000-digit"])
@pytest.mark.parametrize(
    ("what", "rewritten"),
    [("manifest", False), ("index", False), ("index", True)],
    ids=["manifest", "index", "index-manifest-rewritten"],
)
@pytest.mark.parametrize("fmt", list(BUILDERS))
def test_deep_nesting_or_a_huge_number_is_a_fault_not_a_traceback(
    copy_of, capsys, fmt, what, rewritten, hostile
):
    """100k brackets or a 5,000-digit integer in the root manifest or the format's index
    (as it is, or with the manifest rewritten over it): verify lists a FAULT (exit 1),
    inspect says one line (exit 2), open_store raises an actstore error (was: a
    RecursionError or "ValueError: Exceeds the limit (4300 digits)" traceback)."""
    store = copy_of(fmt)
    name = MANIFEST if what == "manifest" else INDEX[fmt]
    (store / name).write_bytes(DEEP if hostile == "deep" else BIG_NUMBER)
    if rewritten:
        resign(store)
    faults = verify_faults(store, capsys)
    assert any(name in f for f in faults), faults
    assert name in inspect_error(store, capsys)
    refused_at_open(store)


def test_the_bounded_parser_names_each_bound(monkeypatch):
    """Depth, digits and length each have their own message; brackets and digits inside
    strings are text (a prompt may hold them)."""
    from actstore.storage import local

    text = json.dumps({"prompt": "[" * 500 + "9" * 500})
    assert local.load_json(text)["prompt"].startswith("[[[")
    with pytest.raises(ValueError, match="nested more than 64 levels"):
        local.load_json(b"[" * 65 + b"]" * 65)
    assert local.load_json(b"[" * 64 + b"]" * 64) is not None  # at the bound: parsed
    with pytest.raises(ValueError, match="more than 64 digits"):
        local.load_json(b"[1.0, -" + b"1" * 65 + b"]")
    monkeypatch.setattr(local, "JSON_MAX_BYTES", 100)
    with pytest.raises(ValueError, match="more than the 100"):
        local.load_json(b" " * 101 + b"{}")


# ---------------------------------------------------------------------------- item 6


@pytest.mark.parametrize("fmt", ["saev", "saelens"])
def test_a_non_ascii_signature_is_refused_in_one_line(copy_of, capsys, monkeypatch, fmt):
    """With ACTSTORE_MANIFEST_KEY set, a manifest whose "hmac" is a non-ASCII string (or not
    a string) is refused as unsigned (was: TypeError from hmac.compare_digest)."""
    store = copy_of(fmt)
    path = store / MANIFEST
    doc = json.loads(path.read_text())
    monkeypatch.setenv(KEY_ENV, "our key")
    for signature in ["\u00e9" * 64, 12345, ["x"]]:
        doc["hmac"] = signature
        path.write_text(json.dumps(doc, indent=1))
        faults = verify_faults(store, capsys)
        assert any("is not signed with the key" in f for f in faults), faults
        assert "is not signed with the key" in inspect_error(store, capsys)
        refused_at_open(store)


def test_an_empty_manifest_key_is_refused_not_read_as_no_key(copy_of, capsys, monkeypatch):
    """ACTSTORE_MANIFEST_KEY="" used to turn signature checks off without a word: now every
    command refuses it in one line (exit 2), before reading or writing anything."""
    store = copy_of("saev")
    monkeypatch.setenv(KEY_ENV, "")
    for command in (["verify", str(store), "--no-progress"], ["inspect", str(store)]):
        code, err = actstore(*command, capsys=capsys)
        assert code == 2 and "Traceback" not in err, err
        assert err.strip().splitlines() == [err.strip()] and "set but empty" in err, err
    with pytest.raises(ActstoreError, match="set but empty"):
        open_store(store)


# ---------------------------------------------------------------------------- item 8


def _edit_json(path: Path, edit: Callable[[Any], None]) -> None:
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc, indent=2))


def _num_tokens_plus_one(doc: Any) -> None:
    doc["shards"][0]["num_tokens"] += 1


def _classes_one(doc: Any) -> None:
    doc["extraction_config"]["actstore"]["classes"] = 1


@pytest.mark.parametrize(
    ("edit", "says"),
    [(_num_tokens_plus_one, "declares 31 tokens"), (_classes_one, "classes must be a list")],
    ids=["num_tokens+1", "classes=1"],
)
def test_pkl_gz_metadata_edits_are_faults_not_tracebacks(copy_of, capsys, edit, says):
    """pkl.gz metadata.json with a shard's num_tokens + 1, or classes = 1, the manifest
    rewritten over it: a FAULT line (was: a ValueError/TypeError traceback from verify and
    inspect)."""
    store = copy_of("pickle")
    _edit_json(store / "metadata.json", edit)
    resign(store)
    faults = verify_faults(store, capsys)
    assert any(says in f for f in faults), faults
    assert says in inspect_error(store, capsys)
    refused_at_open(store)


def _feature_shape(doc: Any) -> None:
    doc["features"]["blocks.1.hook_resid_post"]["shape"] = [6, 9]


def _token_length(doc: Any) -> None:
    doc["features"]["token_ids"]["length"] = 5


@pytest.mark.parametrize("edit", [_feature_shape, _token_length], ids=["shape", "token_ids.length"])
def test_saelens_feature_edits_are_faults_not_usage_errors(copy_of, capsys, edit):
    """A SAELens dataset_info.json feature edited (an activation column's shape: was exit 2,
    "columns differ", a usage error; token_ids' length: passed verify), manifest rewritten:
    the features are what actstore.json's layout gives, so it is a FAULT (exit 1)."""
    store = copy_of("saelens")
    _edit_json(store / "dataset_info.json", edit)
    resign(store)
    faults = verify_faults(store, capsys)
    assert any("dataset_info.json: its features" in f for f in faults), faults
    assert "dataset_info.json" in inspect_error(store, capsys)
    refused_at_open(store)


# ---------------------------------------------------------------------------- item 7

HOOK = "models.layers.1.post"


@pytest.mark.parametrize("field", ["d_in", "sequence_length", "batch_size"])
def test_activault_hook_metadata_fields_are_checked_against_the_files(copy_of, capsys, field):
    """An Activault hook's metadata.json with d_in or sequence_length edited (the shape its
    reader uses left alone), manifest rewritten: was passed by verify; now each field must
    be what actstore writes for the files' shape and cfg.json's commit record."""
    store = copy_of("activault")
    _edit_json(store / HOOK / "metadata.json", lambda doc: doc.update({field: doc[field] + 1}))
    resign(store)
    faults = verify_faults(store, capsys)
    assert any(field in f and "metadata.json" in f for f in faults), faults
    assert "metadata.json" in inspect_error(store, capsys)
    refused_at_open(store)


def test_activault_statistics_replaced_by_nothing_is_a_fault_not_none(copy_of, capsys):
    """statistics.json replaced by {} (no count, as Activault's own files), manifest
    rewritten: was passed by verify, and reader.statistics(site) answered None where the
    published run had exact statistics. A run actstore wrote always has them."""
    store = copy_of("activault")
    (store / HOOK / "statistics.json").write_text("{}")
    resign(store)
    faults = verify_faults(store, capsys)
    assert any("holds no exact statistics" in f for f in faults), faults
    with (
        open_store(store) as reader,
        pytest.raises(ActstoreError, match="holds no exact statistics"),
    ):
        reader.statistics("resid.1")
    (store / HOOK / "statistics.json").unlink()
    resign(store)
    assert any("statistics.json is missing" in f for f in verify_faults(store, capsys))


ZARRAY = "arrays/prompt_len/.zarray"


def _garbage(store: Path) -> None:
    (store / ZARRAY).write_bytes(b"garbage, not JSON")


def _dtype_in_the_file(store: Path) -> None:
    _edit_json(store / ZARRAY, lambda doc: doc.update(dtype="<i2"))


def _dtype_everywhere(store: Path) -> None:
    _dtype_in_the_file(store)
    _edit_json(store / ".zmetadata", lambda doc: doc["metadata"][ZARRAY].update(dtype="<i2"))


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (_garbage, "is not valid JSON"),
        (_dtype_in_the_file, "differs from its entry in .zmetadata"),
        (_dtype_everywhere, "dtype is not what actstore writes"),
    ],
    ids=["garbage", "dtype-in-.zarray", "dtype-in-.zarray-and-.zmetadata"],
)
def test_zarr_array_metadata_is_checked(copy_of, capsys, edit, says):
    """A zarr .zarray replaced by garbage or its dtype edited, manifest rewritten: passed
    verify, and zarr-python reading without consolidated metadata then returned other
    values. Every node's file must equal its .zmetadata entry, and every entry what the
    writer writes for the layout (an edit of both is refused at open)."""
    store = copy_of("zarr")
    edit(store)
    resign(store)
    faults = verify_faults(store, capsys)
    assert any(says in f for f in faults), faults
    if edit is _dtype_everywhere:
        assert says in inspect_error(store, capsys)
        refused_at_open(store)


def test_zarr_python_reads_the_arrays_folder_of_an_untouched_store(built):
    """What docs/zarr.md says of plain zarr-python: the per-sample arrays and activations
    under arrays/ read with it, with or without consolidated metadata."""
    zarr = pytest.importorskip("zarr")
    store = built("zarr")
    with open_store(store) as reader:
        lengths, first = reader.lengths("prompt"), reader.read(0, reader.sites[0], "prompt")
    for consolidated in (True, False):
        group = zarr.open_group(str(store), mode="r", zarr_format=2, use_consolidated=consolidated)
        np.testing.assert_array_equal(group["arrays/prompt_len"][:], lengths)
        acts = group["arrays/prompt_activations"][0, 0, : lengths[0]]
        np.testing.assert_array_equal(acts, first)


# ---------------------------------------------------------------------------- the fuzz

#: Whole-file replacements: hostile nesting and numbers, bytes that are not UTF-8 or not
#: JSON, JSON of the wrong type.
WHOLE = {
    "deep": DEEP,
    "5000-digit": BIG_NUMBER,
    "not-utf8": b'{"a": "\xff\xfe"}',
    "not-json": b'{"cut": [1, 2',
    "wrong-type": b"[]",
}

#: Values a field is replaced by: every JSON type, out-of-range numbers, nesting.
HOSTILE: list[Any] = [
    None,
    -1,
    10**30,
    "x",
    [],
    {},
    True,
    1.5,
    json.loads("[" * 70 + "0" + "]" * 70),  # past the parser's depth, inside a file
    "\u00e9\u0000\ud7ff",
]

#: Fields whose edit a rewritten manifest still gets past (docs/reliability.md lists them,
#: and test_what_a_rewrite_without_a_key_still_gets_past shows each): a value of the right
#: type that nothing derives from the data. ``(format, file, field path)``.
GETS_PAST: set[tuple[str, str, str]] = {
    ("pickle", "metadata.json", "created_at"),
    ("pickle", "metadata.json", "statistics/extraction_duration_seconds"),
    ("pickle", "metadata.json", "distributed_config/total_machines"),
    ("pickle", "metadata.json", "distributed_config/samples_per_machine"),
    ("zarr", ".zmetadata", "metadata/.zattrs/created_at"),
    ("zarr", ".zmetadata", "metadata/.zattrs/git_commit"),
    ("zarr", ".zmetadata", "metadata/.zattrs/actstore_version"),
    ("zarr", "meta/config.json", "model/modality"),
    ("zarr", "meta/config.json", "model/has_cls"),
    ("zarr", "meta/config.json", "classes"),
    ("zarr", "meta/config.json", "batch_size"),
    ("activault", "cfg.json", "run_name"),
    ("activault", "cfg.json", "data_config/bucket_name"),
}


#: Each format's metadata files the fuzz edits (every JSON and metadata file but the
#: chunk-level repeats of zarr's per-array nodes, of which two arrays stand for all).
def _metadata_files(fmt: str, store: Path) -> list[str]:
    names = []
    for path in sorted(store.rglob("*")):
        name = path.relative_to(store).as_posix()
        if not path.is_file():
            continue
        if path.suffix in (".json", ".jsonl") or path.name in (
            ".zarray",
            ".zattrs",
            ".zgroup",
            ".zmetadata",
        ):
            if name == MANIFEST:
                continue  # edited as it is (below): a rewrite writes it
            one_of_many = name.startswith("arrays/") and name.count("/") == 2
            if (
                fmt == "zarr"
                and one_of_many
                and not name.startswith(("arrays/prompt_len/", "arrays/sample_key/"))
            ):
                continue  # two arrays stand for all
            if fmt == "activault" and "/" in name and not name.startswith("models.layers.1."):
                continue  # one hook folder stands for all
            names.append(name)
    return names


def _leaves(doc: Any, path: tuple = ()) -> Iterator[tuple]:
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield from _leaves(value, (*path, key))
    elif isinstance(doc, list) and doc:
        yield path
        yield from _leaves(doc[0], (*path, 0))
    else:
        yield path


def _set(doc: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    inner = doc
    for key in path[:-1]:
        inner = inner[key]
    inner[path[-1]] = value
    return doc


#: Fields edited per file (evenly spaced over its leaves), and whole-file replacements.
PER_FILE = 4
WHOLE_PER_FILE = 2


def _cases(fmt: str, store: Path) -> Iterator[tuple[str, str, str, bytes, bool]]:
    """``(file, what, path, new bytes, rewrite the manifest)`` for every edit of ``fmt``."""
    files = _metadata_files(fmt, store)
    kinds = list(WHOLE.items())
    for name in [MANIFEST, *files]:
        seed = zlib.crc32(name.encode())
        for k in range(WHOLE_PER_FILE):  # the kinds taken in turn across a format's files
            what, data = kinds[(seed + k) % len(kinds)]
            rewrite = name != MANIFEST and (seed + k) % 2 == 1
            yield name, what, "", data, rewrite
    for name in [MANIFEST, *files]:
        raw = (store / name).read_bytes()
        if name.endswith(".jsonl"):
            doc = json.loads(raw.split(b"\n", 1)[0])
        else:
            doc = json.loads(raw)
        leaves = list(_leaves(doc))
        step = max(1, len(leaves) // PER_FILE)
        for i, path in enumerate(leaves[::step][:PER_FILE]):
            value = HOSTILE[(zlib.crc32(name.encode()) + i) % len(HOSTILE)]
            edited = _set(json.loads(json.dumps(doc)), path, value)
            if edited == doc and json.dumps(edited) == json.dumps(doc):
                continue  # the value it holds already
            text = json.dumps(edited, ensure_ascii=False).encode("utf-8", "surrogatepass")
            if name.endswith(".jsonl"):
                text = text + b"\n" + raw.split(b"\n", 1)[1]
            yield (
                name,
                f"{'/'.join(map(str, path)) or '<root>'}={value!r:.12}",
                "/".join(map(str, path)),
                text,
                name != MANIFEST,  # the manifest edited as it is: a rewrite writes it
            )


REFUSED = "refused"


def _read_everything(store: Path) -> list[Any] | None:
    """Every read path a user takes, through the API; None if the store is refused. Any
    exception but an actstore error fails the test."""
    try:
        reader = open_store(store)
    except ActstoreError:
        return None
    seen: list[Any] = []
    with reader:
        for read in (
            lambda: reader.shape,
            reader.describe,
            reader.capture_plan,
            lambda: [reader.statistics(s) and reader.statistics(s).mean for s in reader.sites],
            lambda: [reader.read_block(reader.blocks(s)[0]) for s in reader.sites],
            lambda: reader.tokens is not None and np.asarray(reader.tokens[0]),
            lambda: reader.tokens_per_example and reader[0, reader.sites[0], 0],
        ):
            try:
                seen.append(read())
            except ActstoreError:
                seen.append(REFUSED)
    return seen


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


@pytest.mark.parametrize("fmt", list(BUILDERS))
def test_fuzz_every_metadata_file_of_every_format(built, tmp_path, capsys, fmt):
    """Every JSON and metadata file of a store (the root manifest included), replaced whole
    by hostile bytes (as it is, or with the manifest rewritten over it) and field by field
    by hostile values (manifest rewritten): no command or read raises anything but an
    actstore error; ``verify`` exits 1 with a FAULT line unless the edited field is one
    :data:`GETS_PAST` lists, and then every read returns what the untouched store does;
    ``inspect`` exits 0, or 2 with one line."""
    store = writable_copy(built(fmt), tmp_path / built(fmt).name)
    reference = _read_everything(store)
    assert reference is not None and not any(x is REFUSED for x in reference)
    own = {
        n: (store / n).read_bytes()
        for n in (MANIFEST, "actstore-blocks.xxh3")
        if (store / n).exists()
    }
    problems = []
    for name, what, path, data, rewrite in _cases(fmt, store):
        original = (store / name).read_bytes()
        (store / name).write_bytes(data)
        try:
            if rewrite:
                resign(store)
            code, err = actstore("verify", str(store), "--no-progress", capsys=capsys)
            assert "Traceback" not in err, err
            case = f"{name} {what}{' (manifest rewritten)' if rewrite else ''}"
            seen = _read_everything(store)
            if code == 0:
                if (fmt, name, path) not in GETS_PAST:
                    problems.append(f"{case}: verify passed")
                elif seen is None or not all(map(_same, seen, reference)):
                    problems.append(f"{case}: verify passed but reads changed")
            elif code != 1 or not any(line.startswith("FAULT: ") for line in err.splitlines()):
                problems.append(f"{case}: verify exit {code}: {err.strip()[-300:]}")
            code, err = actstore("inspect", str(store), capsys=capsys)
            lines = [line for line in err.splitlines() if line.strip()]
            if code not in (0, 2) or (code == 2 and len(lines) != 1):
                problems.append(f"{case}: inspect exit {code}: {err.strip()[-300:]}")
        finally:
            (store / name).write_bytes(original)
            for own_name, own_data in own.items():
                (store / own_name).chmod(0o644)
                (store / own_name).write_bytes(own_data)
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------- what gets past


def _zattrs(edit: Callable[[Any], None]) -> Callable[[Path], None]:
    """An edit of the group's attributes made where zarr-python reads them: its own file
    and its entry in .zmetadata alike."""

    def apply(store: Path) -> None:
        _edit_json(store / ".zattrs", edit)
        _edit_json(store / ".zmetadata", lambda doc: edit(doc["metadata"][".zattrs"]))

    return apply


def _json_edit(name: str, edit: Callable[[Any], None]) -> Callable[[Path], None]:
    return lambda store: _edit_json(store / name, edit)


def _tokens_edited(store: Path) -> None:
    data = bytearray((store / "tokens.bin").read_bytes())
    data[0] ^= 1
    (store / "tokens.bin").write_bytes(bytes(data))


def _values_and_statistics_edited(store: Path) -> None:
    """One stored value changed, and the statistics recomputed over the changed values with
    actstore's own code: every check is a recomputation anyone can redo."""
    from actstore.formats.recompute import sharded_statistics

    data = bytearray((store / "acts000000.bin").read_bytes())
    data[2] ^= 0x40
    (store / "acts000000.bin").write_bytes(bytes(data))
    resign(store)
    with open_store(store, verify_reads=False) as reader:
        stats = sharded_statistics(reader, reader.statistics_shards())
    doc = {"sites": {str(site.layer): st.to_dict() for site, st in stats.items()}}
    (store / "statistics.json").write_text(json.dumps(doc))


def _extras_edited(store: Path) -> None:
    data = bytearray((store / "arrays/hallu_label/0").read_bytes())
    data[0] ^= 1
    (store / "arrays/hallu_label/0").write_bytes(bytes(data))


def _sites_swapped(store: Path) -> None:
    """The two layers' slabs exchanged in every shard, and their statistics with them."""
    meta = json.loads((store / "metadata.json").read_text())
    t = meta["patches_per_ex"] + int(meta["cls_token"])
    for path in sorted(store.glob("acts*.bin")):
        acts = np.fromfile(path, dtype="<f4").reshape(-1, len(meta["layers"]), t, meta["d_model"])
        acts[:, [0, 1]] = acts[:, [1, 0]]
        acts.tofile(path)
    _edit_json(
        store / "statistics.json",
        lambda d: d.update(sites=dict(zip(d["sites"], reversed(list(d["sites"].values()))))),
    )


#: docs/reliability.md's list of what a rewritten manifest still gets past, one edit each.
STILL_GETS_PAST: dict[str, tuple[str, Callable[[Path], None]]] = {
    "pkl.gz creation time": (
        "pickle",
        _json_edit("metadata.json", lambda d: d.update(created_at="2000-01-01T00:00:00Z")),
    ),
    "pkl.gz extraction duration": (
        "pickle",
        _json_edit(
            "metadata.json", lambda d: d["statistics"].update(extraction_duration_seconds=9.5)
        ),
    ),
    "pkl.gz split into another number of machines giving the same shards": (
        "pickle",
        _json_edit("metadata.json", lambda d: d["distributed_config"].update(total_machines=2)),
    ),
    "zarr creation time": (
        "zarr",
        _zattrs(lambda a: a.update(created_at="2000-01-01T00:00:00+00:00")),
    ),
    "zarr commit and version": ("zarr", _zattrs(lambda a: a.update(git_commit="0" * 40))),
    "zarr modality, CLS flag, classes and batch size": (
        "zarr",
        _json_edit(
            "meta/config.json",
            lambda d: (d.update(classes=["a"], batch_size=7), d["model"].update(has_cls=True)),
        ),
    ),
    "Activault run name and bucket": (
        "activault",
        _json_edit(
            "cfg.json",
            lambda d: (d.update(run_name="other"), d["data_config"].update(bucket_name="b")),
        ),
    ),
    "token ids": ("saev", _tokens_edited),
    "per-sample extras (zarr hallu_label)": ("zarr", _extras_edited),
    "two sites' values exchanged with their statistics": ("saev", _sites_swapped),
    "values with their statistics recomputed": ("saev", _values_and_statistics_edited),
}


@pytest.mark.parametrize("case", list(STILL_GETS_PAST))
def test_what_a_rewrite_without_a_key_still_gets_past(copy_of, capsys, monkeypatch, case):
    """Each edit docs/reliability.md says a manifest rewritten without a key still gets
    past: ``verify`` passes it. With ``ACTSTORE_MANIFEST_KEY`` set for writer and reader,
    the rewritten manifest is refused."""
    fmt, edit = STILL_GETS_PAST[case]
    store = copy_of(fmt)
    edit(store)
    resign(store)
    code, err = actstore("verify", str(store), "--no-progress", capsys=capsys)
    assert code == 0 and "FAULT" not in err, err
    monkeypatch.setenv(KEY_ENV, "the key")
    assert any("is not signed with the key" in f for f in verify_faults(store, capsys))
