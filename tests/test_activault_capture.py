"""Capture into the activault format end to end: the CLI against a real S3 server and a
local directory, token cleaning, and a capture SIGKILLed mid-run then resumed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from forked import run_actstore
from test_activault_s3 import stored_stream
from typer.testing import CliRunner

from actstore.capture import CaptureConfig, capture
from actstore.capture.cleaning import TokenCleaner
from actstore.cli import app
from actstore.errors import CorruptStoreError
from actstore.formats import open_store
from actstore.formats.activault import ActivaultOptions, ActivaultReader, ActivaultWriter
from actstore.sites import Site

runner = CliRunner()


def invoke(*args: str):
    result = runner.invoke(app, [str(a) for a in args], catch_exceptions=False)
    return result


def test_cli_capture_to_s3_then_ls_inspect_verify(s3, model_dir, text_file):
    out = s3.url("gpt2-run")
    result = invoke(
        "capture",
        "--model",
        model_dir("gpt2"),
        "--dataset",
        text_file,
        "--sites",
        "resid.1,mlp_out.2,attn_in.0",
        "--context-length",
        16,
        "--max-examples",
        48,
        "--batch-size",
        8,
        "--format",
        "activault",
        "--out",
        out,
        "--opt",
        "rows_per_file=8",
        "--no-progress",
    )
    assert result.exit_code == 0, result.output
    assert out in result.output and "r.blocks('attn_in.0')" in result.output  # sites, not hooks
    reader = open_store(out)
    assert reader.sites == (Site("resid", 1), Site("mlp_out", 2), Site("attn_in", 0))
    assert reader.hooks == [
        "models.layers.1.post",
        "models.layers.2.mlp.post",
        "models.layers.0.self_attn.pre",
    ]
    assert reader.record.token_mask is True  # cleaning is on by default for activault
    eos = 2  # tiny models' </s>, the separator between documents
    for hook in reader.hooks:
        _, ids = stored_stream(reader, hook)
        assert eos not in ids.tolist()

    listing = invoke("ls", out)
    assert listing.exit_code == 0
    assert listing.output.startswith(f"{out}: activault") and "attn_in.0" in listing.output
    assert "gpt2-run/" in invoke("ls", s3.url()).output
    hook = "models.layers.1.post"
    hook_files = s3.keys(f"gpt2-run/{hook}/")  # the megabatches, metadata and statistics
    assert sum(k.endswith(".pt") for k in hook_files) == reader.n_files
    hook_listing = invoke("ls", s3.url("gpt2-run", hook), "--json")
    described = json.loads(hook_listing.output)
    assert described["sites"] == ["resid.1"] and described["hooks"] == {hook: "resid.1"}
    assert described["files"] == len(hook_files)  # the folder's, not the whole run's
    assert described["bytes"] == sum(hook_files.values())
    inspected = invoke("inspect", out, "--json")
    summary = json.loads(inspected.output)
    assert summary["format"].startswith("activault") and summary["complete"] is True
    assert summary["text"] and all(isinstance(t, str) and t for t in summary["text"])
    verified = invoke("verify", out, "--no-progress")
    assert verified.exit_code == 0 and "OK" in verified.output
    again = invoke(
        "capture",
        "--model",
        model_dir("gpt2"),
        "--dataset",
        text_file,
        "--sites",
        "resid.1,mlp_out.2,attn_in.0",
        "--context-length",
        16,
        "--max-examples",
        48,
        "--batch-size",
        8,
        "--format",
        "activault",
        "--out",
        out,
        "--opt",
        "rows_per_file=8",
        "--no-progress",
    )
    assert "Already captured" in again.output


def test_cli_capture_to_a_local_directory_without_cleaning(tmp_path, model_dir, text_file):
    out = tmp_path / "run"
    result = invoke(
        "capture",
        "--model",
        model_dir("qwen2"),
        "--dataset",
        text_file,
        "--layers",
        "1,3",
        "--context-length",
        16,
        "--max-examples",
        24,
        "--batch-size",
        8,
        "--format",
        "activault",
        "--out",
        f"file://{out}",
        "--opt",
        "rows_per_file=8",
        "--opt",
        "dtype=float16",
        "--no-clean",
        "--no-progress",
    )
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == [
        "actstore-manifest.json",  # the root manifest, written last
        "actstore-positions.npy",  # where each example's tokens lie (actstore's own)
        "cfg.json",
        "models.layers.1.post",
        "models.layers.3.post",
    ]
    reader = open_store(out)
    assert reader.n_files == 3 and reader.dtype == np.float16 and reader.record.token_mask is False
    names = sorted(p.name for p in (out / "models.layers.3.post").iterdir())
    assert names[-2:] == ["metadata.json", "statistics.json"]
    assert all(n.endswith(".pt") for n in names[:-2]) and len(names) == 5


def test_token_cleaning_stores_exactly_the_kept_tokens(tmp_path, model_dir, text_file):
    def run(clean: bool):
        config = CaptureConfig(
            model=str(model_dir("llama")),
            dataset=str(text_file),
            sites=("resid.2",),
            context_length=24,
            max_examples=32,
            batch_size=8,
            progress=False,
            clean_tokens=clean,
        )
        out = str(tmp_path / ("clean" if clean else "raw"))
        options = ActivaultOptions(rows_per_file=8 if not clean else 3, dtype="float32")
        result = capture(config, lambda plan: ActivaultWriter.from_plan(plan, out, options))
        return ActivaultReader(result.output)

    raw, clean = run(False), run(True)
    hook = "models.layers.2.post"
    raw_states, raw_ids = stored_stream(raw, hook)  # every token: rows are the examples
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir("llama"))
    keep = TokenCleaner.from_tokenizer(tokenizer).mask(raw_ids.reshape(32, 24)).reshape(-1)
    assert 0 < (~keep).sum() < keep.size  # BOS at every window start, EOS between documents
    clean_states, clean_ids = stored_stream(clean, hook)
    n = clean_ids.size
    assert n == (keep.sum() // 72) * 72  # whole files of 3 rows x 24 tokens; the tail dropped
    np.testing.assert_array_equal(clean_ids, raw_ids[keep][:n])
    np.testing.assert_array_equal(clean_states, raw_states[keep][:n])  # full-context values
    assert not {tokenizer.bos_token_id, tokenizer.eos_token_id} & set(clean_ids.tolist())
    assert clean.record.dropped_tokens == keep.sum() - n


def cfg_groups(s3, run: str) -> int:
    try:
        body = s3.client().get_object(Bucket=s3.bucket, Key=f"{run}/cfg.json")["Body"].read()
    except Exception:  # noqa: BLE001 - not written yet
        return 0
    return json.loads(body)["actstore"]["groups"]


@pytest.mark.slow
def test_sigkill_mid_capture_then_resume_gives_the_uninterrupted_tokens(s3, model_dir, text_file):
    args = [
        "--model",
        str(model_dir("gpt2")),
        "--dataset",
        str(text_file),
        "--sites",
        "resid.1,mlp_out.3",
        "--context-length",
        "32",
        "--max-examples",
        "240",
        "--batch-size",
        "8",
        "--format",
        "activault",
        "--opt",
        "rows_per_file=8",
        "--opt",
        "sequence_length=20",
        "--no-progress",
    ]

    env = {**os.environ, "TQDM_DISABLE": "1"}

    def start(run: str) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "actstore", "capture", "--out", s3.url(run), *args]
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    proc = start("crashed")
    deadline = time.monotonic() + 120
    while cfg_groups(s3, "crashed") < 4:
        assert proc.poll() is None, (
            "capture ended before it could be killed:\n" + proc.stdout.read().decode()
        )
        assert time.monotonic() < deadline, "capture made no progress"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = cfg_groups(s3, "crashed")
    with pytest.raises(CorruptStoreError, match="unfinished capture"):
        open_store(s3.url("crashed"))

    # the killed run above is started as the console script is; the reruns are processes
    # of their own, forked from a helper that imported torch once (tests/forked.py)
    resumed = run_actstore("capture", "--out", s3.url("crashed"), *args, env=env, timeout=300)
    log = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, log
    assert "resuming" in log
    reference = run_actstore("capture", "--out", s3.url("clean"), *args, env=env, timeout=300)
    assert reference.returncode == 0, reference.stderr

    a, b = open_store(s3.url("crashed")), open_store(s3.url("clean"))
    assert a.n_files == b.n_files > killed_at
    assert a.record.num_runs == 1 and a.record.dropped_tokens == b.record.dropped_tokens
    for hook in b.hooks:
        states_a, ids_a = stored_stream(a, hook)
        states_b, ids_b = stored_stream(b, hook)
        np.testing.assert_array_equal(ids_a, ids_b)  # no duplicate, no missing token
        np.testing.assert_array_equal(states_a, states_b)
        sa, sb = a.statistics(hook), b.statistics(hook)
        assert sa.count == sb.count
        np.testing.assert_allclose(sa.mean, sb.mean, rtol=1e-12)
        np.testing.assert_allclose(sa.m2, sb.m2, rtol=1e-12)
    crashed_files = [k for k in s3.keys("crashed/") if k.endswith(".pt")]
    assert len(crashed_files) == b.n_files * len(b.hooks)  # nothing left over from the crash
    assert torch.equal(a.megabatch(b.hooks[0], 0)["states"], b.megabatch(b.hooks[0], 0)["states"])
    assert a.verify().ok
