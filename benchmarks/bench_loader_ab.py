"""A/B of the training loader: this checkout against another one (e.g. a ``git worktree``
of an older commit), on the same saev store, warm, interleaved in one run.

Each side runs in a process of its own (``PYTHONPATH`` set to that checkout's ``src``):
three verified epochs, in process and with 2 persistent DataLoader workers; the third
epoch's rate counts. The baseline of each repetition is the best of 1- and 4-stream 16 MiB
sequential reads of the store's files (warm: they also fill the page cache). Prints each
repetition's ratios and their medians (min-max).

    git worktree add /tmp/old 056ede5
    python benchmarks/bench_loader_ab.py STORE --other /tmp/old/src --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

CHILD = r"""
import json, sys, time
from actstore.formats.saev import SaevReader
from actstore.loader import ActivationDataLoader, ActivationLoader
store, workers, batch, pool = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
loader = ActivationLoader(SaevReader(store), batch_size=batch, pool_blocks=pool)
data = ActivationDataLoader(loader, num_workers=workers, persistent_workers=True) if workers else loader
rates = []
for _ in range(3):
    t, rows = time.perf_counter(), 0
    for x in data:
        rows += len(x)
    rates.append(rows / (time.perf_counter() - t))
print(json.dumps(rates))
"""


def sequential_read(files: list[Path]) -> float:
    """GB/s of the best of 1- and 4-stream 16 MiB reads of ``files``."""
    best = 0.0
    for streams in (1, 4):
        jobs = []
        for f in files:
            size = f.stat().st_size
            step = -(-size // streams)
            jobs += [(f, i * step, min(size, (i + 1) * step)) for i in range(streams)]

        def read(path: Path, lo: int, hi: int) -> None:
            fd, buf = os.open(path, os.O_RDONLY), bytearray(16 << 20)
            view, at = memoryview(buf), lo
            while at < hi:
                at += os.preadv(fd, [view[: min(len(view), hi - at)]], at)
            os.close(fd)

        threads = [threading.Thread(target=read, args=job) for job in jobs]
        t = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        best = max(best, sum(f.stat().st_size for f in files) / 1e9 / (time.perf_counter() - t))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("store", type=Path, help="a saev store (its acts*.bin shards)")
    parser.add_argument("--other", type=Path, required=True, help="the other checkout's src/")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--pool-blocks", type=int, default=256)
    args = parser.parse_args()
    files = sorted(args.store.glob("acts*.bin"))
    row_bytes = 4 * 1024  # the benchmark store: float32 rows of D = 1024
    this = Path(__file__).resolve().parents[1] / "src"
    ratios: dict[str, list[float]] = {}
    for rep in range(args.repeats):
        base = sequential_read(files)
        ratios.setdefault("sequential read, GB/s", []).append(base)
        for side, src in (("other", args.other), ("this", this)):
            for workers in (0, 2):
                env = {**os.environ, "PYTHONPATH": str(src), "TQDM_DISABLE": "1"}
                argv = [str(args.store), str(workers), str(args.batch_size), str(args.pool_blocks)]
                out = subprocess.run(
                    [sys.executable, "-c", CHILD, *argv],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
                rows_per_s = json.loads(out.strip().splitlines()[-1])[-1]
                key = f"{side}, {workers} workers, vs read"
                ratios.setdefault(key, []).append(rows_per_s * row_bytes / 1e9 / base)
        print(rep, {k: round(v[-1], 3) for k, v in ratios.items()}, flush=True)
    for key, values in ratios.items():
        print(f"{key}: {statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})")


if __name__ == "__main__":
    main()
