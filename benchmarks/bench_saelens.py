"""Benchmark the saelens format: writer throughput against SaevWriter on the same batches,
and the shared loader over a saelens store against a sequential read of its Arrow files.

Goals (issue 15): saelens writer >= 0.8x the saev writer; ActivationLoader >= 0.8x a
sequential read of the store's files, warm (page cache) and cold (evicted first).

Both writers get identical in-memory float32 batches (no model), checksum and keep exact
statistics as they go; the time includes ``close()`` (index files, fsync, publication).

Run:
    PYTHONPATH=src python benchmarks/bench_saelens.py --examples 2048 --context 128 --d-model 768
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import Timer, evict, sequential_read, table

from actstore import ActivationLoader
from actstore.batch import Batch, CapturePlan
from actstore.formats.saelens import SaelensOptions, SaelensReader, SaelensWriter
from actstore.formats.saev import SaevOptions, SaevReader, SaevWriter
from actstore.sites import Site
from actstore.storage.location import Location


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--examples", type=int, default=1024)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--batch", type=int, default=32, help="examples per capture batch")
    p.add_argument("--shard-mb", type=float, default=256.0, help="saelens MB per Arrow file")
    p.add_argument("--repeats", type=int, default=3, help="writer runs each; the best counts")
    p.add_argument("--loader-batch", type=int, default=4096, help="rows per loader batch")
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    p.add_argument("--skip-cold", action="store_true")
    return p.parse_args(argv)


def make_plan(args) -> CapturePlan:
    return CapturePlan(
        ckpt="bench",
        family="gpt2",
        modality="text",
        sites=(Site("resid", 6),),
        n_model_layers=12,
        d_model=args.d_model,
        tokens_per_example=args.context,
        has_cls=False,
        n_examples=args.examples,
        dataset_root="bench",
        data={"kind": "bench"},
        classes=None,
        has_labels=False,
        has_tokens=True,
        batch_size=args.batch,
    )


def make_batches(args) -> list[Batch]:
    rng = np.random.default_rng(0)
    out = []
    for lo in range(0, args.examples, args.batch):
        hi = min(lo + args.batch, args.examples)
        acts = rng.standard_normal((hi - lo, args.context, args.d_model), dtype=np.float32)
        out.append(
            Batch(
                acts={"resid.6": torch.from_numpy(acts)},
                example_ids=np.arange(lo, hi),
                token_ids=rng.integers(0, 50000, (hi - lo, args.context), dtype=np.int32),
            )
        )
    return out


def time_writer(make, batches, out: Path) -> float:
    shutil.rmtree(out, ignore_errors=True)
    with Timer() as t:
        writer = make(out)
        for batch in batches:
            writer.write(batch)
        writer.close()
    shutil.rmtree(out)
    return t.seconds


def loader_epoch(loader: ActivationLoader, epoch: int) -> tuple[int, Timer]:
    loader.set_epoch(epoch)
    rows = 0
    with Timer() as t:
        for x in loader:
            rows += len(x)
    return rows, t


def saelens_store(reader: SaelensReader, store: Path, args: argparse.Namespace):
    """SAELens's ActivationsStore over the cache (None when sae-lens is not installed)."""
    try:
        from sae_lens.training.activations_store import ActivationsStore
    except ImportError:
        print("sae-lens is not installed: no ActivationsStore row")
        return None
    n_rows = sum(b.n_rows for b in reader.blocks(reader.sites[0]))
    return ActivationsStore(
        model=None,
        dataset=None,
        streaming=False,
        hook_name=reader.native_name(reader.sites[0]),
        hook_head_index=None,
        context_size=args.context,
        d_in=args.d_model,
        # its shuffle buffer holds n_batches_in_buffer x context rows: as many as the
        # loader's default 256 MiB window
        n_batches_in_buffer=max(20, (256 << 20) // (args.d_model * 4) // args.context),
        total_training_tokens=10 * n_rows,
        store_batch_size_prompts=32,
        train_batch_size_tokens=args.loader_batch,
        prepend_bos=False,
        normalize_activations="none",
        device=torch.device("cpu"),
        dtype="float32",
        cached_activations_path=str(store),
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-saelens-"))
    root.mkdir(parents=True, exist_ok=True)
    plan, batches = make_plan(args), make_batches(args)
    gb = args.examples * args.context * args.d_model * 4 / 1e9
    options = SaelensOptions(shard_mb=args.shard_mb)
    print(
        f"{args.examples} examples x {args.context} tokens x D={args.d_model} float32 "
        f"({gb:.2f} GB), batches of {args.batch}; writing under {root}\n"
    )

    saev_s, saelens_s = [], []
    for _ in range(args.repeats):  # interleaved, so drift in machine load hits both
        saev_s.append(
            time_writer(
                lambda out: SaevWriter.from_plan(plan, Location.parse(out), SaevOptions()),
                batches,
                root / "saev",
            )
        )
        saelens_s.append(
            time_writer(
                lambda out: SaelensWriter.from_plan(plan, Location.parse(out), options),
                batches,
                root / "sl",
            )
        )
    saev_best, sl_best = min(saev_s), min(saelens_s)
    rows = [
        ["SaevWriter", saev_best, gb * 1e3 / saev_best, 1.0],
        ["SaelensWriter", sl_best, gb * 1e3 / sl_best, saev_best / sl_best],
    ]
    print(f"writer throughput (best of {args.repeats})")
    print(table(["writer", "seconds", "MB/s", "vs saev"], rows))

    writer = SaelensWriter.from_plan(plan, Location.parse(root / "store"), options)
    for batch in batches:
        writer.write(batch)
    store = writer.close()
    files = sorted(store.glob("data-*.arrow"))
    reader = SaelensReader(store)
    loader = ActivationLoader(reader, batch_size=args.loader_batch, seed=0)
    loader_epoch(loader, 0)  # the first epoch allocates the pools; later ones reuse them
    rows = []
    for epoch, cache in enumerate(["warm"] if args.skip_cold else ["cold", "warm"], start=1):
        if cache == "warm":
            sequential_read(files)  # every page cached
        else:
            evict(files)
        nbytes, seq = sequential_read(files)
        seq_mb = nbytes / 1e6 / seq.seconds
        if cache == "cold":
            evict(files)
        reader.close()  # fresh memory maps
        blocks = reader.blocks(reader.sites[0])
        out = np.empty((max(b.n_rows for b in blocks), args.d_model), dtype=np.float32)
        with Timer() as direct:
            for block in blocks:
                reader.read_block(block, out=out[: block.n_rows])
        direct_mb = sum(b.n_rows for b in blocks) * args.d_model * 4 / 1e6 / direct.seconds
        if cache == "cold":
            evict(files)
        reader.close()
        n, t = loader_epoch(loader, epoch)
        mb = n * args.d_model * 4 / 1e6 / t.seconds
        rows.append([f"sequential read of the Arrow files ({cache})", seq_mb, 1.0])
        rows.append(
            [f"SaelensReader.read_block in storage order ({cache})", direct_mb, direct_mb / seq_mb]
        )
        rows.append([f"ActivationLoader, next epoch ({cache})", mb, mb / seq_mb])
    # the same loader over a saev store of the same data: what the loader itself reaches
    saev_store = SaevWriter.from_plan(plan, Location.parse(root / "saev-store"), SaevOptions())
    for batch in batches:
        saev_store.write(batch)
    saev_loader = ActivationLoader(SaevReader(saev_store.close()), batch_size=args.loader_batch)
    loader_epoch(saev_loader, 0)
    n, t = loader_epoch(saev_loader, 1)
    rows.append(
        [
            "ActivationLoader over a saev store, next epoch (warm)",
            n * args.d_model * 4 / 1e6 / t.seconds,
            "",
        ]
    )
    # the peer: SAELens's own ActivationsStore over the same cache, warm, shuffling as many
    # rows as the loader's window, for as many rows as one epoch
    peer = saelens_store(reader, store, args)
    if peer is not None:
        sequential_read(files)
        wanted = sum(b.n_rows for b in reader.blocks(reader.sites[0])) // args.loader_batch
        with Timer() as t:
            for _ in range(wanted):
                peer.next_batch()
        peer_mb = wanted * args.loader_batch * args.d_model * 4 / 1e6 / t.seconds
        n, t = loader_epoch(loader, 3)
        ours = n * args.d_model * 4 / 1e6 / t.seconds
        rows.append(["SAELens ActivationsStore, same cache (warm)", peer_mb, ""])
        rows.append(["ActivationLoader, same cache, right after it (warm)", ours, ""])
        rows.append(["  ActivationLoader / ActivationsStore", f"{ours / peer_mb:.1f}x", ""])
    print("\nreading (MB/s of activations; the files also hold token ids)")
    print(table(["what", "MB/s", "vs sequential"], rows))
    if not args.dir:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
