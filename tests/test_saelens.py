"""The saelens format: sae_lens's own ActivationsStore reads what actstore captures, exactly;
captures resume byte-identically, verify catches damage, the loader serves every row once,
conversion round-trips, distributed parts merge, and caches sae_lens wrote open too."""

from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from forked import run_actstore
from typer.testing import CliRunner

from actstore import ActivationLoader
from actstore.capture import CaptureConfig, capture
from actstore.cli import app
from actstore.convert import convert
from actstore.dist import capture_distributed
from actstore.errors import ConfigError, StoreExistsError
from actstore.formats import open_store
from actstore.formats.journal import recorded_shards
from actstore.formats.saelens import (
    ColumnSite,
    SaelensOptions,
    SaelensReader,
    SaelensWriter,
    hook_name,
)
from actstore.sites import Site
from actstore.testing import ConformanceSuite, FormatCase, make_acts, make_batches, make_plan

SMALL = SaelensOptions(examples_per_shard=4, block_kb=1)
SITES = ("resid.1", "mlp_out.2", "attn_out.0")
N_EXAMPLES, CONTEXT = 10, 8


def files(store: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(store).iterdir()) if p.is_file()}


def rows(reader, site) -> np.ndarray:
    return np.concatenate([reader.read_block(b) for b in reader.blocks(site)])


def unverified_warnings(caplog, store) -> int:
    """How often opening ``store`` warned that it has no root manifest to check it by."""
    message = (
        f"{store} has no actstore manifest (written by another tool): its contents cannot be "
        "verified"
    )
    return [r.getMessage() for r in caplog.records].count(message)


def sae_lens_store(path, column: str, context: int, d_in: int, batch: int):
    from sae_lens.training.activations_store import ActivationsStore

    return ActivationsStore(
        model=None,
        dataset=None,
        streaming=False,
        hook_name=column,
        hook_head_index=None,
        context_size=context,
        d_in=d_in,
        n_batches_in_buffer=2,
        total_training_tokens=10_000,
        store_batch_size_prompts=batch,
        train_batch_size_tokens=16,
        prepend_bos=False,
        normalize_activations="none",
        device=torch.device("cpu"),
        dtype="float32",
        cached_activations_path=str(path),
    )


@pytest.fixture(scope="module")
def config(model_dir, text_file):
    return CaptureConfig(
        model=str(model_dir("gpt2")),
        dataset=str(text_file),
        sites=SITES,
        batch_size=3,
        context_length=CONTEXT,
        max_examples=N_EXAMPLES,
        progress=False,
    )


@pytest.fixture(scope="module")
def captured(tmp_path_factory, model_dir, text_file):
    """A store captured with the CLI (3 sites, 3 files, blocks of 1 example)."""
    out = tmp_path_factory.mktemp("cli") / "acts"
    result = CliRunner().invoke(
        app,
        [
            "capture",
            "--model",
            str(model_dir("gpt2")),
            "--dataset",
            str(text_file),
            "--sites",
            ",".join(SITES),
            "--context-length",
            str(CONTEXT),
            "--max-examples",
            str(N_EXAMPLES),
            "--batch-size",
            "3",
            "--format",
            "saelens",
            "--opt",
            "examples_per_shard=4",
            "--opt",
            "block_kb=1",
            "--out",
            str(out),
            "--no-progress",
        ],
    )
    assert result.exit_code == 0, result.output
    return out


# ---------------------------------------------------------------- sae_lens reads it


def test_sae_lens_activations_store_reads_the_capture_exactly(captured):
    reader = SaelensReader(captured)
    assert reader.sites == tuple(Site.parse(s) for s in SITES)
    assert reader.columns == tuple(hook_name(s) for s in SITES)
    assert reader.columns == (
        "blocks.1.hook_resid_post",
        "blocks.2.hook_mlp_out",
        "blocks.0.hook_attn_out",
    )
    ds = datasets.load_from_disk(str(captured))
    assert isinstance(ds, datasets.Dataset) and len(ds) == N_EXAMPLES
    assert ds.features["blocks.1.hook_resid_post"] == datasets.Array2D((CONTEXT, 32), "float32")
    assert ds.features["token_ids"] == datasets.Sequence(datasets.Value("int32"), length=CONTEXT)
    assert sorted(p.name for p in captured.glob("data-*.arrow")) == [
        f"data-0000{i}-of-00003.arrow" for i in range(3)
    ]
    assert reader.tokens.shape == (N_EXAMPLES, CONTEXT)
    tokens = np.asarray(reader.tokens)  # read (and checked) by record batch
    assert tokens.dtype == np.int32 and tokens.shape == (N_EXAMPLES, CONTEXT)
    for column in reader.columns:
        store = sae_lens_store(captured, column, CONTEXT, 32, batch=2)
        got = [store.get_raw_llm_batch() for _ in range(N_EXAMPLES // 2)]
        acts = torch.cat([a for a, _ in got]).numpy()
        ids = torch.cat([t for _, t in got]).numpy()
        np.testing.assert_array_equal(acts, rows(reader, column))
        np.testing.assert_array_equal(ids, tokens.reshape(-1))
        assert np.abs(acts).max() > 0
        stats = reader.statistics(column)
        np.testing.assert_allclose(stats.mean, acts.astype(np.float64).mean(0), atol=1e-12)
    assert SaelensReader(captured).verify().ok


def test_inspect_and_verify_commands(captured):
    shown = CliRunner().invoke(app, ["inspect", str(captured), "--json"])
    assert shown.exit_code == 0, shown.output
    summary = json.loads(shown.output)
    assert summary["n_examples"] == N_EXAMPLES and summary["context_size"] == CONTEXT
    assert summary["sites"] == list(SITES)
    assert "blocks.2.hook_mlp_out" in summary["columns"]
    assert summary["per_site"]["mlp_out.2 (blocks.2.hook_mlp_out)"]["rows"] == N_EXAMPLES * CONTEXT
    checked = CliRunner().invoke(app, ["verify", str(captured), "--no-progress"])
    assert checked.exit_code == 0, checked.output


def test_sae_lens_trains_an_sae_from_the_capture(captured, tmp_path):
    from sae_lens import (
        LanguageModelSAERunnerConfig,
        LanguageModelSAETrainingRunner,
        LoggingConfig,
    )
    from sae_lens.saes.standard_sae import StandardTrainingSAEConfig
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    # sae_lens's runner also wants a model and dataset for its evaluations; a
    # TransformerLens model of the same shape (offline, random weights) stands in.
    model = HookedTransformer(
        HookedTransformerConfig(
            n_layers=4, d_model=32, n_ctx=CONTEXT, d_head=8, d_vocab=300, act_fn="gelu"
        )
    )
    ids = np.asarray(SaelensReader(captured).tokens).astype(np.int64)
    tokens = datasets.Dataset.from_dict({"tokens": ids})
    cfg = LanguageModelSAERunnerConfig(
        sae=StandardTrainingSAEConfig(d_in=32, d_sae=64),
        model_name="tiny",
        hook_name="blocks.1.hook_resid_post",
        dataset_path="unused",
        context_size=CONTEXT,
        use_cached_activations=True,
        cached_activations_path=str(captured),
        training_tokens=64,
        train_batch_size_tokens=16,
        store_batch_size_prompts=2,
        n_batches_in_buffer=2,
        n_eval_batches=1,
        eval_batch_size_prompts=2,
        device="cpu",
        act_store_device="cpu",
        logger=LoggingConfig(log_to_wandb=False),
        output_path=str(tmp_path / "sae"),
        checkpoint_path=str(tmp_path / "ckpt"),
        n_checkpoints=0,
    )
    runner = LanguageModelSAETrainingRunner(cfg, override_dataset=tokens, override_model=model)
    before = runner.sae.W_enc.detach().clone()
    sae = runner.run()
    assert not torch.equal(before, sae.W_enc.detach())
    assert torch.isfinite(sae.W_enc).all()


# ---------------------------------------------------------------- resume, verify, loader


def test_interrupted_writer_resumes_to_identical_bytes(tmp_path):
    plan = make_plan()
    acts = make_acts(plan)
    batches = make_batches(plan, acts)
    options = SaelensOptions(examples_per_shard=10, block_kb=1)
    clean = SaelensWriter.from_plan(plan, tmp_path / "clean", options)
    for batch in batches:
        clean.write(batch)
    clean.close()

    first = SaelensWriter.from_plan(plan, tmp_path / "crashed", options)
    for batch in batches[:4]:  # 16 examples: file 0 finished, file 1 half written
        first.write(batch)
    first.abort()  # what a kill leaves: no publication
    partial = tmp_path / ".crashed.partial"
    assert not (tmp_path / "crashed").exists() and partial.is_dir()
    with open(partial / "data-00001-of-00003.arrow", "ab") as f:
        f.write(b"torn write")
    again = SaelensWriter.from_plan(plan, tmp_path / "crashed", options)
    assert again.resume_from == 10
    for batch in batches:  # capture restarts at a batch boundary; the writer skips the rest
        again.write(batch)
    again.close()
    assert files(tmp_path / "crashed") == files(tmp_path / "clean")
    assert not partial.exists()
    done = SaelensWriter.from_plan(plan, tmp_path / "crashed", options)
    assert done.complete and done.resume_from == plan.n_examples
    with pytest.raises(StoreExistsError):
        SaelensWriter.from_plan(make_plan(d_model=4), tmp_path / "crashed", options)


def test_verify_catches_a_flipped_byte(captured, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(captured, copy)
    name = "data-00001-of-00003.arrow"
    data = copy / name
    data.chmod(0o644)
    raw = bytearray(data.read_bytes())
    at = len(raw) // 2
    raw[at] ^= 0x01
    data.write_bytes(bytes(raw))
    # the root manifest's blocks tile the file: find the one holding the flipped byte
    ranges = json.loads((copy / "actstore-manifest.json").read_text())["files"][name]["ranges"]
    block, (o, n) = next((k, r) for k, r in enumerate(ranges) if r[0] <= at < r[0] + r[1])
    report = SaelensReader(copy).verify()
    assert report.faults == [
        (
            f"{name}: 1 block(s) differ from the manifest, first block {block} "
            f"(bytes {o}-{o + n}): the file was changed, damaged or replaced"
        )
    ]


def test_loader_serves_every_row_once(captured):
    reader = SaelensReader(captured)
    expected = rows(reader, "resid.1")
    loader = ActivationLoader(
        reader, site="resid.1", batch_size=7, pool_blocks=3, return_index=True
    )
    xs, idx = zip(*loader)
    x, r = torch.cat(xs).numpy(), torch.cat(idx).numpy()
    assert sorted(r.tolist()) == list(range(len(expected)))
    np.testing.assert_array_equal(x, expected[r])


# ---------------------------------------------------------------- convert, parts


def test_convert_saev_to_saelens_and_back(config, tmp_path):
    resid = CaptureConfig(**{**config.__dict__, "sites": ("resid.1", "resid.3")})
    from actstore.formats.saev import SaevWriter

    saev = capture(resid, lambda plan: SaevWriter.from_plan(plan, tmp_path / "saev")).output
    there = convert(saev, tmp_path / "sl", to="saelens", options=SMALL, progress=False)
    assert there.lossless and there.verified
    back = convert(there.location, tmp_path / "back", to="saev", progress=False)
    assert back.lossless
    a, b = open_store(saev), open_store(back.location)
    for layer in (1, 3):
        np.testing.assert_array_equal(rows(a, layer), rows(b, layer))
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    assert (Path(back.location) / "acts000000.bin").read_bytes() == (
        Path(saev) / "acts000000.bin"
    ).read_bytes()


def test_distributed_parts_merge_to_the_one_process_store(config, captured, tmp_path):
    out = tmp_path / "dist"
    results = [
        capture_distributed(config, "saelens", str(out), SMALL, machine_id=i, n_machines=3)
        for i in range(3)
    ]
    assert [r.published is not None for r in results] == [False, False, True]
    assert files(out) == files(captured)
    assert not list(tmp_path.glob(".*.parts"))


# ---------------------------------------------------------------- caches sae_lens wrote


def test_opens_a_cache_sae_lens_wrote(model_dir, tmp_path, caplog):
    from sae_lens.cache_activations_runner import CacheActivationsRunner
    from sae_lens.config import CacheActivationsRunnerConfig

    n, t = 12, 8
    tokens = np.random.default_rng(0).integers(4, 300, (n, t))
    out = tmp_path / "theirs"
    cfg = CacheActivationsRunnerConfig(
        dataset_path="local",
        model_name=str(model_dir("gpt2")),
        model_class_name="AutoModelForCausalLM",
        model_batch_size=2,
        hook_name="transformer.h.1",
        d_in=32,
        training_tokens=n * t,
        context_size=t,
        new_cached_activations_path=str(out),
        device="cpu",
        buffer_size_gb=3 * 2 * t * 32 * 4 / 1e9,  # 3 model batches per file
        prepend_bos=False,
        streaming=False,
        shuffle=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = CacheActivationsRunner(
            cfg, override_dataset=datasets.Dataset.from_dict({"tokens": tokens})
        ).run()
    with caplog.at_level(logging.WARNING):
        reader = open_store(out)
        open_store(out)
    assert unverified_warnings(caplog, out) == 1  # one warning per location
    assert not reader.verified and reader.n_examples == n and len(reader.arrow_files) == 2
    # an HF module name denotes no actstore site: the column is keyed by its own name
    assert reader.sites == (ColumnSite("transformer.h.1", -1),)
    assert reader.site("transformer.h.1") == reader.sites[0]
    want = np.asarray(theirs.with_format("numpy")["transformer.h.1"]).reshape(-1, 32)
    np.testing.assert_array_equal(rows(reader, "transformer.h.1"), want)
    np.testing.assert_array_equal(np.asarray(reader.tokens), tokens)
    # nothing to verify its bytes against: verify fails, though every file parses
    report = reader.verify()
    assert not report.ok and report.files_checked == 2
    assert [f for f in report.faults if "no root manifest" not in f] == []
    assert reader.statistics("transformer.h.1") is None
    described = reader.describe()
    assert described["sites"] == ["transformer.h.1"] and not described["verified"]
    loader = ActivationLoader(reader, batch_size=5, return_index=True)
    assert sorted(torch.cat([r for _, r in loader]).tolist()) == list(range(n * t))
    with pytest.raises(ConfigError, match="no actstore site name"):
        reader.capture_plan()


def test_a_sae_lens_cache_with_transformer_lens_names_converts(tmp_path, caplog):
    # The features sae_lens's CacheActivationsRunner declares, saved the way it saves
    # (save_to_disk), for a TransformerLens model's hook: no actstore sidecars.
    n, t, d = 9, 5, 6
    acts = np.random.default_rng(1).standard_normal((n, t, d)).astype(np.float32)
    ids = np.arange(n * t, dtype=np.int32).reshape(n, t)
    features = datasets.Features(
        {
            "blocks.2.hook_resid_post": datasets.Array2D(shape=(t, d), dtype="float32"),
            "token_ids": datasets.Sequence(datasets.Value(dtype="int32"), length=t),
        }
    )
    datasets.Dataset.from_dict(
        {"blocks.2.hook_resid_post": acts, "token_ids": ids}, features=features
    ).save_to_disk(str(tmp_path / "theirs"), num_shards=2)
    with caplog.at_level(logging.WARNING):
        result = convert(tmp_path / "theirs", tmp_path / "saev", to="saev", progress=False)
    assert unverified_warnings(caplog, tmp_path / "theirs") == 1
    assert result.lossless and result.rows == {"resid.2": n * t}
    saev = open_store(result.location)
    np.testing.assert_array_equal(rows(saev, 2), acts.reshape(-1, d))
    np.testing.assert_array_equal(np.asarray(saev.tokens), ids)


# ---------------------------------------------------------------- bad input


def test_bad_options_and_plans_are_refused_clearly(tmp_path):
    with pytest.raises(ConfigError, match="dtype"):
        SaelensOptions(dtype="bfloat16")
    with pytest.raises(ConfigError, match="shard_mb"):
        SaelensOptions(shard_mb=5000)
    with pytest.raises(ConfigError, match="text"):
        SaelensWriter.from_plan(make_plan(modality="image", family="clip"), tmp_path / "x")
    assert not (tmp_path / "x").exists()
    result = CliRunner().invoke(
        app, ["capture", "--format", "saelens", "--opt", "dtype=int8", "--out", str(tmp_path)]
    )
    assert isinstance(result.exception, ConfigError) and "dtype" in str(result.exception)


def test_sae_lens_reads_a_float16_store(tmp_path):
    plan = make_plan()
    acts = make_acts(plan)
    writer = SaelensWriter.from_plan(plan, tmp_path / "half", SaelensOptions(dtype="float16"))
    for batch in make_batches(plan, acts):
        writer.write(batch)
    store = sae_lens_store(writer.close(), "blocks.3.hook_resid_post", 6, 8, batch=4)
    got, _ = store.get_raw_llm_batch()
    want = acts["resid.3"][:4].reshape(-1, 8).astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(got.numpy(), want)


def test_site_spellings(tmp_path):
    plan = make_plan()
    writer = SaelensWriter.from_plan(plan, tmp_path / "s", SMALL)
    for batch in make_batches(plan, make_acts(plan)):
        writer.write(batch)
    reader = SaelensReader(writer.close())
    for spelling in ("resid.3", 3, Site("resid", 3), "blocks.3.hook_resid_post"):
        assert reader.column(spelling) == "blocks.3.hook_resid_post"
    assert reader.site("blocks.3.hook_resid_post") == Site("resid", 3)


# ---------------------------------------------------------------- conformance


#: A SAELens cache is activation and token-id columns: no class labels.
SAELENS_CANNOT_HOLD = {"labels": "a SAELens cache keeps activations and token ids only"}


class TestSaelensConformance(ConformanceSuite):
    case = FormatCase(
        "saelens",
        SaelensOptions(examples_per_shard=10, block_kb=1),
        cannot_hold=SAELENS_CANNOT_HOLD,
    )


class TestSaelensFloat16Conformance(ConformanceSuite):
    case = FormatCase(
        "saelens",
        SaelensOptions(examples_per_shard=10, block_kb=1, dtype="float16"),
        stored_dtype="float16",
        cannot_hold=SAELENS_CANNOT_HOLD,
        check_crashes="crash and resume are checked on TestSaelensConformance's float32 cache",
    )


# ---------------------------------------------------------------- kill -9


@pytest.mark.slow
def test_sigkill_mid_capture_then_resume_is_byte_identical(model_dir, text_file, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from actstore.errors import CorruptStoreError

    env = {**os.environ, "TQDM_DISABLE": "1"}

    def run(out, argv_only=False):
        cmd = ["capture", "--model", str(model_dir("gpt2"))]
        cmd += ["--dataset", str(text_file), "--sites", "resid.1,mlp_out.3", "--batch-size", "2"]
        cmd += ["--context-length", "16", "--max-examples", "120", "--format", "saelens"]
        cmd += ["--opt", "examples_per_shard=2", "--out", str(out), "--no-progress"]
        if argv_only:
            return cmd
        return subprocess.Popen(
            [sys.executable, "-m", "actstore", *cmd],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )

    def finished(partial):
        return recorded_shards(partial)

    crashed, clean = tmp_path / "crashed", tmp_path / "clean"
    partial = tmp_path / ".crashed.partial"
    proc = run(crashed)
    deadline = time.monotonic() + 120
    while finished(partial) < 3:
        assert proc.poll() is None, "finished before the kill:\n" + proc.stdout.read().decode()
        assert time.monotonic() < deadline, "capture made no progress"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not crashed.exists()
    with pytest.raises(CorruptStoreError, match="unfinished capture"):
        SaelensReader(partial)
    # the killed run above is started as the console script is; the reruns are processes
    # of their own, forked from a helper that imported torch once (tests/forked.py)
    resumed = run_actstore(*run(crashed, argv_only=True), env=env, timeout=300)
    log = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0 and "resuming at example" in log, log
    reference = run_actstore(*run(clean, argv_only=True), env=env, timeout=300)
    assert reference.returncode == 0, reference.stderr
    assert files(crashed) == files(clean)
    assert len(list(clean.glob("data-*.arrow"))) == 60
    assert not partial.exists()
