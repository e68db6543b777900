"""The loader feeding a synthetic trainer, against the same trainer on resident batches
(issue 29: where do the training loop and the loader contend, before a GPU is spent).

A GPU trainer's step is, seen from its process, either a wait with the GIL released
(``torch.cuda.synchronize``, a copy, a kernel queue that is full) or Python that holds the
GIL (autograd, optimizer and autocast dispatch, many small kernel launches). The trainers
here do exactly that for a fixed time per step, sized so that alone they would consume
``--load`` (default 0.75, as the bf16 SAE on an H200: 3.2 of the loader's 4.16 GB/s) of
the in-process loader's solo rate:

- ``wait``: ``time.sleep`` (the GIL is released: a trainer waiting on the GPU);
- ``python``: a Python loop (the GIL is held but for the interpreter's forced switches);
- ``mixed``: half of each.

Each is fed by the loader in process (also with the next epoch's read-ahead off:
``ACTSTORE_READ_AHEAD=0``), by ``ActivationDataLoader`` with ``--workers``
persistent workers and by ``actstore serve`` (one consumer), over a warm store, and is
run on the same number of resident batches (the baseline). Rows: fed time, resident time,
ratio resident / fed (goal >= 0.95), medians of ``--repeats`` interleaved repetitions;
and each feed alone (no trainer) against the in-process loader alone.

    python benchmarks/bench_trainer.py                 # 0.5 GiB store, about 2 minutes on 2 cores
    python benchmarks/bench_trainer.py --quick         # fewer rows, one trainer pair
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Timer, fmt, table
from bench_loader import build_store

from actstore.formats.saev import SaevReader
from actstore.loader import ActivationDataLoader, ActivationLoader
from actstore.loader.serve import ServedLoader, start_server

TRAINERS = ("wait", "python", "mixed")


def step_function(kind: str, seconds: float) -> Callable[[Any], None]:
    """One synthetic training step of ``seconds``: GIL released, held, or half of each."""

    def spin(s: float) -> None:
        end = time.perf_counter() + s
        while time.perf_counter() < end:
            pass

    if kind == "wait":
        return lambda batch: time.sleep(seconds)
    if kind == "python":
        return lambda batch: spin(seconds)
    if kind == "mixed":
        return lambda batch: (spin(seconds / 2), time.sleep(seconds / 2))[0]
    raise SystemExit(f"unknown trainer {kind!r}; one of {TRAINERS}")


def without_read_ahead(loader: Iterable[Any]) -> Iterator[Any]:
    """``loader``'s epoch with the next epoch's read-ahead off (the loader before issue 29:
    each epoch's first batch waits for its first window to be read)."""
    os.environ["ACTSTORE_READ_AHEAD"] = "0"
    try:
        yield from loader
    finally:
        os.environ.pop("ACTSTORE_READ_AHEAD", None)


def drain(batches: Iterable[Any]) -> None:
    """Iterate to the end, holding no batch afterwards (a served consumer releases its
    batches in order: one still referenced stalls the ring)."""
    collections.deque(batches, maxlen=0)


def train(batches: Iterable[Any], step: Callable[[Any], None]) -> tuple[float, int]:
    """Seconds to run ``step`` on every batch of ``batches`` (one whole epoch: a loader
    iterated to its end starts reading the next epoch), and the steps taken."""
    done = 0
    with Timer() as t:
        for batch in batches:
            step(batch)
            done += 1
            del batch
    return t.seconds, done


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data-dir", type=Path, default=Path("/tmp/actstore-bench-trainer"))
    p.add_argument("--gib", type=float, default=0.5, help="size of the store in GiB")
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--pool-mib", type=int, default=64, help="shuffle window size")
    p.add_argument("--io-threads", type=int, default=2, help="read threads per consumer")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers of the worker row")
    p.add_argument("--load", type=float, default=0.75, help="trainer demand / loader solo rate")
    p.add_argument("--trainers", default=",".join(TRAINERS))
    p.add_argument("--feeds", default="in process,workers,serve")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repetitions (medians)")
    p.add_argument("--quick", action="store_true", help="0.25 GiB, wait and python, 2 repeats")
    p.add_argument("--json", type=Path, help="also write every number here")
    args = p.parse_args(argv)
    if args.quick:
        args.gib, args.repeats, args.trainers = min(args.gib, 0.25), 2, "wait,python"
    args.layers, args.shard_gib, args.data_dir = 1, max(args.gib / 2, 0.05), args.data_dir
    path = build_store(args)
    reader = SaevReader(path)
    block_bytes = reader.blocks(0)[0].n_rows * reader.d_model * 4
    pool_blocks = max(1, (args.pool_mib << 20) // block_bytes)
    options = {
        "site": 0,
        "batch_size": args.batch_size,
        "pool_blocks": pool_blocks,
        "io_threads": args.io_threads,
        "drop_last": True,
    }
    row_bytes = reader.d_model * 4
    batch_bytes = args.batch_size * row_bytes
    in_process = ActivationLoader(reader, **options)
    steps = len(in_process)
    drain(in_process)  # the page cache, and the loader's buffers
    one = next(iter(ActivationLoader(reader, **options))).clone()  # the resident batch

    feeds: dict[str, Callable[[], Iterable[Any]]] = {}
    closers: list[Callable[[], None]] = []
    wanted = [f.strip() for f in args.feeds.split(",") if f.strip()]
    if "in process" in wanted:
        feeds["in process"] = lambda: in_process
        unprimed = ActivationLoader(reader, **options)
        drain(without_read_ahead(unprimed))
        feeds["in process, no read-ahead"] = lambda: without_read_ahead(unprimed)
    if "workers" in wanted:
        data = ActivationDataLoader(
            ActivationLoader(reader, **options),
            num_workers=args.workers,
            persistent_workers=True,
        )
        drain(data)  # workers started, their pools made
        feeds[f"{args.workers} workers"] = lambda: data
    if "serve" in wanted:
        name = f"bench-trainer-{os.getpid()}"
        server = start_server(
            str(path), name=name, consumers=1, epochs=10_000, context="spawn", **options
        )
        served = ServedLoader(name, 0)
        drain(served)
        feeds["serve"] = lambda: served

        def stop() -> None:
            served.close()
            server.kill()
            server.join(10)

        closers.append(stop)

    trainers = [t.strip() for t in args.trainers.split(",") if t.strip()]
    alone: dict[str, list[float]] = {f: [] for f in feeds}
    fed: dict[tuple[str, str], list[float]] = {}
    resident: dict[tuple[str, str], list[float]] = {}
    step_s = 0.0
    try:
        for rep in range(args.repeats):
            for feed, make in feeds.items():  # each feed alone: its rate with no trainer
                s, n = train(make(), lambda batch: None)
                alone[feed].append(n * batch_bytes / s)
            if rep == 0:  # the trainers' step, from the in-process loader's solo rate
                solo = alone.get("in process", next(iter(alone.values())))[0]
                step_s = batch_bytes / (args.load * solo)
            for kind in trainers:
                step = step_function(kind, step_s)
                for feed, make in feeds.items():
                    s, n = train(make(), step)
                    fed.setdefault((kind, feed), []).append(s / n)
                    s, n = train(itertools.repeat(one, steps), step)
                    resident.setdefault((kind, feed), []).append(s / n)
            print(f"repetition {rep + 1}/{args.repeats}: done", flush=True)
    finally:
        for close in closers:
            close()

    rows: list[list[Any]] = []
    base = statistics.median(alone.get("in process", next(iter(alone.values()))))
    for feed, rates in alone.items():
        r = statistics.median(rates)
        rows.append(
            [f"{feed}, no trainer", f"{r / 1e9:.2f} GB/s", "in process, no trainer", r / base, "-"]
        )
    for (kind, feed), times in fed.items():
        a, b = statistics.median(times), statistics.median(resident[(kind, feed)])
        rows.append(
            [
                f"{kind} trainer fed {feed}",
                f"{a * 1e3:.1f} ms/step",
                f"same trainer, resident ({b * 1e3:.1f} ms/step)",
                b / a,
                ">= 0.95",
            ]
        )
    print()
    print(table(["what", "measured", "baseline", "ratio", "goal"], rows))
    print(
        f"\n{os.cpu_count()} cores; store {path} ({args.gib} GiB, D={reader.d_model}); "
        f"batch {args.batch_size} rows ({batch_bytes / 2**20:.0f} MiB); {steps} steps per "
        f"epoch; trainer step {step_s * 1e3:.1f} ms = {args.load} of the in-process loader's "
        f"solo rate; medians of {args.repeats} interleaved repetitions"
    )
    if args.json:
        args.json.write_text(
            json.dumps({"rows": [[fmt(v) for v in r] for r in rows], "step_s": step_s}, indent=1)
        )


if __name__ == "__main__":
    main()
