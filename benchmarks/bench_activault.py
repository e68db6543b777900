"""Activault format against a local S3 server (moto, in its own process on 127.0.0.1).

Four measurements, each against a baseline taken in the same run on the same server:

1. upload: ActivaultWriter (pack, cast, statistics, torch.save, per-hook uploaders) vs a
   plain boto3 client's put_object of the same bytes (the files are under the multipart
   threshold on both sides), with actstore's client settings (no extra checksums either
   way) and the same number of requests in flight (hooks x upload threads); client and
   server CPU seconds per GiB beside each (>= 0.9);
2. read: ActivaultStream (prefetch, ranged GETs, torch.load, shuffle) vs raw parallel
   ranged GETs of the same objects (>= 0.8);
3. consumer wait: a consumer that needs 1.5x the download time per window waits for data
   this fraction of the time after warm-up (< 5%);
4. capture wall time (forward loop) writing to S3 vs handing batches to a writer that
   discards them (<= 1.1x), on the embedded all-MiniLM-L6-v2.

    python benchmarks/bench_activault.py            # a few minutes
    python benchmarks/bench_activault.py --files 32 --file-mib 32 --examples 512
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from _common import DiscardWriter, Timer, table

from actstore.batch import Batch
from actstore.capture import CaptureConfig, capture
from actstore.formats.activault import ActivaultOptions, ActivaultStream, ActivaultWriter
from actstore.formats.activault.layout import serialize_megabatch
from actstore.sites import Site
from actstore.storage.location import Location
from actstore.storage.object import S3Config, S3Store

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def start_server() -> tuple[subprocess.Popen, str]:
    """moto in a separate process, so its CPU time does not share our GIL."""
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "s3_server.py")], stdout=subprocess.PIPE, text=True
    )
    endpoint = proc.stdout.readline().strip()
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        S3_ENDPOINT_URL=endpoint,
    )
    return proc, endpoint


def raw_client():
    """A plain boto3 S3 client with the settings actstore's own client uses
    (``S3Store._make_client``): path addressing, retries off, checksums only when an
    operation requires them (so neither side computes a CRC32 nor a Content-MD5; both sign
    the payload with SHA-256 over plain HTTP, as botocore does), the same pool size."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=os.environ["S3_ENDPOINT_URL"],
        config=Config(
            signature_version="s3v4",
            s3={"addressing_style": "path"},
            retries={"total_max_attempts": 1, "mode": "standard"},
            max_pool_connections=64,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            tcp_keepalive=True,
        ),
    )


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def make_plan(args):
    from actstore.batch import CapturePlan

    sites = tuple(Site("resid", layer) for layer in range(args.hooks))
    return CapturePlan(
        ckpt="bench",
        family="gpt2",
        modality="text",
        sites=sites,
        n_model_layers=args.hooks,
        d_model=args.d,
        tokens_per_example=args.seq,
        has_cls=False,
        n_examples=args.rows * args.files,
        dataset_root="/bench",
        data={},
        classes=None,
        has_labels=False,
        has_tokens=True,
        batch_size=args.rows // 4,
    )


def make_batches(plan, args) -> list[Batch]:
    gen = torch.Generator().manual_seed(0)
    bs = plan.batch_size
    out = []
    base = {str(s): torch.randn(bs, args.seq, args.d, generator=gen) for s in plan.sites}
    for lo in range(0, plan.n_examples, bs):
        out.append(
            Batch(
                acts=base,
                example_ids=np.arange(lo, lo + bs),
                token_ids=np.zeros((bs, args.seq), dtype=np.int64),
            )
        )
    return out


def bench_upload(args, bucket: str, server_pid: int) -> tuple[list, int]:
    plan = make_plan(args)
    batches = make_batches(plan, args)
    options = ActivaultOptions(rows_per_file=args.rows, upload_threads=args.threads, queue_files=2)
    store = S3Store(bucket, options.s3_config())
    store.check_bucket()  # the session's service model loaded before any timing
    client = raw_client()
    client.head_bucket(Bucket=bucket)
    states = torch.randn(args.rows, args.seq, args.d).to(torch.bfloat16)
    data = serialize_megabatch(
        states, torch.zeros(args.rows, args.seq, dtype=torch.long)
    ).getvalue()
    assert len(data) <= options.s3_config().multipart_threshold, "one PUT per file, both sides"
    total = len(data) * args.files * args.hooks
    results = []
    for repeat in range(args.repeats):
        prefix = f"raw-{repeat}"
        keys = [
            f"{prefix}/h{h}/{uuid.uuid4()}--{i}.pt"
            for h in range(args.hooks)
            for i in range(args.files)
        ]

        def put(key: str) -> None:
            client.put_object(
                Bucket=bucket, Key=key, Body=data, ContentType="application/octet-stream"
            )

        cpu0, server0 = time.process_time(), cpu_seconds(server_pid)
        with ThreadPoolExecutor(args.threads * args.hooks) as pool, Timer() as raw:
            list(pool.map(put, keys))
        cpu1, server1 = time.process_time(), cpu_seconds(server_pid)
        writer = ActivaultWriter.from_plan(
            plan, Location.parse(f"s3://{bucket}/run-{repeat}"), options
        )
        with Timer() as ours:
            for batch in batches:
                writer.write(batch)
            writer.close()
        cpu2, server2 = time.process_time(), cpu_seconds(server_pid)
        results.append(
            (
                raw.seconds,
                ours.seconds,
                cpu1 - cpu0,
                cpu2 - cpu1,
                server1 - server0,
                server2 - server1,
            )
        )
        for key in keys:
            store.delete(key)
    # medians of the interleaved repetitions (raw, writer, raw, writer, ...)
    raw = sorted(results, key=lambda r: r[0])[len(results) // 2]
    ours = sorted(results, key=lambda r: r[1])[len(results) // 2]
    gib = total / (1 << 30)
    rows = [
        [
            "raw boto3 put_object, same bytes",
            total / MiB / raw[0],
            1.0,
            raw[2],
            raw[2] / gib,
            raw[4] / gib,
        ],
        [
            "ActivaultWriter (pack, statistics, torch.save, upload)",
            total / MiB / ours[1],
            raw[0] / ours[1],
            ours[3],
            ours[3] / gib,
            ours[5] / gib,
        ],
    ]
    ratios = sorted(r[0] / r[1] for r in results)
    rows.append(["  ratio in each repetition: " + ", ".join(f"{x:.2f}" for x in ratios)])
    return rows, len(data)


def raw_parallel_get(store: S3Store, keys: list[str], size: int, args) -> float:
    """Every ranged GET of every file through one pool of ``concurrency`` threads: the
    most parallel plain download of the same bytes."""
    chunk = args.chunk_mib * MiB
    bufs = [bytearray(size) for _ in keys]

    def get(job: tuple[int, int]) -> None:
        i, start = job
        view = memoryview(bufs[i])[start : start + chunk]
        view[:] = store.get_range(keys[i], start, start + len(view))

    jobs = [(i, start) for i in range(len(keys)) for start in range(0, size, chunk)]
    with ThreadPoolExecutor(args.concurrency) as pool, Timer() as t:
        list(pool.map(get, jobs))
    return t.seconds


def bench_read(args, bucket: str, file_bytes: int) -> list:
    location = f"s3://{bucket}/run-0/models.layers.0.post"
    store = S3Store(bucket, S3Config())
    keys = [o.key for o in store.list("run-0/models.layers.0.post/") if o.key.endswith(".pt")]
    total = file_bytes * len(keys)
    results = []
    for _ in range(args.repeats):
        raw_s = raw_parallel_get(store, keys, file_bytes, args)
        stream = ActivaultStream(
            location,
            batch_size=4096,
            mix_files=args.mix,
            prefetch_files=args.prefetch,
            concurrency=args.concurrency,
            chunk_size=args.chunk_mib * MiB,
            seed=0,
        )
        with Timer() as ours:
            n = sum(b.shape[0] for b in stream)
        assert n == stream.n_tokens
        results.append((raw_s, ours.seconds))
    raw_s = min(r[0] for r in results)
    ours_s = min(r[1] for r in results)
    return [
        ["raw parallel ranged GETs", total / MiB / raw_s, 1.0],
        ["ActivaultStream (fetch + torch.load + shuffle)", total / MiB / ours_s, raw_s / ours_s],
    ]


def bench_wait(args, bucket: str, file_bytes: int) -> list:
    """A consumer slower than the network: after warm-up it should never wait."""
    location = f"s3://{bucket}/run-0/models.layers.0.post"
    store = S3Store(bucket, S3Config())
    keys = [o.key for o in store.list("run-0/models.layers.0.post/") if o.key.endswith(".pt")]
    per_file_s = raw_parallel_get(store, keys, file_bytes, args) / len(keys)
    stream = ActivaultStream(
        location,
        batch_size=4096,
        mix_files=args.mix,
        prefetch_files=args.prefetch,
        concurrency=args.concurrency,
        chunk_size=args.chunk_mib * MiB,
        seed=0,
    )
    tokens_per_file = stream.n_tokens / len(stream.files)
    step_s = 1.5 * per_file_s * 4096 / tokens_per_file  # consume at 2/3 of download speed
    with Timer() as t:
        for _ in stream:
            time.sleep(step_s)  # the training step
    after_warmup = t.seconds - stream.stats.warmup_s
    frac = stream.stats.wait_s / after_warmup
    return [["consumer wait after warm-up (fraction)", frac, stream.stats.warmup_s, t.seconds]]


def bench_capture(args, bucket: str) -> list:
    cfg = CaptureConfig(
        sites=("resid.3", "resid.5"),
        batch_size=32,
        max_examples=args.examples,
        progress=False,
        clean_tokens=True,
    )
    capture(CaptureConfig(**{**cfg.__dict__, "max_examples": 32}), lambda p: DiscardWriter())
    options = ActivaultOptions(rows_per_file=32)
    rows = []
    for repeat in range(args.repeats):
        bare = capture(cfg, lambda p: DiscardWriter())
        out = f"s3://{bucket}/capture-{repeat}"
        stored = capture(
            cfg, lambda p, out=out: ActivaultWriter.from_plan(p, Location.parse(out), options)
        )
        rows.append((bare.seconds, stored.seconds, stored.writer_wait_s))
    bare_s = min(r[0] for r in rows)
    stored_s = min(r[1] for r in rows)
    return [
        ["capture, no storage", bare_s, 1.0, 0.0],
        ["capture -> S3 (activault)", stored_s, stored_s / bare_s, min(r[2] for r in rows)],
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=32, help="files per hook")
    parser.add_argument("--hooks", type=int, default=2)
    parser.add_argument("--rows", type=int, default=32, help="rows per file")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--d", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2, help="upload threads per hook")
    parser.add_argument("--concurrency", type=int, default=8, help="ranged GETs at once")
    parser.add_argument("--chunk-mib", type=int, default=1, help="range size of ranged GETs")
    parser.add_argument("--mix", type=int, default=2, help="files shuffled together")
    parser.add_argument("--prefetch", type=int, default=2, help="files downloaded ahead")
    parser.add_argument("--examples", type=int, default=768, help="capture benchmark examples")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--only", choices=["upload", "read", "wait", "capture"], action="append", default=None
    )
    args = parser.parse_args()
    only = set(args.only or ["upload", "read", "wait", "capture"])

    proc, endpoint = start_server()
    try:
        import boto3

        bucket = "bench"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        print(
            f"moto S3 at {endpoint} (separate process); {os.cpu_count()} CPUs; "
            f"load average {os.getloadavg()[0]:.1f}; torch {torch.__version__}\n"
        )
        up, file_bytes = bench_upload(args, bucket, proc.pid)
        print(
            f"1. upload: {args.hooks} hooks x {args.files} files of {file_bytes / MiB:.1f} MiB "
            f"(bf16 [{args.rows}, {args.seq}, {args.d}]), {args.threads} threads per hook, "
            f"medians of {args.repeats} interleaved repetitions\n"
        )
        print(
            table(
                ["what", "MiB/s", "ratio", "client CPU s", "client s/GiB", "server s/GiB"],
                [r + [""] * (6 - len(r)) for r in up],
            ),
            f"\nload average after: {os.getloadavg()[0]:.1f}\n",
        )
        if only == {"upload"}:
            return
        read = bench_read(args, bucket, file_bytes)
        print(
            f"2. read: {args.files} files, concurrency {args.concurrency}, "
            f"{args.chunk_mib} MiB ranges, mix {args.mix}, prefetch {args.prefetch}\n"
        )
        print(table(["what", "MiB/s", "ratio"], read), "\n")
        wait = bench_wait(args, bucket, file_bytes)
        print("3. consumer at 2/3 of the download speed\n")
        print(table(["what", "value", "warm-up s", "total s"], wait), "\n")
        cap = bench_capture(args, bucket)
        print(
            f"4. capture of {args.examples} examples (embedded MiniLM, resid.3 + resid.5, "
            "token cleaning on)\n"
        )
        print(table(["what", "seconds", "ratio", "forward waited s"], cap))
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
