"""Capture overhead of storage, and the saev writer against the disk.

Two measurements, each against a baseline taken in the same run:

1. capture wall time (the forward loop) writing saev shards vs the same capture handing
   batches to a writer that discards them (no storage at all); target ratio <= 1.05;
2. the saev writer alone (write + xxh3 block checksums + statistics + fsync + publish) vs
   a raw sequential write of the same bytes with fsync (the disk's limit); reported as
   MB/s; target ratio >= 0.9.

Each pair is measured ``--repeats`` times interleaved (baseline, then ours) and the median
is reported, so a noisy disk or a loaded machine does not decide.

    python benchmarks/bench_capture.py --examples 400 --writer-gib 2
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from _common import DiscardWriter, saev_writer

from actstore.batch import Batch
from actstore.capture import CaptureConfig, capture
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
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="actstore-bench-", dir=args.dir))
    try:
        bench_capture_overhead(args, root)
        bench_writer(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
