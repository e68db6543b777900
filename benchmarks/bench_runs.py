"""Benchmark the run commands' data paths against in-memory baselines measured in the same run.

On one synthetic saev store (ViT-shaped: CLS + patches, one layer; written once with
SaevWriter and reused), in one run:

- training: steps/s of ``train_sae`` fed by the shared loader exactly as ``actstore train``
  feeds it (``training_batches``), against the same loop fed from a tensor already in
  RAM (the compute-bound ceiling). Ratio near 1: reading never starves the optimiser;
- inference: tokens/s of ``encode_store`` (sequential block reads, normalise, encode,
  sparse CSR) against encoding the same rows already in RAM, densely, without the CSR;
- ``patch_acts.npz``: bytes per token and write time, against ``np.save`` of the
  dense activations (what the sparse layout saves);
- visuals: seconds to choose the top latents and their examples from the CSR.

Usage:
    python benchmarks/bench_runs.py                        # ~0.5 GiB store, CPU, ~2 min
    python benchmarks/bench_runs.py --device cuda --expansion 16 --batch-size 4096 --steps 200
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Timer, saev_writer, table

from actstore.batch import Batch
from actstore.formats.saev import SaevMetadata, SaevReader
from actstore.formats.saev.layout import encode_data
from actstore.sae import SparseActs, TrainConfig, encode_store, train_sae
from actstore.sae.rows import ordered_rows
from actstore.sae.train import resolve_device, training_batches
from actstore.visuals.select import TokenRows, top_examples, top_latents


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--data-dir", type=Path, default=Path(tempfile.gettempdir()) / "actstore-bench-runs"
    )
    p.add_argument("--examples", type=int, default=800, help="examples in the store")
    p.add_argument("--patches", type=int, default=196, help="patches per example (+1 CLS)")
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--expansion", type=int, default=4)
    p.add_argument("--k", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--steps", type=int, default=40, help="training steps per measurement")
    p.add_argument("--device", default="auto")
    p.add_argument("--latents", type=int, default=32, help="latents for the visuals selection")
    return p.parse_args(argv)


def make_store(args: argparse.Namespace) -> Path:
    """A store of sparse-ish synthetic activations (a few directions active per token)."""
    md = SaevMetadata(
        family="clip",
        ckpt="synthetic",
        layers=(11,),
        patches_per_ex=args.patches,
        cls_token=True,
        d_model=args.d_model,
        n_examples=args.examples,
        data=encode_data({"kind": "synthetic"}),
        dataset="/nowhere",
    )
    writer = saev_writer(md, args.data_dir)
    if writer.complete:  # written by an earlier run with the same sizes
        return writer.close()
    rng = np.random.default_rng(0)
    directions = rng.standard_normal((4 * args.d_model, args.d_model)).astype(np.float32)
    t = args.patches + 1
    for lo in range(0, args.examples, 32):
        n = min(32, args.examples - lo)
        codes = rng.exponential(1.0, (n * t, 8)).astype(np.float32)
        which = rng.integers(0, len(directions), (n * t, 8))
        acts = np.einsum("rk,rkd->rd", codes, directions[which]) + 0.1 * rng.standard_normal(
            (n * t, args.d_model), dtype=np.float32
        )
        writer.write(
            Batch(
                acts={"resid.11": torch.from_numpy(acts.reshape(n, t, -1))},
                example_ids=np.arange(lo, lo + n),
            )
        )
    return writer.close()


def bench_training(reader: SaevReader, args: argparse.Namespace) -> list[list[object]]:
    config = TrainConfig(
        kind="topk",
        k=args.k,
        expansion=args.expansion,
        steps=args.steps,
        batch_size=args.batch_size,
        warmup_steps=10,
        device=args.device,
        log_every=args.steps,
    )
    stats = reader.statistics(11)
    rows = torch.from_numpy(
        np.concatenate([r.acts for r in ordered_rows(reader, 11, tokens="content")])
    )
    device = resolve_device(args.device)
    in_ram = rows.to(device)
    gen = torch.Generator(device=device).manual_seed(0)

    def ram_batches():
        while True:
            yield in_ram[
                torch.randint(len(in_ram), (args.batch_size,), device=device, generator=gen)
            ]

    out = []
    feeds = (
        ("in-RAM tensor (ceiling)", ram_batches()),
        ("shared loader (actstore train)", training_batches(reader, 11, config)),
    )
    for name, batches in feeds:
        # one untimed run first (allocator, thread pools), then the measured one
        train_sae(config, batches, d_model=reader.d_model, statistics=stats, progress=False)
        result = train_sae(
            config, batches, d_model=reader.d_model, statistics=stats, progress=False
        )
        seconds = result.metrics["seconds"]
        out.append([name, args.steps / seconds, args.steps * args.batch_size / seconds])
    for row in out:
        row.append(row[1] / out[0][1])
    return out


def bench_inference(reader: SaevReader, args: argparse.Namespace):
    from actstore.sae import SAEConfig, SparseAutoencoder

    device = resolve_device(args.device)
    sae = SparseAutoencoder(
        SAEConfig(d_model=args.d_model, d_sae=args.expansion * args.d_model, k=args.k)
    )
    stats = reader.statistics(11)
    sae.set_normalisation(stats.mean, stats.var)
    sae.to(device).eval()
    n_tokens = reader.n_examples * reader.tokens_per_ex
    rows = torch.from_numpy(reader[:, 11].reshape(-1, args.d_model)).to(device)
    with torch.inference_mode(), Timer() as dense:
        for lo in range(0, len(rows), 4096):
            sae.encode(rows[lo : lo + 4096])
        if device.type == "cuda":
            torch.cuda.synchronize()
    with Timer() as full:
        acts = encode_store(sae, reader, 11, batch_rows=4096, progress=False)
    table_rows = [
        ["encode rows in RAM, dense (ceiling)", n_tokens / dense.seconds, 1.0],
        [
            "encode_store: read + encode + CSR",
            n_tokens / full.seconds,
            dense.seconds / full.seconds,
        ],
    ]
    return table_rows, acts


def bench_files(acts: SparseActs, args: argparse.Namespace) -> list[list[object]]:
    path = args.data_dir / "patch_acts.npz"
    with Timer() as t:
        acts.save(path)
    sparse_bytes = path.stat().st_size
    dense_bytes = acts.n_rows * acts.d_sae * 4
    path.unlink()
    return [
        ["patch_acts.npz (CSR)", sparse_bytes / acts.n_rows, t.seconds, dense_bytes / sparse_bytes],
        ["dense float32 (not written)", dense_bytes / acts.n_rows, "-", 1.0],
    ]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.data_dir.mkdir(parents=True, exist_ok=True)
    reader = SaevReader(make_store(args))
    print(
        f"store: {reader.n_examples} examples x {reader.tokens_per_ex} tokens x "
        f"{reader.d_model} dims; SAE {args.expansion}x, k={args.k}, batch {args.batch_size}, "
        f"device {resolve_device(args.device)}, torch threads {torch.get_num_threads()}\n"
    )
    print("Training (ratio: steps/s against the in-RAM ceiling)\n")
    print(table(["feed", "steps/s", "tokens/s", "ratio"], bench_training(reader, args)))
    rows, acts = bench_inference(reader, args)
    print("\nInference (ratio: tokens/s against the dense in-RAM ceiling)\n")
    print(table(["path", "tokens/s", "ratio"], rows))
    print("\nStored activations (ratio: dense bytes / these bytes)\n")
    print(table(["file", "bytes/token", "write s", "ratio"], bench_files(acts, args)))
    tokens = TokenRows(
        rows_per_example=reader.tokens_per_ex,
        first_token=0,
        n_examples=reader.n_examples,
        skip_tokens=(0,),
    )
    with Timer() as t:
        for summary in top_latents(acts, tokens, args.latents):
            top_examples(acts, summary.latent, tokens, 8)
    print(
        f"\nVisuals selection: top {args.latents} latents and 8 examples each from "
        f"{acts.nnz:,} non-zeros in {t.seconds:.2f} s"
    )


if __name__ == "__main__":
    main()
