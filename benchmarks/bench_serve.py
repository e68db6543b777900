"""Benchmark ``actstore serve``: one disk pass feeding K trainer processes.

On bench_loader's synthetic store, for K = 1, 2, 4 consumer processes (broadcast: each
gets the whole stream; partition: each a K-th): every consumer's rows/s against one
ActivationLoader alone reading the same store (its first epoch, fresh pools, like the
server's), and the bytes the server read from the disk in the epoch (the kernel's I/O
accounting of the reaped server process, ``ru_inblock`` x 512 = ``/proc/<pid>/io``
``read_bytes``) against the store's size. Cold runs evict the store from the page cache
first; each configuration runs ``--repeats`` times, interleaved, and medians are shown.

Usage:
    python benchmarks/bench_serve.py --gib 1.5 --consumers 1,2,4
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SAEV_SHARDS, files_under, table
from bench_loader import build_store, drop_cache, make_loader, run_epoch, stream_read

from actstore.formats.saev import SaevReader
from actstore.loader.serve import ServedLoader


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", type=Path, default=Path("/tmp/actstore-bench-loader"))
    p.add_argument("--gib", type=float, default=1.5)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--shard-gib", type=float, default=1.0)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--pool-mib", type=int, default=256)
    p.add_argument("--io-threads", type=int, default=4)
    p.add_argument("--consumers", default="1,2,4")
    p.add_argument("--modes", default="broadcast,partition")
    p.add_argument("--caches", default="cold,warm")
    p.add_argument("--cold", choices=["fadvise", "drop"], default="fadvise")
    p.add_argument("--repeats", type=int, default=3)
    return p.parse_args(argv)


def consumer(name: str, c: int, directory: str, results) -> None:
    loader = ServedLoader(name, c, directory=directory)
    rows, it = 0, iter(loader)
    next(it)  # timed from the first batch: the K processes start at different moments
    t0 = time.perf_counter()
    for batch in it:
        rows += len(batch)
    results.put((c, rows, time.perf_counter() - t0))
    loader.close()


def serve_once(args, path: Path, k: int, mode: str, row_bytes: int) -> dict[str, float]:
    """One epoch served to ``k`` consumer processes: their rows/s and the server's reads."""
    name = f"bench-{os.getpid()}-{k}-{mode}"
    directory = "/dev/shm"
    pool_blocks = max(
        1, (args.pool_mib << 20) // (SaevReader(path).blocks(0)[0].n_rows * row_bytes)
    )
    cmd = [sys.executable, "-m", "actstore", "serve", str(path), "--name", name]
    cmd += ["--consumers", str(k), "--mode", mode, "--epochs", "1", "--directory", directory]
    cmd += ["--batch-size", str(args.batch_size), "--pool-blocks", str(pool_blocks)]
    cmd += ["--io-threads", str(args.io_threads)]
    env = {**os.environ, "ACTSTORE_LOG": "WARNING"}
    server = subprocess.Popen(cmd, env=env)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=consumer, args=(name, c, directory, results)) for c in range(k)]
    for p in procs:
        p.start()
    got = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
    _, status, usage = os.wait4(server.pid, 0)
    server.returncode = os.waitstatus_to_exitcode(status)
    if server.returncode != 0:
        raise SystemExit(f"the server failed (exit {server.returncode})")
    rates = [rows * row_bytes / s / 1e6 for _, rows, s in got]
    return {
        "min_mb_per_s": min(rates),
        "median_mb_per_s": float(np.median(rates)),
        "rows": sum(r for _, r, _ in got),
        "read_bytes": usage.ru_inblock * 512,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.shard_gib = args.shard_gib
    path = build_store(args)
    files = files_under(path, SAEV_SHARDS)
    store_bytes = sum(f.stat().st_size for f in files)
    row_bytes = SaevReader(path).d_model * 4
    ks = [int(x) for x in args.consumers.split(",") if x]
    modes = [m for m in args.modes.split(",") if m]
    caches = [c for c in args.caches.split(",") if c]
    single: dict[str, list[float]] = {c: [] for c in caches}
    served: dict[tuple[str, str, int], list[dict[str, float]]] = {}
    for rep in range(args.repeats):
        for cache in caches:
            if cache == "warm":
                stream_read(files, 1)
            else:
                drop_cache(files, args.cold)
            loader = make_loader(path, args, 0)
            res = run_epoch(loader, row_bytes)  # also timed from its first batch
            first = min(args.batch_size, res["rows"])
            rate = (res["rows"] - first) * row_bytes / (res["seconds"] - res["first_batch_s"])
            single[cache].append(rate / 1e6)
            del loader
            for mode in modes:
                for k in ks:
                    if mode == "partition" and k == 1:
                        continue
                    if cache == "warm":
                        stream_read(files, 1)
                    else:
                        drop_cache(files, args.cold)
                    res = serve_once(args, path, k, mode, row_bytes)
                    served.setdefault((cache, mode, k), []).append(res)
            print(f"repetition {rep + 1}/{args.repeats}, {cache}: done", file=sys.stderr)
    rows = []
    for cache in caches:
        base = float(np.median(single[cache]))
        rows.append(["one ActivationLoader alone", cache, base, "1.00", "", "", ""])
        for mode in modes:
            for k in ks:
                runs = served.get((cache, mode, k))
                if not runs:
                    continue
                slowest = float(np.median([r["min_mb_per_s"] for r in runs]))
                share = 1 if mode == "broadcast" else k  # a partition consumer gets 1/K
                read = float(np.median([r["read_bytes"] for r in runs]))
                rows.append(
                    [
                        f"serve, {mode}, {k} consumer{'s' * (k > 1)} (slowest)",
                        cache,
                        slowest,
                        f"{slowest * share / base:.2f}",
                        f"{read / 2**30:.2f} GiB",
                        f"{read / store_bytes:.2f}",
                        ">= 0.8" if mode == "broadcast" else "",
                    ]
                )
    print(f"store {store_bytes / 2**30:.2f} GiB; medians of {args.repeats} interleaved repetitions")
    print(
        table(
            [
                "what",
                "cache",
                "MB/s per consumer",
                "vs alone (partition: x K)",
                "server read from disk",
                "/ store size",
                "target",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
