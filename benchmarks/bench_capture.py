"""Capture overhead of storage, the saev writer against the disk, tokenisation, and the
time a capture of a big corpus takes to start its forward pass.

Measurements, each against a baseline taken in the same run:

1. capture wall time (the forward loop) writing saev shards vs the same capture handing
   batches to a writer that discards them (no storage at all); target ratio <= 1.05;
2. the saev writer alone (write + xxh3 block checksums + statistics + fsync + publish) vs
   a raw sequential write of the same bytes with fsync (the disk's limit); reported as
   MB/s; target ratio >= 0.9;
3. tokenisation: ``open_source`` over a JSONL file (reading, JSON, batched fast
   tokenizer, packing) in tokens/s vs one batched tokenizer call per 2,048 documents
   already in memory (the tokenizer's own speed);
4. ``--big-gb G``: seconds from starting ``actstore capture ... --max-tokens 1000000``
   until its forward pass starts (its progress bar appears), over a generated JSONL of G
   GB vs the same over a 1 MB one (deleted afterwards).

Each pair is measured ``--repeats`` times interleaved (baseline, then ours) and the median
is reported, so a noisy disk or a loaded machine does not decide.

    python benchmarks/bench_capture.py --examples 400 --writer-gib 2 --big-gb 1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from _common import DiscardWriter, saev_writer

from actstore.batch import Batch
from actstore.capture import CaptureConfig, capture, load_model, open_source
from actstore.capture.data import embedded_documents
from actstore.formats.saev import SaevMetadata, SaevOptions, SaevWriter
from actstore.formats.saev.layout import encode_data
from actstore.storage.location import Location


class CpuTimedSaevWriter(SaevWriter):
    """SaevWriter that adds the CPU time of its ``write`` calls (on the capture's writer
    thread, its I/O thread excluded) to ``cpu_s``: the writer's own cost, free of the
    forward pass's run-to-run noise."""

    cpu_s = 0.0

    def write(self, batch: Batch) -> None:
        start = time.thread_time()
        super().write(batch)
        CpuTimedSaevWriter.cpu_s += time.thread_time() - start


def bench_capture_overhead(args, root: Path) -> None:
    cfg = CaptureConfig(
        model=args.model,
        dataset=args.dataset,
        sites=tuple(f"resid.{x}" for x in args.layers),
        batch_size=args.batch_size,
        max_examples=args.examples,
        progress=False,
    )
    # warm-up: load model weights and tokenise once so both timed runs start equal
    capture(
        CaptureConfig(**{**cfg.__dict__, "max_examples": args.batch_size}),
        lambda p: DiscardWriter(),
    )
    rows = []
    for repeat in range(args.repeats):
        bare = capture(cfg, lambda p: DiscardWriter())
        out = root / f"capture-{repeat}"
        CpuTimedSaevWriter.cpu_s = 0.0
        stored = capture(
            cfg,
            lambda p, out=out: CpuTimedSaevWriter.from_plan(p, Location.parse(out), SaevOptions()),
        )
        rows.append((bare.seconds, stored.seconds, stored.writer_wait_s, CpuTimedSaevWriter.cpu_s))
        shutil.rmtree(out)
    bare_s = statistics.median(r[0] for r in rows)
    stored_s = statistics.median(r[1] for r in rows)
    wait_s = statistics.median(r[2] for r in rows)
    cpu_s = statistics.median(r[3] for r in rows)
    ratios = sorted(r[1] / r[0] for r in rows)
    n = args.examples
    print(
        f"\ncapture of {n} examples, model {args.model}, layers {args.layers} "
        f"(median of {args.repeats} interleaved):"
    )
    print(f"  no storage (discarding writer)  {bare_s:7.2f} s  {n / bare_s:8.1f} ex/s")
    print(f"  saev shards                     {stored_s:7.2f} s  {n / stored_s:8.1f} ex/s")
    print(f"  ratio stored / no storage       {stored_s / bare_s:7.3f}   (target <= 1.05)")
    print(f"  per-repetition ratios           {', '.join(f'{r:.3f}' for r in ratios)}")
    print(f"  forward loop blocked on writer  {wait_s:7.2f} s")
    print(
        f"  writer CPU on its thread        {cpu_s:7.3f} s  ({cpu_s / stored_s:.1%} of the "
        "capture; the rest of the ratio is the forward pass's own run-to-run spread)"
    )


def bench_writer(args, root: Path) -> None:
    layers, tokens, d = (6, 12), 257, 1024
    per_example = len(layers) * tokens * d * 4
    n = max(1, int(args.writer_gib * 2**30) // per_example)
    md = SaevMetadata(
        family="clip",
        ckpt="bench",
        layers=layers,
        patches_per_ex=tokens - 1,
        cls_token=True,
        d_model=d,
        n_examples=n,
        data=encode_data({}),
        dataset="/bench",
        patches_per_shard=256 * tokens * len(layers),
    )
    batch_n = 32
    rng = np.random.default_rng(0)
    acts = {
        f"resid.{layer}": torch.from_numpy(
            rng.standard_normal((batch_n, tokens, d), dtype=np.float32)
        )
        for layer in layers
    }
    total = n * per_example

    payload = np.ascontiguousarray(
        np.stack([acts[f"resid.{layer}"].numpy() for layer in layers], 1)
    )

    def raw_write() -> float:
        raw = root / "raw.bin"
        t0 = time.perf_counter()
        with open(raw, "wb") as f:
            written = 0
            while written < total:
                chunk = memoryview(payload).cast("B")[: total - written]
                f.write(chunk)
                written += len(chunk)
            f.flush()
            os.fsync(f.fileno())
        seconds = time.perf_counter() - t0
        raw.unlink()
        return seconds

    def saev_write() -> float:
        t0 = time.perf_counter()
        writer = saev_writer(md, root / "writer")
        for lo in range(0, n, batch_n):
            hi = min(lo + batch_n, n)
            writer.write(
                Batch(
                    acts={k: v[: hi - lo] for k, v in acts.items()}, example_ids=np.arange(lo, hi)
                )
            )
        writer.close()
        seconds = time.perf_counter() - t0
        shutil.rmtree(root / "writer")
        return seconds

    pairs = [(raw_write(), saev_write()) for _ in range(args.repeats)]
    raw_s = statistics.median(p[0] for p in pairs)
    writer_s = statistics.median(p[1] for p in pairs)
    ratios = sorted(p[0] / p[1] for p in pairs)
    mb = total / 1e6
    print(
        f"\nsaev writer, {total / 2**30:.2f} GiB ({n} examples x {len(layers)} layers x "
        f"{tokens} x {d}), median of {args.repeats} interleaved:"
    )
    print(f"  raw sequential write + fsync    {raw_s:7.2f} s  {mb / raw_s:8.0f} MB/s")
    print(f"  SaevWriter (xxh3 blocks + stats) {writer_s:6.2f} s  {mb / writer_s:8.0f} MB/s")
    print(f"  ratio writer / raw throughput   {raw_s / writer_s:7.3f}   (target >= 0.9)")
    print(f"  per-repetition ratios           {', '.join(f'{r:.3f}' for r in ratios)}")


def _write_jsonl(path: Path, n_bytes: int) -> int:
    """The embedded corpus, each document numbered, repeated to ``n_bytes``; returns the
    documents written."""
    docs, _ = embedded_documents()
    written = n = 0
    with path.open("w", encoding="utf-8") as f:
        while written < n_bytes:
            line = json.dumps({"text": f"{n}: {docs[n % len(docs)]}"}) + "\n"
            f.write(line)
            written += len(line.encode("utf-8"))
            n += 1
    return n


def bench_tokenization(args, root: Path) -> None:
    path = root / "tokenize.jsonl"
    _write_jsonl(path, int(args.tokenize_mb * 1e6))
    model = load_model(args.model)
    tokenizer = model.tokenizer
    docs = [json.loads(line)["text"] for line in path.open(encoding="utf-8")]

    def raw() -> tuple[float, int]:
        t0 = time.perf_counter()
        n = 0
        for lo in range(0, len(docs), 2048):
            ids = tokenizer(docs[lo : lo + 2048], add_special_tokens=False)["input_ids"]
            n += sum(len(x) for x in ids)
        return time.perf_counter() - t0, n

    def ours() -> tuple[float, int]:
        t0 = time.perf_counter()
        source = open_source(str(path), model, context_length=128, progress=False)
        return time.perf_counter() - t0, int(source.token_ids.size)

    pairs = [(raw(), ours()) for _ in range(args.repeats)]
    raw_rate = statistics.median(n / s for (s, n), _ in pairs)
    our_rate = statistics.median(n / s for _, (s, n) in pairs)
    ratios = sorted((n2 / s2) / (n1 / s1) for (s1, n1), (s2, n2) in pairs)
    print(
        f"\ntokenisation of {args.tokenize_mb:.0f} MB of JSONL ({len(docs):,} documents), "
        f"tokenizer of {args.model}, median of {args.repeats} interleaved:"
    )
    print(f"  tokenizer alone, docs in memory  {raw_rate:12,.0f} tokens/s")
    print(f"  open_source (read+tokenise+pack) {our_rate:12,.0f} tokens/s")
    print(f"  ratio open_source / tokenizer    {our_rate / raw_rate:7.3f}")
    print(f"  per-repetition ratios            {', '.join(f'{r:.3f}' for r in ratios)}")
    path.unlink()


def _seconds_to_forward(dataset: Path, out: Path, model: str) -> float:
    """Start ``actstore capture`` with a budget of 10^6 tokens and time until its forward
    loop starts (the capture progress bar appears), then stop it."""
    cmd = [sys.executable, "-m", "actstore", "capture", "--model", model, "--dataset"]
    cmd += [str(dataset), "--max-tokens", "1000000", "--layers", "1", "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"}
    env["ACTSTORE_MEMO_DIR"] = str(out / ".memo")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env)
    seen = b""
    while b"capture:" not in seen:
        chunk = proc.stderr.read1(4096)
        if not chunk:
            raise RuntimeError(f"capture ended before its forward pass: {seen[-2000:]!r}")
        seen += chunk
    seconds = time.perf_counter() - t0
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=300)
    shutil.rmtree(out, ignore_errors=True)
    return seconds


def bench_time_to_forward(args, root: Path) -> None:
    big, small = root / "big.jsonl", root / "small.jsonl"
    t0 = time.perf_counter()
    n_docs = _write_jsonl(big, int(args.big_gb * 1e9))
    made = time.perf_counter() - t0
    _write_jsonl(small, 1_000_000)
    try:
        pairs = [
            (
                _seconds_to_forward(small, root / "out-small", args.model),
                _seconds_to_forward(big, root / "out-big", args.model),
            )
            for _ in range(args.repeats)
        ]
    finally:
        big.unlink()
        small.unlink()
    small_s = statistics.median(p[0] for p in pairs)
    big_s = statistics.median(p[1] for p in pairs)
    print(
        f"\ntime to the first forward pass, actstore capture --model {args.model} "
        f"--max-tokens 1000000, median of {args.repeats} interleaved:"
    )
    print(f"  1 MB JSONL                       {small_s:7.2f} s")
    print(
        f"  {args.big_gb:g} GB JSONL ({n_docs:,} documents, written in {made:.0f} s) {big_s:7.2f} s"
    )
    print(f"  ratio big / small                {big_s / small_s:7.3f}")
    print(
        f"  per-repetition seconds (small, big) {', '.join(f'({a:.2f}, {b:.2f})' for a, b in pairs)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--dataset", default="embedded")
    parser.add_argument("--layers", type=int, nargs="+", default=[3, 5])
    parser.add_argument("--examples", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--writer-gib", type=float, default=2.0)
    parser.add_argument("--tokenize-mb", type=float, default=20.0)
    parser.add_argument("--big-gb", type=float, default=0.0, help="0: skip the big corpus")
    parser.add_argument(
        "--only", choices=["capture", "writer", "tokenize", "forward"], default=None
    )
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="actstore-bench-", dir=args.dir))
    run = {args.only} if args.only else {"capture", "writer", "tokenize", "forward"}
    try:
        if "capture" in run:
            bench_capture_overhead(args, root)
        if "writer" in run:
            bench_writer(args, root)
        if "tokenize" in run:
            bench_tokenization(args, root)
        if "forward" in run and args.big_gb > 0:
            bench_time_to_forward(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
