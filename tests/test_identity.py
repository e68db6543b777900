"""A store is what its name says (issue 30, items 1-5), through the real ``actstore`` command.

- its identity covers the data it was made from: an edited corpus (same path, same token
  count; a .npy with one id changed, a re-cleaned .txt or .jsonl, an image rewritten) is
  captured anew, never answered "Already captured", and an unfinished capture of other
  data is not resumed;
- a conversion never lands under the name of a capture, and ``inspect`` says where the
  data came from and at what precision;
- ``--out`` that holds a store of another format, or foreign files, is refused in one line
  before anything is created, and a store never nests inside another;
- ``actstore ls`` of an output root lists its stores;
- every check that needs no weights runs before anything is created or loaded.

Issue 38: the identity also covers the model's weights (their bytes, edited in place to the
same size and mtime), the compute dtype, and token cleaning; an output that holds another
capture is refused in one line saying what differs (the data, the weights, the dtype).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import uuid
from pathlib import Path

import numpy as np
import pytest
from forked import run_actstore

# each case runs the real command several times (each a process of its own)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

SRC = Path(__file__).resolve().parents[1] / "src"
SAEV_HASH = 64


def run_cli(*args: str, env: dict | None = None, cwd: Path | None = None):
    environ = {
        **os.environ,
        "PYTHONPATH": str(SRC),
        "TQDM_DISABLE": "1",
        "HF_HUB_OFFLINE": "1",
        **(env or {}),
    }
    # a process per run, forked from a helper that imported torch once (tests/forked.py)
    return run_actstore(*args, env=environ, cwd=cwd, timeout=300)


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs:
            out[os.path.relpath(os.path.join(dirpath, name), root)] = (-1, 0)
        for name in files:
            st = os.lstat(os.path.join(dirpath, name))
            out[os.path.relpath(os.path.join(dirpath, name), root)] = (st.st_size, st.st_mtime_ns)
    return out


def assert_one_line_error(proc, needle: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    assert needle in errors[0], errors[0]
    return errors[0]


def saev_stores(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir() and len(p.name) == SAEV_HASH)


def rewrite_keeping_times(path: Path, data: bytes) -> None:
    """Write ``data`` over ``path`` and put its size and mtime back as they were (what
    ``cp -p`` or ``rsync -t`` of a re-made file does): only the content differs."""
    st = path.stat()
    assert len(data) == st.st_size
    path.write_bytes(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.fixture
def world(tmp_path, model_dir, monkeypatch):
    monkeypatch.setenv("ACTSTORE_MEMO_DIR", str(tmp_path / "memo"))
    rng = np.random.default_rng(0)
    np.save(tmp_path / "tokens.npy", rng.integers(4, 300, size=(6, 16)))
    rows = rng.integers(4, 300, size=(6, 16)).tolist()
    (tmp_path / "tokens.jsonl").write_text("".join(json.dumps({"tokens": r}) + "\n" for r in rows))
    (tmp_path / "corpus.txt").write_text(
        "".join(f"line {i} of the corpus, with words in it\n" for i in range(40))
    )
    return {"tmp": tmp_path, "gpt2": str(model_dir("gpt2")), "memo": tmp_path / "memo"}


def capture(world, dataset, out, *extra, env: dict | None = None, model: str | None = None):
    return run_cli(
        "capture",
        "--model",
        model or world["gpt2"],
        "--dataset",
        dataset,
        "--layers",
        "1",
        "--context-length",
        "16",
        "--batch-size",
        "2",
        "--out",
        out,
        "--no-progress",
        *extra,
        env=env,
    )


# ---------------------------------------------------------------------- 1. the data


def _edit_npy(path: Path) -> None:
    ids = np.load(path)
    ids[3, 5] = 7 if ids[3, 5] != 7 else 8
    buf = path.with_suffix(".tmp.npy")
    np.save(buf, ids)
    rewrite_keeping_times(path, buf.read_bytes())
    buf.unlink()


def _edit_jsonl(path: Path) -> None:
    lines = path.read_text().splitlines(keepends=True)
    record = json.loads(lines[2])
    v = record["tokens"][0]
    record["tokens"][0] = v + 1 if len(str(v + 1)) == len(str(v)) else v - 1
    lines[2] = json.dumps(record) + "\n"
    rewrite_keeping_times(path, "".join(lines).encode())


def _edit_txt(path: Path) -> None:
    text = path.read_text()
    rewrite_keeping_times(path, text.replace("line 7 of", "LINE 7 of", 1).encode())


@pytest.mark.parametrize(
    ("name", "edit"),
    [("tokens.npy", _edit_npy), ("tokens.jsonl", _edit_jsonl), ("corpus.txt", _edit_txt)],
)
def test_an_edited_corpus_is_captured_anew_not_already_captured(world, name, edit):
    data, out = world["tmp"] / name, world["tmp"] / "out"
    first = capture(world, data, out)
    assert first.returncode == 0, first.stderr
    again = capture(world, data, out)  # unchanged: answered (from the memo)
    assert again.returncode == 0 and "Already captured" in again.stdout, again.stderr
    (old,) = saev_stores(out)
    edit(data)
    rerun = capture(world, data, out)
    assert rerun.returncode == 0, rerun.stderr
    assert "Already captured" not in rerun.stdout, rerun.stdout
    assert "Captured" in rerun.stdout
    stores = saev_stores(out)
    assert len(stores) == 2 and old in stores
    new = next(s for s in stores if s != old)
    import actstore

    before, after = actstore.open_store(out / old), actstore.open_store(out / new)
    assert not np.array_equal(np.asarray(before.tokens[:]), np.asarray(after.tokens[:]))
    # the store records the digest of the tokens it holds
    digest = after.capture_plan().data["token_digest"]
    assert digest != before.capture_plan().data["token_digest"]
    third = capture(world, data, out)
    assert "Already captured" in third.stdout and new in third.stdout


def test_an_unfinished_capture_of_other_data_is_not_resumed(world):
    """pkl.gz writes its store at --out: an unfinished capture there, of a corpus since
    edited, is refused in one line (never resumed with the new data), nothing changed."""
    data, out = world["tmp"] / "tokens.npy", world["tmp"] / "acts-pkl"
    opts = ("--format", "pickle", "--opt", "samples_per_shard=2")
    crashed = capture(world, data, out, *opts, env={"ACTSTORE_CRASH_AT": "pickle.shard_recorded:2"})
    assert crashed.returncode == 137, crashed.stderr
    _edit_npy(data)
    before = snapshot(world["tmp"] / ".acts-pkl.partial")
    rerun = capture(world, data, out, *opts)
    assert_one_line_error(rerun, "unfinished capture")
    assert snapshot(world["tmp"] / ".acts-pkl.partial") == before


def test_an_edited_image_is_captured_anew(world, model_dir):
    """Uncompressed images, so one pixel byte can change with the file's size (and here its
    mtime) kept: the store is named by the images' bytes, not their listing."""
    from PIL import Image

    images = world["tmp"] / "images"
    rng = np.random.default_rng(0)
    for i in range(6):
        folder = images / ("cat", "dog")[i % 2]
        folder.mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 255, size=(32, 32, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"{i}.bmp")
    out = world["tmp"] / "out"
    argv = ["capture", "--model", model_dir("clip"), "--dataset", images, "--layers", "1"]
    argv += ["--batch-size", "8", "--out", out, "--no-progress"]
    first = run_cli(*argv)
    assert first.returncode == 0, first.stderr
    (old,) = saev_stores(out)
    picture = images / "dog" / "1.bmp"
    raw = bytearray(picture.read_bytes())
    raw[-20] ^= 0xFF  # one pixel byte
    rewrite_keeping_times(picture, bytes(raw))
    rerun = run_cli(*argv)
    assert rerun.returncode == 0, rerun.stderr
    assert "Already captured" not in rerun.stdout
    assert len(saev_stores(out)) == 2 and old in saev_stores(out)
    dialect = [*argv, "--dialect", "saev"]  # saev's own layout: its ImgFolder data too
    assert run_cli(*dialect).returncode == 0
    (h8,) = list((out / "saev" / "shards").iterdir())
    raw[-30] ^= 0xFF
    rewrite_keeping_times(picture, bytes(raw))
    again = run_cli(*dialect)
    assert again.returncode == 0 and "Already captured" not in again.stdout, again.stderr
    assert len(list((out / "saev" / "shards").iterdir())) == 2 and h8.exists()


# ---------------------------------------------------------------------- 2. conversions


SOURCES = {
    # format: (capture options, the store to convert, the precision it stores)
    "zarr": (("--format", "zarr"), "activations.zarr", "float16"),
    "activault": (("--format", "activault"), "", "bfloat16"),
    "saelens": (("--format", "saelens", "--opt", "dtype=float16"), "", "float16"),
}


@pytest.mark.parametrize("source", list(SOURCES))
def test_a_conversion_never_takes_the_name_of_a_capture(world, source):
    opts, inner, precision = SOURCES[source]
    data, root = world["tmp"] / "tokens.npy", world["tmp"] / "root"
    made_at = world["tmp"] / f"acts-{source}"
    made = capture(world, data, made_at, *opts)
    assert made.returncode == 0, made.stderr
    store = made_at / inner if inner else made_at
    conv = run_cli("convert", store, root, "--to", "saev", "--no-progress")
    assert conv.returncode == 0, conv.stderr
    (converted,) = saev_stores(root)
    shown = run_cli("inspect", root / converted)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    origin = next(line for line in lines if line.strip().startswith("converted from"))
    assert source in origin and precision in origin
    assert any(line.strip().startswith("precision") and precision in line for line in lines)
    fresh = capture(world, data, root)  # float32, same model, dataset and layers
    assert fresh.returncode == 0, fresh.stderr
    assert "Already captured" not in fresh.stdout
    stores = saev_stores(root)
    assert len(stores) == 2 and converted in stores
    shown = run_cli("inspect", root / next(s for s in stores if s != converted))
    assert "converted from" not in shown.stdout and "token_digest" in shown.stdout
    # converting again is the same conversion (answered), not a third store
    again = run_cli("convert", store, root, "--to", "saev", "--no-progress")
    assert again.returncode == 0 and "Already converted" in again.stdout, again.stderr
    assert saev_stores(root) == stores


# ---------------------------------------------------------------------- 3. --out


def test_out_holding_a_store_of_another_format_is_refused_before_anything_is_created(world):
    data = world["tmp"] / "tokens.npy"
    pkl = world["tmp"] / "acts-pkl"
    assert capture(world, data, pkl, "--format", "pickle").returncode == 0
    lens = world["tmp"] / "acts-saelens"
    assert capture(world, data, lens, "--format", "saelens").returncode == 0
    saev_root = world["tmp"] / "acts-saev"
    assert capture(world, data, saev_root).returncode == 0
    (saev_store,) = saev_stores(saev_root)
    foreign = world["tmp"] / "notes"
    foreign.mkdir()
    (foreign / "paper.tex").write_text("\\begin{document}")
    cases = [
        (pkl, ()),  # saev into a pkl.gz store
        (lens, ()),  # saev into a SAELens store
        (saev_root / saev_store, ()),  # saev into a saev store
        (pkl / "deeper", ()),  # anything inside a store
        (saev_root / saev_store / "x", ("--format", "pickle")),
        (saev_root, ("--format", "pickle")),  # pkl.gz over an output root of stores
        (foreign, ("--format", "pickle")),  # pkl.gz over foreign files
        (foreign, ("--format", "saelens")),
        (pkl, ("--format", "saelens")),
        (lens, ("--format", "activault")),
        (saev_root / saev_store, ("--format", "zarr")),
    ]
    for out, extra in cases:
        before = snapshot(world["tmp"])
        proc = capture(world, data, out, *extra)
        line = assert_one_line_error(proc, str(out))
        assert "--out" in line
        assert "contexts of" not in proc.stderr  # refused before the dataset was read
        assert snapshot(world["tmp"]) == before, (out, extra)
    # the stores are intact, and each format still answers for its own store
    for store in (pkl, lens, saev_root / saev_store):
        assert run_cli("verify", store, "--no-progress").returncode == 0
    again = capture(world, data, pkl, "--format", "pickle")
    assert again.returncode == 0 and "Already captured" in again.stdout


def test_a_conversion_into_a_store_of_another_format_is_refused(world):
    data = world["tmp"] / "tokens.npy"
    pkl, saev_root = world["tmp"] / "acts-pkl", world["tmp"] / "acts-saev"
    assert capture(world, data, pkl, "--format", "pickle").returncode == 0
    assert capture(world, data, saev_root).returncode == 0
    (store,) = saev_stores(saev_root)
    before = snapshot(world["tmp"])
    proc = run_cli("convert", saev_root / store, pkl, "--to", "saev", "--no-progress")
    assert_one_line_error(proc, str(pkl))
    assert snapshot(world["tmp"]) == before


# ---------------------------------------------------------------------- 4. ls


def test_ls_of_an_output_root_lists_its_stores(world):
    data, root = world["tmp"] / "tokens.npy", world["tmp"] / "actstore-data"
    assert capture(world, data, root).returncode == 0
    assert capture(world, data, root, "--max-examples", "4").returncode == 0
    first, second = saev_stores(root)
    crashed = capture(
        world,
        data,
        root,
        "--max-examples",
        "5",
        "--patches-per-shard",
        "32",
        env={"ACTSTORE_CRASH_AT": "saev.shard_recorded:2"},
    )
    assert crashed.returncode == 137, crashed.stderr
    proc = run_cli("ls", root)
    assert proc.returncode == 0, proc.stderr
    assert "Activault" not in proc.stdout and "model None" not in proc.stdout
    listed = proc.stdout.splitlines()
    for name in (first, second):
        line = next(line for line in listed if name in line and ".partial" not in line)
        assert "saev" in line
    assert any(".partial" in line and "unfinished" in line for line in listed)
    as_json = json.loads(run_cli("ls", root, "--json").stdout)
    assert sorted(Path(s["store"]).name for s in as_json["stores"]) == [first, second]
    # an empty root, and a root with only an unfinished store, are said to be so
    empty = world["tmp"] / "empty"
    empty.mkdir()
    proc = run_cli("ls", empty)
    assert proc.returncode == 0 and "Activault" not in proc.stdout


# ---------------------------------------------------------------------- 5. checks first


@pytest.fixture
def weightless(world, tmp_path) -> str:
    """The tiny GPT-2 with garbage in place of its weights: loading it fails, so a check
    that passes this far ran before any weight was read."""
    broken = Path(shutil.copytree(world["gpt2"], tmp_path / "broken-gpt2"))
    (broken / "model.safetensors").write_bytes(b"not a safetensors file" * 10)
    return str(broken)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (("--dtype", "float64"), "dtype must be one of"),
        (("--dtype", "half"), "dtype must be one of"),
        (("--mode", "prompt-response"), "prompt"),  # a .npy is no prompt/response dataset
        (("--mode", "prompt-response", "--format", "saev"), "prompt"),
        (("--mode", "bogus"), "mode must be"),
        (("--sites", "mlp_out.1", "--format", "pickle"), "residual stream only"),
        (("--sites", "mlp_out.1", "--num-machines", "2", "--machine-id", "0"), "residual"),
    ],
)
def test_checks_without_weights_come_before_anything_is_created(world, weightless, extra, needle):
    out = world["tmp"] / "new-out"
    before = snapshot(world["tmp"])
    argv = ["capture", "--model", weightless, "--dataset", world["tmp"] / "tokens.npy"]
    argv += ["--context-length", "16", "--out", out, "--no-progress", *extra]
    proc = run_cli(*argv)
    assert_one_line_error(proc, needle)
    assert "contexts of" not in proc.stderr  # before the dataset was packed
    assert not out.exists()
    assert snapshot(world["tmp"]) == before


def test_prompt_response_dataset_checks_come_before_the_model_loads(world, weightless):
    qa = world["tmp"] / "qa.jsonl"
    qa.write_text(json.dumps({"question": "2+2?", "response": "4"}) + "\n")
    for dataset, needle in [
        (world["tmp"] / "corpus.txt", "prompt/response datasets are"),
        (qa, "'prompt'"),
    ]:
        proc = run_cli(
            "capture",
            "--model",
            weightless,
            "--dataset",
            dataset,
            "--mode",
            "prompt-response",
            "--format",
            "zarr",
            "--out",
            world["tmp"] / "pr",
        )
        assert_one_line_error(proc, needle)
        assert not (world["tmp"] / "pr").exists()


# ---------------------------------------------------------------------- 6. weights, dtype (issue 38)


def rescale_tensor(path: Path, name: str, factor: float = 2.0) -> None:
    """Multiply tensor ``name`` of the safetensors file ``path`` by ``factor`` in place,
    its size and mtime put back: only the bytes of one tensor differ."""
    st = path.stat()
    with open(path, "r+b") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        start, stop = json.loads(f.read(length))[name]["data_offsets"]
        f.seek(8 + length + start)
        values = np.frombuffer(f.read(stop - start), dtype="<f4") * factor
        f.seek(8 + length + start)
        f.write(values.astype("<f4").tobytes())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (st.st_size, st.st_mtime_ns)


#: format -> capture options; saev names its store by its record, the others write theirs
#: at --out (zarr: OUT/activations.zarr)
FORMATS = {
    "saev": (),
    "pickle": ("--format", "pickle"),
    "saelens": ("--format", "saelens"),
    "activault": ("--format", "activault"),
    "zarr": ("--format", "zarr"),
}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_weights_edited_in_place_are_never_already_captured(world, fmt):
    """One tensor rescaled, the file's size and mtime kept: saev captures anew (another
    name, other values); a format whose store is --out refuses in one line saying the
    weights changed, and leaves its store as it was."""
    model = Path(shutil.copytree(world["gpt2"], world["tmp"] / "gpt2-edited"))
    data, out = world["tmp"] / "tokens.npy", world["tmp"] / f"acts-{fmt}"
    first = capture(world, data, out, *FORMATS[fmt], model=str(model))
    assert first.returncode == 0, first.stderr
    before = snapshot(out)
    rescale_tensor(model / "model.safetensors", "transformer.h.0.mlp.c_fc.weight")
    rerun = capture(world, data, out, *FORMATS[fmt], model=str(model))
    assert "Already captured" not in rerun.stdout, rerun.stdout
    if fmt != "saev":
        line = assert_one_line_error(rerun, "the model's weights changed")
        assert str(out) in line
        assert snapshot(out) == before
        return
    assert rerun.returncode == 0 and "Captured" in rerun.stdout, rerun.stderr
    import actstore

    old, new = (actstore.open_store(out / name) for name in saev_stores(out))
    assert old.capture_plan().data["weights"] != new.capture_plan().data["weights"]
    assert not np.array_equal(old[:, "resid.1"], new[:, "resid.1"])


def test_weights_identity_reads_only_what_loading_reads(tmp_path, model_dir):
    """The digest covers the bytes loading reads: a tensor of a block the capture needs
    changes it, even with size and mtime put back; a shard holding only later blocks is
    never read (deleted: the same identity), nor a weight file loading ignores."""
    import torch
    import transformers as tf

    from actstore.capture.identity import weights_identity

    torch.manual_seed(0)
    config = tf.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
    )
    folder = tmp_path / "llama"
    tf.LlamaModel(config).save_pretrained(folder, max_shard_size="40KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    first = weights_identity(str(folder), last_block=1)
    assert set(first) == {"digest"}
    (folder / "optimizer.pt").write_bytes(b"not read by loading")
    (folder / "README.md").write_text("a model")
    assert weights_identity(str(folder), last_block=1) == first
    late = {f for n, f in index.items() if ".layers.3." in n}
    early = {f for n, f in index.items() if ".layers.3." not in n}
    for shard in late - early:  # only block 3: never read by a capture of blocks 0..1
        (folder / shard).unlink()
    assert weights_identity(str(folder), last_block=1) == first
    name = next(n for n in index if n.endswith("layers.0.mlp.up_proj.weight"))
    rescale_tensor(folder / index[name], name)
    assert weights_identity(str(folder), last_block=1) != first
    gpt2 = model_dir("gpt2")
    assert weights_identity(str(gpt2)) == weights_identity(str(gpt2))  # the same bytes


def test_another_compute_dtype_is_another_capture_and_inspect_shows_it(world):
    data, root = world["tmp"] / "tokens.npy", world["tmp"] / "root"
    assert capture(world, data, root).returncode == 0  # float32
    half = capture(world, data, root, "--dtype", "bfloat16")
    assert half.returncode == 0, half.stderr
    assert "Already captured" not in half.stdout and "Captured" in half.stdout
    stores = saev_stores(root)
    assert len(stores) == 2
    shown = {}
    for name in stores:
        proc = run_cli("inspect", root / name)
        assert proc.returncode == 0, proc.stderr
        (line,) = [x for x in proc.stdout.splitlines() if x.strip().startswith("compute dtype")]
        shown[name] = line.split()[-1]
    assert sorted(shown.values()) == ["bfloat16", "float32"]
    # a format whose store is --out refuses, naming the dtype
    pkl = world["tmp"] / "acts-pkl"
    assert capture(world, data, pkl, "--format", "pickle").returncode == 0
    before = snapshot(pkl)
    proc = capture(world, data, pkl, "--format", "pickle", "--dtype", "bfloat16")
    assert_one_line_error(proc, "another compute dtype (--dtype: float32 there, bfloat16 now)")
    assert snapshot(pkl) == before


@pytest.mark.parametrize("fmt", ["pickle", "saelens", "activault", "zarr"])
def test_a_refusal_after_a_corpus_edit_says_the_data_changed(world, fmt):
    """The store at --out was made from the corpus before the edit: refused in one line
    that says the data changed (a finished Activault run is not offered a resume)."""
    data, out = world["tmp"] / "tokens.npy", world["tmp"] / f"acts-{fmt}"
    assert capture(world, data, out, *FORMATS[fmt]).returncode == 0
    before = snapshot(out)
    _edit_npy(data)
    proc = capture(world, data, out, *FORMATS[fmt])
    line = assert_one_line_error(proc, "the data changed (the digest of its token ids")
    assert "resume" not in line
    assert snapshot(out) == before


def test_a_hub_model_is_identified_by_its_revision(world):
    """A Hub id is identified by the commit its cached files come from (nothing is read
    or downloaded for it): the same id at a new revision is another capture."""
    # published into the session's $HF_HUB_CACHE (tests/conftest.py) under a name of this
    # test's own: the command runs forked from the helper the other runs share
    name = f"tiny-gpt2-{uuid.uuid4().hex[:12]}"
    repo = Path(os.environ["HF_HUB_CACHE"]) / f"models--org--{name}"
    (repo / "refs").mkdir(parents=True)

    def publish(revision: str) -> None:
        shutil.copytree(world["gpt2"], repo / "snapshots" / revision)
        (repo / "refs" / "main").write_text(revision)

    first, second = "1" * 40, "2" * 40
    publish(first)
    data, root = world["tmp"] / "tokens.npy", world["tmp"] / "root"
    proc = capture(world, data, root, model=f"org/{name}")
    assert proc.returncode == 0, proc.stderr
    import actstore

    (store,) = saev_stores(root)
    assert actstore.open_store(root / store).capture_plan().data["weights"] == {"revision": first}
    publish(second)
    again = capture(world, data, root, model=f"org/{name}")
    assert again.returncode == 0 and "Already captured" not in again.stdout, again.stderr
    assert len(saev_stores(root)) == 2
