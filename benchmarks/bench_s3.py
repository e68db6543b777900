"""saev stores on S3 (moto, in its own process on 127.0.0.1): the reader, the loader, the
cache tier and ``actstore cp``, each against a raw boto3 baseline in the same run on the same
server and the same bytes; each figure is the best of interleaved repeats (runs take turns,
so load from other work on the machine hits a measurement and its baseline alike).

1. loader over ``s3://`` (ActivationLoader, ``io_threads`` readers) vs raw parallel ranged
   GETs of the same block byte ranges with the same concurrency (goal >= 0.8);
2. random ``reader[example, layer, token]`` rows vs one raw ranged GET per row (sequential,
   both), and ``reader.gather`` of the same rows in one call;
3. second epoch with the cache tier vs a loader over the same store on local disk (>= 0.8);
4. ``cp`` upload and download vs raw parallel PUT (multipart) / ranged GET into files of the
   same part size and concurrency (>= 0.8);
5. a capture whose ``--out`` is ``s3://`` (the saev writer staged locally, its shards
   uploaded as they are sealed, the index and manifest at close) vs raw parallel PUT /
   multipart of the same files, with the staged writer's part size and thread count
   (>= 0.9); client and server CPU seconds per GiB beside each. ``--only-capture`` runs
   just this one.

    python benchmarks/bench_s3.py                  # ~64 MiB store, a minute or two
    python benchmarks/bench_s3.py --examples 1024 --threads 16
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from _common import SAEV_SHARDS, Timer, saev_plan, saev_writer, table
from bench_activault import cpu_seconds, start_server

from actstore.batch import Batch
from actstore.formats.saev import SaevMetadata, SaevReader
from actstore.formats.saev.layout import encode_data, shard_name
from actstore.loader import ActivationLoader
from actstore.storage.copy import copy_store

MiB = 1 << 20


def saev_metadata(n: int, t: int, d: int, per_shard: int) -> SaevMetadata:
    return SaevMetadata(
        family="gpt2",
        ckpt="bench",
        layers=(6,),
        patches_per_ex=t,
        cls_token=False,
        d_model=d,
        n_examples=n,
        patches_per_shard=per_shard * t,
        data=encode_data({"kind": "bench"}),
        dataset="/bench",
        dialect="protocol",
    )


def saev_batches(n: int, t: int, d: int) -> list[Batch]:
    rng = np.random.default_rng(0)
    out = []
    for lo in range(0, n, 32):
        part = rng.standard_normal((min(32, n - lo), t, d), dtype=np.float32)
        out.append(
            Batch(
                acts={"resid.6": torch.from_numpy(part)}, example_ids=np.arange(lo, lo + len(part))
            )
        )
    return out


def write_saev(root: Path, n: int, t: int, d: int, per_shard: int) -> Path:
    writer = saev_writer(saev_metadata(n, t, d, per_shard), root)
    for batch in saev_batches(n, t, d):
        writer.write(batch)
    return Path(writer.close())


def bench_capture(c, bucket: str, server_pid: int, tmp: Path, args) -> None:
    """5. The saev writer to ``s3://`` (staged, uploading as it goes) vs raw parallel
    PUT/multipart of the files it publishes, with its part size and threads; medians of
    interleaved repetitions, with client and server CPU."""
    from actstore.formats.registry import get_format
    from actstore.formats.staged import StagedWriter
    from actstore.storage.upload import DEFAULT_PART_BYTES

    n = args.capture_examples
    md = saev_metadata(n, args.tokens, args.d, args.per_shard)
    plan, options = saev_plan(md)
    batches = saev_batches(n, args.tokens, args.d)  # made before any timing
    spec = get_format("saev")
    assert "ACTSTORE_CACHE" not in os.environ, "the S3 rows would read through a cache"
    os.environ["ACTSTORE_CACHE"] = str(tmp / "staging")  # where the staged store lives
    local = saev_writer(md, tmp / "capture-local")
    for batch in batches:
        local.write(batch)
    local_dir = Path(local.close())
    nbytes = sum(f.stat().st_size for f in local_dir.iterdir())
    threads = StagedWriter.__init__.__kwdefaults__["threads"]
    part = DEFAULT_PART_BYTES

    def raw(i: int) -> None:
        raw_upload(c, bucket, local_dir, f"capture-raw{i}", part, threads)

    def ours(i: int) -> None:
        writer = spec.open_writer(plan, f"s3://{bucket}/capture{i}", options)
        for batch in batches:
            writer.write(batch)
        writer.close()

    results: list[list[tuple[float, float, float]]] = [[], []]
    try:
        ours(-1)  # warm: imports, the session's service model
        for i in range(args.repeats):
            for k in (0, 1) if i % 2 == 0 else (1, 0):  # raw first, then ours first
                cpu0, server0 = time.process_time(), cpu_seconds(server_pid)
                with Timer() as t:
                    (raw, ours)[k](i)
                results[k].append(
                    (t.seconds, time.process_time() - cpu0, cpu_seconds(server_pid) - server0)
                )
    finally:  # the other rows read S3 without the cache tier unless they ask for it
        os.environ.pop("ACTSTORE_CACHE", None)
    gib = nbytes / (1 << 30)
    med = [sorted(r)[len(r) // 2] for r in results]
    ratios = sorted(r[0] / o[0] for r, o in zip(results[0], results[1]))
    print(
        f"5. capture -> s3:// (saev, staged): {n} examples x {args.tokens} tokens x {args.d} "
        f"dims, {nbytes / MiB:.0f} MiB in {len(list(local_dir.glob(SAEV_SHARDS)))} shards; "
        f"{threads} threads, {part // MiB} MiB parts; medians of {args.repeats} interleaved "
        f"repetitions; load average {os.getloadavg()[0]:.1f}"
    )
    rows = [
        [
            "capture -> s3:// (saev writer + uploads)",
            nbytes / MiB / med[1][0],
            med[0][0] / med[1][0],
            med[1][1] / gib,
            med[1][2] / gib,
        ],
        ["  raw parallel PUT/multipart, same files", nbytes / MiB / med[0][0], 1.0]
        + [med[0][1] / gib, med[0][2] / gib],
        ["  ratio in each repetition: " + ", ".join(f"{x:.2f}" for x in ratios), "", "", "", ""],
    ]
    print(table(["what", "MiB/s", "ratio", "client CPU s/GiB", "server CPU s/GiB"], rows))


def client():
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=os.environ["S3_ENDPOINT_URL"],
        config=Config(  # as actstore's own client: no extra CRC checksums either way
            max_pool_connections=64,
            s3={"addressing_style": "path"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        ),
    )


def raw_ranged_gets(c, bucket: str, ranges: list[tuple[str, int, int]], threads: int) -> int:
    """Each (key, offset, length) into its own slice of one buffer, ``threads`` at a time."""
    total = sum(n for _, _, n in ranges)
    buf = np.empty(total, dtype=np.uint8)
    starts = np.cumsum([0] + [n for _, _, n in ranges])

    def get(i: int) -> None:
        key, offset, n = ranges[i]
        body = c.get_object(Bucket=bucket, Key=key, Range=f"bytes={offset}-{offset + n - 1}")[
            "Body"
        ]
        view, done = memoryview(buf[starts[i] : starts[i] + n]), 0
        while done < n:
            done += body.readinto(view[done:])

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(get, range(len(ranges))))
    return total


def raw_upload(c, bucket: str, src: Path, prefix: str, part: int, threads: int) -> None:
    """Every file of ``src``: one PUT, or a multipart upload of ``part``-byte parts."""
    jobs, uploads = [], {}
    for path in sorted(src.iterdir()):
        size, key = path.stat().st_size, f"{prefix}/{path.name}"
        if size <= part:
            jobs.append((key, path, 0, size, None))
            continue
        uploads[key] = c.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        for i, off in enumerate(range(0, size, part), start=1):
            jobs.append((key, path, off, min(part, size - off), i))

    def send(job):
        key, path, off, n, number = job
        with open(path, "rb") as f:
            data = os.pread(f.fileno(), n, off)
        if number is None:
            c.put_object(Bucket=bucket, Key=key, Body=data)
            return key, None
        return key, (
            number,
            c.upload_part(
                Bucket=bucket, Key=key, UploadId=uploads[key], PartNumber=number, Body=data
            )["ETag"],
        )

    with ThreadPoolExecutor(threads) as pool:
        results = list(pool.map(send, jobs))
    for key, upload_id in uploads.items():
        parts = sorted(p for k, p in results if k == key)
        c.complete_multipart_upload(
            Bucket=bucket,
            Key=key,
            UploadId=upload_id,
            MultipartUpload={"Parts": [{"PartNumber": n, "ETag": e} for n, e in parts]},
        )


def raw_download(c, bucket: str, prefix: str, dst: Path, part: int, threads: int) -> None:
    dst.mkdir(parents=True)
    objects = c.list_objects_v2(Bucket=bucket, Prefix=prefix + "/")["Contents"]
    fds, jobs = {}, []
    for o in objects:
        name = o["Key"].rpartition("/")[2]
        fds[name] = os.open(dst / name, os.O_WRONLY | os.O_CREAT, 0o644)
        jobs += [
            (o["Key"], name, off, min(part, o["Size"] - off)) for off in range(0, o["Size"], part)
        ]

    def get(job):
        key, name, off, n = job
        data = c.get_object(Bucket=bucket, Key=key, Range=f"bytes={off}-{off + n - 1}")[
            "Body"
        ].read()
        os.pwrite(fds[name], data, off)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(get, jobs))
    for fd in fds.values():
        os.fsync(fd)
        os.close(fd)


class _Seconds:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds


def best(run, *, times: int = 2) -> _Seconds:
    """Fastest of ``times`` runs of ``run(i)`` (each writes a fresh destination)."""
    return interleaved(run, times=times)[0]


def interleaved(*runs, times: int = 3) -> list[_Seconds]:
    """Fastest of ``times`` runs of each ``run(i)``, the runs taking turns (first one,
    then another) so that load from other work on the machine hits them alike."""
    out: list[list[float]] = [[] for _ in runs]
    for i in range(times):
        order = list(range(len(runs)))
        order = order[i % len(runs) :] + order[: i % len(runs)]
        for k in order:
            with Timer() as t:
                runs[k](i)
            out[k].append(t.seconds)
    return [_Seconds(min(o)) for o in out]


def epoch(loader) -> int:
    return sum(len(b) for b in loader)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--examples", type=int, default=512)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--d", type=int, default=512)
    p.add_argument("--per-shard", type=int, default=128, help="examples per shard file")
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--rows", type=int, default=200, help="random rows read one by one")
    p.add_argument("--part-mb", type=int, default=8)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument(
        "--capture-examples", type=int, default=2048, help="examples of the capture row (0: none)"
    )
    p.add_argument("--repeats", type=int, default=3, help="repetitions of the capture row")
    p.add_argument("--only-capture", action="store_true", help="run only the capture row")
    args = p.parse_args()

    server, _endpoint = start_server()
    tmp = Path(tempfile.mkdtemp(prefix="bench-s3-"))
    try:
        c = client()
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        c.create_bucket(Bucket=bucket)
        if args.capture_examples:
            bench_capture(c, bucket, server.pid, tmp, args)
        if args.only_capture:
            return
        local = write_saev(tmp / "acts", args.examples, args.tokens, args.d, args.per_shard)
        nbytes = sum(f.stat().st_size for f in local.iterdir())
        part = args.part_mb * MiB
        rows = []

        # 4. cp upload / download vs raw PUT / GET (each timed twice, the faster kept).
        from actstore.formats import available_formats

        available_formats()  # import the format modules before any timing
        kw = {"threads": args.threads, "part_bytes": part}
        url = f"s3://{bucket}/acts0"  # the first cp upload's copy, read below
        t_raw_up, t_cp_up, t_cp_up_nv = interleaved(
            lambda i: raw_upload(c, bucket, local, f"raw{i}", part, args.threads),
            lambda i: copy_store(local, f"s3://{bucket}/acts{i}", **kw),
            lambda i: copy_store(local, f"s3://{bucket}/nv{i}", verify=False, **kw),
        )
        t_raw_down, t_cp_down, t_cp_down_nv = interleaved(
            lambda i: raw_download(c, bucket, "raw0", tmp / f"raw-down{i}", part, args.threads),
            lambda i: copy_store(url, tmp / f"cp-down{i}", **kw),
            lambda i: copy_store(url, tmp / f"cp-nv{i}", verify=False, **kw),
        )

        # 1. loader over s3 vs raw ranged GETs of the same blocks.
        reader = SaevReader(url)
        blocks = reader.blocks(6)
        row_bytes = args.d * 4
        ranges = [
            (
                f"acts0/{shard_name(b.loc[0])}",
                b.loc[1] * args.tokens * row_bytes,
                b.n_rows * row_bytes,
            )
            for b in blocks
        ]
        opts = {"site": 6, "batch_size": args.batch, "io_threads": args.threads}
        t_raw_get, t_loader = interleaved(
            lambda i: raw_ranged_gets(c, bucket, ranges, args.threads),
            lambda i: epoch(ActivationLoader(reader, **opts)),
        )

        # 2. random rows: reader[...] one by one vs one raw GET per row; gather in one call.
        rng = np.random.default_rng(1)
        ex = rng.integers(0, args.examples, args.rows)
        tok = rng.integers(0, args.tokens, args.rows)
        per_shard = args.per_shard

        def rows_one_by_one(_: int) -> None:
            for e, t in zip(ex, tok):
                reader[int(e), 6, int(t)]

        def raw_rows(_: int) -> None:
            for e, t in zip(ex, tok):
                off = ((int(e) % per_shard) * args.tokens + int(t)) * row_bytes
                key = f"acts0/{shard_name(int(e) // per_shard)}"
                c.get_object(Bucket=bucket, Key=key, Range=f"bytes={off}-{off + row_bytes - 1}")[
                    "Body"
                ].read()

        t_raw_rows, t_rows = interleaved(raw_rows, rows_one_by_one)
        t_gather = best(lambda i: reader.gather((ex, tok), 6))

        # 3. second epoch with the cache vs a local-disk loader.
        cached = SaevReader(url, cache_dir=tmp / "cache", cache_bytes=4 * nbytes)
        t_first = best(lambda i: epoch(ActivationLoader(cached, **opts)), times=1)
        t_second, t_local = interleaved(
            lambda i: epoch(ActivationLoader(cached, **opts)),
            lambda i: epoch(ActivationLoader(SaevReader(local), **opts)),
        )

        mib = nbytes / MiB
        rows = [
            [
                "loader over s3:// (1 epoch)",
                mib / t_loader.seconds,
                t_raw_get.seconds / t_loader.seconds,
            ],
            ["  raw parallel ranged GETs, same blocks", mib / t_raw_get.seconds, 1.0],
            [
                f"reader[e, 6, t], {args.rows} rows one by one",
                args.rows / t_rows.seconds,
                t_raw_rows.seconds / t_rows.seconds,
            ],
            ["  raw: one ranged GET per row", args.rows / t_raw_rows.seconds, 1.0],
            [
                f"reader.gather of the same {args.rows} rows",
                args.rows / t_gather.seconds,
                t_raw_rows.seconds / t_gather.seconds,
            ],
            [
                "loader, cache tier, epoch 1 (fills)",
                mib / t_first.seconds,
                t_local.seconds / t_first.seconds,
            ],
            [
                "loader, cache tier, epoch 2",
                mib / t_second.seconds,
                t_local.seconds / t_second.seconds,
            ],
            ["  loader over local disk", mib / t_local.seconds, 1.0],
            ["cp upload (verified)", mib / t_cp_up.seconds, t_raw_up.seconds / t_cp_up.seconds],
            [
                "cp upload (--no-verify)",
                mib / t_cp_up_nv.seconds,
                t_raw_up.seconds / t_cp_up_nv.seconds,
            ],
            ["  raw parallel PUT/multipart", mib / t_raw_up.seconds, 1.0],
            [
                "cp download (verified)",
                mib / t_cp_down.seconds,
                t_raw_down.seconds / t_cp_down.seconds,
            ],
            [
                "cp download (--no-verify)",
                mib / t_cp_down_nv.seconds,
                t_raw_down.seconds / t_cp_down_nv.seconds,
            ],
            ["  raw parallel ranged GET into files", mib / t_raw_down.seconds, 1.0],
        ]
        print(
            f"store: {args.examples} examples x {args.tokens} tokens x {args.d} dims, "
            f"{mib:.0f} MiB in {len(list(local.glob(SAEV_SHARDS)))} shards, {len(blocks)} blocks; "
            f"{args.threads} threads, {args.part_mb} MiB parts; cache stats {cached.files.cache.stats}"
        )
        print(table(["what", "MiB/s or rows/s", "ratio to baseline"], rows))
    finally:
        server.terminate()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
