"""Which client library for ``gs://`` and ``az://``: parallel ranged GETs of one object
through each candidate, on the same emulator, same bytes, same concurrency (the figures in
docs/s3.md, "Google Cloud Storage and Azure"). Candidates: the official SDKs
(google-cloud-storage, azure-storage-blob) and obstore; for GCS also actstore's backend, for
Azure actstore's, each through ``get_range_into`` as the readers use it. Runs take turns
and the best of ``--repeats`` counts. azure-storage-blob is no dependency of actstore:
install it to compare with it (left out otherwise).

Then (``--loader``, on by default) the shared loader over a ~256 MiB saev store on each
emulator (one epoch of a new loader, with and without its read ahead of the next epoch's
first window, and with windows of an eighth of the store) against raw
parallel ranged GETs (obstore) of the same blocks' bytes with the same concurrency,
``actstore cp`` up and down against the same files sent and fetched raw, and ``verify``
(and its first pass alone: every file's bytes against the manifest, without the
statistics recomputed from the data) against raw GETs of every file, hashed: ``--repeats``
interleaved repetitions, each row the median MiB/s and the median (and range) of the
per-repetition ratios.

    python benchmarks/bench_backends.py               # 64 MiB in 4 MiB ranges, 8 threads
    python benchmarks/bench_backends.py --mib 128 --threads 16 --no-loader
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import xxhash

from actstore.storage.object import AzureConfig, GCSConfig, open_bucket
from actstore.testing.emulators import make_bucket, start_azurite, start_gcs


def timed(ranges: list[tuple[int, int]], threads: int, fetch: Callable[[int, int], int]) -> float:
    """Seconds to fetch every range on ``threads`` threads (checks the byte counts)."""
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        got = sum(pool.map(lambda r: fetch(*r), ranges))
    assert got == sum(e - s for s, e in ranges), got
    return time.perf_counter() - start


def gcs_candidates(endpoint: str, bucket: str, key: str) -> dict[str, Callable[[int, int], int]]:
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage
    from obstore import get_range
    from obstore.store import GCSStore

    sdk = storage.Client(
        project="test",
        credentials=AnonymousCredentials(),
        client_options={"api_endpoint": endpoint},
    ).bucket(bucket)
    ob = GCSStore(
        bucket,
        config={"base_url": endpoint, "skip_signature": True},
        client_options={"allow_http": True},
    )
    ours = open_bucket("gs", bucket, GCSConfig(endpoint_url=endpoint))

    def ours_fetch(s: int, e: int) -> int:
        out = bytearray(e - s)
        ours.get_range_into(key, out, s)
        return len(out)

    return {
        "google-cloud-storage": lambda s, e: len(
            sdk.blob(key).download_as_bytes(start=s, end=e - 1, checksum=None)
        ),
        "obstore": lambda s, e: len(get_range(ob, key, start=s, end=e)),
        "actstore gs://": ours_fetch,
    }


def azure_candidates(
    connection: str, bucket: str, key: str
) -> dict[str, Callable[[int, int], int]]:
    from obstore import get_range

    ours = open_bucket("az", bucket, AzureConfig(connection_string=connection))
    ob = ours.client  # type: ignore[attr-defined]

    def ours_fetch(s: int, e: int) -> int:
        out = bytearray(e - s)
        ours.get_range_into(key, out, s)
        return len(out)

    out: dict[str, Callable[[int, int], int]] = {
        "obstore": lambda s, e: len(get_range(ob, key, start=s, end=e)),
        "actstore az://": ours_fetch,
    }
    try:  # not an actstore dependency: `pip install azure-storage-blob` to compare with it
        from azure.storage.blob import BlobServiceClient
    except ImportError:
        print("  (azure-storage-blob is not installed: left out)")
        return out
    sdk = BlobServiceClient.from_connection_string(connection).get_container_client(bucket)
    return {
        "azure-storage-blob": lambda s, e: len(
            sdk.download_blob(key, offset=s, length=e - s, max_concurrency=1).readall()
        ),
        **out,
    }


def loader_rows(scheme: str, bucket: str, options, args) -> None:
    """The loader and ``cp`` against raw obstore calls on the same store and concurrency."""
    import tempfile
    from pathlib import Path

    import numpy as np
    from bench_s3 import epoch, write_saev
    from obstore import get_range

    from actstore.formats import open_store, verify_store
    from actstore.formats.saev import SaevReader
    from actstore.formats.saev.layout import shard_name
    from actstore.loader import ActivationLoader
    from actstore.storage.copy import copy_store

    tmp = Path(tempfile.mkdtemp(prefix="bench-backends-"))
    # one site, 64 tokens, d = 512, float32: 128 KiB per example, shards of 128 examples
    local = write_saev(tmp / "acts", args.store_mib * 8, 64, 512, 128)
    nbytes = sum(f.stat().st_size for f in local.iterdir())
    store = open_bucket(scheme, bucket, options)
    raw = store.reads.client if scheme == "gs" else store.client  # type: ignore[attr-defined]
    kw = {"threads": args.threads, "part_bytes": 8 << 20}
    files = sorted(local.iterdir())

    def raw_up(i: int) -> None:
        with ThreadPoolExecutor(args.threads) as pool:
            list(pool.map(lambda f: store.put(f"raw{i}/{f.name}", f.read_bytes()), files))

    def raw_down(i: int, durable: bool = True) -> None:
        """Every file fetched whole and written; ``durable``: fsynced as ``cp`` does (its
        files survive a crash), the fair baseline; else left in the page cache."""
        out = tmp / f"raw-down{i}{'' if durable else '-cached'}"
        out.mkdir()

        def one(f: Path) -> None:
            data = get_range(raw, f"raw0/{f.name}", start=0, end=f.stat().st_size)
            with open(out / f.name, "wb") as g:
                g.write(memoryview(data))
                if durable:
                    os.fsync(g.fileno())

        with ThreadPoolExecutor(args.threads) as pool:
            list(pool.map(one, files))
        if durable:
            os.sync()  # the directory entries too (cp fsyncs each directory)

    def raw_verify(_: int) -> None:
        """Every file of the store fetched whole, in parallel, and hashed (xxh3-128): what
        checking its bytes needs at the least."""
        names = {f.name: f.stat().st_size for f in files}

        def one(name: str) -> None:
            xxhash.xxh3_128(memoryview(get_range(raw, f"acts0/{name}", start=0, end=names[name])))

        with ThreadPoolExecutor(args.threads) as pool:
            list(pool.map(one, names))

    url = f"{scheme}://{bucket}/acts0"
    n = args.repeats

    def drop(prefix: str) -> Callable[[int], None]:
        """Delete repetition ``i``'s copy (not the first, which later rows read): the
        emulators hold every object in memory (Azurite: 2 GiB at most)."""

        def run(i: int) -> None:
            if i:
                for info in list(store.list(f"{prefix}{i}/")):
                    store.delete(info.key)

        return run

    t_raw_up, t_cp_up = take_turns(
        n,
        raw_up,
        lambda i: copy_store(local, f"{scheme}://{bucket}/acts{i}", **kw),
        after=[drop("raw"), drop("acts")],
    )

    def remove(name: str) -> Callable[[int], None]:
        """Delete repetition ``i``'s download (untimed): the disk is not the bench's."""
        return lambda i: shutil.rmtree(tmp / name.format(i), ignore_errors=True)

    t_raw_down, t_cp_down, t_raw_cached = take_turns(
        n,
        raw_down,
        lambda i: copy_store(url, tmp / f"cp-down{i}", **kw),
        lambda i: raw_down(i, durable=False),
        after=[remove("raw-down{}"), remove("cp-down{}"), remove("raw-down{}-cached")],
    )

    def bytes_pass(_: int) -> None:
        """verify's first pass alone: every file's blocks against the root manifest."""
        with open_store(url) as store_reader:
            faults: list[str] = []
            store_reader.checks.verify(faults, on_chunk=store_reader.scan_chunk)
            assert not faults, faults

    t_raw_verify, t_verify, t_bytes = take_turns(
        n, raw_verify, lambda i: verify_store(url), bytes_pass
    )
    reader = SaevReader(url)
    row = 512 * 4
    ranges = [
        (f"acts0/{shard_name(b.loc[0])}", b.loc[1] * 64 * row, b.n_rows * row)
        for b in reader.blocks(6)
    ]
    total = sum(n for _, _, n in ranges)

    def raw_gets(_: int) -> None:
        buf = np.empty(total, dtype=np.uint8)
        starts = np.cumsum([0] + [n for _, _, n in ranges])

        def one(i: int) -> None:
            key, offset, n = ranges[i]
            buf[starts[i] : starts[i] + n] = np.frombuffer(
                get_range(raw, key, start=offset, length=n), dtype=np.uint8
            )

        with ThreadPoolExecutor(args.threads) as pool:
            list(pool.map(one, range(len(ranges))))

    opts = {"site": 6, "batch_size": 4096, "io_threads": args.threads}
    # one epoch of a new loader (its window mapped and first read before any batch; as
    # the epoch's last window is read it starts reading the next epoch's first window, the
    # whole store again here, where one window holds it), the same without that read ahead
    # (ACTSTORE_READ_AHEAD=0), and one whose windows are an eighth of the store (reads of
    # the next window overlap the batches; the read ahead is an eighth of the store)
    eighth = max(1, len(ranges) // 8)

    def no_read_ahead(_: int) -> None:
        os.environ["ACTSTORE_READ_AHEAD"] = "0"
        try:
            epoch(ActivationLoader(reader, **opts))
        finally:
            del os.environ["ACTSTORE_READ_AHEAD"]

    t_raw, t_loader, t_alone, t_windows = take_turns(
        n,
        raw_gets,
        lambda i: epoch(ActivationLoader(reader, **opts)),
        no_read_ahead,
        lambda i: epoch(ActivationLoader(reader, pool_blocks=eighth, **opts)),
    )
    mib = nbytes / 2**20
    print(
        f"  {scheme}:// saev store of {mib:.0f} MiB, {args.threads} threads, MiB/s (ratio to raw):"
    )
    for name, ours, base, size in (
        ("loader, 1 epoch", t_loader, t_raw, total / 2**20),
        ("same, no read ahead", t_alone, t_raw, total / 2**20),
        (f"same, {eighth}-block windows", t_windows, t_raw, total / 2**20),
        ("cp up", t_cp_up, t_raw_up, mib),
        ("cp down", t_cp_down, t_raw_down, mib),
        ("cp down (vs no fsync)", t_cp_down, t_raw_cached, mib),
        ("verify", t_verify, t_raw_verify, mib),
        ("verify, bytes pass alone", t_bytes, t_raw_verify, mib),
    ):
        ratios = [b / o for b, o in zip(base, ours, strict=True)]
        print(
            f"    {name:24s} {size / statistics.median(ours):7.0f} vs raw "
            f"{size / statistics.median(base):7.0f}  ({statistics.median(ratios):.2f}; "
            f"{min(ratios):.2f}-{max(ratios):.2f})"
        )
    shutil.rmtree(tmp, ignore_errors=True)


def take_turns(
    times: int,
    *runs: Callable[[int], object],
    after: list[Callable[[int], object]] | None = None,
) -> list[list[float]]:
    """Seconds of each of ``times`` repetitions of every ``run(i)``, the runs taking turns
    in a rotating order (load from other work hits them alike); ratios are then medians of
    the per-repetition ratios. ``after[k](i)``, untimed, follows each ``runs[k](i)``."""
    out: list[list[float]] = [[] for _ in runs]
    for i in range(times):
        for k in [*range(i % len(runs), len(runs)), *range(i % len(runs))]:
            start = time.perf_counter()
            runs[k](i)
            out[k].append(time.perf_counter() - start)
            if after is not None:
                after[k](i)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--store-mib", type=int, default=256, help="the saev store's size")
    parser.add_argument("--range-mib", type=int, default=4)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument(
        "--repeats", type=int, default=5, help="interleaved repetitions (medians reported)"
    )
    parser.add_argument("--loader", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    size, step = args.mib << 20, args.range_mib << 20
    data = os.urandom(size)
    ranges = [(s, min(s + step, size)) for s in range(0, size, step)]
    # Azurite keeps deleted blobs' memory until it collects them: room for every copy
    big_azurite = functools.partial(start_azurite, memory_mib=max(2048, 12 * args.store_mib))
    for start in (start_gcs, big_azurite):
        emulator = start()
        try:
            make_bucket(emulator, "bench-bucket")
            if emulator.scheme == "gs":
                store = open_bucket("gs", "bench-bucket", GCSConfig(endpoint_url=emulator.endpoint))
                store.put("obj", data)
                candidates = gcs_candidates(emulator.endpoint, "bench-bucket", "obj")
            else:
                connection = emulator.env["AZURE_STORAGE_CONNECTION_STRING"]
                store = open_bucket("az", "bench-bucket", AzureConfig(connection_string=connection))
                store.put("obj", data)
                candidates = azure_candidates(connection, "bench-bucket", "obj")
            best = {name: float("inf") for name in candidates}
            for _ in range(args.repeats):
                for name, fetch in candidates.items():
                    best[name] = min(best[name], timed(ranges, args.threads, fetch))
            server = "fake-gcs-server" if emulator.scheme == "gs" else "Azurite"
            print(
                f"{emulator.scheme}:// on {server}: {args.mib} MiB in {args.range_mib} MiB "
                f"ranges, {args.threads} threads, best of {args.repeats}"
            )
            for name, seconds in best.items():
                print(f"  {name:24s} {size / seconds / 2**20:8.0f} MiB/s")
            if args.loader:
                options = (
                    GCSConfig(endpoint_url=emulator.endpoint)
                    if emulator.scheme == "gs"
                    else AzureConfig(
                        connection_string=emulator.env["AZURE_STORAGE_CONNECTION_STRING"]
                    )
                )
                os.environ.update(emulator.env)
                loader_rows(emulator.scheme, "bench-bucket", options, args)
        finally:
            emulator.stop()


if __name__ == "__main__":
    main()
