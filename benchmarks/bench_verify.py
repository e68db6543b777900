"""Cost of the root manifest's checks: verified reads, ``verify`` and opening.

Writes a saev store, then measures, each pair ``--repeats`` times interleaved, medians
reported:

1. ``read_block`` of every block of one layer in a shuffled order into one reused buffer,
   with ``verify_reads=True`` (the default) and ``False``, warm (page cache) and cold
   (evicted first). Goal: verified at least 0.9 of unverified.
2. a cold epoch of the in-process loader (``ActivationLoader``, its I/O threads), verified
   and unverified. Goal: verified at least 0.95 of unverified.
3. ``reader.verify()`` of the cold store against the disk's sequential read of the same
   files (the best of one stream and ``--streams`` streams). Goal: at least 0.8.
4. ``open_store`` of a pkl.gz store of ``--open-files`` files (one sample per shard),
   warm. Goal: under 1 s for 10,000 files.

    python benchmarks/bench_verify.py --gib 1 --layers 1
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from _common import SAEV_SHARDS, evict, files_under, saev_writer
from bench_loader import stream_read

from actstore.batch import Batch
from actstore.formats.saev import SaevMetadata, SaevReader
from actstore.formats.saev.layout import encode_data
from actstore.storage import integrity


def write_store(root: Path, gib: float, n_layers: int, tokens: int, d: int) -> Path:
    layers = tuple(range(n_layers))
    per_example = n_layers * tokens * d * 4
    n = max(1, int(gib * 2**30) // per_example)
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
        patches_per_shard=512 * tokens * n_layers,
    )
    writer = saev_writer(md, root)
    rng = np.random.default_rng(0)
    batch_n = 16
    acts = {
        f"resid.{layer}": torch.from_numpy(rng.standard_normal((batch_n, tokens, d), np.float32))
        for layer in layers
    }
    for lo in range(0, n, batch_n):
        hi = min(lo + batch_n, n)
        writer.write(
            Batch(acts={k: v[: hi - lo] for k, v in acts.items()}, example_ids=np.arange(lo, hi))
        )
    return writer.close()


def read_all(store: Path, verify: bool, cold: bool, order: np.ndarray) -> float:
    """GB/s of reading every block of layer 0 in ``order``."""
    if cold:
        evict(files_under(store, SAEV_SHARDS))
    reader = SaevReader(store, verify_reads=verify)
    blocks = reader.blocks(reader.layers[0])
    out = np.empty((max(b.n_rows for b in blocks), reader.d_model), dtype=np.float32)
    total = 0
    start = time.perf_counter()
    for i in order:
        block = blocks[i]
        reader.read_block(block, out[: block.n_rows])
        total += block.n_rows * reader.d_model * 4
    seconds = time.perf_counter() - start
    reader.close()
    return total / seconds / 1e9


def loader_epoch(store: Path, verify: bool) -> float:
    """GB/s of one cold epoch of the in-process loader over layer 0."""
    from actstore.loader import ActivationLoader

    evict(files_under(store, SAEV_SHARDS))
    reader = SaevReader(store, verify_reads=verify)
    loader = ActivationLoader(reader, site=reader.layers[0], batch_size=4096, seed=0)
    total = 0
    start = time.perf_counter()
    for batch in loader:
        total += batch.numel() * 4
    seconds = time.perf_counter() - start
    reader.close()
    return total / seconds / 1e9


def verify_rate(store: Path, streams: int = integrity.VERIFY_STREAMS) -> float:
    """GB/s of a cold ``reader.verify()`` (every file of the store), reading ``streams``
    files at once."""
    integrity.VERIFY_STREAMS = streams
    evict(files_under(store))
    reader = SaevReader(store)
    start = time.perf_counter()
    report = reader.verify()
    seconds = time.perf_counter() - start
    assert report.ok, report.faults
    return report.bytes_checked / seconds / 1e9


def disk_rate(store: Path, streams: int) -> float:
    """GB/s of the best of one-stream and ``streams``-stream cold sequential reads."""
    paths = files_under(store)
    best = 0.0
    for n in sorted({1, streams}):
        evict(paths)
        nbytes, timer = stream_read(paths, n)
        best = max(best, nbytes / timer.seconds / 1e9)
    return best


def open_many(root: Path, n_files: int, repeats: int) -> tuple[int, float]:
    """(files, median seconds) of ``open_store`` on a pkl.gz store of ~``n_files`` shards."""
    from actstore.formats import open_store
    from actstore.formats.pickle import PickleOptions
    from actstore.formats.registry import get_format
    from actstore.testing import make_acts, make_batches, make_plan

    plan = make_plan(n_examples=n_files, tokens_per_example=2, d_model=4, batch_size=256)
    writer = get_format("pickle").open_writer(
        plan, root / "many", PickleOptions(samples_per_shard=1, compress=False)
    )
    for batch in make_batches(plan, make_acts(plan)):
        writer.write(batch)
    store = Path(str(writer.close()))
    files = len(files_under(store))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        open_store(store).close()
        times.append(time.perf_counter() - start)
    return files, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=257)
    parser.add_argument("--d", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--streams", type=int, default=4, help="streams of the disk baseline")
    parser.add_argument("--open-files", type=int, default=10_000)
    parser.add_argument(
        "--only", choices=("reads", "loader", "verify", "open"), help="run one part only"
    )
    args = parser.parse_args()
    want = {args.only} if args.only else {"reads", "loader", "verify", "open"}
    root = Path(tempfile.mkdtemp(prefix="actstore-bench-verify-", dir=args.dir))
    try:
        store = write_store(root, args.gib, args.layers, args.tokens, args.d)
        n_blocks = len(SaevReader(store).blocks(0))
        order = np.random.default_rng(0).permutation(n_blocks)
        print(f"\n{store} ({args.layers} layers, {n_blocks} blocks of layer 0)")
        for cold in (False, True) if "reads" in want else ():
            if not cold:
                read_all(store, True, False, order)  # load the page cache
            pairs = [
                (read_all(store, False, cold, order), read_all(store, True, cold, order))
                for _ in range(args.repeats)
            ]
            plain = statistics.median(p[0] for p in pairs)
            checked = statistics.median(p[1] for p in pairs)
            ratios = sorted(p[1] / p[0] for p in pairs)
            print(
                f"  {'cold' if cold else 'warm'}: unverified {plain:6.2f} GB/s, verified "
                f"{checked:6.2f} GB/s, ratio {checked / plain:.3f} (goal >= 0.90; per "
                f"repetition {', '.join(f'{r:.3f}' for r in ratios)})"
            )
        if "loader" in want:
            pairs = [
                (loader_epoch(store, False), loader_epoch(store, True)) for _ in range(args.repeats)
            ]
            plain = statistics.median(p[0] for p in pairs)
            checked = statistics.median(p[1] for p in pairs)
            print(
                f"  loader cold epoch: unverified {plain:6.2f} GB/s, verified {checked:6.2f} "
                f"GB/s, ratio {checked / plain:.3f} (goal >= 0.95; per repetition "
                f"{', '.join(f'{p[1] / p[0]:.3f}' for p in pairs)})"
            )
        if "verify" in want:
            streams = integrity.VERIFY_STREAMS
            triples = [
                (disk_rate(store, args.streams), verify_rate(store, 1), verify_rate(store, streams))
                for _ in range(args.repeats)
            ]
            disk = statistics.median(t[0] for t in triples)
            for i, label in ((1, "one file at a time"), (2, f"{streams} files at once")):
                checked = statistics.median(t[i] for t in triples)
                print(
                    f"  verify(), {label}: {checked:6.2f} GB/s vs the disk's sequential read "
                    f"{disk:6.2f} GB/s (best of 1 and {args.streams} streams), ratio "
                    f"{checked / disk:.3f} (goal >= 0.80; per repetition "
                    f"{', '.join(f'{t[i] / t[0]:.3f}' for t in triples)})"
                )
        if args.open_files and "open" in want:
            files, seconds = open_many(root, args.open_files, args.repeats)
            print(f"  open_store of a {files}-file store: {seconds:.3f} s (goal < 1 s)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
