"""Cost of verified reads: ``read_block`` with and without the xxh3 block checks.

Writes a saev store, then reads every block of one layer in a shuffled order into one
reused buffer (as the loader does), once with ``verify_reads=True`` (the default) and
once with ``verify_reads=False``, warm (files in the page cache) and cold (evicted
first). Each pair runs ``--repeats`` times interleaved; the median is reported. Goal:
verified reads cost at most 10% of the throughput. Both single-layer stores (blocks of
several examples, up to 1 MiB) and multi-layer stores (one example per block) are
measured with ``--layers``.

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

from actstore.batch import Batch
from actstore.formats.saev import SaevMetadata, SaevReader
from actstore.formats.saev.layout import encode_data


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
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="actstore-bench-verify-", dir=args.dir))
    try:
        store = write_store(root, args.gib, args.layers, args.tokens, args.d)
        n_blocks = len(SaevReader(store).blocks(0))
        order = np.random.default_rng(0).permutation(n_blocks)
        print(f"\n{store} ({args.layers} layers, {n_blocks} blocks of layer 0)")
        for cold in (False, True):
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
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
