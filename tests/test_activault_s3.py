"""The activault format against a real S3 server (moto on 127.0.0.1): round trips, what
Activault's own reader does with our files (and ours with Activault's), faults injected on
the server and on the wire, resume after a crash, and bad input."""

from __future__ import annotations

import io
import json
import urllib.request
import uuid

import numpy as np
import pytest
import torch

from actstore.errors import (
    CaptureError,
    ConfigError,
    CorruptStoreError,
    StorageError,
    StoreExistsError,
    StoreNotFoundError,
)
from actstore.formats import detect_format, open_store
from actstore.formats.activault import (
    ActivaultOptions,
    ActivaultReader,
    ActivaultStream,
    ActivaultWriter,
    hook_name,
)
from actstore.formats.activault.layout import group_uuid, parse_data_file, serialize_megabatch
from actstore.sites import Site
from actstore.storage.object import S3Config
from actstore.testing import make_batches, make_plan

SITES = (Site("resid", 1), Site("mlp_out", 2), Site("attn_in", 0))


def make_run_data(*, n_examples=24, tokens=8, d=16, batch_size=4, sites=SITES, seed=0):
    """A plan and activations whose first column is each token's global index (unique rows)."""
    plan = make_plan(
        n_examples=n_examples,
        tokens_per_example=tokens,
        d_model=d,
        sites=sites,
        batch_size=batch_size,
        n_model_layers=4,
    )
    rng = np.random.default_rng(seed)
    acts = {}
    for i, site in enumerate(sites):
        a = (rng.standard_normal((n_examples, tokens, d)) * (1 + i)).astype(np.float32)
        a[..., 0] = np.arange(n_examples * tokens).reshape(n_examples, tokens) + 1000 * i
        acts[str(site)] = a
    return plan, acts


def write_run(out, plan, acts, *, batches=None, close=True, **options):
    """Write and close (returns the location); ``close=False``: flush, then abort as a
    crash after the last commit would (returns the writer)."""
    options.setdefault("dtype", "float32")
    writer = ActivaultWriter.from_plan(plan, out, ActivaultOptions(**options))
    try:
        for batch in batches if batches is not None else make_batches(plan, acts):
            writer.write(batch)
        if close:
            return writer.close()
    except BaseException:
        writer.abort()  # as a capture does: its lock lease stops being refreshed
        raise
    writer.flush()
    writer.abort()
    return writer


def stored_stream(reader, site):
    """(states rows, input ids) of every file of ``site``, in commit order."""
    states, ids = [], []
    for i in range(len(reader.data_files(site))):
        mb = reader.megabatch(site, i)
        states.append(mb["states"].reshape(-1, mb["states"].shape[-1]))
        ids.append(mb["input_ids"].reshape(-1))
    return torch.cat(states).float().numpy(), torch.cat(ids).numpy()


# ---------------------------------------------------------------------------- round trips


def test_round_trip_several_hooks_uuid_aligned_stats_exact(s3):
    plan, acts = make_run_data()
    location = write_run(s3.url("run"), plan, acts, rows_per_file=3, dtype="bfloat16")
    assert location == s3.url("run")
    keys = s3.keys("run/")
    cfg = json.loads(s3.client().get_object(Bucket=s3.bucket, Key="run/cfg.json")["Body"].read())
    assert list(cfg)[:9] == [
        "run_name",
        "transformer_config",
        "data_config",
        "upload_config",
        "total_tokens",
        "d_model",
        "n_total_files",
        "batches_processed",
        "num_runs",
    ]
    assert cfg["upload_config"]["hooks"] == [hook_name(s) for s in SITES]
    reader = open_store(s3.url("run"))
    assert isinstance(reader, ActivaultReader) and reader.sites == SITES
    assert reader.hooks == [hook_name(s) for s in SITES]
    n_files = (24 * 8) // (3 * 8)
    assert cfg["n_total_files"] == n_files and cfg["total_tokens"] == 24 * 8
    names = None
    ids_ref = None
    for site in SITES:
        hook = hook_name(site)
        files = sorted(
            k.split("/")[-1] for k in keys if k.startswith(f"run/{hook}/") and k.endswith(".pt")
        )
        parsed = sorted((parse_data_file(n) for n in files), key=lambda f: f.n)
        assert [f.n for f in parsed] == list(range(1, n_files + 1))  # n counts uploads from 1
        names = names or files
        assert files == names  # the same uuid for the same group in every hook folder
        md = json.loads(
            s3.client().get_object(Bucket=s3.bucket, Key=f"run/{hook}/metadata.json")["Body"].read()
        )
        assert md["shape"] == [3, 8, 16] and md["dtype"] == "torch.bfloat16"
        assert {keys[f"run/{hook}/{n}"] for n in files} == {md["bytes_per_file"]}
        rows, ids = stored_stream(reader, hook)
        expected = torch.from_numpy(acts[str(site)].reshape(-1, 16)).to(torch.bfloat16).float()
        np.testing.assert_array_equal(rows.astype(np.float32), expected.numpy())
        ids_ref = ids if ids_ref is None else ids_ref
        np.testing.assert_array_equal(ids, ids_ref)  # same tokens in every hook
        stats = reader.statistics(hook)
        exact = expected.numpy().astype(np.float64)
        assert stats.count == 24 * 8
        np.testing.assert_allclose(stats.mean, exact.mean(0), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(stats.var, exact.var(0), rtol=1e-10)
        np.testing.assert_allclose(
            stats.norm_mean, np.linalg.norm(exact, axis=1).mean(), rtol=1e-12
        )
        doc = json.loads(
            s3.client()
            .get_object(Bucket=s3.bucket, Key=f"run/{hook}/statistics.json")["Body"]
            .read()
        )
        np.testing.assert_allclose(doc["std"], exact.std(0), rtol=1e-10)
    assert reader.verify().ok
    # one hook folder opens on its own too, and detection finds the format for both
    assert open_store(s3.url("run", hook_name(SITES[1]))).sites == (SITES[1],)
    assert detect_format(s3.url("run")).name == "activault"


def activault_rcache_read(s3, prefix: str, chunk_size: int = 1000) -> torch.Tensor:
    """What Activault's S3RCache does, step by step (see notes/activault.md section 5):
    metadata.json, list_objects_v2 with Prefix=prefix (no slash, no delimiter), skip
    metadata/statistics/cfg.json keys, presigned URLs, Range GETs of exactly bytes_per_file,
    b"".join, torch.load with default arguments, a buffer of metadata shape and dtype."""
    client = s3.client()
    metadata = json.loads(
        client.get_object(Bucket=s3.bucket, Key=f"{prefix}/metadata.json")["Body"].read()
    )
    paths = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=s3.bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            key = obj["Key"]
            if key in (f"{prefix}/metadata.json", f"{prefix}/statistics.json") or key.endswith(
                "cfg.json"
            ):
                continue
            paths.append(
                client.generate_presigned_url(
                    "get_object", Params={"Bucket": s3.bucket, "Key": key}, ExpiresIn=604700
                )
            )
    dtype = getattr(torch, metadata["dtype"].removeprefix("torch."))  # their eval(...)
    buffer = torch.empty((len(paths), *metadata["shape"]), dtype=dtype)
    for idx, url in enumerate(sorted(paths)):
        chunks = []
        for start in range(0, metadata["bytes_per_file"], chunk_size):
            end = min(start + chunk_size - 1, metadata["bytes_per_file"] - 1)
            request = urllib.request.Request(url, headers={"Range": f"bytes={start}-{end}"})
            with urllib.request.urlopen(request) as response:
                assert response.status == 206
                chunks.append((start, response.read()))
        t = torch.load(io.BytesIO(b"".join(c for _, c in sorted(chunks))))
        if isinstance(t, dict) and "states" in t:
            t = t["states"]
        buffer[idx] = t
    return buffer


def test_activaults_reader_reads_what_we_write(s3):
    plan, acts = make_run_data(sites=(Site("resid", 1), Site("resid", 3)))
    write_run(s3.url("run"), plan, acts, rows_per_file=4, dtype="bfloat16")
    hook = hook_name(Site("resid", 1))
    got = activault_rcache_read(s3, f"run/{hook}")  # sorted(paths): by uuid
    reader = open_store(s3.url("run"))
    files = reader.data_files(hook)
    by_uuid = sorted(range(len(files)), key=lambda i: files[i].key)
    ours = torch.stack([reader.megabatch(hook, i)["states"] for i in by_uuid])
    assert got.dtype == torch.bfloat16 and torch.equal(got, ours)


def write_like_activault(s3, run: str, hook: str, megabatches: list[torch.Tensor]) -> None:
    """An Activault run as HookUploader and generate.py leave it: {uuid}--{n}_{job}.saved.pt,
    metadata.json via json.dumps, statistics.json without count, cfg.json without actstore."""
    client = s3.client()
    size = None
    for n, states in enumerate(megabatches, start=1):
        ids = torch.arange(states.shape[0] * states.shape[1]).reshape(states.shape[:2])
        data = serialize_megabatch(states, ids).getvalue()
        size = len(data)
        client.put_object(
            Bucket=s3.bucket, Key=f"{run}/{hook}/{uuid.uuid4()}--{n}_0.saved.pt", Body=data
        )
    rows, seq, d = megabatches[0].shape
    metadata = {
        "batch_size": rows,
        "sequence_length": seq,
        "dtype": str(megabatches[0].dtype),
        "d_in": d,
        "batches_per_file": 2,
        "shape": [rows, seq, d],
        "input_ids_shape": [rows, seq],
        "bytes_per_file": size,
    }
    client.put_object(
        Bucket=s3.bucket, Key=f"{run}/{hook}/metadata.json", Body=json.dumps(metadata)
    )
    stats = {"mean": [0.0] * d, "std": [1.0] * d, "norm": 1.0, "M2": [1.0] * d}
    client.put_object(Bucket=s3.bucket, Key=f"{run}/{hook}/statistics.json", Body=json.dumps(stats))
    cfg = {
        "run_name": run,
        "transformer_config": {"model_name": "meta-llama/Llama-3.3-70B"},
        "total_tokens": rows * seq * len(megabatches),
        "n_total_files": len(megabatches),
        "batches_processed": 2 * len(megabatches),
        "num_runs": 1,
    }
    client.put_object(Bucket=s3.bucket, Key=f"{run}/cfg.json", Body=json.dumps(cfg))


def test_we_read_what_activault_writes(s3):
    hook = "models.layers.24.mlp.post"
    mbs = [torch.randn(4, 5, 8).to(torch.float16) for _ in range(5)]
    write_like_activault(s3, "llama70b", hook, mbs)
    reader = open_store(s3.url("llama70b"))
    assert reader.hooks == [hook] and reader.sites == (Site("mlp_out", 24),)
    assert reader.dtype == np.float16 and reader.statistics(hook) is None  # count-less: untrusted
    got = [reader.read_block(b) for b in reader.blocks("mlp_out.24")]  # sorted by n
    for block, mb in zip(got, mbs):
        np.testing.assert_array_equal(block, mb.reshape(-1, 8).numpy())
    summary = reader.describe()
    assert summary["written_by"].startswith("Activault") and summary["verified"] is False
    assert summary["model"] == "meta-llama/Llama-3.3-70B (unknown)"
    report = reader.verify()  # every file decoded and checked, but nothing to verify against
    assert report.faults == [
        (
            "no root manifest (actstore-manifest.json): the contents cannot be verified "
            "(deleted, or a store written by another tool)"
        )
    ]
    assert report.files_checked == 5 and any("statistics" in n for n in report.notes)
    stream = ActivaultStream(s3.url("llama70b", hook), batch_size=7, shuffle=False)
    rows = torch.cat(list(stream))
    assert torch.equal(rows, torch.cat([m.reshape(-1, 8) for m in mbs]))


def test_loader_refuses_to_pair_hooks_whose_files_hold_different_tokens(s3):
    """Regression: with sites=[a, b] the loader pairs block i of a with block i of b; on an
    Activault run whose hooks' files are different groups (other uuids) that paired rows of
    different tokens silently. Now it is refused, and each hook still loads on its own."""
    from actstore.loader import ActivationLoader

    a, b = "models.layers.1.post", "models.layers.2.post"
    write_like_activault(s3, "drift", a, [torch.randn(2, 3, 4) for _ in range(3)])
    write_like_activault(s3, "drift", b, [torch.randn(2, 3, 4) for _ in range(3)])  # new uuids
    reader = open_store(s3.url("drift"))
    assert not reader.aligned_on([a, b]) and reader.aligned_on([a])
    with pytest.raises(ConfigError, match="not aligned"):
        ActivationLoader(reader, sites=[a, b], batch_size=4)
    assert sum(len(x) for x in ActivationLoader(reader, site=b, batch_size=4)) == 3 * 2 * 3
    plan, acts = make_run_data(sites=(Site("resid", 1), Site("resid", 2)))
    write_run(s3.url("ours"), plan, acts, rows_per_file=4)  # actstore's runs always align
    pairs = torch.cat(
        list(ActivationLoader(s3.url("ours"), sites=["resid.1", "resid.2"], batch_size=16))
    )
    np.testing.assert_array_equal(pairs[:, 1, 0].numpy(), pairs[:, 0, 0].numpy() + 1000)


def test_shared_loader_trains_from_s3(s3):
    from actstore.loader import ActivationLoader

    plan, acts = make_run_data()
    write_run(s3.url("run"), plan, acts, rows_per_file=2)
    loader = ActivationLoader(s3.url("run"), site="mlp_out.2", batch_size=10, seed=1)
    rows = torch.cat(list(loader)).numpy()
    expected = acts["mlp_out.2"].reshape(-1, 16)
    assert rows.shape == expected.shape
    np.testing.assert_array_equal(np.sort(rows[:, 0]), np.sort(expected[:, 0]))


# ---------------------------------------------------------------------------- faults


def test_server_errors_during_upload_are_retried(s3):
    plan, acts = make_run_data()
    slow = s3.faults.fail(method="PUT", path_contains=".pt", status=503, code="SlowDown", times=4)
    internal = s3.faults.fail(
        method="PUT", path_contains=".pt", status=500, code="InternalError", times=3
    )
    cfg_fault = s3.faults.fail(method="PUT", path_contains="cfg.json", status=503, times=2)
    write_run(s3.url("run"), plan, acts, rows_per_file=2)
    assert (slow.hits, internal.hits, cfg_fault.hits) == (4, 3, 2)
    reader = open_store(s3.url("run"))
    assert reader.n_files == 12
    for site in SITES:  # nothing lost, nothing duplicated
        rows, _ = stored_stream(reader, hook_name(site))
        np.testing.assert_array_equal(rows, acts[str(site)].reshape(-1, 16))
    data_keys = [k for k in s3.keys("run/") if k.endswith(".pt")]
    assert len(data_keys) == 12 * len(SITES)


def test_multipart_upload_retries_a_failed_part_and_completes_only_whole(s3):
    # one 12 MiB file per hook: 5 MiB parts, multipart above 10 MiB -> 3 parts
    plan, acts = make_run_data(n_examples=48, tokens=128, d=512, sites=(Site("resid", 1),))
    part = s3.faults.fail(
        method="PUT", query_contains="partNumber=2", status=500, code="InternalError", times=2
    )
    done = s3.faults.fail(method="POST", query_contains="uploadId", status=503, times=1)
    write_run(s3.url("big"), plan, acts, rows_per_file=48, part_size_mb=5)
    assert part.hits == 2 and done.hits == 1
    (key,) = [k for k in s3.keys("big/") if k.endswith(".pt")]
    assert s3.keys("big/")[key] > 12 << 20  # really went through multipart
    assert not s3.client().list_multipart_uploads(Bucket=s3.bucket).get("Uploads")
    rows, _ = stored_stream(open_store(s3.url("big")), hook_name(Site("resid", 1)))
    np.testing.assert_array_equal(rows, acts["resid.1"].reshape(-1, 512))
    # a part that never goes through: the upload is aborted, no object, no pending upload
    s3.faults.fail(method="PUT", query_contains="partNumber=3", status=500, times=10_000)
    with pytest.raises(CaptureError, match="PUT part 3/3 .* failed after 2 attempts"):
        write_run(s3.url("big2"), plan, acts, rows_per_file=48, part_size_mb=5, max_attempts=2)
    assert not [k for k in s3.keys("big2/") if k.endswith(".pt")]
    assert not s3.client().list_multipart_uploads(Bucket=s3.bucket).get("Uploads")


def test_exhausted_retries_fail_clearly_leave_nothing_half_written_and_resume(s3):
    plan, acts = make_run_data(
        n_examples=8, tokens=64, d=512, sites=(Site("resid", 1),), batch_size=2
    )
    batches = make_batches(plan, acts)
    options = {"rows_per_file": 4, "part_size_mb": 5, "max_attempts": 3, "dtype": "float32"}
    writer = ActivaultWriter.from_plan(plan, s3.url("run"), ActivaultOptions(**options))
    writer.write(batches[0])
    writer.write(batches[1])  # completes group 0 (examples 0-3)
    s3.faults.fail(method="PUT", path_contains=".pt", status=503, times=10_000)
    with pytest.raises(
        CaptureError, match=r"failed after 3 attempts.*SlowDown|SlowDown.*3 attempts"
    ):
        for batch in batches[2:]:
            writer.write(batch)
        writer.close()
    writer.abort()
    s3.faults.clear()
    data = {k: v for k, v in s3.keys("run/").items() if k.endswith(".pt")}
    assert len(data) <= 1  # only group 0's file can exist; never a partial object
    assert not s3.client().list_multipart_uploads(Bucket=s3.bucket).get("Uploads")
    with pytest.raises(CorruptStoreError, match="unfinished capture"):
        open_store(s3.url("run"))
    resumed = ActivaultWriter.from_plan(plan, s3.url("run"), ActivaultOptions(**options))
    assert resumed.resume_from in (0, 4)
    first = resumed.resume_from // plan.batch_size
    for batch in batches[first:]:
        resumed.write(batch)
    resumed.close()
    rows, _ = stored_stream(open_store(s3.url("run")), hook_name(Site("resid", 1)))
    np.testing.assert_array_equal(rows, acts["resid.1"].reshape(-1, 512))


def test_upload_survives_connection_resets_and_refusals(s3_proxy):
    plan, acts = make_run_data()
    writer = ActivaultWriter.from_plan(
        plan, s3_proxy.url("run"), ActivaultOptions(rows_per_file=2, dtype="float32")
    )
    # PUT responses cut after the server stored the object: the retried PUT must replace it,
    # never add a second copy. Fewer faults than max_attempts, even if one request gets all.
    s3_proxy.proxy.reset_connections(times=5, after_bytes=150)
    s3_proxy.proxy.refuse(times=2)
    for batch in make_batches(plan, acts):
        writer.write(batch)
    writer.close()
    assert s3_proxy.proxy.injected["reset"] == 5 and s3_proxy.proxy.injected["refuse"] == 2
    s3_proxy.proxy.clear()
    reader = open_store(s3_proxy.url("run"))
    for site in SITES:
        rows, _ = stored_stream(reader, hook_name(site))
        np.testing.assert_array_equal(rows, acts[str(site)].reshape(-1, 16))
    assert len([k for k in s3_proxy.keys("run/") if k.endswith(".pt")]) == 12 * len(SITES)


def test_stream_survives_resets_stalls_and_server_errors(s3_proxy):
    plan, acts = make_run_data(n_examples=32, d=64, sites=(Site("resid", 1),))
    write_run(s3_proxy.url("run"), plan, acts, rows_per_file=4)
    clean = torch.cat(list(ActivaultStream(s3_proxy.url("run"), batch_size=50, seed=3)))
    # fewer faults in all than max_attempts (8), even if a single request met every one
    s3_proxy.proxy.reset_connections(times=4, after_bytes=5_000)
    s3_proxy.proxy.stall(times=1, seconds=1.5)
    s3_proxy.faults.fail(method="GET", path_contains=".pt", status=503, times=2)
    config = S3Config(read_timeout_s=0.5, backoff_s=0.01)
    stream = ActivaultStream(
        s3_proxy.url("run"), batch_size=50, seed=3, storage=config, chunk_size=16 << 10
    )
    faulty = torch.cat(list(stream))
    assert s3_proxy.proxy.injected["reset"] == 4 and s3_proxy.proxy.injected["stall"] == 1
    assert torch.equal(faulty, clean)  # every token exactly once, same order
    assert sorted(faulty[:, 0].tolist()) == list(range(32 * 8))


# ---------------------------------------------------------------------------- resume


def test_resume_cleans_uncommitted_files_and_catches_statistics_up(s3):
    plan, acts = make_run_data(n_examples=24, tokens=6)
    batches = make_batches(plan, acts)
    options = {"rows_per_file": 1, "sequence_length": 7}  # files end mid-example
    clean = write_run(s3.url("clean"), plan, acts, **options)
    writer = write_run(s3.url("run"), plan, acts, batches=batches[:4], close=False, **options)
    record = writer.record
    assert 0 < record.groups and record.next_skip > 0  # stopped inside an example
    hook = hook_name(SITES[0])
    orphan = f"run/{hook}/{group_uuid(record.run_id, record.groups + 3)}--{record.groups + 4}.pt"
    s3.client().put_object(Bucket=s3.bucket, Key=orphan, Body=b"x" * 10)
    s3.client().delete_object(Bucket=s3.bucket, Key=f"run/{hook}/statistics.json")
    partial = open_store(s3.url("run"), allow_incomplete=True)
    assert partial.n_files == record.groups  # the orphan is not data
    assert any("no committed group" in f for f in partial.verify().faults)

    resumed = ActivaultWriter.from_plan(
        plan, s3.url("run"), ActivaultOptions(dtype="float32", **options)
    )
    assert resumed.resume_from == record.next_example
    assert orphan not in s3.keys("run/")
    for batch in batches[resumed.resume_from // plan.batch_size :]:
        resumed.write(batch)
    resumed.close()
    a, b = open_store(s3.url("run")), open_store(clean)
    assert len(a) == len(b)
    for site in SITES:
        h = hook_name(site)
        for x, y in zip(stored_stream(a, h), stored_stream(b, h)):
            np.testing.assert_array_equal(x, y)
        sa, sb = a.statistics(h), b.statistics(h)
        assert (
            sa.count == sb.count
            and np.array_equal(sa.mean, sb.mean)
            and np.array_equal(sa.m2, sb.m2)
        )
    assert a.record.num_runs == 1 and a.record.dropped_tokens == b.record.dropped_tokens
    # rerunning a finished capture writes nothing
    again = ActivaultWriter.from_plan(
        plan, s3.url("run"), ActivaultOptions(dtype="float32", **options)
    )
    assert again.complete and again.close() == s3.url("run")


# ---------------------------------------------------------------------------- bad input


def test_wrong_credentials_and_missing_bucket_are_clear(s3, monkeypatch):
    from moto.core.authorization import enable_iam_authentication

    plan, acts = make_run_data()
    write_run(s3.url("run"), plan, acts, rows_per_file=4)
    iam = __import__("boto3").client(
        "iam", endpoint_url=s3.server.endpoint, region_name="us-east-1"
    )
    iam.create_user(UserName="reader")
    iam.put_user_policy(
        UserName="reader",
        PolicyName="s3",
        PolicyDocument=json.dumps(
            {
                "Version": "2012-10-17",
                "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
            }
        ),
    )
    key = iam.create_access_key(UserName="reader")["AccessKey"]
    with enable_iam_authentication():
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
        assert open_store(s3.url("run")).n_files == 6  # real credentials work
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
        with pytest.raises(StorageError, match="refused access.*AWS_SECRET_ACCESS_KEY"):
            ActivaultReader(s3.url("run"))
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOSUCHKEY0000000")
        with pytest.raises(StorageError, match="refused access"):
            ActivaultWriter.from_plan(plan, s3.url("run2"), ActivaultOptions())
    with pytest.raises(StoreNotFoundError, match="bucket 'no-such-bucket' does not exist"):
        ActivaultReader("s3://no-such-bucket/run")
    with pytest.raises(StoreNotFoundError, match="bucket 'no-such-bucket' does not exist"):
        ActivaultWriter.from_plan(plan, "s3://no-such-bucket/run", ActivaultOptions())
    with pytest.raises(StoreNotFoundError, match="no Activault hook folders"):
        ActivaultReader(s3.url("nothing-here"))


def test_open_store_names_the_s3_problem_not_an_unknown_format(s3, monkeypatch, tmp_path):
    """Regression: format detection swallowed a missing bucket or missing credentials, so
    open_store (and the loader, inspect, verify) said "not an actstore-readable store"."""
    import actstore.storage.object.s3_store as object_storage
    from actstore.loader import ActivationLoader

    with pytest.raises(StoreNotFoundError, match="bucket 'no-such-bucket' does not exist"):
        open_store("s3://no-such-bucket/run")
    with pytest.raises(StoreNotFoundError, match="bucket 'no-such-bucket' does not exist"):
        ActivationLoader("s3://no-such-bucket/run")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setattr(object_storage, "_SESSION", None)  # no credentials cached from before
    with pytest.raises(ConfigError, match="no S3 credentials.*AWS_ACCESS_KEY_ID"):
        open_store(s3.url("run"))


def test_a_wrong_endpoint_is_named_with_the_setting_to_fix(s3, monkeypatch):
    import socket

    with socket.socket() as sock:  # a loopback port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("S3_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    fast = S3Config(max_attempts=2, backoff_s=0.01)
    with pytest.raises(
        StorageError, match=f"cannot reach http://127.0.0.1:{port}.*S3_ENDPOINT_URL"
    ):
        ActivaultReader(s3.url("run"), storage=fast)
    monkeypatch.setenv("S3_ENDPOINT_URL", f"127.0.0.1:{port}")  # no scheme
    with pytest.raises(ConfigError, match="S3_ENDPOINT_URL.*http://"):
        ActivaultReader(s3.url("run"), storage=fast)


def test_corrupt_and_short_files_are_clear_errors(s3):
    plan, acts = make_run_data()
    write_run(s3.url("run"), plan, acts, rows_per_file=4)
    client = s3.client()
    hook = hook_name(SITES[0])
    keys = sorted(k for k in s3.keys(f"run/{hook}/") if k.endswith(".pt"))
    size = s3.keys()[keys[0]]
    client.put_object(Bucket=s3.bucket, Key=keys[0], Body=b"\0" * size)  # right size, garbage
    reader = open_store(s3.url("run"))  # same size: found where it is read
    index = [f.key for f in reader.data_files(hook)].index(keys[0])
    name = keys[0].removeprefix("run/")
    with pytest.raises(
        CorruptStoreError, match=rf"{name}: block 0 \(bytes 0-{size}\) is not the block published"
    ):
        reader.read_block(reader.blocks(hook)[index])
    faults = reader.verify().faults
    assert any(f.startswith(f"{name}: 1 block(s) differ from the manifest") for f in faults)
    assert any("not a loadable megabatch" in f for f in faults)
    unchecked = open_store(s3.url("run"), verify_reads=False)
    with pytest.raises(CorruptStoreError, match="not a loadable megabatch"):
        unchecked.read_block(unchecked.blocks(hook)[index])
    assert any("not a loadable megabatch" in f for f in unchecked.verify().faults)
    client.put_object(Bucket=s3.bucket, Key=keys[1], Body=b"\0" * (size - 7))  # short
    short = keys[1].removeprefix("run/")
    with pytest.raises(
        CorruptStoreError, match=f"{short} has {size - 7} bytes, the manifest says {size}"
    ):
        open_store(s3.url("run"))
    with pytest.raises(
        CorruptStoreError, match=f"{size - 7} bytes but metadata.json says every file is {size}"
    ):
        open_store(s3.url("run"), verify_reads=False)


def test_prefix_collisions_strays_and_foreign_runs_are_refused(s3):
    plan, acts = make_run_data(sites=(Site("resid", 1),))
    write_run(s3.url("run"), plan, acts, rows_per_file=4)
    client = s3.client()
    hook = hook_name(Site("resid", 1))
    client.put_object(Bucket=s3.bucket, Key=f"run/{hook}/notes.txt", Body=b"hello")
    with pytest.raises(CorruptStoreError, match=f"{hook}/notes.txt is not listed in the manifest"):
        open_store(s3.url("run"))
    report = open_store(s3.url("run"), verify_reads=False).verify()
    assert f"{hook}/notes.txt is not listed in the manifest" in report.faults
    assert any("notes.txt is not a megabatch file" in f for f in report.faults)
    client.put_object(Bucket=s3.bucket, Key=f"run/{hook}_ln/x.pt", Body=b"x")
    with pytest.raises(CorruptStoreError, match="is a prefix of 'models.layers.1.post_ln'"):
        open_store(s3.url("run"))
    client.put_object(Bucket=s3.bucket, Key=f"other/{hook}_ln/x.pt", Body=b"x")
    with pytest.raises(ConfigError, match="prefix of"):
        ActivaultWriter.from_plan(plan, s3.url("other"), ActivaultOptions())
    client.put_object(Bucket=s3.bucket, Key="third/data.bin", Body=b"x")
    with pytest.raises(StoreExistsError, match="no cfg.json"):
        ActivaultWriter.from_plan(plan, s3.url("third"), ActivaultOptions())
    write_like_activault(s3, "theirs", hook, [torch.zeros(2, 3, 4)])
    with pytest.raises(StoreExistsError, match="not written by actstore"):
        ActivaultWriter.from_plan(plan, s3.url("theirs"), ActivaultOptions())
    with pytest.raises(StoreExistsError, match="different rows_per_file"):
        ActivaultWriter.from_plan(
            plan, s3.url("run"), ActivaultOptions(rows_per_file=2, dtype="float32")
        )


def test_mismatched_prefixes_are_not_mixed(s3):
    plan, acts = make_run_data(sites=(Site("resid", 1),))
    write_run(s3.url("a"), plan, acts, rows_per_file=4)
    write_run(s3.url("b"), plan, acts, rows_per_file=2)  # same d, dtype, model: mixable
    hook = hook_name(Site("resid", 1))
    both = ActivaultStream([s3.url("a"), s3.url("b")], batch_size=16, seed=0)
    assert both.n_tokens == 2 * 24 * 8 and len(list(both)) == 24
    wide, wide_acts = make_run_data(sites=(Site("resid", 1),), d=32)
    write_run(s3.url("wide"), wide, wide_acts, rows_per_file=4)
    with pytest.raises(ConfigError, match="width 32 vs 16"):
        ActivaultStream([s3.url("a"), s3.url("wide")])
    write_run(s3.url("half"), plan, acts, rows_per_file=4, dtype="float16")
    with pytest.raises(ConfigError, match="dtype torch.float16 vs torch.float32"):
        ActivaultStream([s3.url("a", hook), s3.url("half", hook)])
    other = make_plan(
        n_examples=24,
        tokens_per_example=8,
        d_model=16,
        sites=(Site("resid", 1),),
        ckpt="another-model",
    )
    write_run(s3.url("other"), other, acts, rows_per_file=4)
    with pytest.raises(ConfigError, match="model 'another-model'"):
        ActivaultStream([s3.url("a"), s3.url("other")])
