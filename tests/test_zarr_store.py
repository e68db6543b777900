"""The zarr prompt/response store: layout maths, bytes on disk, plain zarr-python access,
the reading contract, atomic publication, damage, sharded runs, the manifest and the merge."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from actstore.batch import Batch, CapturePlan
from actstore.errors import (
    CaptureError,
    ConfigError,
    CorruptStoreError,
    IndexOutOfRangeError,
    LayerNotStoredError,
    ProtocolVersionError,
    StoreExistsError,
    StoreNotFoundError,
)
from actstore.formats import open_store
from actstore.formats.zarr import (
    ZarrLayout,
    ZarrOptions,
    ZarrReader,
    ZarrWriter,
    merge_run,
    shard_ranges,
    write_manifest,
    write_shards,
)
from actstore.formats.zarr.layout import (
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    choose_layout,
    choose_max_len,
    choose_t_chunk,
)
from actstore.formats.zarr.shards import shard_path
from actstore.sites import Site

N, H, SITES, LAYERS = 11, 8, ("resid.1", "resid.3", "mlp_out.3"), (1, 3, 3)
P_FULL = np.array([5, 1, 9, 3, 7, 2, 4, 9, 6, 8, 0])
R_FULL = np.array([2, 6, 0, 3, 1, 5, 4, 2, 7, 3, 1])


def zarr_plan(n=N) -> CapturePlan:
    """The capture plan of the synthetic prompt/response samples."""
    return CapturePlan(
        ckpt="synthetic",
        family="gpt2",
        modality="text",
        sites=tuple(Site.parse(s) for s in SITES),
        n_model_layers=4,
        d_model=H,
        tokens_per_example=int((P_FULL + R_FULL).max()),
        has_cls=False,
        n_examples=n,
        dataset_root="/synthetic",
        data={"kind": "synthetic"},
        classes=None,
        has_labels=False,
        has_tokens=True,
        batch_size=3,
        extras={
            "prompt_lengths": P_FULL[:n].tolist(),
            "response_lengths": R_FULL[:n].tolist(),
            "has_hallu_label": True,
        },
    )


def zarr_options(**kw) -> ZarrOptions:
    """Options giving :func:`layout` (P_max 8, R_max 6, chunks of 3 and 6 tokens)."""
    values = {"p_max": 8, "r_max": 6, "t_chunk_prompt": 3, "t_chunk_response": 6}
    values.update(samples_per_shard=4, **kw)
    return ZarrOptions(**values)


def make_writer(path, n=N, **options) -> ZarrWriter:
    """A writer of the synthetic samples to the store ``path`` (ending in ``.zarr``)."""
    return ZarrWriter.from_plan(zarr_plan(n), path, zarr_options(**options))


def layout(n=N, **kw) -> ZarrLayout:
    values = {
        "n_samples": n,
        "sites": SITES,
        "layers": LAYERS,
        "hidden_size": H,
        "p_max": 8,
        "r_max": 6,
        "t_chunk_prompt": 3,
        "t_chunk_response": 6,
    }
    values.update(kw)
    return ZarrLayout(**values)


def sample_acts(i: int) -> np.ndarray:
    """Activations ``[L, T, H]`` float32 of global sample ``i`` (T = its prompt + response)."""
    rng = np.random.default_rng(1000 + i)
    return rng.standard_normal((len(SITES), P_FULL[i] + R_FULL[i], H)).astype(np.float32) * (1 + i)


class SyntheticBatches:
    """Picklable producer: the batches of samples ``start..stop-1`` (runs in writer processes)."""

    def __init__(self, batch_size: int = 3) -> None:
        self.batch_size = batch_size

    def __call__(self, start: int, stop: int):
        for lo in range(start, stop, self.batch_size):
            ids = np.arange(lo, min(stop, lo + self.batch_size))
            width = int(max(P_FULL[ids] + R_FULL[ids]))
            acts = np.zeros((len(ids), len(SITES), width, H), dtype=np.float32)
            tokens = np.full((len(ids), width), 99, dtype=np.int32)
            for b, i in enumerate(ids):
                a = sample_acts(int(i))
                acts[b, :, : a.shape[1]] = a
                tokens[b, : a.shape[1]] = np.arange(a.shape[1]) + 10 * i
            yield Batch(
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


def write_store(path, **options) -> Path:
    writer = make_writer(path, **options)
    for batch in SyntheticBatches()(0, N):
        writer.write(batch)
    return writer.close()


def expected(i: int, k: int, part: str, lay: ZarrLayout) -> np.ndarray:
    """Stored values (float16, trimmed) of sample ``i``, layer position ``k``."""
    a = sample_acts(i)[k].astype(np.float16)
    p0, pk, r0, rk = lay.kept(int(P_FULL[i]), int(R_FULL[i]))
    return a[p0 : p0 + pk] if part == "prompt" else a[r0 : r0 + rk]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return write_store(tmp_path_factory.mktemp("zarr") / "activations.zarr")


# ---------------------------------------------------------------------------- layout maths


@settings(max_examples=200, deadline=None)
@given(max_len=st.integers(1, 5000), hidden=st.integers(1, 16384))
def test_t_chunk_stays_in_the_byte_range_when_the_length_allows(max_len, hidden):
    t = choose_t_chunk(max_len, hidden)
    n_chunks = -(-max_len // t)
    assert 1 <= t <= max_len and (n_chunks - 1) * t < max_len <= n_chunks * t
    chunk_bytes = t * hidden * 2
    if hidden * 2 <= MAX_CHUNK_BYTES:
        assert chunk_bytes <= MAX_CHUNK_BYTES
    if max_len * hidden * 2 >= 2 * MIN_CHUNK_BYTES:  # enough data for a full-size chunk
        assert chunk_bytes >= MIN_CHUNK_BYTES


def test_t_chunk_matches_the_spec_examples():
    assert [choose_t_chunk(n, 4096) for n in (64, 128, 256, 1024)] == [64, 128, 128, 128]
    assert choose_t_chunk(100, 32) == 100  # tiny H: one chunk per (sample, layer)
    assert choose_t_chunk(0, 4096) == 1  # an empty part has no chunks; Zarr needs a length


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(0, 400), min_size=1, max_size=60), q=st.floats(0.01, 1.0))
def test_max_len_is_the_smallest_length_covering_the_quantile(lengths, q):
    m = choose_max_len(lengths, quantile=q)
    values = np.array(lengths)
    assert np.mean(values <= m) >= q - 1e-12
    smaller = values[values < m]
    assert smaller.size == 0 or np.mean(values <= smaller.max()) < q


def test_choose_layout_records_truncation():
    choice = choose_layout(
        n_samples=N,
        sites=SITES,
        layers=LAYERS,
        hidden_size=H,
        prompt_lengths=P_FULL,
        response_lengths=R_FULL,
        quantile=0.8,
    )
    lay = choice.layout
    assert (lay.p_max, lay.r_max) == (8, 5) and lay.t_chunk_response == lay.r_max
    assert choice.attrs["prompt_truncated_count"] == 2  # the two 9s
    assert choice.attrs["response_truncated_fraction"] == pytest.approx(2 / N)
    assert choice.attrs["prompt_len_quantiles"]["max"] == 9


def test_layout_rejects_bad_values():
    with pytest.raises(ConfigError, match="t_chunk_prompt"):
        layout(t_chunk_prompt=9)
    with pytest.raises(ConfigError, match="twice"):
        layout(sites=("resid.1", "resid.1", "resid.2"))
    with pytest.raises(ConfigError, match="prompt_keep"):
        layout(prompt_keep="middle")
    assert shard_ranges(11, 3) == [(0, 4), (4, 8), (8, 11)]
    with pytest.raises(ConfigError):
        shard_ranges(2, 3)


# ---------------------------------------------------------------------------- bytes on disk


def test_zarr_metadata_and_chunk_bytes_follow_the_spec(store):
    lay = layout()
    for part, shape, chunks in (
        ("prompt", [N, 3, 8, H], [1, 1, 3, H]),
        ("response", [N, 3, 6, H], [1, 1, 6, H]),
    ):
        zarray = json.loads((store / f"arrays/{part}_activations/.zarray").read_text())
        assert zarray == {
            "shape": shape,
            "chunks": chunks,
            "dtype": "<f2",
            "fill_value": 0.0,
            "order": "C",
            "filters": None,
            "dimension_separator": ".",
            "compressor": None,
            "zarr_format": 2,
        }
    for name, dtype in (
        ("prompt_len", "<i4"),
        ("response_len", "<i4"),
        ("sample_key", "|S64"),
        ("hallu_label", "|i1"),
    ):
        zarray = json.loads((store / f"arrays/{name}/.zarray").read_text())
        assert zarray["dtype"] == dtype and zarray["compressor"] is None and zarray["shape"] == [N]
    # chunk file = raw little-endian float16, C order, full chunk size (tail zero-padded)
    raw = (store / "arrays/prompt_activations/2.1.2.0").read_bytes()
    want = np.zeros((3, H), dtype="<f2")
    want[:2] = expected(2, 1, "prompt", lay)[6:8]
    assert raw == want.tobytes()
    # a chunk holding only padding is not stored (zarr's fill value 0 stands for it)
    assert not (store / "arrays/prompt_activations/1.0.1.0").exists()
    assert not (store / "arrays/response_activations/2.0.0.0").exists()
    attrs = json.loads((store / ".zattrs").read_text())
    for key in (
        "schema_version",
        "model_id",
        "num_layers",
        "hidden_size",
        "dtype",
        "T_max",
        "P_max",
        "R_max",
        "T_chunk_prompt",
        "T_chunk_response",
        "chunks",
        "created_at",
        "prompt_truncated_count",
        "prompt_truncated_fraction",
        "response_truncated_count",
        "response_truncated_fraction",
        "layers",
        "sites",
    ):
        assert key in attrs, key
    assert attrs["prompt_truncated_count"] == 2 and attrs["response_truncated_count"] == 1
    assert attrs["dtype"] == "float16" and attrs["num_layers"] == 3
    zmeta = json.loads((store / ".zmetadata").read_text())["metadata"]
    assert "arrays/prompt_activations/.zarray" in zmeta and ".zattrs" in zmeta
    lines = (store / "text/prompts.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    assert first == {"i": 0, "sample_key": first["sample_key"], "prompt": "prompt 0"}
    assert len(first["sample_key"]) == 64 and len(lines) == N
    assert (
        json.loads((store / "text/responses.jsonl").read_text().splitlines()[3])["response"]
        == "response 3"
    )
    assert (store / "arrays/prompt_activations/0.0.0.0").stat().st_mode & 0o222 == 0  # read-only


def test_plain_zarr_python_reads_the_store_without_actstore(store, tmp_path):
    lay = layout()
    want = {
        f"{part}_{i}_{k}": expected(i, k, part, lay)
        for part in ("prompt", "response")
        for i in range(N)
        for k in range(3)
    }
    np.savez(tmp_path / "want.npz", **want)
    script = textwrap.dedent("""
        import sys
        sys.modules["actstore"] = None  # any import of actstore fails
        import json
        import numpy as np
        import zarr
        store, want = sys.argv[1], np.load(sys.argv[2])
        root = zarr.open_consolidated(store, mode="r", zarr_format=2)
        assert root.attrs["dtype"] == "float16"
        prompt, response = root["arrays/prompt_activations"], root["arrays/response_activations"]
        p_len, r_len = root["arrays/prompt_len"][:], root["arrays/response_len"][:]
        for i in range(prompt.shape[0]):
            for k in range(prompt.shape[1]):
                np.testing.assert_array_equal(prompt[i, k, : p_len[i]], want[f"prompt_{i}_{k}"])
                np.testing.assert_array_equal(response[i, k, : r_len[i]], want[f"response_{i}_{k}"])
                assert not prompt[i, k, p_len[i]:].any() and not response[i, k, r_len[i]:].any()
        keys = root["arrays/sample_key"][:]
        assert keys.dtype == np.dtype("S64")
        lines = open(store + "/text/prompts.jsonl").read().splitlines()
        assert [json.loads(x)["sample_key"].encode() for x in lines] == list(keys)
        print("ok", prompt.shape, prompt.dtype)
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script, str(store), str(tmp_path / "want.npz")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok (11, 3, 8, 8) float16")


# ---------------------------------------------------------------------------- reading


def test_read_returns_the_real_tokens(store):
    lay = layout()
    reader = ZarrReader(store)
    assert tuple(map(str, reader.sites)) == SITES and reader.d_model == H and len(reader) == N
    for i in range(N):
        for k, site in enumerate(SITES):
            for part in ("prompt", "response"):
                got = reader.read(i, site, part)
                assert got.dtype == np.float16 and got.shape == (reader.lengths(part)[i], H)
                np.testing.assert_array_equal(got, expected(i, k, part, lay))
    np.testing.assert_array_equal(reader.read(4, 3, "prompt"), reader.read(4, "resid.3", "prompt"))
    padded = reader.read(0, "resid.1", "prompt", trim=False)
    assert padded.shape == (8, H) and not padded[5:].any()
    out = np.empty((2, H), dtype=np.float16)
    assert reader.read(0, "mlp_out.3", "response", out=out) is out
    with pytest.raises(LayerNotStoredError, match="resid.2"):
        reader.read(0, 2)
    with pytest.raises(IndexOutOfRangeError):
        reader.read(N, 1)
    with pytest.raises(ConfigError, match="part"):
        reader.read(0, 1, "answer")
    assert reader.text(7, "response") == "response 7"
    assert reader.array("hallu_label").tolist() == [i % 2 for i in range(N)]
    assert reader.token_ids(2, "prompt").tolist() == list(range(20, 28))  # first 8 of 9


def test_read_touches_only_the_chunks_of_that_sample_and_layer(store, monkeypatch):
    reader = ZarrReader(store)
    opened: list[str] = []
    real_open = os.open

    def recording_open(path, *args, **kwargs):
        opened.append(str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", recording_open)
    reader.read(8, "resid.3", "prompt")  # 6 tokens, chunks of 3: chunks 0 and 1
    reader.read(8, "resid.3", "response")  # 7 > R_max 6 tokens: the one chunk
    assert [Path(p).relative_to(store).as_posix() for p in opened] == [
        "arrays/prompt_activations/8.1.0.0",
        "arrays/prompt_activations/8.1.1.0",
        "arrays/response_activations/8.1.0.0",
    ]


def test_batches_for_the_training_pattern(store):
    lay = layout()
    reader = ZarrReader(store)
    batch = reader.random_batch(6, np.random.default_rng(0), n_layers=2)
    assert batch["acts"].shape == (6, 2, 6, H) and batch["layers"].shape == (6, 2)
    for j, i in enumerate(batch["samples"]):
        assert batch["sites"][j][0] != batch["sites"][j][1]
        for m, site in enumerate(batch["sites"][j]):
            want = expected(int(i), SITES.index(site), "response", lay)
            np.testing.assert_array_equal(batch["acts"][j, m, : len(want)], want)
            assert not batch["acts"][j, m, len(want) :].any()
    acts, lengths = reader.read_batch(
        [2, 9], [["resid.1", "mlp_out.3"], [3, 1]], "prompt", trim=True
    )
    assert acts.shape == (2, 2, 8, H) and lengths.tolist() == [8, 8]
    np.testing.assert_array_equal(acts[1, 1], expected(9, 0, "prompt", lay))


def test_dataloader_workers_read_the_same_values(store):
    reader = ZarrReader(store)
    dataset = reader.dataset("response", n_layers=2, seed=3)
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, num_workers=2)
    seen = 0
    for batch in loader:
        for j, i in enumerate(batch["index"].tolist()):
            for m, layer_idx in enumerate(dataset.layers_of(i)):
                want = reader.read_index(i, int(layer_idx), "response", trim=False)
                np.testing.assert_array_equal(batch["acts"][j, m].numpy(), want)
            seen += 1
    assert seen == N and batch["acts"].dtype == torch.float16
    batches = list(
        dataset.loader(4, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(0))
    )
    assert sorted(torch.cat([b["index"] for b in batches]).tolist()) == list(range(N))
    for b in batches:
        items = [dataset[int(i)] for i in b["index"]]
        np.testing.assert_array_equal(
            b["acts"].numpy(), np.stack([x["acts"].numpy() for x in items])
        )
        assert b["layers"].tolist() == [x["layers"].tolist() for x in items]


def test_blocks_and_statistics(store):
    lay = layout()
    reader = ZarrReader(store)
    for k, site in enumerate(SITES):
        blocks = reader.blocks(site)
        rows = np.concatenate([reader.read_block(b) for b in blocks])
        want = np.concatenate(
            [
                expected(i, k, part, lay)
                for i in range(N)
                for part in ("prompt", "response")
                if len(expected(i, k, part, lay))
            ]
        )
        np.testing.assert_array_equal(rows, want)
        exact = (
            np.concatenate(  # the statistics describe the stored float16 values
                [
                    sample_acts(i)[k][
                        np.r_[0 : min(P_FULL[i], 8), P_FULL[i] : P_FULL[i] + min(R_FULL[i], 6)]
                    ]
                    for i in range(N)
                ]
            )
            .astype(np.float16)
            .astype(np.float64)
        )
        stats = reader.statistics(site)
        assert stats.count == len(exact) == len(rows)
        np.testing.assert_allclose(stats.mean, exact.mean(0), rtol=1e-10)
        np.testing.assert_allclose(stats.var, exact.var(0), rtol=1e-10)


@pytest.mark.parametrize("batch_size", [1, 2])
def test_a_sample_without_tokens_is_stored_and_the_statistics_count_the_rest(
    tmp_path, monkeypatch, batch_size
):
    # sample 3 (the last of shard 0) has neither prompt nor response: a batch of its own
    # holds no token (batch_size 1), or it ends a batch (2); verify recomputes statistics
    lengths = {"P_FULL": P_FULL.copy(), "R_FULL": R_FULL.copy()}
    for name, values in lengths.items():
        values[3] = 0
        monkeypatch.setattr(sys.modules[__name__], name, values)
    writer = make_writer(tmp_path / "a.zarr")
    for batch in SyntheticBatches(batch_size)(0, N):
        writer.write(batch)
    reader = ZarrReader(writer.close())
    assert reader.verify().ok
    lay = layout()
    kept = sum(sum(lay.kept(int(P_FULL[i]), int(R_FULL[i]))[1::2]) for i in range(N))
    for site in SITES:
        assert reader.statistics(site).count == kept
        assert sum(b.n_rows for b in reader.blocks(site)) == kept


# ---------------------------------------------------------------------------- publication


def test_nothing_is_published_until_close(tmp_path):
    final = tmp_path / "activations.zarr"
    writer = make_writer(final)
    batches = SyntheticBatches()(0, N)
    writer.write(next(batches))
    assert not final.exists()
    with pytest.raises(StoreNotFoundError):
        open_store(final)
    (partial,) = tmp_path.glob(".activations.zarr.partial")
    with pytest.raises(CorruptStoreError, match="unfinished"):
        ZarrReader(partial)
    with pytest.raises(CaptureError, match="only 3 of 11"):
        writer.close()
    # no shard was finished: nothing worth resuming is left behind
    assert not final.exists() and not list(tmp_path.glob(".*"))
    with pytest.raises(CaptureError, match="order"):
        w = make_writer(final)
        w.write(list(SyntheticBatches()(0, N))[1])


def test_a_killed_writer_leaves_nothing_a_reader_accepts(tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_zarr_store import N, SyntheticBatches, make_writer
        w = make_writer({str(tmp_path / "activations.zarr")!r})
        for k, batch in enumerate(SyntheticBatches()(0, N)):
            w.write(batch)
            if k == 2:
                os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, timeout=120, check=False
    )
    assert proc.returncode == -signal.SIGKILL
    assert not (tmp_path / "activations.zarr").exists()
    assert len(list(tmp_path.glob(".activations.zarr.partial"))) == 1
    with pytest.raises(StoreNotFoundError):
        open_store(tmp_path)
    path = write_store(tmp_path / "activations.zarr")  # a fresh writer is unaffected
    assert ZarrReader(path).verify().ok


def test_existing_store_is_kept(store):
    assert make_writer(store).complete
    with pytest.raises(StoreExistsError):
        make_writer(store, r_max=5)


def _copy(store: Path, tmp_path: Path) -> Path:
    import shutil

    target = tmp_path / "copy.zarr"
    shutil.copytree(store, target)
    for dirpath, _, names in os.walk(target):
        for name in names:
            os.chmod(os.path.join(dirpath, name), 0o644)
    return target


def test_texts_with_unicode_line_separators_verify(tmp_path):
    """Regression: verify split text/*.jsonl with str.splitlines(), which also breaks at
    U+2028 / U+0085 that json.dumps(ensure_ascii=False) keeps raw, and then crashed."""
    odd = "line\u2028separator, next\u0085line, para\u2029end"
    writer = make_writer(tmp_path / "activations.zarr")
    for batch in SyntheticBatches()(0, N):
        batch.extras["prompt_text"] = [f"{odd} {i}" for i in batch.example_ids]
        writer.write(batch)
    reader = ZarrReader(writer.close())
    assert reader.text(4, "prompt") == f"{odd} 4" and reader.text(5, "response") == "response 5"
    report = reader.verify()
    assert report.ok, report.faults


def test_damage_is_detected(store, tmp_path):
    copy = _copy(store, tmp_path)
    chunk = copy / "arrays/response_activations/5.2.0.0"
    data = bytearray(chunk.read_bytes())
    data[10] ^= 0x40
    chunk.write_bytes(bytes(data))
    report = ZarrReader(copy).verify()
    assert not report.ok and any("sample 5" in f for f in report.faults)
    chunk.write_bytes(bytes(data[:-2]))
    with pytest.raises(
        CorruptStoreError, match="chunk files of 2878 bytes, the manifest says 30 of"
    ):
        ZarrReader(copy)  # the chunk folder's bytes are counted at open
    with pytest.raises(CorruptStoreError, match="truncated"):
        ZarrReader(copy, verify_reads=False).read(5, "mlp_out.3", "response")
    zmeta_path = copy / ".zmetadata"
    zmeta = json.loads(zmeta_path.read_text())
    zmeta["metadata"]["arrays/prompt_activations/.zarray"]["compressor"] = {"id": "zstd"}
    zmeta_path.write_text(json.dumps(zmeta))
    with pytest.raises(CorruptStoreError, match="does not match its root manifest"):
        ZarrReader(copy)
    with pytest.raises(CorruptStoreError, match="compressor"):  # the layout check behind it
        ZarrReader(copy, verify_reads=False)
    zmeta["metadata"][".zattrs"]["schema_version"] = "2.0"
    zmeta_path.write_text(json.dumps(zmeta))
    with pytest.raises(ProtocolVersionError):
        ZarrReader(copy, verify_reads=False)
    zmeta_path.unlink()
    with pytest.raises(StoreNotFoundError, match="no .zmetadata"):
        ZarrReader(copy)


# ---------------------------------------------------------------------------- sharded runs


@pytest.mark.slow
def test_parallel_shards_manifest_multi_shard_reader_and_merge(store, tmp_path):
    run = tmp_path / "run_test"
    manifest = write_shards(
        run, zarr_plan(), SyntheticBatches(), n_writers=2, options=zarr_options(), progress=False
    )
    pids = {t["pid"] for t in manifest["timings"]}
    assert len(pids) == 2 and os.getpid() not in pids  # one process per shard
    on_disk = json.loads((run / "manifest.json").read_text())
    assert on_disk["shards"] == [
        {"index": 0, "path": "shards/shard-0000.zarr", "start": 0, "n_samples": 6},
        {"index": 1, "path": "shards/shard-0001.zarr", "start": 6, "n_samples": 5},
    ]
    single, sharded = ZarrReader(store), open_store(run)
    assert isinstance(sharded, ZarrReader) and len(sharded.stores) == 2 and len(sharded) == N
    assert sharded.locate(7) == (1, 1)
    for site in SITES:
        for i in range(N):
            for part in ("prompt", "response"):
                np.testing.assert_array_equal(
                    sharded.read(i, site, part), single.read(i, site, part)
                )
        a, b = single.statistics(site), sharded.statistics(site)
        assert a.count == b.count
        np.testing.assert_allclose(b.mean, a.mean, rtol=1e-12)
        np.testing.assert_allclose(b.var, a.var, rtol=1e-12)
        assert [x.n_rows for x in sharded.blocks(site)] == [x.n_rows for x in single.blocks(site)]
    assert sharded.sample_keys == single.sample_keys and sharded.text(9, "prompt") == "prompt 9"
    assert sharded.verify().ok

    merged = merge_run(run, progress=False)
    assert merged == run / "merged" / "activations.zarr"
    assert json.loads((run / "manifest.json").read_text())["merged"] == "merged/activations.zarr"
    # same chunking, and every array file byte-identical to the single-writer store
    files = lambda root: {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in (root / "arrays").rglob("*")
        if p.is_file()
    }
    assert files(merged) == files(store)
    for name in ("text/prompts.jsonl", "text/responses.jsonl"):
        assert (merged / name).read_text() == (store / name).read_text()
    m = ZarrReader(merged)
    assert m.attrs["prompt_truncated_count"] == 2 and "shard" not in m.attrs
    assert m.verify().ok
    assert merge_run(run, progress=False) == merged  # merged already: nothing to do


def test_manifest_refuses_a_missing_shard(tmp_path):
    run = tmp_path / "run"
    writer = ZarrWriter.for_shard(zarr_plan(), run, 1, 2, zarr_options())
    assert writer.example_range == (6, 11)
    for batch in SyntheticBatches()(6, 11):
        writer.write(batch)
    writer.close()
    assert shard_path(run, 1).is_dir()
    with pytest.raises(CaptureError, match=r"shards \[0\] of 2"):
        write_manifest(run)
    with pytest.raises(StoreNotFoundError, match="no manifest.json"):
        ZarrReader(run)


def test_shared_loader_serves_every_stored_token_once_aligned_across_sites(store):
    from actstore.loader import ActivationLoader

    reader = ZarrReader(store)
    loader = ActivationLoader(
        reader,
        sites=("resid.1", "mlp_out.3"),
        batch_size=7,
        pool_blocks=3,
        dtype="float16",
        return_index=True,
    )
    acts, rows = zip(*[(b.acts, b.rows) for b in loader])
    acts, rows = torch.cat(acts).numpy(), torch.cat(rows).numpy()
    stored = {
        site: np.concatenate([reader.read_block(b) for b in reader.blocks(site)])
        for site in ("resid.1", "mlp_out.3")
    }
    assert sorted(rows.tolist()) == list(range(len(stored["resid.1"])))
    np.testing.assert_array_equal(acts[:, 0], stored["resid.1"][rows])
    np.testing.assert_array_equal(acts[:, 1], stored["mlp_out.3"][rows])


def test_batches_without_prompt_response_lengths_store_prompts_only(tmp_path):
    """Packed captures and conversions carry no split: all tokens are the prompt, R_max = 0."""
    from actstore.testing import make_acts, make_batches, make_plan

    plan = make_plan()
    acts = make_acts(plan)
    writer = ZarrWriter.from_plan(plan, tmp_path)
    for batch in make_batches(plan, acts):
        writer.write(batch)
    reader = ZarrReader(writer.close())
    assert (reader.layout.p_max, reader.layout.r_max) == (plan.tokens_per_example, 0)
    assert reader.read(3, "resid.1", "response").shape == (0, plan.d_model)
    np.testing.assert_array_equal(
        reader.read(3, "resid.3", "prompt"), acts["resid.3"][3].astype(np.float16)
    )
    assert reader.random_batch(4, np.random.default_rng(0))["acts"].shape == (4, 2, 0, plan.d_model)
    assert not list((reader.path / "arrays/response_activations").glob("*.*.*.*"))
    assert reader.verify().ok and reader.text(5) == "example 5"
    import zarr

    root = zarr.open_consolidated(str(reader.path), mode="r")
    assert root["arrays/response_activations"].shape == (plan.n_examples, 2, 0, plan.d_model)


def test_negative_zero_chunks_are_stored_read_back_bit_exact_and_verify(tmp_path):
    """Regression: a chunk of -0.0 equals 0 but zarr stores it (it compares bits); the chunk
    digests must count it stored too, or the published store fails its own checks."""
    writer = make_writer(tmp_path / "activations.zarr")
    sent = {}
    for batch in SyntheticBatches()(0, N):
        for k, site in enumerate(SITES):
            acts = batch.acts[site].numpy()
            for b, i in enumerate(batch.example_ids.tolist()):
                if i == 2:  # every value -0.0
                    acts[b] = -0.0
                elif i == 4:  # -0.0 and +0.0 mixed, every other token
                    acts[b] = 0.0
                    acts[b, 1::2] = -0.0
            for b, i in enumerate(batch.example_ids.tolist()):
                sent[i, k] = acts[b, : P_FULL[i] + R_FULL[i]].astype(np.float16)
        writer.write(batch)
    reader = ZarrReader(writer.close())
    report = reader.verify()
    assert report.ok, report.faults
    lay = reader.layout
    for i in (2, 4):
        for k, site in enumerate(SITES):
            p0, pk, r0, rk = lay.kept(int(P_FULL[i]), int(R_FULL[i]))
            want = sent[i, k]
            got_p, got_r = reader.read(i, site, "prompt"), reader.read(i, site, "response")
            np.testing.assert_array_equal(got_p.view(np.uint16), want[p0 : p0 + pk].view(np.uint16))
            np.testing.assert_array_equal(got_r.view(np.uint16), want[r0 : r0 + rk].view(np.uint16))
    assert (reader.read(2, "resid.1", "prompt").view(np.uint16) == 0x8000).all()
    assert ZarrReader(reader.path).verify().ok  # a fresh open checks every chunk again
