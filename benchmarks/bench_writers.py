"""Every writer against the disk (issue 28): each format alone vs a raw write + fsync of the
same bytes, where its CPU goes per pipeline stage, how it scales with the writer's threads,
and what 24 sites of a 24-layer model cost, journal included.

Parts (``--parts``, default disk, stages, sites24), each against a baseline measured in
the same run:

1. ``disk``: each writer (``--formats``: saev, activault, saelens, zarr, pickle, opened
   through ``get_format(name).open_writer(plan, out, options)``) fed batches of each
   ``--feeds`` dtype (float32: what a capture that casts on the GPU hands a float32 store;
   bfloat16: what a bf16 model hands), against a raw sequential ``write`` + ``fsync`` of as
   many bytes as the published store holds, into the same directory (``--dir``), taken
   both ways a file can be written: through the page cache, and with ``O_DIRECT`` where the
   file system offers it; the baseline of each repetition is the faster of the two. Runs
   are interleaved (raw, raw direct, writer, ...), ``--repeats`` of them after one untimed
   warm-up write (which also gives the store's size); every repetition writes fresh files,
   ``os.sync()`` first, and deletes them afterwards, so no repetition finds the previous
   one's pages. ratio = raw seconds / writer seconds (>= 0.9 is the goal), median of the
   per-repetition ratios.
2. ``stages``: the same writers into tmpfs (``--tmpfs``; no disk; ``--stage-on
   tmpfs,disk`` also onto ``--dir``): CPU seconds per GB of
   stored bytes per pipeline stage (``ShardedWriter.stage_seconds()``: cast, encode,
   statistics, write, hash, commit, summed over threads) next to the process's whole CPU,
   and throughput with the writer's pools at 1..N threads (``ACTSTORE_WRITER_THREADS``,
   read by :class:`actstore.formats.threads.Pools`), thread counts interleaved.
3. ``sites24``: every site of a 24-layer model (saev, ``--sites24-d``), small shards so
   there are many: the same ratio to the raw write, and the wall time of each shard's
   journal append (``.partial/progress.jsonl``, one line per shard, appended, on the commit
   thread) against the shard's index: flat if the journal is O(1) per shard.
4. ``direct``: each writer of ``--formats`` fed each ``--feeds`` dtype on ``--dir`` with
   direct writes and through the page cache (``ACTSTORE_DIRECT_IO=1`` / ``0``),
   interleaved: GB/s, the process's CPU s/GB and the ``write`` stage's, medians.

The CPU capture path (capture to saev vs a discarding writer, <= 1.05) is
``bench_capture.py --only capture``. Batches are built in memory before any timing: views
into one random block (``--pool-mib``) of the feed dtype, cycled, so data costs nothing.
Each row carries the 1-minute load average (``os.getloadavg``) over its repetitions: on a
shared machine the figures are only as quiet as it was.

    python benchmarks/bench_writers.py                                  # ~1 GiB per rep
    python benchmarks/bench_writers.py --parts stages --tmpfs /dev/shm/bw
    python benchmarks/bench_writers.py --formats saev,activault --feeds bfloat16 --gib 4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import mmap
import os
import resource
import shutil
import statistics
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import table

from actstore.batch import Batch, CapturePlan
from actstore.formats import get_format
from actstore.formats.threads import THREADS_ENV
from actstore.sites import Site
from actstore.storage.writeback import DIRECT_ENV, direct_alignment_in, pool_size
from actstore.testing import make_plan

FORMATS = ("saev", "activault", "saelens", "zarr", "pickle")
FEEDS = ("float32", "bfloat16")
STAGES = ("cast", "encode", "statistics", "write", "hash", "commit")
#: Bytes per stored value of each format's default dtype.
STORED = {"saev": 4, "activault": 2, "saelens": 4, "zarr": 2, "pickle": 4}
STORED_DTYPE = {
    "saev": "float32",
    "activault": "bfloat16",
    "saelens": "float32",
    "zarr": "float16",
    "pickle": "float32",
}
GB = 1e9


def load() -> float:
    return os.getloadavg()[0]


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# ---------------------------------------------------------------------- inputs


class Pool:
    """One random block per feed dtype, made once; batches are views into it, cycled."""

    def __init__(self, mib: int) -> None:
        self.values = max(1, (mib << 20) // 4)
        self._blocks: dict[str, torch.Tensor] = {}

    def block(self, dtype: str) -> torch.Tensor:
        if dtype not in self._blocks:
            rng = np.random.default_rng(0)
            x = torch.from_numpy(rng.standard_normal(self.values, dtype=np.float32))
            self._blocks[dtype] = x if dtype == "float32" else x.to(getattr(torch, dtype))
        return self._blocks[dtype]

    def raw_source(self) -> memoryview:
        return memoryview(self.block("float32").numpy()).cast("B")


@dataclass
class Case:
    fmt: str
    feed: str
    plan: CapturePlan
    options: Any
    batches: list[Batch]
    label: str = ""
    store_bytes: int = 0
    rows: list[dict[str, Any]] = field(default_factory=list)


def make_case(
    fmt: str,
    feed: str,
    pool: Pool,
    *,
    gib: float,
    sites: Sequence[int],
    n_layers: int,
    tokens: int,
    d: int,
    batch_size: int,
    shard_mib: float,
) -> Case:
    """``fmt``'s plan, options and in-memory batches of ``feed`` holding about ``gib`` GiB
    of stored activations (shards of about ``shard_mib`` MiB, whole batches each)."""
    n_sites = len(sites)
    per_example = n_sites * tokens * d * STORED[fmt]
    n = max(batch_size, int(gib * 2**30) // per_example // batch_size * batch_size)
    per_shard = max(1, round(shard_mib * 2**20 / per_example / batch_size)) * batch_size
    plan = make_plan(
        sites=tuple(Site("resid", k) for k in sites),
        n_model_layers=n_layers,
        d_model=d,
        tokens_per_example=tokens,
        n_examples=n,
        batch_size=batch_size,
        has_tokens=fmt != "zarr",
    )
    options = shard_options(fmt, plan, per_shard if shard_mib > 0 else 0)
    block = pool.block(feed)
    per_batch = batch_size * tokens * d
    tokens_ids = ((np.arange(batch_size * tokens) % 250) + 4).astype(np.int32)
    tokens_ids = tokens_ids.reshape(batch_size, tokens)
    batches, at = [], 0
    for lo in range(0, n, batch_size):
        hi = min(n, lo + batch_size)
        acts = {}
        for site in plan.sites:
            if at + per_batch > len(block):
                at = 0
            acts[str(site)] = block[at : at + (hi - lo) * tokens * d].view(hi - lo, tokens, d)
            at += per_batch
        extras = {}
        if fmt == "zarr":  # prompt/response store: half the tokens each
            p = tokens // 2
            extras = {
                "prompt_len": np.full(hi - lo, p, np.int64),
                "response_len": np.full(hi - lo, tokens - p, np.int64),
            }
        batches.append(
            Batch(
                acts=acts,
                example_ids=np.arange(lo, hi, dtype=np.int64),
                token_ids=None if fmt == "zarr" else tokens_ids[: hi - lo],
                extras=extras,
            )
        )
    return Case(fmt, feed, plan, options, batches)


def shard_options(fmt: str, plan: CapturePlan, per_shard: int) -> Any:
    """``fmt``'s default options, with ``per_shard`` examples per shard (0: its default)."""
    spec = get_format(fmt)
    options = spec.options()
    t, s = plan.tokens_per_example, len(plan.sites)
    if not per_shard:
        return (
            dataclasses.replace(options, p_max=t // 2, r_max=t - t // 2)
            if fmt == "zarr"
            else options
        )
    fields = {
        "saev": {"patches_per_shard": per_shard * t * s},
        "activault": {"rows_per_file": per_shard},
        "saelens": {"examples_per_shard": per_shard},
        "zarr": {
            "samples_per_shard": per_shard,
            "p_max": t // 2,
            "r_max": t - t // 2,
        },
        "pickle": {"samples_per_shard": per_shard},
    }[fmt]
    return dataclasses.replace(options, **fields)


# ---------------------------------------------------------------------- one write each


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def run_writer(
    case: Case, root: Path, *, journal: list[tuple[int, float, int]] | None = None
) -> dict[str, Any]:
    """Write ``case`` once into a fresh directory under ``root`` (open, every batch, close:
    published and durable); returns seconds, CPU seconds, stage seconds, bytes. The store
    is deleted afterwards (untimed)."""
    out = root / f"w-{uuid.uuid4().hex[:8]}"
    os.sync()
    t_load = load()
    cpu0 = cpu_seconds()
    t0 = time.perf_counter()
    writer = get_format(case.fmt).open_writer(case.plan, out, case.options)
    if journal is not None and hasattr(writer, "_append_journal"):
        append = writer._append_journal

        def timed_append(entry: Any) -> None:  # a ShardRecord
            s = time.perf_counter()
            append(entry)
            journal.append((int(entry.index), time.perf_counter() - s, journal_size(writer)))

        writer._append_journal = timed_append  # the commit thread calls it per shard
    try:
        for batch in case.batches:
            writer.write(batch)
        writer.close()
    except BaseException:
        writer.abort()
        shutil.rmtree(out, ignore_errors=True)
        raise
    seconds = time.perf_counter() - t0
    cpu = cpu_seconds() - cpu0
    stages = writer.stage_seconds() if hasattr(writer, "stage_seconds") else {}
    threads = getattr(getattr(writer, "_pools", None), "threads", None)
    nbytes = tree_bytes(out)
    shutil.rmtree(out, ignore_errors=True)
    return {
        "seconds": seconds,
        "cpu": cpu,
        "stages": stages,
        "bytes": nbytes,
        "load": t_load,
        "threads": threads,
    }


def journal_size(writer: Any) -> int:
    try:
        return os.path.getsize(writer.partial / "progress.jsonl")
    except OSError:
        return 0


def raw_write(
    root: Path, nbytes: int, source: memoryview, chunk: int = 8 << 20, *, direct: bool = False
) -> dict:
    """A sequential ``write`` of ``nbytes`` (from ``source``, cycled, in ``chunk``-byte
    calls) into a fresh file under ``root``, then ``fsync``: the disk's limit. ``direct``:
    through ``O_DIRECT`` from one aligned buffer (the tail that is not a whole block
    through the page cache), the other way to write a file at the disk's speed."""
    path = root / f"raw-{uuid.uuid4().hex[:8]}.bin"
    align = direct_alignment_in(root) if direct else 0
    if direct and not align:
        return {"seconds": float("nan"), "load": load()}
    aligned = None
    if direct:
        aligned = memoryview(mmap.mmap(-1, chunk))
        aligned[:] = source[:chunk]
    os.sync()
    t_load = load()
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    dfd = os.open(path, os.O_WRONLY | os.O_DIRECT) if direct else -1
    try:
        done, at = 0, 0
        while done < nbytes:
            want = min(chunk, nbytes - done)
            if aligned is not None and want >= align:
                n = os.pwrite(dfd, aligned[: want - want % align], done)
            else:
                if at + chunk > len(source):
                    at = 0
                n = os.pwrite(fd, source[at : at + want], done)
            done += n
            at += n
        os.fsync(fd)
    finally:
        os.close(fd)
        if dfd >= 0:
            os.close(dfd)
    seconds = time.perf_counter() - t0
    path.unlink()
    return {"seconds": seconds, "load": t_load}


# ---------------------------------------------------------------------- the parts


def guarded(what: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, or None with a printed note when the writer is broken (others are
    converting writers onto the pipeline while this runs)."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - report and go on to the next writer
        print(f"  SKIPPED {what}: {type(err).__name__}: {str(err)[:300]}", flush=True)
        if os.environ.get("BENCH_TRACEBACK"):
            traceback.print_exc()
        return None


def disk_pairs(case: Case, root: Path, source: memoryview, repeats: int, **kw: Any) -> dict:
    """Warm-up write (its size is the raw write's), then ``repeats`` interleaved pairs."""
    warm = run_writer(case, root)
    case.store_bytes = warm["bytes"]
    pairs, direct = [], bool(direct_alignment_in(root))
    for _ in range(repeats):
        raw = raw_write(root, case.store_bytes, source)
        if direct:  # the baseline is the better of the two ways to write, in each pair
            other = raw_write(root, case.store_bytes, source, direct=True)
            raw = {**raw, "buffered_s": raw["seconds"], "direct_s": other["seconds"]}
            raw["seconds"] = min(raw["buffered_s"], raw["direct_s"])
        ours = run_writer(case, root, **kw)
        pairs.append((raw, ours))
    ratios = [r["seconds"] / w["seconds"] for r, w in pairs]
    loads = [x["load"] for p in pairs for x in p]
    raw_s = statistics.median(r["seconds"] for r, _ in pairs)
    ours_s = statistics.median(w["seconds"] for _, w in pairs)
    buffered_s = statistics.median(r.get("buffered_s", r["seconds"]) for r, _ in pairs)
    direct_s = statistics.median(r.get("direct_s", float("nan")) for r, _ in pairs)
    return {
        "format": case.fmt,
        "feed": case.feed,
        "stored": STORED_DTYPE[case.fmt],
        "GB": case.store_bytes / GB,
        "raw_GBps": case.store_bytes / raw_s / GB,
        "raw_buffered_GBps": case.store_bytes / buffered_s / GB,
        "raw_direct_GBps": case.store_bytes / direct_s / GB,
        "writer_GBps": case.store_bytes / ours_s / GB,
        "ratio": statistics.median(ratios),
        "ratios": sorted(ratios),
        "load_median": statistics.median(loads),
        "load_max": max(loads),
        "reps": repeats,
        "shards": -(-case.plan.n_examples // max(1, shard_examples(case))),
        "pairs": [
            {
                "raw_s": r["seconds"],
                "raw_buffered_s": r.get("buffered_s", r["seconds"]),
                "raw_direct_s": r.get("direct_s"),
                "writer_s": w["seconds"],
                "writer_cpu": w["cpu"],
            }
            for r, w in pairs
        ],
    }


def shard_examples(case: Case) -> int:
    o = case.options
    for name in ("samples_per_shard", "examples_per_shard", "rows_per_file"):
        if getattr(o, name, None):
            return int(getattr(o, name))
    if getattr(o, "patches_per_shard", None):
        return int(o.patches_per_shard) // (case.plan.tokens_per_example * len(case.plan.sites))
    return case.plan.n_examples


def part_disk(args, pool: Pool, root: Path, results: dict) -> None:
    print(
        f"\n== 1. each writer alone vs raw write + fsync of the same bytes, {root} "
        f"(median of {args.repeats} interleaved pairs after a warm-up)",
        flush=True,
    )
    rows = []
    for fmt in args.formats:
        for feed in args.feeds:
            gib = args.pickle_gib if fmt == "pickle" else args.gib
            case = guarded(f"{fmt} ({feed})", lambda fmt=fmt, feed=feed, gib=gib: make_case(
                fmt, feed, pool, gib=gib, sites=args.sites, n_layers=args.layers,
                tokens=args.tokens, d=args.d, batch_size=args.batch_size,
                shard_mib=args.shard_mib,
            ))  # fmt: skip
            if case is None:
                continue
            row = guarded(
                f"{fmt} ({feed})",
                lambda case=case: disk_pairs(case, root, pool.raw_source(), args.repeats),
            )
            if row is None:
                continue
            rows.append(row)
            print(
                f"  {fmt:9} fed {feed:8} -> {row['stored']:8} {row['GB']:5.2f} GB: raw "
                f"{row['raw_GBps'] * 1e3:.0f} MB/s (page cache {row['raw_buffered_GBps'] * 1e3:.0f}, "
                f"direct {row['raw_direct_GBps'] * 1e3:.0f}), writer {row['writer_GBps'] * 1e3:.0f} MB/s, ratio "
                f"{row['ratio']:.2f} (reps {', '.join(f'{r:.2f}' for r in row['ratios'])}; "
                f"load {row['load_median']:.1f}, max {row['load_max']:.1f})",
                flush=True,
            )
    results["disk"] = rows
    if rows:
        print()
        print(
            table(
                [
                    "writer",
                    "fed",
                    "stored",
                    "GB",
                    "shards",
                    "raw MB/s",
                    "page cache / direct",
                    "writer MB/s",
                    "ratio",
                    "reps",
                    "load",
                ],
                [
                    [
                        r["format"],
                        r["feed"],
                        r["stored"],
                        r["GB"],
                        r["shards"],
                        r["raw_GBps"] * 1e3,
                        f"{r['raw_buffered_GBps'] * 1e3:.0f} / {r['raw_direct_GBps'] * 1e3:.0f}",
                        r["writer_GBps"] * 1e3,
                        r["ratio"],
                        " ".join(f"{x:.2f}" for x in r["ratios"]),
                        f"{r['load_median']:.1f} (max {r['load_max']:.1f})",
                    ]
                    for r in rows
                ],
            )
        )


def part_stages(args, pool: Pool, root: Path, results: dict, where: str = "tmpfs") -> None:
    counts = sorted({1, *args.threads})
    print(
        f"\n== 2. into {where} ({root}): CPU s per GB stored, per stage, and throughput at "
        f"{counts} writer threads (median of {args.stage_repeats}, thread counts interleaved)",
        flush=True,
    )
    rows = []
    for fmt in args.formats:
        for feed in args.feeds:
            gib = args.pickle_gib if fmt == "pickle" else args.stage_gib
            case = guarded(f"{fmt} ({feed})", lambda fmt=fmt, feed=feed, gib=gib: make_case(
                fmt, feed, pool, gib=gib, sites=args.sites, n_layers=args.layers,
                tokens=args.tokens, d=args.d, batch_size=args.batch_size,
                shard_mib=args.shard_mib,
            ))  # fmt: skip
            if case is None:
                continue
            row = guarded(f"{fmt} ({feed})", lambda case=case: stage_runs(case, root, counts, args))
            if row is None:
                continue
            rows.append(row)
            rates = ", ".join(f"{t}: {row['GBps'][t] * 1e3:.0f}" for t in counts)
            print(
                f"  {fmt:9} fed {feed:8}: MB/s by threads {rates}; CPU s/GB "
                + " ".join(f"{s} {stage_cell(row, s)}" for s in STAGES)
                + f", process {row['cpu_per_GB']:.2f} (load {row['load_median']:.1f})",
                flush=True,
            )
    results["stages" if where == "tmpfs" else f"stages_{where}"] = rows
    if not rows:
        return
    print()
    print(
        table(
            ["writer", "fed", *[f"{s} s/GB" for s in STAGES], "stages sum", "process CPU s/GB"],
            [
                [
                    r["format"],
                    r["feed"],
                    *[stage_cell(r, s) for s in STAGES],
                    f"{sum(r['per_GB'].values()):.2f}" if r["per_GB"] else "-",
                    r["cpu_per_GB"],
                ]
                for r in rows
            ],
        )
    )
    print()
    print(
        table(
            ["writer", "fed", *[f"{t} thr MB/s" for t in counts], f"{counts[-1]} / 1", "load"],
            [
                [
                    r["format"],
                    r["feed"],
                    *[r["GBps"][t] * 1e3 for t in counts],
                    r["GBps"][counts[-1]] / r["GBps"][1],
                    f"{r['load_median']:.1f}",
                ]
                for r in rows
            ],
        )
    )


def stage_cell(row: dict, stage: str) -> str:
    """A stage's CPU s/GB, or "-" where the writer's clock has no such stage."""
    return f"{row['per_GB'][stage]:.2f}" if stage in row["per_GB"] else "-"


def stage_runs(case: Case, root: Path, counts: list[int], args) -> dict:
    with_env(THREADS_ENV, counts[-1], lambda: run_writer(case, root))  # warm-up, gives the size
    runs: dict[int, list[dict]] = {t: [] for t in counts}
    for _ in range(args.stage_repeats):
        for t in counts:
            runs[t].append(with_env(THREADS_ENV, t, lambda: run_writer(case, root)))
    nbytes = runs[counts[-1]][0]["bytes"]
    top = runs[counts[-1]]
    per_gb = {
        s: statistics.median(r["stages"].get(s, 0.0) for r in top) / (nbytes / GB)
        for s in STAGES
        if any(s in r["stages"] for r in top)
    }
    loads = [r["load"] for rs in runs.values() for r in rs]
    return {
        "format": case.fmt,
        "feed": case.feed,
        "GB": nbytes / GB,
        "GBps": {t: nbytes / statistics.median(r["seconds"] for r in runs[t]) / GB for t in counts},
        "per_GB": per_gb,
        "per_GB_1thread": {
            s: statistics.median(r["stages"].get(s, 0.0) for r in runs[1]) / (nbytes / GB)
            for s in per_gb
        },
        "cpu_per_GB": statistics.median(r["cpu"] for r in top) / (nbytes / GB),
        "load_median": statistics.median(loads),
        "reps": args.stage_repeats,
    }


def with_env(name: str, value: object, fn: Callable[[], Any]) -> Any:
    """``fn()`` with environment variable ``name`` set to ``value`` (the writer's pools
    read ``ACTSTORE_WRITER_THREADS``, its files ``ACTSTORE_DIRECT_IO``)."""
    old = os.environ.get(name)
    os.environ[name] = str(value)
    try:
        return fn()
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def part_sites24(args, pool: Pool, root: Path, results: dict) -> None:
    print(
        f"\n== 3. all 24 sites of a 24-layer model to saev (d={args.sites24_d}, "
        f"{args.sites24_shard_mib} MiB shards), {root}",
        flush=True,
    )
    rows = []
    for feed in args.sites24_feeds:
        case = make_case(
            "saev", feed, pool, gib=args.sites24_gib, sites=range(24), n_layers=24,
            tokens=args.sites24_tokens, d=args.sites24_d, batch_size=args.sites24_batch,
            shard_mib=args.sites24_shard_mib,
        )  # fmt: skip
        journal: list[tuple[int, float, int]] = []
        row = guarded(
            f"saev 24 sites ({feed})",
            lambda case=case, journal=journal: disk_pairs(
                case, root, pool.raw_source(), args.repeats, journal=journal
            ),
        )
        if row is None:
            continue
        by_shard: dict[int, list[float]] = {}
        size: dict[int, int] = {}
        for index, seconds, nbytes in journal:
            by_shard.setdefault(index, []).append(seconds)
            size[index] = nbytes
        shards = sorted(by_shard)
        med = np.array([statistics.median(by_shard[i]) for i in shards])
        q = max(1, len(shards) // 4)
        slope = float(np.polyfit(shards, med, 1)[0]) if len(shards) > 2 else 0.0
        row["journal"] = {
            "shards": len(shards),
            "first_quarter_ms": float(med[:q].mean() * 1e3),
            "last_quarter_ms": float(med[-q:].mean() * 1e3),
            "slope_us_per_shard": slope * 1e6,
            "median_ms": float(np.median(med) * 1e3),
            "line_bytes": (size[shards[-1]] - size[shards[0]]) / max(1, len(shards) - 1),
            "per_shard_ms": [float(x * 1e3) for x in med],
        }
        rows.append(row)
        j = row["journal"]
        print(
            f"  fed {feed:8}: {row['GB']:.2f} GB, {j['shards']} shards: raw "
            f"{row['raw_GBps'] * 1e3:.0f} MB/s, writer {row['writer_GBps'] * 1e3:.0f} MB/s, ratio "
            f"{row['ratio']:.2f} (reps {', '.join(f'{r:.2f}' for r in row['ratios'])}; load "
            f"{row['load_median']:.1f}, max {row['load_max']:.1f})\n"
            f"    journal append (one line of {j['line_bytes'] / 1e3:.0f} kB, appended), median "
            f"over reps per shard: first quarter {j['first_quarter_ms']:.2f} ms, last quarter "
            f"{j['last_quarter_ms']:.2f} ms, slope {j['slope_us_per_shard']:+.1f} us/shard",
            flush=True,
        )
        step = max(1, len(shards) // 8)
        print(
            "    by shard: "
            + ", ".join(f"#{shards[i]} {med[i] * 1e3:.1f}" for i in range(0, len(shards), step))
            + " (ms)"
        )
    results["sites24"] = rows


def part_direct(args, pool: Pool, root: Path, results: dict) -> None:
    print(
        f"\n== 4. each writer with direct writes and through the page cache "
        f"(ACTSTORE_DIRECT_IO=1 / 0), {root} (median of {args.repeats}, interleaved)",
        flush=True,
    )
    rows = []
    for fmt in args.formats:
        for feed in args.feeds:
            case = make_case(
                fmt, feed, pool, gib=args.gib, sites=args.sites, n_layers=args.layers,
                tokens=args.tokens, d=args.d, batch_size=args.batch_size,
                shard_mib=args.shard_mib,
            )  # fmt: skip
            runs: dict[str, list[dict]] = {"1": [], "0": []}
            with_env(DIRECT_ENV, 1, lambda case=case: run_writer(case, root))  # warm-up
            for _ in range(args.repeats):
                for mode, got in runs.items():
                    got.append(with_env(DIRECT_ENV, mode, lambda case=case: run_writer(case, root)))
            gb = runs["1"][0]["bytes"] / GB
            row: dict[str, Any] = {"format": fmt, "feed": feed, "GB": gb}
            for mode, name in (("1", "direct"), ("0", "cached")):
                got = runs[mode]
                row[f"GBps_{name}"] = gb / statistics.median(r["seconds"] for r in got)
                row[f"cpu_per_GB_{name}"] = statistics.median(r["cpu"] for r in got) / gb
                row[f"write_per_GB_{name}"] = (
                    statistics.median(r["stages"].get("write", 0.0) for r in got) / gb
                )
                row[f"seconds_{name}"] = [r["seconds"] for r in got]
            rows.append(row)
            print(
                f"  {fmt:9} fed {feed:8}: direct {row['GBps_direct']:.2f} GB/s "
                f"(CPU {row['cpu_per_GB_direct']:.2f} s/GB, write {row['write_per_GB_direct']:.2f}), "
                f"page cache {row['GBps_cached']:.2f} GB/s (CPU {row['cpu_per_GB_cached']:.2f}, "
                f"write {row['write_per_GB_cached']:.2f}); seconds direct "
                f"{', '.join(f'{x:.2f}' for x in row['seconds_direct'])}, page cache "
                f"{', '.join(f'{x:.2f}' for x in row['seconds_cached'])}",
                flush=True,
            )
    results["direct"] = rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)

    def csv(kind: Callable[[str], Any] = str) -> Callable[[str], list]:
        return lambda s: [kind(x) for x in s.split(",") if x]

    p.add_argument("--parts", type=csv(), default=["disk", "stages", "sites24"])
    p.add_argument("--formats", type=csv(), default=list(FORMATS))
    p.add_argument("--feeds", type=csv(), default=list(FEEDS), help="batch dtypes handed over")
    p.add_argument("--gib", type=float, default=1.0, help="GiB stored per repetition (disk)")
    p.add_argument("--pickle-gib", type=float, default=0.25, help="pickle's (gzip is CPU work)")
    p.add_argument("--stage-gib", type=float, default=0.5, help="GiB per tmpfs repetition")
    p.add_argument("--repeats", type=int, default=3, help="interleaved pairs (disk, sites24)")
    p.add_argument("--stage-repeats", type=int, default=2)
    p.add_argument("--threads", type=csv(int), default=[pool_size()], help="tmpfs thread counts")
    p.add_argument("--dir", default=None, help="directory on the disk to measure")
    p.add_argument("--tmpfs", default="/dev/shm", help="tmpfs directory for part 2")
    p.add_argument(
        "--stage-on", type=csv(), default=["tmpfs"], help="part 2 into tmpfs, the disk or both"
    )
    p.add_argument("--sites", type=csv(int), default=[6, 12], help="blocks captured (parts 1, 2)")
    p.add_argument("--layers", type=int, default=24, help="model blocks")
    p.add_argument("--tokens", type=int, default=256, help="tokens per example")
    p.add_argument("--d", type=int, default=1024, help="d_model (parts 1, 2)")
    p.add_argument("--batch-size", type=int, default=16, help="examples per batch")
    p.add_argument("--shard-mib", type=float, default=128, help="MiB per shard (0: defaults)")
    p.add_argument("--sites24-d", type=int, default=256)
    p.add_argument("--sites24-tokens", type=int, default=64)
    p.add_argument("--sites24-batch", type=int, default=4)
    p.add_argument("--sites24-gib", type=float, default=1.0)
    p.add_argument("--sites24-shard-mib", type=float, default=12)
    p.add_argument("--sites24-feeds", type=csv(), default=["float32"])
    p.add_argument("--pool-mib", type=int, default=512, help="random block the batches view")
    p.add_argument("--json", type=Path, default=None, help="also write every number here")
    args = p.parse_args()

    pool = Pool(args.pool_mib)
    results: dict[str, Any] = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "cores": pool_size(),
        "start_load": os.getloadavg(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    print(
        f"bench_writers: {pool_size()} cores, load {os.getloadavg()[0]:.1f}, "
        f"{results['started']}; figures on a shared machine are noisy",
        flush=True,
    )
    t0 = time.perf_counter()
    disk = Path(tempfile.mkdtemp(prefix="actstore-bw-", dir=args.dir))
    shm = Path(tempfile.mkdtemp(prefix="actstore-bw-", dir=args.tmpfs))
    try:
        if "disk" in args.parts:
            part_disk(args, pool, disk, results)
        if "stages" in args.parts:
            for where in args.stage_on:
                part_stages(args, pool, shm if where == "tmpfs" else disk, results, where)
        if "sites24" in args.parts:
            part_sites24(args, pool, disk, results)
        if "direct" in args.parts:
            part_direct(args, pool, disk, results)
    finally:
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
        results["seconds"] = time.perf_counter() - t0
        results["end_load"] = os.getloadavg()
        print(f"\n{results['seconds']:.0f} s; load now {os.getloadavg()[0]:.1f}")
        if args.json:
            args.json.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
