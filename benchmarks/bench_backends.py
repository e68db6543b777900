"""Which client library for ``gs://`` and ``az://``: parallel ranged GETs of one object
through each candidate, on the same emulator, same bytes, same concurrency (the figures in
docs/s3.md, "Google Cloud Storage and Azure"). Candidates: the official SDKs
(google-cloud-storage, azure-storage-blob) and obstore; for GCS also actstore's backend, for
Azure actstore's, each through ``get_range_into`` as the readers use it. Runs take turns
and the best of ``--repeats`` counts.

    python benchmarks/bench_backends.py               # 64 MiB in 4 MiB ranges, 8 threads
    python benchmarks/bench_backends.py --mib 128 --threads 16
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

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
    from azure.storage.blob import BlobServiceClient
    from obstore import get_range

    sdk = BlobServiceClient.from_connection_string(connection).get_container_client(bucket)
    ours = open_bucket("az", bucket, AzureConfig(connection_string=connection))
    ob = ours.client  # type: ignore[attr-defined]

    def ours_fetch(s: int, e: int) -> int:
        out = bytearray(e - s)
        ours.get_range_into(key, out, s)
        return len(out)

    return {
        "azure-storage-blob": lambda s, e: len(
            sdk.download_blob(key, offset=s, length=e - s, max_concurrency=1).readall()
        ),
        "obstore": lambda s, e: len(get_range(ob, key, start=s, end=e)),
        "actstore az://": ours_fetch,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--range-mib", type=int, default=4)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    size, step = args.mib << 20, args.range_mib << 20
    data = os.urandom(size)
    ranges = [(s, min(s + step, size)) for s in range(0, size, step)]
    for start in (start_gcs, start_azurite):
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
        finally:
            emulator.stop()


if __name__ == "__main__":
    main()
