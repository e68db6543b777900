"""The local file layer on its own: rows read straight into place (rows wider than the gap
buffer, skipped rows, repeated or unordered offsets), errors opening a file said as ours,
the listing of a writer's sealed files, and deleting trees. Then what storage writes once:
one location parser (``Location.parse`` and ``open_location`` agree), one temp-and-rename
(``AtomicFile``: cache entries too), and no private name shared between its modules."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from actstore.errors import ConfigError, CorruptStoreError, StorageError
from actstore.storage.cache import BlockCache
from actstore.storage.files import GAP_BYTES, LocalFiles, PathFiles
from actstore.storage.local import AtomicFile, atomic_write, make_tree_read_only, remove_tree
from actstore.storage.location import Location
from actstore.storage.object import LocalStore, S3Store, open_location

SRC = Path(__file__).resolve().parents[1] / "src"
#: float32 rows of d_model 17,000: 68,000 bytes, wider than the 64 KiB gap buffer
D_WIDE = 17_000


def _rows(root: Path, n: int, d: int, seed: int = 0) -> np.ndarray:
    rows = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    (root / "rows.bin").write_bytes(rows.tobytes())
    return rows


def test_rows_wider_than_the_gap_buffer_with_skipped_rows_land_exactly(tmp_path):
    assert D_WIDE * 4 > GAP_BYTES
    rows = _rows(tmp_path, 12, D_WIDE)
    files = LocalFiles(tmp_path)
    offsets = np.arange(12, dtype=np.int64) * D_WIDE * 4
    # skipped rows (-1) between, before and after those read; row 11 beyond a long gap
    slots = np.array([-1, 0, -1, -1, 1, 2, -1, 3, -1, -1, -1, 4])
    out = np.full((6, D_WIDE), np.nan, dtype=np.float32)
    files.read_rows("rows.bin", offsets, D_WIDE * 4, out, slots)
    assert out[:5].tobytes() == rows[[1, 4, 5, 7, 11]].tobytes()
    assert np.isnan(out[5]).all()  # a slot nobody asked for is untouched


def test_rows_into_strided_slots_with_gaps_are_exact(tmp_path):
    d = 64
    rows = _rows(tmp_path, 40, d, seed=1)
    files = LocalFiles(tmp_path)
    pool = np.zeros((10, 2, d), dtype=np.float32)  # rows into one site of [rows, sites, D]
    picked = np.array([0, 3, 4, 9, 30, 31, 39])
    slots = np.array([9, 0, 5, 2, 7, 1, 3])
    files.read_rows("rows.bin", picked * d * 4, d * 4, pool[:, 1], slots)
    want = np.zeros((10, d), dtype=np.float32)
    want[slots] = rows[picked]
    assert pool[:, 1].tobytes() == want.tobytes()
    assert not pool[:, 0].any()  # the other site's rows are left alone


def test_repeated_and_unordered_offsets_read_each_row(tmp_path):
    rows = _rows(tmp_path, 5, D_WIDE, seed=2)
    files = LocalFiles(tmp_path)
    out = np.zeros((4, D_WIDE), dtype=np.float32)
    offsets = np.array([3, 3, 1, 4], dtype=np.int64) * D_WIDE * 4
    files.read_rows("rows.bin", offsets, D_WIDE * 4, out, np.array([0, 1, 2, 3]))
    assert out.tobytes() == rows[[3, 3, 1, 4]].tobytes()


def test_rows_that_do_not_fit_out_are_refused_before_any_read(tmp_path):
    _rows(tmp_path, 4, 16)
    files = LocalFiles(tmp_path)
    out = np.zeros((2, 16), dtype=np.float32)
    with pytest.raises(ConfigError, match="out rows of 128 contiguous bytes"):
        files.read_rows("rows.bin", np.array([0, 128]), 128, out, np.array([0, 2]))
    with pytest.raises(ConfigError, match=r"out rows hold 64 bytes"):
        files.read_rows("rows.bin", np.array([0]), 128, out, np.array([0]))
    assert not out.any()


def test_a_symlinked_file_is_the_stores_fault(tmp_path):
    (tmp_path / "outside.bin").write_bytes(b"x" * 8)
    store = tmp_path / "store"
    store.mkdir()
    (store / "a.bin").symlink_to(tmp_path / "outside.bin")
    with pytest.raises(CorruptStoreError, match="a symlink or not a file"):
        LocalFiles(store).read_range("a.bin", 0, 8)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_an_unreadable_file_is_a_storage_error_saying_what_to_do(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"x" * 8)
    (tmp_path / "a.bin").chmod(0)
    files = LocalFiles(tmp_path)
    with pytest.raises(StorageError) as err:
        files.read_range("a.bin", 0, 8)
    assert str(err.value) == (
        f"{tmp_path}/a.bin cannot be opened (EACCES: Permission denied); permission denied: "
        "make the store readable by this user (chmod)"
    )
    assert not isinstance(err.value, CorruptStoreError)
    with pytest.raises(StorageError, match="EACCES"):
        files.read_exact("a.bin", bytearray(8))


_OUT_OF_DESCRIPTORS = """
import os, resource, sys
from actstore.errors import StorageError
from actstore.storage.files import LocalFiles

files = LocalFiles(sys.argv[1])
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held = []
try:
    while True:
        held.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
try:
    files.read_range("a.bin", 0, 8)
except StorageError as err:
    print(err)
"""


def test_running_out_of_descriptors_says_to_raise_the_limit(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"x" * 8)
    proc = subprocess.run(
        [sys.executable, "-c", _OUT_OF_DESCRIPTORS, str(tmp_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SRC)},
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == (
        f"{tmp_path}/a.bin cannot be opened (EMFILE: Too many open files); too many open "
        "files: raise the limit (`ulimit -n 65536`) or read fewer stores at once"
    )


def test_sealed_files_are_listed_by_name_without_a_walk(tmp_path):
    (tmp_path / "x").write_bytes(b"abc")
    (tmp_path / "y").write_bytes(b"de")
    files = PathFiles()
    files.add("shard/b.bin", tmp_path / "x")
    files.add("a.bin", tmp_path / "y")
    assert files.listing() == ({"a.bin": 2, "shard/b.bin": 3}, [])
    assert bytes(files.read_range("shard/b.bin", 1, 2)) == b"bc"


def test_delete_tree_refuses_the_whole_root(tmp_path):
    (tmp_path / "run" / "hook").mkdir(parents=True)
    (tmp_path / "run" / "hook" / "f").write_bytes(b"1")
    (tmp_path / "keep").write_bytes(b"2")
    store = LocalStore(tmp_path)
    for prefix in ("", "/"):
        with pytest.raises(ConfigError, match="refusing to delete the whole of"):
            store.delete_tree(prefix)
    store.delete_tree("run/")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep"]


def test_remove_tree_removes_a_read_only_store(tmp_path):
    store = tmp_path / "store"
    (store / "sub").mkdir(parents=True)
    (store / "sub" / "a").write_bytes(b"1")
    make_tree_read_only(store)
    (store / "sub").chmod(0o555)
    remove_tree(store)
    assert not store.exists()


# ---------------------------------------------------------------- one location parser


def test_location_and_open_location_name_the_same_place(tmp_path, monkeypatch):
    """A symlinked directory, ``..``, ``~`` and ``file://``: the object store's key is where
    the ``Location`` says (one parser: abspath, symlinks kept)."""
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    monkeypatch.setenv("HOME", str(tmp_path))
    for text in (
        str(tmp_path / "link" / "store"),
        f"{tmp_path}/real/../link/store",
        "~/link/store",
        f"file://{tmp_path}/link/store",
    ):
        loc = Location.parse(text)
        store, prefix = open_location(text)
        assert isinstance(store, LocalStore)
        assert store.url(prefix) == loc.url == str(tmp_path / "link" / "store"), text
        assert (store.root_url, prefix) == (str(loc.parent), loc.name)
    for text in ("s3://bucket/runs/a/", "s3://bucket//runs/a"):
        store, prefix = open_location(text)
        assert isinstance(store, S3Store)
        assert store.url(prefix) == Location.parse(text).url == "s3://bucket/runs/a"


@pytest.mark.parametrize("text", ["/", "file:///", "/..", "", "s3://", "http://host/x"])
def test_location_and_open_location_refuse_the_same_things_alike(text):
    with pytest.raises(ConfigError) as parsed:
        Location.parse(text)
    with pytest.raises(ConfigError) as opened:
        open_location(text)
    assert str(parsed.value) == str(opened.value)


# ---------------------------------------------------------------- one temp-and-rename


def test_an_atomic_file_is_published_whole_or_not_at_all(tmp_path):
    target = tmp_path / "x.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic_write(target) as f:
        f.write(b"half")
        raise RuntimeError("killed")
    assert target.read_bytes() == b"old" and sorted(os.listdir(tmp_path)) == ["x.bin"]
    out = AtomicFile(target, durable=False)
    os.write(out.fd, b"new")
    assert target.read_bytes() == b"old"
    out.commit()
    assert target.read_bytes() == b"new" and sorted(os.listdir(tmp_path)) == ["x.bin"]
    out = AtomicFile(target)
    out.discard()
    assert sorted(os.listdir(tmp_path)) == ["x.bin"]


def test_cache_entries_are_written_like_every_other_file(tmp_path):
    """Through the one temp-and-rename: the permissions ``open`` gives (mkstemp's own
    0600 kept a cache shared by a group unreadable to the others), no temporary left."""
    cache = BlockCache(tmp_path / "cache", max_bytes=1 << 20)
    cache.put("s3://b/run/a.bin@0+4", b"abcd")
    path = cache.path("s3://b/run/a.bin@0+4")
    mask = os.umask(0)
    os.umask(mask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask
    assert [p.name for p in path.parent.iterdir()] == [path.name]
    out = bytearray(4)
    assert cache.get_into("s3://b/run/a.bin@0+4", out) and out == b"abcd"


# ---------------------------------------------------------------- seams


def test_no_storage_module_imports_a_private_name_of_another():
    """Names shared between modules are public (``env``, ``describe_error``,
    ``describe_holder``...): a leading underscore means "this module only"."""
    root = SRC / "actstore" / "storage"
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (
                node.level or "actstore" in (node.module or "")
            ):
                found += [
                    f"{path.relative_to(root)}: {a.name} from {'.' * node.level}{node.module or ''}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
    assert found == []


def test_the_files_layer_keeps_its_public_names():
    from actstore.storage import files

    for name in ("StoreFiles", "LocalFiles", "PathFiles", "S3Files", "open_files", "GAP_BYTES"):
        assert getattr(files, name) is not None
    assert files.open_files(SRC).local_path == SRC
