"""Activault writer alone on local disk vs a raw sequential write + fsync of the same bytes.

The writer is driven through the public API (``get_format("activault").open_writer(plan,
out, options)`` / ``write(batch)`` / ``close()``), fed pre-made float32 (or bfloat16)
batches; the baseline writes the same files (same count, same size, one serialized
megabatch's bytes each) one after another into the same directory, each fsynced. Rows are
interleaved (raw, writer, raw, writer, ...) and the medians are reported.

    python benchmarks/bench_activault_writer.py                  # ~1-2 minutes on 2 cores
    python benchmarks/bench_activault_writer.py --cases f32:bfloat16 --reps 5
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

from actstore.batch import Batch, CapturePlan
from actstore.formats import get_format
from actstore.formats.activault import ActivaultOptions
from actstore.formats.activault.layout import serialize_megabatch
from actstore.sites import Site

MB = 1e6


def make_plan(args) -> CapturePlan:
    return CapturePlan(
        ckpt="bench",
        family="gpt2",
        modality="text",
        sites=tuple(Site("resid", layer) for layer in range(args.hooks)),
        n_model_layers=args.hooks,
        d_model=args.d,
        tokens_per_example=args.seq,
        has_cls=False,
        n_examples=args.rows * args.files,
        dataset_root="/bench",
        data={},
        classes=None,
        has_labels=False,
        has_tokens=True,
        batch_size=args.batch,
    )


def make_batches(plan: CapturePlan, args, dtype: torch.dtype) -> list[Batch]:
    gen = torch.Generator().manual_seed(0)
    bs = plan.batch_size
    base = {str(s): torch.randn(bs, args.seq, args.d, generator=gen).to(dtype) for s in plan.sites}
    ids = np.zeros((bs, args.seq), dtype=np.int64)
    return [
        Batch(acts=base, example_ids=np.arange(lo, lo + bs), token_ids=ids)
        for lo in range(0, plan.n_examples, bs)
    ]


def raw_write(directory: Path, data: bytes, n_files: int) -> float:
    """Seconds to write ``n_files`` copies of ``data`` one after another, each fsynced."""
    directory.mkdir(parents=True)
    start = time.perf_counter()
    for i in range(n_files):
        fd = os.open(directory / f"f{i}.pt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
    dfd = os.open(directory, os.O_RDONLY)
    os.fsync(dfd)
    os.close(dfd)
    return time.perf_counter() - start


def writer_run(out: Path, plan: CapturePlan, batches: list[Batch], options) -> float:
    start = time.perf_counter()
    writer = get_format("activault").open_writer(plan, str(out), options)
    for batch in batches:
        writer.write(batch)
    writer.close()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hooks", type=int, default=2)
    p.add_argument("--d", type=int, default=1024)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--rows", type=int, default=128, help="rows per file")
    p.add_argument("--batch", type=int, default=32, help="examples per batch")
    p.add_argument("--files", type=int, default=12, help="files per hook")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir in /tmp)")
    p.add_argument(
        "--cases",
        default="f32:bfloat16,bf16:bfloat16,f32:float32",
        help="input:stored dtype pairs",
    )
    args = p.parse_args()
    plan = make_plan(args)
    root = Path(tempfile.mkdtemp(prefix="bench-av-", dir=args.dir))
    print(
        f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; {args.hooks} hooks x "
        f"{args.files} files of [{args.rows}, {args.seq}, {args.d}] in {root}"
    )
    try:
        for case in args.cases.split(","):
            src, stored = case.split(":")
            in_dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[src]
            batches = make_batches(plan, args, in_dtype)
            options = ActivaultOptions(rows_per_file=args.rows, dtype=stored)
            data = serialize_megabatch(
                torch.zeros(args.rows, args.seq, args.d, dtype=getattr(torch, stored)),
                torch.zeros(args.rows, args.seq, dtype=torch.long),
            ).getvalue()
            n_files = args.files * args.hooks
            total = len(data) * n_files
            raws, ours = [], []
            for rep in range(args.reps):
                raws.append(raw_write(root / f"raw-{case}-{rep}", data, n_files))
                ours.append(writer_run(root / f"run-{case}-{rep}", plan, batches, options))
                shutil.rmtree(root / f"raw-{case}-{rep}")
                shutil.rmtree(root / f"run-{case}-{rep}")
            raw, mine = statistics.median(raws), statistics.median(ours)
            print(
                f"{src} -> {stored}: {total / MB:.0f} MB; raw write+fsync {total / MB / raw:.0f} "
                f"MB/s, writer {total / MB / mine:.0f} MB/s, ratio {raw / mine:.2f} "
                f"(raw s {[round(x, 2) for x in raws]}, writer s {[round(x, 2) for x in ours]})"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
