"""What mapping a store costs, and why the loader maps it the way it does.

On one shard file of bench_loader's synthetic store (written first if missing), in one
run, interleaved, medians of ``--repeats``:

- cold: the file evicted, then faulted in (``MADV_POPULATE_READ``) in 16 MiB stretches in
  random order (a window's runs) by 1 and by 4 threads, with and without ``MADV_HUGEPAGE``
  on the mapping, against 16 MiB ``pread``s of the same file by 1 and 4 threads;
- warm, after each cold pass: the CPU seconds per GB to map the whole file again
  (populate) and to drop it from the page tables (``MADV_DONTNEED``), which the loader
  pays every epoch, and the folio size the cold pass left in the page cache shows in them.

Usage:
    python benchmarks/bench_mapping.py --data-dir /tmp/bench/store --gib 1.5
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SAEV_SHARDS, evict, files_under, table
from bench_loader import build_store

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_DONTNEED, MADV_HUGEPAGE, MADV_POPULATE_READ = 4, 14, 22
STRETCH = 16 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", type=Path, default=Path("/tmp/actstore-bench-loader"))
    p.add_argument("--gib", type=float, default=1.5)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--shard-gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    return p.parse_args(argv)


def mapped(path: Path, huge: bool) -> tuple[mmap.mmap, int]:
    fd = os.open(path, os.O_RDONLY)
    try:
        m = mmap.mmap(fd, os.path.getsize(path), prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    address = np.frombuffer(m, dtype=np.uint8).ctypes.data
    if huge:
        _LIBC.madvise(address, len(m), MADV_HUGEPAGE)
    return m, address


def cold_pass(path: Path, how: str, threads: int, order: np.ndarray) -> float:
    """GB/s reading the evicted file: populate (``huge``/``small``) or pread."""
    size = os.path.getsize(path)
    evict([path])
    t0 = time.perf_counter()
    if how == "pread":

        def read(offset: int) -> None:
            buf = bytearray(STRETCH)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.preadv(fd, [memoryview(buf)[: min(STRETCH, size - offset)]], offset)
            finally:
                os.close(fd)

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(read, order.tolist()))
    else:
        m, address = mapped(path, how == "huge")
        with ThreadPoolExecutor(threads) as pool:
            list(
                pool.map(
                    lambda o: _LIBC.madvise(
                        address + o, min(STRETCH, size - o), MADV_POPULATE_READ
                    ),
                    order.tolist(),
                )
            )
        m.close()
    return size / 1e9 / (time.perf_counter() - t0)


def warm_costs(path: Path, huge: bool) -> tuple[float, float]:
    """CPU s/GB to fault the cached file in, and to let it go, in a fresh mapping."""
    size = os.path.getsize(path)
    m, address = mapped(path, huge)
    t0 = time.thread_time()
    _LIBC.madvise(address, size, MADV_POPULATE_READ)
    fault = time.thread_time() - t0
    t0 = time.thread_time()
    _LIBC.madvise(address, size, MADV_DONTNEED)
    let_go = time.thread_time() - t0
    m.close()
    return fault / (size / 1e9), let_go / (size / 1e9)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    path = files_under(build_store(args), SAEV_SHARDS)[0]
    size = os.path.getsize(path)
    order = np.random.default_rng(0).permutation(-(-size // STRETCH)) * STRETCH
    cases = [(how, n) for how in ("pread", "small", "huge") for n in (1, 4)]
    got: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    for _ in range(args.repeats):
        for how, n in cases:
            rate = cold_pass(path, how, n, order)
            fault, let_go = warm_costs(path, how == "huge")
            got.setdefault((how, n), []).append((rate, fault, let_go))
    names = {
        "pread": "16 MiB preads",
        "small": "populate, 4 KiB pages",
        "huge": "populate, MADV_HUGEPAGE",
    }
    rows = []
    for how, n in cases:
        runs = np.array(got[(how, n)])
        med = np.median(runs, axis=0)
        rows.append(
            [
                f"{names[how]}, {n} thread{'s' * (n > 1)}",
                f"{med[0]:.2f}",
                f"{runs[:, 0].min():.2f}-{runs[:, 0].max():.2f}",
                f"{med[1]:.4f}" if how != "pread" else "",
                f"{med[2]:.4f}" if how != "pread" else "",
            ]
        )
    print(f"{path.name}: {size / 2**30:.2f} GiB in {STRETCH >> 20} MiB stretches, random order; "
          f"medians of {args.repeats}")  # fmt: skip
    print(
        table(
            ["cold read of the file by", "GB/s", "range", "then fault-in, CPU s/GB", "let go"],
            rows,
        )
    )


if __name__ == "__main__":
    main()
