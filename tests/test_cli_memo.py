"""The memo of finished captures on its own: it answers only while the store's index files
and its root manifest files are the ones published, and a model or dataset whose files
cannot all be listed is simply not memoised (never a traceback)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from actstore.cli.capture_memo import Memo, capture_key, recall, remember

MANIFESTS = ("shards.json", "metadata.json")


@pytest.fixture
def world(tmp_path, monkeypatch) -> dict:
    monkeypatch.setenv("ACTSTORE_MEMO_DIR", str(tmp_path / "memo"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("one line\n")
    store = tmp_path / "out" / "abc"
    store.mkdir(parents=True)
    for name in (*MANIFESTS, "actstore-manifest.json", "actstore-blocks.xxh3", "acts.bin"):
        (store / name).write_text(name)
    params = {"model": str(model), "dataset": str(data), "out": str(tmp_path / "out")}
    return {"params": params, "store": store, "data": data, "memo": tmp_path / "memo"}


def _replace(path: Path, text: str) -> None:
    """Rewrite ``path`` as a writer publishes: a new file renamed over it."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@pytest.mark.parametrize("name", ["actstore-manifest.json", "actstore-blocks.xxh3"])
def test_a_rewritten_or_removed_root_manifest_file_is_not_answered(world, name):
    params, store = world["params"], world["store"]
    remember(params, store, "summary", MANIFESTS)
    assert recall(params) == Memo(str(store), "summary")
    _replace(store / name, "rewritten")
    assert recall(params) is None
    remember(params, store, "summary", MANIFESTS)
    assert recall(params) == Memo(str(store), "summary")
    (store / name).unlink()
    assert recall(params) is None


def test_a_store_without_a_blocks_file_is_memoised(world):
    params, store = world["params"], world["store"]
    (store / "actstore-blocks.xxh3").unlink()
    remember(params, store, "summary", MANIFESTS)
    assert recall(params) == Memo(str(store), "summary")


@pytest.mark.parametrize("where", ["dataset", "model"])
def test_a_dangling_symlink_means_no_memo_not_a_traceback(world, where, tmp_path):
    params = world["params"]
    (Path(params[where]) / "gone").symlink_to(tmp_path / "nowhere")
    assert capture_key(params) is None
    remember(params, world["store"], "summary", MANIFESTS)
    assert recall(params) is None
    assert not world["memo"].exists()  # nothing was written


def test_a_dataset_edited_to_the_same_size_and_mtime_is_not_answered(world):
    """An edit that puts the old size and mtime back (``cp -p``, ``rsync -t`` of a
    re-made corpus) still moves the file's ctime: the memo is not answered (issue 30)."""
    import time

    params, store, data = world["params"], world["store"], world["data"] / "a.txt"
    remember(params, store, "summary", MANIFESTS)
    assert recall(params) == Memo(str(store), "summary")
    st = data.stat()
    time.sleep(0.01)  # the ctime clock ticks at least this often
    data.write_text("one lime\n")  # same size
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (data.stat().st_size, data.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    assert recall(params) is None


@pytest.mark.parametrize(
    ("index_files", "at_the_top"),
    [
        ((".zmetadata", "manifest.json"), (".zmetadata", ".zattrs")),  # zarr
        (("cfg.json", "metadata.json"), ("cfg.json",)),  # Activault: metadata.json per hook
    ],
)
def test_a_store_whose_index_files_are_not_all_at_its_top_is_memoised(
    world, index_files, at_the_top
):
    """Issue 38 (12): zarr and Activault stores hold some of their format's index files
    below their top (or not at all), so their captures were never memoised; the root
    manifest (written anew at every publication) and the index files at the top answer."""
    params, store = world["params"], world["store"]
    for name in (*MANIFESTS, "actstore-blocks.xxh3"):
        (store / name).unlink()
    for name in at_the_top:
        (store / name).write_text(name)
    remember(params, store, "summary", index_files)
    assert recall(params) == Memo(str(store), "summary")
    _replace(store / at_the_top[0], "rewritten")
    assert recall(params) is None
    remember(params, store, "summary", index_files)
    (store / "actstore-manifest.json").unlink()  # no root manifest: never answered
    assert recall(params) is None
    remember(params, store, "summary", index_files)
    assert recall(params) is None
