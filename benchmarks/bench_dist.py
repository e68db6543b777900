"""Benchmark the pkl.gz format, conversion, and distributed capture, each against a baseline
measured in the same run.

- pkl.gz write: PickleWriter (gzip level 1, level 6, plain pickle) vs the saev writer
  (raw float32 files), MB/s of float32 activations; stored size against raw.
- pkl.gz read: actstore's safe reader (checksum + restricted unpickler + structure checks)
  vs the spec's own loader (``gzip.open`` + ``pickle.load``, no checks) on the same files.
- conversion: ``actstore.convert`` (streamed and verified) vs copying the source files
  (``shutil.copyfile``: the floor for moving the bytes once).
- merge: publishing a saev capture from 2 parts (hard links) vs copying its bytes.
- distributed capture: the embedded model over the embedded corpus in one process vs 2
  Ray workers on a local cluster (cluster start included and excluded).

Reads are warm (page cache). Usage:

    python benchmarks/bench_dist.py                 # all sections, ~2 minutes on 2 cores
    python benchmarks/bench_dist.py --examples 128 --skip-ray
"""

from __future__ import annotations

import argparse
import gzip
import os
import pickle
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")

import numpy as np
import torch
from _common import SAEV_SHARDS, Timer, evict, files_under, table

from actstore.batch import Batch, CapturePlan
from actstore.convert import convert
from actstore.formats.pickle import PickleOptions, PickleReader, PickleWriter
from actstore.formats.saev import SaevOptions, SaevWriter
from actstore.sites import Site
from actstore.storage.location import Location


def make_plan(n: int, t: int, d: int, layers: tuple[int, ...]) -> CapturePlan:
    return CapturePlan(
        ckpt="synthetic",
        family="gpt2",
        modality="text",
        sites=tuple(Site("resid", la) for la in layers),
        n_model_layers=12,
        d_model=d,
        tokens_per_example=t,
        has_cls=False,
        n_examples=n,
        dataset_root="/synthetic",
        data={"kind": "synthetic"},
        classes=None,
        has_labels=False,
        has_tokens=True,
        batch_size=32,
    )


def batches(plan: CapturePlan, seed: int = 0):
    """Activation-like batches (normal values, a few large dimensions), made once."""
    rng = np.random.default_rng(seed)
    t, d = plan.tokens_per_example, plan.d_model
    scale = np.ones(d, dtype=np.float32)
    scale[: d // 64] = 20.0
    base = (rng.standard_normal((plan.batch_size, t, d)) * scale).astype(np.float32)
    tokens = rng.integers(0, 50_000, size=(plan.batch_size, t), dtype=np.int32)
    for lo in range(0, plan.n_examples, plan.batch_size):
        hi = min(lo + plan.batch_size, plan.n_examples)
        acts = {str(s): torch.from_numpy(base[: hi - lo] + i) for i, s in enumerate(plan.sites)}
        yield Batch(
            acts=acts,
            example_ids=np.arange(lo, hi),
            token_ids=tokens[: hi - lo],
            texts=[f"text of example {i}" for i in range(lo, hi)],
        )


def write(writer, plan: CapturePlan) -> float:
    data = list(batches(plan))
    with Timer() as t:
        for batch in data:
            writer.write(batch)
        writer.close()
    return t.seconds


def bench_pickle(root: Path, plan: CapturePlan) -> Path:
    mb = plan.n_examples * plan.tokens_per_example * plan.d_model * 4 * len(plan.sites) / 1e6
    per_shard = max(1, plan.n_examples // 4)
    saev_s = write(SaevWriter.from_plan(plan, Location.parse(root / "saev"), SaevOptions()), plan)
    saev_dir = next(p for p in (root / "saev").iterdir() if not p.name.startswith("."))
    rows = [["saev writer (raw float32, baseline)", mb / saev_s, 1.0, 1.0]]
    stores = {}
    variants = (
        ("pkl.gz, gzip level 1 (default)", PickleOptions(compresslevel=1)),
        ("pkl.gz, gzip level 6", PickleOptions(compresslevel=6)),
        ("pkl, uncompressed", PickleOptions(compress=False)),
    )
    for i, (name, opts) in enumerate(variants):
        opts = PickleOptions(**{**opts.__dict__, "samples_per_shard": per_shard})
        out = root / f"pkl-{i}"
        seconds = write(PickleWriter.from_plan(plan, Location.parse(out), opts), plan)
        size = sum(p.stat().st_size for p in files_under(out, "shard_*"))
        rows.append([name, mb / seconds, (mb / seconds) / (mb / saev_s), size / 1e6 / mb])
        stores[name] = out
    print(
        f"\npkl.gz write: {plan.n_examples} examples x {len(plan.sites)} layers x "
        f"{plan.tokens_per_example} tokens x {plan.d_model} dims = {mb:.0f} MB float32; "
        f"{per_shard} samples per shard (ratio: MB/s against the saev writer)\n"
    )
    print(table(["writer", "MB/s", "ratio", "size / raw"], rows))

    read_rows = []
    for name, out in stores.items():
        reader = PickleReader(out)
        files = [out / s.filename for s in reader.shards]
        with Timer() as spec_t:  # the spec's loader: no checksum, plain pickle
            for f, s in zip(files, reader.shards):
                opener = gzip.open if s.compressed else open
                with opener(f, "rb") as fh:
                    pickle.load(fh)
        with Timer() as ours_t:  # block i of every layer together: each shard decoded once
            for same_rows in zip(*(reader.blocks(layer) for layer in reader.sites)):
                for block in same_rows:
                    reader.read_block(block)
        read_rows.append(
            [name, mb / spec_t.seconds, mb / ours_t.seconds, spec_t.seconds / ours_t.seconds]
        )
    print(
        "\npkl.gz read, every layer of every shard (ratio: safe reader speed / the spec's "
        "plain pickle loader speed)\n"
    )
    print(table(["store", "spec loader MB/s", "actstore MB/s", "ratio"], read_rows))
    return saev_dir


def bench_convert(root: Path, saev_dir: Path, plan: CapturePlan) -> None:
    mb = sum(p.stat().st_size for p in files_under(saev_dir, SAEV_SHARDS)) / 1e6
    copy_dir = root / "copy"
    copy_dir.mkdir()
    with Timer() as base:
        for f in files_under(saev_dir):
            shutil.copyfile(f, copy_dir / f.name)
    rows = [["copy the saev files (baseline)", mb / base.seconds, 1.0, "-"]]
    for target, options in (
        ("pickle", PickleOptions(compress=False, samples_per_shard=64)),
        ("zarr", None),
        ("saev", SaevOptions(patches_per_shard=1_200_000)),
    ):
        source = saev_dir if target != "saev" else root / "conv-pickle"
        with Timer() as t:
            result = convert(
                source,
                root / f"conv-{target}",
                to=target,
                options=options,
                batch_size=32,
                progress=False,
            )
        err = max(result.max_abs_error.values())
        rows.append(
            [
                f"convert {result.source_format} -> {target} (+ verify)",
                mb / t.seconds,
                (mb / t.seconds) / (mb / base.seconds),
                f"{err:.2g}",
            ]
        )
    print(f"\nconversion of {mb:.0f} MB (ratio: MB/s against copying the source files)\n")
    print(table(["what", "MB/s", "ratio", "max abs error"], rows))


def bench_merge(root: Path, plan: CapturePlan) -> None:
    from actstore.dist import merge_store, part_format
    from actstore.dist.split import split_examples

    options = SaevOptions(patches_per_shard=plan.tokens_per_example * len(plan.sites) * 16)
    layout = part_format("saev")
    final = layout.final_location(plan, str(root / "merge"), options)
    data = list(batches(plan))
    for sl in split_examples(plan.n_examples, 2, align=16):
        writer = layout.part_writer(plan, final, options, sl)
        for batch in data:
            keep = (batch.example_ids >= sl.start) & (batch.example_ids < sl.stop)
            if keep.any():
                writer.write(batch.select(keep))
        writer.close()
    parts_bytes = sum(p.stat().st_size for p in files_under(final.parent / f".{final.name}.parts"))
    copy_dir = root / "merge-copy"
    copy_dir.mkdir()
    evict(files_under(final.parent / f".{final.name}.parts"))  # as after a real capture
    with Timer() as base:
        for f in files_under(final.parent / f".{final.name}.parts"):
            shutil.copyfile(f, copy_dir / f"{f.parent.name}-{f.name}")
    evict(files_under(final.parent / f".{final.name}.parts"))
    with Timer() as t:
        merge_store(final, "saev")
    print(
        f"\nmerge of a 2-part saev capture, {parts_bytes / 1e6:.0f} MB, page cache dropped "
        "(ratio: time against copying the parts' bytes)\n"
    )
    print(
        table(
            ["what", "seconds", "ratio"],
            [
                ["copy the parts (baseline)", base.seconds, 1.0],
                ["merge_store (links + index)", t.seconds, t.seconds / base.seconds],
            ],
        )
    )


def bench_ray(root: Path, examples: int) -> None:
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray

    from actstore.capture import CaptureConfig, capture
    from actstore.dist import capture_on_ray, init_local_ray
    from actstore.formats.registry import get_format

    cfg = CaptureConfig(
        sites=("resid.3", "resid.5"), max_examples=examples, batch_size=16, progress=False
    )
    options = SaevOptions(patches_per_shard=128 * 2 * 16)
    spec = get_format("saev")
    runs = {}
    for threads in (1, 2):  # one process with one worker's resources, and with the machine's
        torch.set_num_threads(threads)
        with Timer() as single:
            out = str(root / f"one-{threads}")
            one = capture(cfg, lambda plan, out=out: spec.open_writer(plan, out, options))
        runs[threads] = (single.seconds, one)
    base_s, one = runs[1]
    with Timer() as start:
        init_local_ray(num_cpus=2, _temp_dir=str(root / "ray"), log_to_driver=False)
    with Timer() as dist:
        result = capture_on_ray(cfg, "saev", str(root / "ray-out"), options, workers=2)
    ray.shutdown()
    loop = max(p.seconds for p in result.parts)
    same = all(
        (Path(one.output) / f.name).read_bytes() == f.read_bytes()
        for f in files_under(result.location)
    )
    print(
        f"\ndistributed capture: embedded model (all-MiniLM-L6-v2), {examples} examples of 128 "
        "tokens, layers 3 and 5, 2 CPU cores; a Ray worker gets 1 CPU (1 torch thread) "
        "(ratio: speed against one process with 1 thread)\n"
    )
    print(
        table(
            ["run", "seconds", "ratio"],
            [
                ["one process, 1 thread, end to end (baseline)", base_s, 1.0],
                ["one process, 1 thread, forward loop", one.seconds, base_s / one.seconds],
                ["one process, 2 threads, end to end", runs[2][0], base_s / runs[2][0]],
                [
                    "2 Ray workers, end to end (cluster running)",
                    dist.seconds,
                    base_s / dist.seconds,
                ],
                [
                    "2 Ray workers, + starting the local cluster",
                    dist.seconds + start.seconds,
                    base_s / (dist.seconds + start.seconds),
                ],
                ["2 Ray workers, slowest forward loop", loop, one.seconds / loop],
            ],
        )
    )
    print(f"\nmerged store byte-identical to the one-process store: {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--capture-examples", type=int, default=512)
    parser.add_argument("--skip-ray", action="store_true")
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    root = Path(tempfile.mkdtemp(prefix="bench-dist-", dir=args.dir))
    try:
        plan = make_plan(args.examples, args.tokens, args.d_model, (6, 9))
        saev_dir = bench_pickle(root, plan)
        bench_convert(root, saev_dir, plan)
        bench_merge(root, plan)
        if not args.skip_ray:
            bench_ray(root, args.capture_examples)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
