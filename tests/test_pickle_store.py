"""pkl.gz stores: the spec's own loader reads them, nothing in a shard can run code,
checksums and sample ids are checked, publication is atomic, captures resume, and the
stores of several machines merge."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import pickle
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from actstore import safe_pickle
from actstore.capture import CaptureConfig, capture
from actstore.errors import (
    ConfigError,
    CorruptStoreError,
    StoreExistsError,
    UnsafeDataError,
)
from actstore.formats import open_store
from actstore.formats.pickle import PickleOptions, PickleReader, PickleWriter, merge_stores
from actstore.formats.saev import SaevReader, SaevWriter
from actstore.sites import Site
from actstore.testing import make_acts, make_batches, make_plan, resign

PER_SHARD = 5


def write(root, plan=None, acts=None, compress=True, **part):
    plan = plan or make_plan()
    acts = acts if acts is not None else make_acts(plan)
    writer = PickleWriter(
        plan, root, PickleOptions(compress=compress, samples_per_shard=PER_SHARD), **part
    )
    for batch in make_batches(plan, acts):
        writer.write(batch)
    return writer.close(), plan, acts


# ---------------------------------------------------------------- the spec's own loader
# A transcription of the spec's "Loading API" example: plain pickle, no actstore code.


def spec_load_metadata(output_dir):
    with open(Path(output_dir) / "metadata.json") as f:
        return json.load(f)


def spec_load_shard(shard_path, compressed=True):
    if compressed:
        with gzip.open(shard_path, "rb") as f:
            return pickle.load(f)
    with open(shard_path, "rb") as f:
        return pickle.load(f)


def spec_iter_activations(output_dir, layer_idx):
    metadata = spec_load_metadata(output_dir)
    layer_key = f"layer_{layer_idx}"
    for shard_info in metadata["shards"]:
        if layer_idx not in shard_info["layers"]:
            continue
        shard_data = spec_load_shard(
            Path(output_dir) / shard_info["filename"], compressed=shard_info["compressed"]
        )
        if layer_key in shard_data:
            yield from shard_data[layer_key]


@pytest.mark.parametrize("compress", [True, False])
def test_spec_example_loader_reads_what_we_write(tmp_path, compress):
    out, plan, acts = write(tmp_path / "acts", compress=compress)
    md = spec_load_metadata(out)
    assert {
        "version",
        "created_at",
        "extraction_config",
        "distributed_config",
        "shards",
        "statistics",
    } <= set(md)
    assert md["version"] == "1.0"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", md["created_at"])
    assert md["extraction_config"]["layers_extracted"] == [1, 3]
    assert md["extraction_config"]["model_params"]["hidden_size"] == plan.d_model
    assert md["distributed_config"]["machine_id"] == 0
    assert md["distributed_config"]["total_machines"] == 1
    suffix = ".pkl.gz" if compress else ".pkl"
    assert [s["filename"] for s in md["shards"]] == [f"shard_{i:04d}{suffix}" for i in range(1, 6)]
    assert [s["sample_id_range"] for s in md["shards"]] == [
        [0, 4],
        [5, 9],
        [10, 14],
        [15, 19],
        [20, 22],
    ]
    for shard in md["shards"]:
        data = (out / shard["filename"]).read_bytes()
        assert shard["checksum"] == "sha256:" + hashlib.sha256(data).hexdigest()
        assert shard["size_bytes"] == len(data) and shard["compressed"] is compress
        assert shard["layers"] == [1, 3]
        assert shard["num_samples"] == shard["sample_id_range"][1] - shard["sample_id_range"][0] + 1
    stats = md["statistics"]
    assert stats["total_shards"] == 5 and stats["total_samples"] == 23
    assert stats["total_size_bytes"] == sum(s["size_bytes"] for s in md["shards"])
    assert stats["layers_extracted"] == [1, 3] and stats["extraction_duration_seconds"] >= 0
    for site in plan.sites:
        items = list(spec_iter_activations(out, site.layer))
        assert [it["sample_idx"] for it in items] == list(range(23))
        for i, item in enumerate(items):
            assert item["activation"].dtype == np.float32
            assert item["shape"] == (plan.tokens_per_example, plan.d_model)
            np.testing.assert_array_equal(item["activation"], acts[str(site)][i])
            assert item["text_preview"] == f"example {i}"
            assert item["metadata"]["token_count"] == plan.tokens_per_example
            assert item["metadata"]["dataset_idx"] == i and item["metadata"]["machine_id"] == 0


def test_text_preview_is_cut_at_200_characters(tmp_path):
    plan = make_plan(n_examples=2)
    acts = make_acts(plan)
    batches = make_batches(plan, acts)
    batches[0] = type(batches[0])(**{**batches[0].__dict__, "texts": ["x" * 500, "short"]})
    writer = PickleWriter(plan, tmp_path / "s", PickleOptions(samples_per_shard=4))
    writer.write(batches[0])
    out = writer.close()
    assert [it["text_preview"] for it in PickleReader(out).items(1)] == ["x" * 200, "short"]


# ---------------------------------------------------------------- safety


class _RunsCode:
    """Unpickling this calls ``Path(marker).touch()``: what a malicious shard would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _replace_shard(store: Path, payload, index: int = 0) -> Path:
    """Swap shard ``index`` for ``payload`` and fix its checksum and size in metadata.json,
    as an attacker who controls the whole directory could."""
    meta_path = store / "metadata.json"
    meta = json.loads(meta_path.read_text())
    shard = meta["shards"][index]
    data = gzip.compress(pickle.dumps(payload), mtime=0)
    path = store / shard["filename"]
    path.chmod(0o644)
    path.write_bytes(data)
    shard["checksum"] = "sha256:" + hashlib.sha256(data).hexdigest()
    shard["size_bytes"] = len(data)
    _rewrite_metadata(store, meta)
    return path


def _rewrite_metadata(store: Path, meta: dict) -> None:
    """Replace metadata.json and re-sign the root manifest (as an attacker could)."""
    (store / "metadata.json").chmod(0o644)
    (store / "metadata.json").write_text(json.dumps(meta))
    resign(store)


def test_malicious_shard_runs_no_code(tmp_path):
    out, plan, acts = write(tmp_path / "acts")
    marker = tmp_path / "pwned"
    good = spec_load_shard(out / "shard_0001.pkl.gz")
    good["layer_1"][0]["metadata"]["evil"] = _RunsCode(marker)
    _replace_shard(out, good)
    reader = PickleReader(out)  # metadata and sizes are consistent: opening succeeds
    with pytest.raises(UnsafeDataError, match=r"refusing to unpickle pathlib\..*Path\.touch"):
        reader.read_block(reader.blocks(1)[0])
    with pytest.raises(UnsafeDataError):
        list(reader.items(3))
    report = reader.verify()
    assert not report.ok and "refusing to unpickle" in report.faults[0]
    assert not marker.exists()
    # the other shards still read, exactly
    np.testing.assert_array_equal(
        reader.read_block(reader.blocks(1)[1]), acts["resid.1"][5:10].reshape(-1, plan.d_model)
    )
    # whereas plain pickle, as the spec's loader uses it, would have run the code
    spec_load_shard(out / "shard_0001.pkl.gz")
    assert marker.exists()


@pytest.mark.parametrize(
    "payload, refused",
    [
        ((os.system, ("echo pwned",)), "posix.system"),
        ((eval, ("1 + 1",)), "builtins.eval"),
        ((subprocess.Popen, (["true"],)), "subprocess.Popen"),
        ((np.load, ("x.npy",)), "numpy"),
        ((getattr, ("text", "upper")), "builtins.getattr"),
    ],
)
def test_restricted_unpickler_refuses_callables(payload, refused):
    class Evil:
        def __reduce__(self):
            return payload

    with pytest.raises(UnsafeDataError, match=re.escape(refused)):
        safe_pickle.loads(pickle.dumps({"layer_0": [Evil()]}))


def test_restricted_unpickler_refuses_object_arrays_and_admits_plain_data():
    objects = np.array([{"a": 1}, None], dtype=object)
    with pytest.raises(UnsafeDataError, match="dtype object"):
        safe_pickle.loads(pickle.dumps(objects))
    plain = {
        "a": [1, 2.5, "s", b"b", None, True, (1, 2), {3}, frozenset({4}), 1 + 2j, bytearray(b"x")],
        "arr": np.arange(6, dtype=np.float16).reshape(2, 3),
        "s": np.float32(2.5),
        "i": np.int64(7),
        "f": np.asfortranarray(np.ones((2, 3))),
        "empty": np.zeros((0, 4)),
    }
    for protocol in (2, 4, 5):
        got = safe_pickle.loads(pickle.dumps(plain, protocol=protocol))
        assert got["a"] == plain["a"] and got["s"] == plain["s"] and got["i"] == 7
        for key in ("arr", "f", "empty"):
            np.testing.assert_array_equal(got[key], plain[key])
            assert got[key].dtype == plain[key].dtype


def test_truncated_pickle_is_a_corrupt_store_error():
    data = pickle.dumps({"x": np.ones(100)})
    with pytest.raises(CorruptStoreError, match="not a readable pickle"):
        safe_pickle.load(io.BytesIO(data[: len(data) // 2]))


# ---------------------------------------------------------------- integrity


def test_changed_shard_fails_its_checksum_on_read(tmp_path):
    out, *_ = write(tmp_path / "acts", compress=False)
    shard = out / "shard_0003.pkl"
    shard.chmod(0o644)
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0x01  # one bit of one activation value: still a valid pickle
    shard.write_bytes(bytes(data))
    reader = PickleReader(out)
    with pytest.raises(CorruptStoreError, match="shard_0003.pkl: block 0 .* is not the block"):
        reader.read_block(reader.blocks(3)[2])
    assert reader.read_block(reader.blocks(3)[1]).shape == (30, 8)  # others unaffected


def test_missing_or_truncated_shard_is_reported_at_open(tmp_path):
    out, *_ = write(tmp_path / "acts")
    shard = out / "shard_0002.pkl.gz"
    shard.chmod(0o644)
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(CorruptStoreError, match="shard_0002.pkl.gz has .* bytes"):
        PickleReader(out)
    shard.unlink()
    with pytest.raises(FileNotFoundError, match="shard_0002.pkl.gz is missing"):
        PickleReader(out)


def test_sample_ids_are_checked_for_uniqueness(tmp_path):
    out, *_ = write(tmp_path / "acts")
    meta = json.loads((out / "metadata.json").read_text())
    meta["shards"][1]["sample_id_range"] = [4, 9]  # overlaps shard 1's [0, 4]
    _rewrite_metadata(out, meta)
    with pytest.raises(CorruptStoreError, match="overlapping sample id ranges"):
        PickleReader(out)
    out2, *_ = write(tmp_path / "acts2")
    shard = spec_load_shard(out2 / "shard_0001.pkl.gz")
    for layer in ("layer_1", "layer_3"):
        shard[layer][1]["sample_idx"] = 0  # a repeated id inside one shard
    _replace_shard(out2, shard)
    with pytest.raises(CorruptStoreError, match="repeats sample ids"):
        list(PickleReader(out2).items(1))


# ---------------------------------------------------------------- atomicity and resume


def test_nothing_is_published_until_close(tmp_path):
    plan = make_plan()
    batches = make_batches(plan, make_acts(plan))
    writer = PickleWriter(plan, tmp_path / "acts", PickleOptions(samples_per_shard=PER_SHARD))
    for batch in batches[:4]:
        writer.write(batch)
    assert not (tmp_path / "acts").exists()  # written beside it, in .acts.partial
    partial = tmp_path / ".acts.partial"
    assert sorted(p.name for p in partial.iterdir() if p.name.startswith("shard")) == [
        "shard_0001.pkl.gz",
        "shard_0002.pkl.gz",
        "shard_0003.pkl.gz",
    ]
    with pytest.raises(CorruptStoreError, match="unfinished capture"):
        PickleReader(partial)
    for batch in batches[4:]:
        writer.write(batch)
    out = writer.close()
    names = sorted(p.name for p in out.iterdir())
    assert names == ["actstore-manifest.json", "metadata.json"] + [
        f"shard_{i:04d}.pkl.gz" for i in range(1, 6)
    ]
    assert all(not os.access(out / n, os.W_OK) or os.geteuid() == 0 for n in names)
    assert isinstance(open_store(out), PickleReader)


def test_crashed_capture_resumes_to_identical_shards(tmp_path):
    plan = make_plan()
    acts = make_acts(plan)
    batches = make_batches(plan, acts)
    options = PickleOptions(samples_per_shard=PER_SHARD)
    crashed = PickleWriter(plan, tmp_path / "a", options)
    for batch in batches[:3]:  # 12 examples: 2 finished shards, 2 examples buffered
        crashed.write(batch)
    crashed.abort()
    resumed = PickleWriter(plan, tmp_path / "a", options)
    assert resumed.resume_from == 10
    for batch in batches:  # capture restarts at the batch holding example 10
        resumed.write(batch)
    a = resumed.close()
    b, *_ = write(tmp_path / "b")
    for name in (f"shard_{i:04d}.pkl.gz" for i in range(1, 6)):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    ra, rb = PickleReader(a), PickleReader(b)
    assert ra.metadata.shards == rb.metadata.shards
    for layer in (1, 3):
        sa, sb = ra.statistics(layer), rb.statistics(layer)
        np.testing.assert_array_equal(sa.mean, sb.mean)
        np.testing.assert_array_equal(sa.m2, sb.m2)
    again = PickleWriter(plan, tmp_path / "a", options)
    assert again.complete and again.close() == a


def test_refuses_to_mix_with_other_data(tmp_path):
    out, plan, _ = write(tmp_path / "acts")
    other = make_plan(d_model=4)
    with pytest.raises(StoreExistsError, match="holds another capture"):
        PickleWriter(other, out, PickleOptions(samples_per_shard=PER_SHARD))
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(StoreExistsError, match="already holds something else"):
        PickleWriter(plan, tmp_path / "busy")
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"
    with pytest.raises(ConfigError, match="residual stream only"):
        PickleWriter(make_plan(sites=(Site("mlp_out", 1),)), tmp_path / "x")
    with pytest.raises(ConfigError, match="caps shards at 2 GB"):
        PickleWriter(
            make_plan(d_model=4096, tokens_per_example=4096, n_examples=40),
            tmp_path / "y",
            PickleOptions(samples_per_shard=40),
        )


# ---------------------------------------------------------------- several machines


def write_machines(plan, acts, tmp_path, ranges):
    """One PickleWriter per machine slice ``(start, stop)`` (10 samples per machine)."""
    parts = []
    for machine, (start, stop) in enumerate(ranges):
        writer = PickleWriter(
            plan,
            tmp_path / f"machine_{machine}",
            PickleOptions(samples_per_shard=PER_SHARD),
            example_range=(start, stop),
            machine_id=machine,
            total_machines=len(ranges),
            samples_per_machine=10,
        )
        for batch in make_batches(plan, acts):
            writer.write(batch.select((batch.example_ids >= start) & (batch.example_ids < stop)))
        parts.append(writer.close())
    return parts


def test_stores_of_several_machines_merge_into_one(tmp_path):
    plan = make_plan()
    acts = make_acts(plan)
    single, *_ = write(tmp_path / "single", plan, acts)
    parts = write_machines(plan, acts, tmp_path, [(0, 10), (10, 20), (20, 23)])
    machine_md = spec_load_metadata(parts[1])
    assert machine_md["distributed_config"]["machine_id"] == 1
    assert [s["shard_id"] for s in machine_md["shards"]] == [3, 4]  # global shard numbering
    assert [it["sample_idx"] for it in spec_iter_activations(parts[1], 1)] == list(range(10, 20))

    merged = merge_stores(parts[::-1], tmp_path / "merged")  # any order in, id order out
    md = spec_load_metadata(merged)
    assert md["distributed_config"]["total_machines"] == 3
    assert [m["machine_id"] for m in md["distributed_config"]["machines"]] == [0, 1, 2]
    assert md["statistics"]["total_samples"] == 23 and md["statistics"]["total_shards"] == 5
    ref = spec_load_metadata(single)
    for s, r in zip(md["shards"], ref["shards"]):
        assert (s["shard_id"], s["filename"], s["sample_id_range"], s["num_samples"]) == (
            r["shard_id"],
            r["filename"],
            r["sample_id_range"],
            r["num_samples"],
        )
    assert (
        os.stat(merged / "shard_0003.pkl.gz").st_ino
        == os.stat(parts[1] / "shard_0003.pkl.gz").st_ino
    )  # hard-linked, not rewritten
    reader = PickleReader(merged)
    for site in plan.sites:
        rows = np.concatenate([reader.read_block(b) for b in reader.blocks(site.layer)])
        np.testing.assert_array_equal(rows, acts[str(site)].reshape(-1, plan.d_model))
        got, want = reader.statistics(site.layer), PickleReader(single).statistics(site.layer)
        assert got.count == want.count
        np.testing.assert_allclose(got.mean, want.mean, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(got.var, want.var, rtol=1e-12)
    assert reader.verify().ok
    with pytest.raises(ConfigError, match="overlapping sample ids"):
        merge_stores([parts[0], parts[0]], tmp_path / "twice")
    from typer.testing import CliRunner

    from actstore.cli import app

    result = CliRunner().invoke(app, ["merge", *map(str, parts), "--into", str(tmp_path / "cli")])
    assert result.exit_code == 0, result.output
    assert PickleReader(tmp_path / "cli").metadata.shards == reader.metadata.shards


def test_machine_ids_must_give_unique_sample_ids(tmp_path):
    with pytest.raises(ConfigError, match="sample ids would not be unique"):
        PickleWriter(
            make_plan(),
            tmp_path / "m",
            PickleOptions(samples_per_shard=5),
            example_range=(10, 20),
            machine_id=2,
            samples_per_machine=10,
        )


# ---------------------------------------------------------------- from a real capture


def test_capture_into_pickle_matches_the_saev_store(model_dir, text_file, tmp_path):
    cfg = CaptureConfig(
        model=str(model_dir("gpt2")),
        dataset=str(text_file),
        sites=("resid.0", "resid.3"),
        batch_size=4,
        context_length=128,
        max_examples=10,
        progress=False,
    )
    pkl = capture(
        cfg, lambda plan: PickleWriter(plan, tmp_path / "pkl", PickleOptions(samples_per_shard=4))
    ).output
    saev = SaevReader(capture(cfg, lambda plan: SaevWriter.from_plan(plan, tmp_path)).output)
    reader = PickleReader(pkl)
    assert len(reader.shards) == 3 and reader.n_examples == 10
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir("gpt2")))
    # Two separate captures: 512-row matmuls on two threads occasionally round a value one
    # float32 ulp apart from run to run (docs/design.md, Reproducibility), so the values
    # are compared to 1e-6; order, tokens and text are exact.
    for layer in (0, 3):
        items = list(reader.items(layer))
        np.testing.assert_allclose(
            np.stack([it["activation"] for it in items]), saev[:, layer], rtol=1e-5, atol=1e-6
        )
        for i, item in enumerate(items):
            tokens = item["metadata"]["token_ids"]
            np.testing.assert_array_equal(tokens, saev.tokens[i])
            assert item["text_preview"] == tokenizer.decode(tokens)[:200]
            assert len(item["text_preview"]) == 200  # 128 tokens of English exceed 200 chars
    np.testing.assert_allclose(
        reader.statistics(3).mean, saev.statistics(3).mean, rtol=1e-6, atol=1e-9
    )
    plan = reader.capture_plan()
    assert (plan.ckpt, plan.family, plan.n_examples, plan.tokens_per_example) == (
        str(model_dir("gpt2")),
        "gpt2",
        10,
        128,
    )


# ---------------------------------------------------------------- the spec's torch Dataset


def test_spec_dataset_serves_every_sample_once_per_epoch_decoding_each_shard_once(tmp_path):
    import torch

    from actstore.formats.pickle import ActivationDataset

    out, plan, acts = write(tmp_path / "acts")
    dataset = ActivationDataset(out, layer_idx=3, seed=7, pool_shards=2)
    decoded = []
    read = dataset.reader._read
    dataset.reader._read = lambda info, progress: (
        decoded.append(info.shard_id) or read(info, progress)
    )
    epoch0 = list(dataset)
    assert len(epoch0) == len(dataset) == 23
    assert sorted(decoded) == [1, 2, 3, 4, 5]  # each shard once, not once per item
    ids = [item["sample_idx"] for item in epoch0]
    assert sorted(ids) == list(range(23)) and ids != list(range(23))
    for item in epoch0:
        np.testing.assert_array_equal(
            item["activation"].numpy(), acts["resid.3"][item["sample_idx"]]
        )
        assert item["text"] == f"example {item['sample_idx']}"
    assert [i["sample_idx"] for i in dataset] == ids  # a pure function of (seed, epoch)
    dataset.set_epoch(1)
    assert [i["sample_idx"] for i in dataset] != ids
    # DataLoader workers split the epoch between them; batches collate as in the spec
    dataset.set_epoch(0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, num_workers=2)
    batches = list(loader)
    assert batches[0]["activation"].shape == (4, plan.tokens_per_example, plan.d_model)
    assert sorted(int(i) for b in batches for i in b["sample_idx"]) == list(range(23))
    ordered = ActivationDataset(out, layer_idx=1, shuffle=False)
    assert [i["sample_idx"] for i in ordered] == list(range(23))
    halves = [ActivationDataset(out, 1, rank=r, world_size=2) for r in (0, 1)]
    assert [len(h) for h in halves] == [12, 11]
    assert sorted(i["sample_idx"] for h in halves for i in h) == list(range(23))


# ---------------------------------------------------------------- stores other writers made


def _foreign_store(out: Path, seq_len: int) -> None:
    """A store as another writer of the spec may make it: numpy integer sample ids (the
    spec's own loader reads them), arrays of ``seq_len`` tokens under a larger
    ``max_seq_length``, no actstore record."""
    out.mkdir()
    rng = np.random.default_rng(0)
    shards = []
    for shard_id, ids in enumerate([range(3), range(3, 5)], start=1):
        data = {
            "layer_2": [
                {
                    "sample_idx": np.int64(i),
                    "activation": rng.standard_normal((seq_len, 8)).astype(np.float32),
                    "shape": (seq_len, 8),
                    "text_preview": f"text {i}",
                    "metadata": {"token_count": seq_len, "dataset_idx": i, "machine_id": 0},
                }
                for i in ids
            ]
        }
        raw = gzip.compress(pickle.dumps(data))
        name = f"shard_{shard_id:04d}.pkl.gz"
        (out / name).write_bytes(raw)
        shards.append(
            {
                "shard_id": shard_id,
                "filename": name,
                "size_bytes": len(raw),
                "num_samples": len(ids),
                "layers": [2],
                "sample_id_range": [ids[0], ids[-1]],
                "compressed": True,
                "checksum": "sha256:" + hashlib.sha256(raw).hexdigest(),
            }
        )
    (out / "metadata.json").write_text(
        json.dumps(
            {
                "version": "1.0",
                "created_at": "2025-01-09T12:00:00Z",
                "extraction_config": {
                    "model_name": "m",
                    "model_architecture": "qwen2",
                    "model_params": {"hidden_size": 8, "num_hidden_layers": 4},
                    "layers_extracted": [2],
                    "max_seq_length": 6,
                    "batch_size": 2,
                },
                "distributed_config": {"machine_id": 0, "total_machines": 1},
                "shards": shards,
                "statistics": {"total_shards": 2, "total_samples": 5},
            }
        )
    )


def test_foreign_store_with_numpy_ids_and_unpadded_arrays_reads_and_converts(tmp_path):
    from actstore.convert import convert

    _foreign_store(tmp_path / "foreign", seq_len=4)
    reader = PickleReader(tmp_path / "foreign")
    items = list(reader.items(2))
    assert [int(it["sample_idx"]) for it in items] == list(range(5))
    assert reader.item(4, 2)["text_preview"] == "text 4"
    report = reader.verify()  # read and checked for structure, but nothing to verify against
    assert report.faults == [
        (
            "no root manifest (actstore-manifest.json): the contents cannot be verified "
            "(deleted, or a store written by another tool)"
        )
    ]
    assert reader.capture_plan().tokens_per_example == 4  # the arrays' length, not 6
    result = convert(tmp_path / "foreign", tmp_path / "saev", to="saev", progress=False)
    assert result.rows == {"resid.2": 20} and result.lossless
    rows = open_store(result.location)
    got = np.concatenate([rows.read_block(b) for b in rows.blocks(2)])
    np.testing.assert_array_equal(got, np.concatenate([it["activation"] for it in items]))


def test_merge_drops_shards_an_interrupted_merge_left(tmp_path):
    plan = make_plan()
    acts = make_acts(plan)
    parts = write_machines(plan, acts, tmp_path, [(0, 10), (10, 23)])
    out = tmp_path / "merged"
    (tmp_path / ".merged.partial").mkdir()  # what a merge killed before its first record leaves
    (tmp_path / ".merged.partial" / "shard_0009.pkl.gz").write_bytes(b"left by a crashed merge")
    merged = merge_stores(parts, out)
    assert sorted(p.name for p in merged.iterdir()) == [
        "actstore-manifest.json",
        "metadata.json",
    ] + [f"shard_{i:04d}.pkl.gz" for i in range(1, 6)]
    assert not (tmp_path / ".merged.partial").exists()
    assert PickleReader(merged).verify().ok
