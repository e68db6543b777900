"""Where the read path's time goes: CPU seconds per GB of each stage of one cold and one
warm epoch, in process, with DataLoader workers and through ``actstore serve``.

On bench_loader's synthetic saev store. Every configuration runs in a fresh process, its
first epoch cold (the store evicted from the page cache just before) and its second
warm. Stage CPU comes from the loader's stage clock (``ActivationLoader.clock``: the CPU
time of the thread that runs each stage, summed over threads); torch's intra-op threads
are set to ``--torch-threads`` (default 1) so the gather's CPU is the calling thread's.
The stages:

- ``fault-in``: mapping the window's pages (``MADV_POPULATE_READ``; it reads them from the
  disk when cold, so part of it is waiting);
- ``verify``: xxh3 of each block where it lies, against the manifest;
- ``read``: windows read into buffers (``ACTSTORE_MAP=0``; checked as they are read);
- ``order``: each window's permutation and the offsets of its rows;
- ``gather``: ``index_select`` of each batch's rows into its buffer (with the cast to
  bfloat16 and normalisation when asked);
- ``let-go``: dropping a served window's pages from the process's page tables;
- ``other``: the process's CPU not in a stage (Python, hand-off of batches, the trainer's
  loop, which here only counts rows).

With workers, ``process`` is the main process (the hand-off) and ``workers`` the worker
processes' CPU (their own stages are not split). Through serve, ``process`` is one
consumer and ``workers`` the server. Ratios are against the best of 1- and 4-stream
16 MiB sequential reads of the same files in the same run, cold and warm.

Usage:
    python benchmarks/bench_read_stages.py --data-dir /tmp/bench/store --gib 1.5
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SAEV_SHARDS, files_under, table
from bench_loader import build_store, drop_cache, make_loader, stream_read

from actstore.formats.saev import SaevReader
from actstore.formats.threads import StageClock
from actstore.loader import ActivationDataLoader
from actstore.loader.serve import ServedLoader, start_server

STAGES = ("fault-in", "verify", "read", "order", "gather", "let-go")
CONFIGS: dict[str, dict] = {  # name -> (what the table says, options)
    "mapped": {"label": "in process, mapped, checked"},
    "unchecked": {"label": "in process, mapped, unchecked", "verify": False},
    "bf16": {"label": "in process, mapped, checked, to bfloat16", "dtype": "bfloat16"},
    "buffers": {"label": "in process, read into buffers", "env": {"ACTSTORE_MAP": "0"}},
    "workers": {"label": "2 workers, mapped, checked", "workers": 2},
    "serve": {"label": "serve, 2 consumers, mapped, checked", "serve": 2},
}


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
    p.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--cold", choices=["fadvise", "drop"], default="fadvise")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--child", help=argparse.SUPPRESS)  # run one configuration (internal)
    p.add_argument("--store", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _cpu(who: int) -> float:
    u = resource.getrusage(who)
    return u.ru_utime + u.ru_stime


def _workers_cpu(data) -> float:
    """CPU seconds of a DataLoader's live worker processes (persistent workers are not
    reaped at the end of an epoch, so their usage is read from /proc)."""
    iterator = getattr(data, "_iterator", None)
    total = 0.0
    for process in getattr(iterator, "_workers", []) or []:
        try:
            fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _served(name: str, c: int, results) -> None:
    """A serve consumer: times each epoch and its own CPU."""
    torch.set_num_threads(1)
    loader = ServedLoader(name, c, directory="/dev/shm")
    rows, t0, cpu0 = 0, time.perf_counter(), _cpu(resource.RUSAGE_SELF)
    for batch in loader:
        rows += len(batch)
    results.put((c, rows, time.perf_counter() - t0, _cpu(resource.RUSAGE_SELF) - cpu0))
    loader.close()


def child(args: argparse.Namespace, name: str) -> None:
    """One configuration in this fresh process: a cold epoch, then a warm one (JSON out)."""
    config = CONFIGS[name]
    torch.set_num_threads(args.torch_threads)
    path = Path(args.store)
    files = files_under(path, SAEV_SHARDS)
    row_bytes = SaevReader(path).d_model * 4
    out = []
    for cache in ("cold", "warm"):
        if cache == "cold":
            drop_cache(files, args.cold)
        if config.get("serve"):
            out.append(serve_epoch(args, path, int(config["serve"]), row_bytes) | {"cache": cache})
            continue
        loader = make_loader(
            path, args, 0, verify=config.get("verify", True), dtype=config.get("dtype", "float32")
        )
        loader.clock = StageClock()
        workers = int(config.get("workers", 0))
        data = ActivationDataLoader(loader, num_workers=workers) if workers else loader
        rows, t0 = 0, time.perf_counter()
        cpu0, kids0 = _cpu(resource.RUSAGE_SELF), _workers_cpu(data)
        for batch in data:
            rows += len(batch)
        seconds = time.perf_counter() - t0
        gb = rows * row_bytes / 1e9
        process = (_cpu(resource.RUSAGE_SELF) - cpu0) / gb
        stages = {k: v / gb for k, v in loader.clock.seconds.items()}
        out.append(
            {
                "cache": cache,
                "gb_per_s": gb / seconds,
                "process": process,
                "workers": (_workers_cpu(data) - kids0) / gb if workers else None,
                "stages": stages,
            }
        )
        loader.close()
    print(json.dumps(out))


def serve_epoch(args, path: Path, k: int, row_bytes: int) -> dict:
    """One epoch served to ``k`` consumer processes: the slowest consumer's rate, one
    consumer's CPU and the server's, per GB it served."""
    name = f"stages-{os.getpid()}-{time.monotonic_ns()}"
    reader = SaevReader(path)
    pool_blocks = max(1, (args.pool_mib << 20) // (reader.blocks(0)[0].n_rows * row_bytes))
    ctx = multiprocessing.get_context("fork")
    server = start_server(
        reader, name=name, consumers=k, batch_size=args.batch_size, pool_blocks=pool_blocks,
        io_threads=args.io_threads, context="fork",
    )  # fmt: skip
    results = ctx.Queue()
    procs = [ctx.Process(target=_served, args=(name, c, results)) for c in range(k)]
    for p in procs:
        p.start()
    got = [results.get(timeout=900) for _ in procs]
    for p in procs:
        p.join(60)
    _, _, usage = os.wait4(server.pid, 0)
    gb = got[0][1] * row_bytes / 1e9
    return {
        "gb_per_s": min(rows * row_bytes / 1e9 / s for _, rows, s, _ in got),
        "process": float(np.median([cpu for *_, cpu in got])) / gb,
        "workers": (usage.ru_utime + usage.ru_stime) / gb,
        "stages": {},
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        child(args, args.child)
        return
    path = build_store(args)
    files = files_under(path, SAEV_SHARDS)
    names = [n for n in args.configs.split(",") if n]
    base: dict[str, float] = {}
    drop_cache(files, args.cold)
    for cache in ("cold", "warm"):
        if cache == "cold":
            drop_cache(files, args.cold)
        runs = [stream_read(files, 1), stream_read(files, 4)]
        if cache == "cold":  # the 4-stream read also from the disk
            drop_cache(files, args.cold)
            runs[1] = stream_read(files, 4)
        base[cache] = max(n / t.seconds for n, t in runs) / 1e9
    rows = []
    results = {}
    for name in names:
        env = {**os.environ, **CONFIGS[name].get("env", {})}
        cmd = [sys.executable, __file__, "--child", name, "--data-dir", str(args.data_dir)]
        cmd += [f"--{k.replace('_', '-')}={v}" for k, v in _size_options(args).items()]
        cmd += [f"--store={path}"]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"{name} failed:\n{done.stderr}")
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{name}: done", file=sys.stderr)
        for epoch in results[name]:
            stages = epoch["stages"]
            other = epoch["process"] - sum(stages.values())
            rows.append(
                [
                    CONFIGS[name]["label"],
                    epoch["cache"],
                    f"{epoch['gb_per_s']:.2f}",
                    f"{epoch['gb_per_s'] / base[epoch['cache']]:.2f}",
                    f"{epoch['process']:.3f}",
                    *(f"{stages[s]:.3f}" if s in stages else "" for s in STAGES),
                    f"{other:.3f}" if stages else "",
                    "" if epoch["workers"] is None else f"{epoch['workers']:.3f}",
                ]
            )
    size = sum(f.stat().st_size for f in files)
    print(
        f"store {size / 2**30:.2f} GiB; best sequential read {base['cold']:.2f} GB/s cold, "
        f"{base['warm']:.2f} GB/s warm; torch threads {args.torch_threads}; CPU s per GB served"
    )
    print(
        table(
            ["read path", "cache", "GB/s", "vs read", "process", *STAGES, "other", "workers"],
            rows,
        )
    )
    if args.json:
        args.json.write_text(json.dumps({"base": base, "results": results}, indent=1))


def _size_options(args: argparse.Namespace) -> dict[str, object]:
    keys = ("gib", "d_model", "tokens", "layers", "shard_gib", "batch_size", "pool_mib")
    keys += ("io_threads", "torch_threads", "cold")
    return {k: getattr(args, k) for k in keys}


if __name__ == "__main__":
    main()
