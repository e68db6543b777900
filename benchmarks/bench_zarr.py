"""Benchmark the zarr prompt/response store: the spec's matrix, measured in one run.

For each store configuration (R_max, T_chunk_prompt) it writes a synthetic store of float16
activations at a realistic hidden size, then measures, on the same random (sample, layer)
queries:

- latency of one prompt slice and one response slice: actstore's ``ZarrReader.read`` vs
  plain zarr-python (``zarr.open_consolidated(...)[i, l, :len]``) vs a raw read of the same
  chunk-file bytes into a numpy buffer (``readinto``: the limit for this layout);
- batch assembly for the training pattern (b random samples x 2 random layers);
- a torch DataLoader over the pattern with 0/4/8 workers (ours vs a plain-zarr Dataset);
- write throughput: one in-process writer vs W = 1, 2 writer processes (sharded run).

R_max only changes the response array and T_chunk_prompt only the prompt array, so the
matrix R_max in {32, 64, 128} x T_chunk_prompt in {64, 128, 256} is covered by three stores
pairing them (32/64, 64/128, 128/256): prompt rows vary T_chunk, response rows vary R_max.

Reads are warm (the stores fit in the page cache; dropping it needs root and disturbs
other users of the machine). Usage:

    python benchmarks/bench_zarr.py                      # the full matrix (a few minutes)
    python benchmarks/bench_zarr.py --queries 500 --samples 64 --hidden 1024   # quick
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from actstore.batch import Batch, CapturePlan
from actstore.formats.zarr import ZarrLayout, ZarrOptions, ZarrReader, ZarrWriter, write_shards
from actstore.formats.zarr.layout import ACT_DTYPE
from actstore.sites import Site
from actstore.storage.location import Location


class SyntheticPairs:
    """Picklable producer of prompt/response batches with fixed pseudo-random lengths.

    Every batch is a view of one precomputed block (random values, tiled; made once per
    process), so producing data costs little next to writing it.
    """

    def __init__(
        self,
        n_layers: int,
        hidden: int,
        prompt_len: np.ndarray,
        response_len: np.ndarray,
        batch_size: int = 8,
    ) -> None:
        self.n_layers, self.hidden, self.batch_size = n_layers, hidden, batch_size
        self.prompt_len, self.response_len = prompt_len, response_len
        self._base: np.ndarray | None = None

    def __getstate__(self):
        return {**self.__dict__, "_base": None}

    def base(self) -> np.ndarray:
        if self._base is None:
            width = int((self.prompt_len + self.response_len).max())
            tile = np.random.default_rng(0).standard_normal(
                (1, self.n_layers, 64, self.hidden), dtype=np.float32
            )
            self._base = np.tile(tile, (self.batch_size, 1, -(-width // 64), 1))[:, :, :width]
        return self._base

    def __call__(self, start: int, stop: int):
        base = self.base()
        for lo in range(start, stop, self.batch_size):
            ids = np.arange(lo, min(stop, lo + self.batch_size))
            p, r = self.prompt_len[ids], self.response_len[ids]
            width = int((p + r).max())
            acts = base[: len(ids), :, :width]  # [B, L, T, H]
            yield Batch(
                acts={f"resid.{k}": torch.from_numpy(acts[:, k]) for k in range(self.n_layers)},
                example_ids=ids,
                extras={"prompt_len": p, "response_len": r},
            )


def make_plan(
    n_layers: int, hidden: int, prompt_len: np.ndarray, response_len: np.ndarray
) -> CapturePlan:
    """The capture plan of :class:`SyntheticPairs`' samples (no token ids)."""
    return CapturePlan(
        ckpt="synthetic",
        family="gpt2",
        modality="text",
        sites=tuple(Site("resid", k) for k in range(n_layers)),
        n_model_layers=n_layers,
        d_model=hidden,
        tokens_per_example=int((prompt_len + response_len).max()),
        has_cls=False,
        n_examples=len(prompt_len),
        dataset_root="synthetic",
        data={"kind": "synthetic"},
        classes=None,
        has_labels=False,
        has_tokens=False,
        batch_size=8,
        extras={
            "prompt_lengths": prompt_len.tolist(),
            "response_lengths": response_len.tolist(),
        },
    )


def lengths(n: int, r_max: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Prompt lengths ~ lognormal (median 140, clipped 8..400); responses 1..1.5 R_max."""
    rng = np.random.default_rng(seed)
    prompt = np.clip(rng.lognormal(math.log(140), 0.5, n), 8, 400).astype(np.int64)
    response = rng.integers(1, int(1.5 * r_max) + 1, n)
    return prompt, response


def summary(ns: list[int]) -> dict[str, float]:
    us = np.asarray(ns, dtype=np.float64) / 1e3
    return {
        "mean_us": float(us.mean()),
        "median_us": float(np.median(us)),
        "p95_us": float(np.percentile(us, 95)),
    }


def raw_read(
    reader: ZarrReader, i: int, layer_idx: int, part: str, n_rows: int, out: np.ndarray
) -> None:
    """The same chunk-file bytes, read with plain Python file objects into ``out``."""
    store = reader.stores[0]
    root = store.location.path()
    t = store.layout.t_chunk(part)
    row = store.layout.hidden_size * 2
    view = memoryview(out.reshape(-1)).cast("B")
    for c in range(math.ceil(n_rows / t)):
        r0, r1 = c * t, min(n_rows, (c + 1) * t)
        try:
            with open(root / store.chunk_name(part, i, layer_idx, c), "rb", buffering=0) as f:
                f.readinto(view[r0 * row : r1 * row])
        except FileNotFoundError:
            out[r0:r1] = 0


class PlainZarrPairs(torch.utils.data.Dataset):
    """The user's obvious Dataset over the same pattern, with zarr-python only."""

    def __init__(self, path: str, n_samples: int, n_layers: int, r_max: int, seed: int) -> None:
        self.path, self.n, self.n_layers, self.r_max, self.seed = (
            path,
            n_samples,
            n_layers,
            r_max,
            seed,
        )
        self._array = None

    def __getstate__(self):
        return {**self.__dict__, "_array": None}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        import zarr

        if self._array is None:
            self._array = zarr.open_consolidated(self.path, mode="r")["arrays/response_activations"]
        layers = np.random.default_rng((self.seed, 0, int(i))).choice(
            self.n_layers, 2, replace=False
        )
        return {
            "acts": torch.from_numpy(np.stack([self._array[i, int(k)] for k in layers])),
            "index": int(i),
        }


def bench_queries(reader: ZarrReader, plain, queries: np.ndarray, part: str) -> dict[str, dict]:
    arrays = {
        "prompt": plain["arrays/prompt_activations"],
        "response": plain["arrays/response_activations"],
    }
    lengths_ = reader.lengths(part)
    times = {"actstore": [], "zarr-python": [], "raw numpy": []}
    buf = np.empty((reader.layout.max_len(part), reader.d_model), dtype=ACT_DTYPE)
    for q, (i, k) in enumerate(queries):
        n = int(lengths_[i])
        i, k = int(i), int(k)
        methods = [
            ("actstore", lambda i=i, k=k: reader.read_index(i, k, part)),
            ("zarr-python", lambda i=i, k=k, n=n: arrays[part][i, k, :n]),
            ("raw numpy", lambda i=i, k=k, n=n: raw_read(reader, i, k, part, n, buf[:n])),
        ]
        for name, fn in methods[q % 3 :] + methods[: q % 3]:  # rotate the order
            t0 = time.perf_counter_ns()
            fn()
            times[name].append(time.perf_counter_ns() - t0)
    return {name: summary(ns) for name, ns in times.items()}


def bench_batches(reader: ZarrReader, plain, b: int, n_batches: int, part: str) -> dict[str, dict]:
    array = plain[f"arrays/{part}_activations"]
    lay = reader.layout
    lens = reader.lengths(part)
    rng = np.random.default_rng(1)

    def zarr_python(samples, layer_idx):
        return np.stack(
            [np.stack([array[int(i), int(k)] for k in row]) for i, row in zip(samples, layer_idx)]
        )

    def raw(samples, layer_idx):
        out = np.zeros((b, 2, lay.max_len(part), lay.hidden_size), dtype=ACT_DTYPE)
        for j, (i, row) in enumerate(zip(samples, layer_idx)):
            for m, k in enumerate(row):
                raw_read(reader, int(i), int(k), part, int(lens[i]), out[j, m, : lens[i]])
        return out

    methods = [
        ("actstore", lambda s, li: reader.read_batch_index(s, li, part)),
        ("zarr-python", zarr_python),
        ("raw numpy", raw),
    ]
    times = {name: [] for name, _ in methods}
    for n in range(n_batches):
        samples = rng.integers(0, lay.n_samples, b)
        layer_idx = np.stack([rng.choice(lay.n_layers, 2, replace=False) for _ in range(b)])
        for name, fn in methods[n % 3 :] + methods[: n % 3]:  # rotate the order
            t0 = time.perf_counter_ns()
            result = fn(samples, layer_idx)
            times[name].append(time.perf_counter_ns() - t0)
            del result
    return {name: summary(ns) for name, ns in times.items()}


def bench_loader(
    reader: ZarrReader, path: str, b: int, n_batches: int, workers: int
) -> dict[str, float]:
    """Samples/s in steady state (timed from the first batch, so worker start-up is out).

    ``actstore`` and ``zarr-python`` are per-item Datasets under the default collate (which
    stacks the items: the same copy for both); ``actstore batched`` reads whole batches
    into one array (``ZarrPairDataset.loader``).
    """
    ours = reader.dataset("response", n_layers=2, seed=0)
    plain = PlainZarrPairs(path, len(reader), reader.layout.n_layers, reader.layout.r_max, 0)
    n = b * (n_batches + 1)

    def sampler(ds):
        return torch.utils.data.RandomSampler(
            ds, replacement=True, num_samples=n, generator=torch.Generator().manual_seed(0)
        )

    def per_item(ds):
        return torch.utils.data.DataLoader(
            ds, batch_size=b, sampler=sampler(ds), num_workers=workers
        )

    def batched(ds):
        return torch.utils.data.DataLoader(
            ds,
            sampler=torch.utils.data.BatchSampler(sampler(ds), b, False),
            batch_size=None,
            num_workers=workers,
        )

    out = {}
    for name, loader in (
        ("actstore", per_item(ours)),
        ("actstore batched", batched(ours)),
        ("zarr-python", per_item(plain)),
    ):
        batches = iter(loader)
        next(batches)
        t0 = time.perf_counter()
        count = sum(len(batch["index"]) for batch in batches)
        out[name] = count / (time.perf_counter() - t0)
    return out


def write_store(
    path: Path, plan: CapturePlan, options: ZarrOptions, producer: SyntheticPairs
) -> float:
    os.sync()  # start each write timing with no dirty pages left by the previous one
    t0 = time.perf_counter()
    writer = ZarrWriter.from_plan(plan, Location.parse(path), options)
    for batch in producer(0, plan.n_examples):
        writer.write(batch)
    writer.close()
    return time.perf_counter() - t0


def stored_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default=None, help="scratch directory (default: a temp dir, deleted)")
    ap.add_argument("--samples", type=int, default=128, help="samples per store")
    ap.add_argument("--layers", type=int, default=4, help="stored layers L")
    ap.add_argument("--hidden", type=int, default=4096, help="hidden size H")
    ap.add_argument("--p-max", type=int, default=256)
    ap.add_argument("--configs", default="32:64,64:128,128:256", help="R_max:T_chunk_prompt pairs")
    ap.add_argument("--queries", type=int, default=10_000, help="random (sample, layer) queries")
    ap.add_argument("--batch", type=int, default=32, help="b samples per training batch")
    ap.add_argument("--batches", type=int, default=30, help="training batches timed")
    ap.add_argument("--workers", default="0,4,8", help="DataLoader worker counts")
    ap.add_argument("--writers", default="1,2", help="writer process counts (sharded runs)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help=(
            "torch intra-op threads of this process (DataLoader workers use 1); on a small shared "
            "machine OpenMP spin-waiting makes the collate's torch.stack slow and erratic"
        ),
    )
    args = ap.parse_args()
    torch.set_num_threads(args.torch_threads)

    import warnings

    import zarr

    warnings.filterwarnings(
        "ignore", message=".*worker processes in total.*"
    )  # 8 workers on 2 cores

    scratch = Path(args.out or tempfile.mkdtemp(prefix="bench-zarr-"))
    scratch.mkdir(parents=True, exist_ok=True)
    results: dict = {"args": vars(args), "cpus": os.cpu_count(), "configs": []}
    print(
        f"H={args.hidden} L={args.layers} N={args.samples} P_max={args.p_max}  "
        f"cpus={os.cpu_count()}  queries={args.queries}  scratch={scratch}"
    )
    try:
        pairs = [tuple(int(x) for x in pair.split(":")) for pair in args.configs.split(",")]
        main_r_max = 64 if any(r == 64 for r, _ in pairs) else pairs[0][0]
        for r_max, t_prompt in pairs:
            p_len, r_len = lengths(args.samples, r_max)
            plan = make_plan(args.layers, args.hidden, p_len, r_len)
            options = ZarrOptions(
                p_max=args.p_max,
                r_max=r_max,
                t_chunk_prompt=t_prompt,
                t_chunk_response=r_max,
            )
            producer = SyntheticPairs(args.layers, args.hidden, p_len, r_len)
            path = scratch / f"r{r_max}-t{t_prompt}.zarr"
            seconds = write_store(path, plan, options, producer)
            size = stored_bytes(path)
            reader = ZarrReader(path)
            lay = reader.layout
            got = (lay.p_max, lay.r_max, lay.t_chunk_prompt, lay.t_chunk_response)
            if got != (args.p_max, r_max, t_prompt, r_max):
                raise SystemExit(f"the writer chose layout {got}, not the configuration asked")
            plain = zarr.open_consolidated(str(path), mode="r")
            rng = np.random.default_rng(42)
            queries = np.stack(
                [
                    rng.integers(0, args.samples, args.queries),
                    rng.integers(0, args.layers, args.queries),
                ],
                axis=1,
            )
            entry = {
                "R_max": r_max,
                "T_chunk_prompt": t_prompt,
                "chunk_kib": {
                    "prompt": lay.chunk_nbytes("prompt") / 1024,
                    "response": lay.chunk_nbytes("response") / 1024,
                },
                "write": {"seconds": seconds, "bytes": size, "MB_per_s": size / seconds / 1e6},
                "prompt": bench_queries(reader, plain, queries, "prompt"),
                "response": bench_queries(reader, plain, queries, "response"),
                "batch_response": bench_batches(
                    reader, plain, args.batch, args.batches, "response"
                ),
                "batch_prompt": bench_batches(reader, plain, args.batch, args.batches, "prompt"),
            }
            if r_max == main_r_max:  # the spec's default R_max = 64 when it is in the matrix
                entry["loader_samples_per_s"] = {
                    w: bench_loader(reader, str(path), args.batch, args.batches, w)
                    for w in (int(x) for x in args.workers.split(","))
                }
                entry["writers"] = bench_writers(
                    scratch, plan, options, producer, args.writers, seconds, size, path
                )
            results["configs"].append(entry)
            report(entry, lay)
            shutil.rmtree(path)
    finally:
        if args.out is None:
            shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def raw_write(store: Path, target: Path) -> float:
    """Seconds to write the store's chunk files' bytes with plain file writes, fsynced: the
    disk's limit for this layout (the bytes are read into memory first, untimed)."""
    files = [(p.relative_to(store), p.read_bytes()) for p in store.rglob("*") if p.is_file()]
    os.sync()
    t0 = time.perf_counter()
    for rel, data in files:
        path = target / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    for rel, _ in files:
        fd = os.open(target / rel, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    seconds = time.perf_counter() - t0
    shutil.rmtree(target)
    return seconds


def bench_writers(
    scratch: Path,
    plan: CapturePlan,
    options: ZarrOptions,
    producer: SyntheticPairs,
    writers: str,
    single_s: float,
    size: int,
    store: Path,
) -> dict:
    raw = raw_write(store, scratch / "raw-copy")
    out = {
        "raw file writes (limit)": {"seconds": raw, "MB_per_s": size / raw / 1e6},
        "single writer (in process)": {"seconds": single_s, "MB_per_s": size / single_s / 1e6},
    }
    for w in (int(x) for x in writers.split(",")):
        run = scratch / f"run_w{w}"
        os.sync()
        t0 = time.perf_counter()
        manifest = write_shards(run, plan, producer, n_writers=w, options=options, progress=False)
        wall = time.perf_counter() - t0
        busy = max(t["seconds"] for t in manifest["timings"])
        out[f"W={w} processes"] = {
            "seconds": wall,
            "MB_per_s": size / wall / 1e6,
            "slowest_writer_s": busy,
            "MB_per_s_excl_startup": size / busy / 1e6,
        }
        shutil.rmtree(run)
    return out


def report(entry: dict, lay: ZarrLayout) -> None:
    print(
        f"\n== R_max={entry['R_max']} (response chunk {entry['chunk_kib']['response']:.0f} KiB), "
        f"T_chunk_prompt={entry['T_chunk_prompt']} (prompt chunk {entry['chunk_kib']['prompt']:.0f} KiB)"
    )
    w = entry["write"]
    print(
        f"   write: {w['bytes'] / 1e6:.0f} MB in {w['seconds']:.1f}s = {w['MB_per_s']:.0f} MB/s (one writer)"
    )
    for part in ("prompt", "response", "batch_response", "batch_prompt"):
        rows = entry[part]
        ours = rows["actstore"]
        print(f"   {part:<15} {'mean':>9} {'median':>9} {'p95':>9}  (us)   ours/zarr  ours/raw")
        for name, s in rows.items():
            ratio = "" if name == "actstore" else f"{ours['mean_us'] / s['mean_us']:9.2f}"
            print(
                f"     {name:<13} {s['mean_us']:9.0f} {s['median_us']:9.0f} {s['p95_us']:9.0f}   "
                + (
                    ""
                    if name == "actstore"
                    else (ratio if name == "zarr-python" else " " * 9 + ratio)
                )
            )
    if "loader_samples_per_s" in entry:
        print("   DataLoader (b x 2 random layers, response, samples/s):")
        for workers, s in entry["loader_samples_per_s"].items():
            z = s["zarr-python"]
            print(
                f"     workers={workers}: zarr-python {z:.0f}, actstore {s['actstore']:.0f} "
                f"({s['actstore'] / z:.2f}x), actstore batched {s['actstore batched']:.0f} "
                f"({s['actstore batched'] / z:.2f}x)"
            )
    if "writers" in entry:
        base = entry["writers"]["single writer (in process)"]["MB_per_s"]
        print("   writers:")
        for name, s in entry["writers"].items():
            extra = (
                f", {s['MB_per_s_excl_startup']:.0f} MB/s excl. process start"
                if "slowest_writer_s" in s
                else ""
            )
            print(
                f"     {name:<27} {s['seconds']:6.1f}s {s['MB_per_s']:6.0f} MB/s  "
                f"({s['MB_per_s'] / base:.2f}x single{extra})"
            )


if __name__ == "__main__":
    main()
