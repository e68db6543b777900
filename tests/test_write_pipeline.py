"""The shared write pipeline (formats/pipeline.py, ShardedWriter): statistics identical for
any thread count and batch split, sparse padding, the append-only journal, commit errors,
and the rule that no format module does its own file I/O."""

from __future__ import annotations

import ast
import io
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from actstore.batch import Batch
from actstore.errors import ConfigError
from actstore.formats import open_store
from actstore.formats.journal import PROGRESS, read_journal, recorded_shards
from actstore.formats.saev import SaevOptions, SaevWriter
from actstore.formats.shard import ShardStats
from actstore.formats.threads import cpu_pool, empty_tensor
from actstore.stats import BLOCK_BYTES, RunningStats, chunk_moments
from actstore.storage.location import Location
from actstore.testing import make_plan

SRC = Path(__file__).resolve().parents[1] / "src"


def _acts(plan, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (plan.n_examples, plan.tokens_per_example, plan.d_model)
    return {str(s): torch.randn(shape, generator=gen) * 3 + 1 for s in plan.sites}


def _batches(plan, acts, sizes):
    start = 0
    for n in sizes:
        if start >= plan.n_examples:
            break
        n = min(n, plan.n_examples - start)
        ids = np.arange(start, start + n)
        yield Batch(
            acts={k: v[start : start + n] for k, v in acts.items()},
            example_ids=ids,
            token_ids=np.zeros((n, plan.tokens_per_example), np.int64) if plan.has_tokens else None,
        )
        start += n


def _write(tmp, plan, acts, sizes, monkeypatch, threads):
    monkeypatch.setenv("ACTSTORE_WRITER_THREADS", str(threads))
    writer = SaevWriter.from_plan(plan, Location.parse(tmp), SaevOptions())
    for batch in _batches(plan, acts, sizes):
        writer.write(batch)
    return writer.close()


def test_chunk_moments_are_exact_sums():
    rows = np.array([[1.0, -2.0], [3.0, 4.0], [0.5, 0.25]], np.float32)
    n, total, sumsq, norms = chunk_moments(rows)
    assert n == 3
    assert total.tolist() == [4.5, 2.25]
    assert sumsq.tolist() == [10.25, 20.0625]
    assert norms == pytest.approx(np.sqrt(5) + 5 + np.sqrt(0.3125), rel=1e-15)


def test_bfloat16_moments_equal_the_widened_values_across_blocks():
    # 3 blocks of BLOCK_BYTES and a partial one: the tensor path widens block by block
    d = 64
    n = 3 * (BLOCK_BYTES // (8 * d)) + 5
    values = torch.randn(n, d, generator=torch.Generator().manual_seed(3)).bfloat16()
    got = chunk_moments(values)
    want = chunk_moments(values.float().numpy())
    assert got[0] == want[0] == n
    assert got[1].tolist() == want[1].tolist() and got[2].tolist() == want[2].tolist()
    assert got[3] == want[3]
    exact = values.double().numpy()
    np.testing.assert_allclose(got[1], exact.sum(0), rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize("as_tensor", [False, True], ids=["numpy", "torch"])
def test_float16_moments_equal_the_widened_values_across_blocks(as_tensor):
    # zarr stores float16: widened through float32 (exact), block by block
    d = 64
    n = 3 * (BLOCK_BYTES // (8 * d)) + 5
    values = torch.randn(n, d, generator=torch.Generator().manual_seed(4)).half()
    got = chunk_moments(values if as_tensor else values.numpy())
    want = chunk_moments(values.numpy().astype(np.float64))
    assert got[0] == want[0] == n
    assert got[1].tolist() == want[1].tolist() and got[2].tolist() == want[2].tolist()
    assert got[3] == want[3]


@pytest.mark.parametrize("rows", [0, 3, 4096], ids=["empty", "small", "mapped"])
def test_fresh_writer_buffers_save_like_torch_empty(rows):
    # from HUGE_FROM bytes the buffer is a huge-page mapping; torch.save must not notice
    values = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(5)).bfloat16()
    buf = empty_tensor(values.shape, torch.bfloat16)
    assert buf.is_contiguous() and buf.shape == values.shape and buf.dtype == torch.bfloat16
    assert buf.untyped_storage().nbytes() == values.numel() * 2
    buf.copy_(values)
    saved, want = io.BytesIO(), io.BytesIO()
    torch.save({"states": buf}, saved)
    torch.save({"states": values.clone()}, want)
    assert saved.getvalue() == want.getvalue()


def test_pool_threads_run_torch_alone_and_leave_the_callers_count():
    before = torch.get_num_threads()
    pool = cpu_pool(2)
    try:
        assert pool.submit(torch.get_num_threads).result() == 1
    finally:
        pool.shutdown()
    seen: list[int] = []
    fresh = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    fresh.start()
    fresh.join()
    assert torch.get_num_threads() == before and seen == [before]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_shard_statistics_are_the_runs_folded_whole_however_batches_cut_them(dtype):
    # runs of rows_per_chunk rows: some whole in a batch, some spanning batches (then
    # accumulated piece by piece), the last one partial; every cut and thread count gives
    # the bits of chunk_moments over each whole run, merged in order
    d = 64
    per = RunningStats(d).rows_per_chunk
    values = torch.randn(2 * per + per // 2 + 3, d, generator=torch.Generator().manual_seed(6))
    values = values.to(dtype)
    rows = values if dtype == torch.bfloat16 else values.numpy()
    want = RunningStats(d)
    for lo in range(0, len(values), per):
        want.add(chunk_moments(rows[lo : lo + per]))
    site = make_plan().sites[0]
    cuts = [
        [len(values)],
        [1, per - 1, per, 7, 5000, per, per],
        [3000] * 20,
        [per + 1, per - 2, per + 1],
        [5, 0, 7, 0, per, 0, 9000, 0, per + per // 2, 0],  # empty batches mid-run too
    ]
    pool = cpu_pool(3)
    try:
        for sizes in cuts:
            for executor in (None, pool):
                stats, at = ShardStats([site], d, executor), 0
                for size in sizes:
                    if at < len(values) or not size:
                        stats.update({site: rows[at : at + size]})
                        stats.settle()
                        at += size
                got = stats.finish()[site]
                assert got.count == want.count == len(values), sizes
                assert got.mean.tobytes() == want.mean.tobytes(), sizes
                assert got.m2.tobytes() == want.m2.tobytes(), sizes
                assert got.norm_mean == want.norm_mean, sizes
    finally:
        pool.shutdown()


def test_a_batch_that_ends_a_run_and_holds_whole_ones_merges_them_in_order():
    """A batch whose head ends the run the batches before began, then holds whole runs:
    the ended run is merged before them (float sums of three or more runs depend on the
    order), whatever the executor and however many tasks the sites share."""
    d = 64
    per = RunningStats(d).rows_per_chunk
    sites = make_plan().sites[:2]
    values = torch.randn(3 * per + 10, d, generator=torch.Generator().manual_seed(7)).numpy()
    want = RunningStats(d)
    for lo in range(0, len(values), per):
        want.add(chunk_moments(values[lo : lo + per]))
    pool = cpu_pool(2)
    try:
        for executor, tasks in ((None, 1), (pool, 1), (pool, 2)):
            stats, at = ShardStats(sites, d, executor, tasks=tasks), 0
            for size in (per + 3, 2 * per + 2, 5):  # the second ends run 1 and holds run 2
                stats.update({s: values[at : at + size] for s in sites})
                stats.settle()
                at += size
            for site, got in stats.finish().items():
                assert got.count == want.count, site
                assert got.mean.tobytes() == want.mean.tobytes(), (site, tasks)
                assert got.m2.tobytes() == want.m2.tobytes(), (site, tasks)
                assert got.norm_mean == want.norm_mean, (site, tasks)
    finally:
        pool.shutdown()


def test_statistics_do_not_depend_on_threads_or_batch_sizes(tmp_path, monkeypatch):
    plan = make_plan()
    acts = _acts(plan)
    a = _write(tmp_path / "a", plan, acts, [5] * 100, monkeypatch, threads=1)
    b = _write(tmp_path / "b", plan, acts, [1, 7, 3, 11, 2] * 20, monkeypatch, threads=4)
    assert (a / "statistics.json").read_bytes() == (b / "statistics.json").read_bytes()
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    for f in a.iterdir():
        assert f.read_bytes() == (b / f.name).read_bytes(), f.name
    # and they are the statistics of the stored values (float64, up to summation order)
    reader = open_store(a)
    for site in plan.sites:
        want = RunningStats.of(acts[str(site)].numpy().astype(np.float64).reshape(-1, plan.d_model))
        got = reader.statistics(site)
        assert got.count == want.count
        np.testing.assert_allclose(got.mean, want.mean, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(got.var, want.var, rtol=1e-10)
        assert got.norm_mean == pytest.approx(want.norm_mean, rel=1e-12)


def test_saev_dialect_padding_is_sparse_and_reads_as_zeros(tmp_path):
    plan = make_plan(family="clip", modality="image")
    acts = _acts(plan)
    options = SaevOptions(dialect="saev")
    writer = SaevWriter.from_plan(plan, Location.parse(tmp_path), options)
    for batch in _batches(plan, acts, [4] * 100):
        writer.write(batch)
    store = writer.close()
    shard = store / "acts000000.bin"
    md = writer.metadata
    written = plan.n_examples * md.example_nbytes
    assert shard.stat().st_size == md.shard_nbytes(0) > written
    allocated = shard.stat().st_blocks * 512
    assert allocated < written + (1 << 20)  # the zero tail takes no disk
    data = np.fromfile(shard, dtype="<f4")
    assert not data[written // 4 :].any()
    assert open_store(store).verify().ok


def test_the_journal_gets_one_line_per_shard(tmp_path):
    plan = make_plan()
    acts = _acts(plan)
    writer = SaevWriter.from_plan(
        plan, Location.parse(tmp_path), SaevOptions(patches_per_shard=5 * 12)
    )
    sizes = []
    for batch in _batches(plan, acts, [5] * 4):
        writer.write(batch)
        writer.sync()  # let the commit stage record what is finished
        sizes.append((writer.partial / PROGRESS).stat().st_size)
    head, shards = read_journal(writer.partial)
    assert head["store_id"] == writer.store_id
    assert (
        [s["index"] for s in shards] == [0, 1, 2, 3] == list(range(recorded_shards(writer.partial)))
    )
    growth = np.diff(sizes)
    assert (growth > 0).all() and growth.max() - growth.min() < 64  # one line each, same size
    writer.abort()


RUN = textwrap.dedent(
    """
    import sys
    import numpy as np, torch
    from actstore.batch import Batch
    from actstore.formats.saev import SaevOptions, SaevWriter
    from actstore.storage.location import Location
    from actstore.testing import make_plan
    plan = make_plan()
    gen = torch.Generator().manual_seed(0)
    shape = (plan.n_examples, plan.tokens_per_example, plan.d_model)
    acts = {str(s): torch.randn(shape, generator=gen) for s in plan.sites}
    w = SaevWriter.from_plan(plan, Location.parse(sys.argv[1]), SaevOptions(patches_per_shard=40))
    for start in range(w.resume_from, plan.n_examples, 3):
        n = min(3, plan.n_examples - start)
        w.write(Batch(acts={k: v[start:start + n] for k, v in acts.items()},
                      example_ids=np.arange(start, start + n),
                      token_ids=np.zeros((n, plan.tokens_per_example), np.int64)))
    print(w.close())
    """
)


def _run(root, crash_at=None):
    env = {**os.environ, "PYTHONPATH": str(SRC), "SOURCE_DATE_EPOCH": "0"}
    env.pop("ACTSTORE_CRASH_AT", None)
    if crash_at:
        env["ACTSTORE_CRASH_AT"] = crash_at
    return subprocess.run(
        [sys.executable, "-c", RUN, str(root)], env=env, capture_output=True, text=True, check=False
    )


def _assert_resumes_to(ref: subprocess.CompletedProcess, out: Path) -> None:
    """A rerun into ``out`` publishes a store with the files of ``ref``'s, byte for byte."""
    rerun = _run(out)
    assert rerun.returncode == 0, rerun.stderr
    a, b = Path(ref.stdout.strip()), Path(rerun.stdout.strip())
    assert {p.name: p.read_bytes() for p in a.iterdir()} == {
        p.name: p.read_bytes() for p in b.iterdir()
    }


def test_a_torn_journal_line_is_a_shard_not_recorded(tmp_path):
    ref = _run(tmp_path / "ref")
    assert ref.returncode == 0, ref.stderr
    crashed = _run(tmp_path / "out", "saev.shard_recorded:3")
    assert crashed.returncode == 137, crashed.stderr
    partial = next((tmp_path / "out").glob(".*.partial"))
    assert recorded_shards(partial) == 3
    with open(partial / PROGRESS, "ab") as f:  # a crash in the middle of the 4th append
        f.write(b'{"index":3,"n_examples":5,"fil')
    assert recorded_shards(partial) == 3
    _assert_resumes_to(ref, tmp_path / "out")


def test_a_lost_journal_line_is_where_the_recorded_shards_end(tmp_path):
    # journal lines are not fsynced: a power loss can drop one (a file system may leave
    # zeros in its place); the shards from there on are written again, the same bytes
    ref = _run(tmp_path / "ref")
    crashed = _run(tmp_path / "out", "saev.shard_recorded:3")
    assert ref.returncode == 0 and crashed.returncode == 137, crashed.stderr
    partial = next((tmp_path / "out").glob(".*.partial"))
    lines = (partial / PROGRESS).read_bytes().split(b"\n")
    lines[2] = bytes(len(lines[2]))  # the second shard's line: zeros
    (partial / PROGRESS).write_bytes(b"\n".join(lines))
    assert recorded_shards(partial) == 1
    _assert_resumes_to(ref, tmp_path / "out")


def test_a_failed_commit_stops_the_capture_and_publishes_nothing(tmp_path):
    plan = make_plan()
    acts = _acts(plan)
    writer = SaevWriter.from_plan(plan, Location.parse(tmp_path), SaevOptions(patches_per_shard=40))
    batches = list(_batches(plan, acts, [5] * 5))
    writer.write(batches[0])
    writer.sync()
    journal = writer.partial / PROGRESS
    journal.unlink()
    journal.mkdir()  # the next journal append fails (even for root)
    with pytest.raises(IsADirectoryError):  # at the next shard's start, or at close
        writer.write(batches[1])
        writer.close()
    writer.abort()
    assert not any(p.name != writer.partial.name for p in tmp_path.iterdir() if p.is_dir())


#: what a format module leaves to the write pipeline (formats/pipeline.py, formats/wholefiles.py)
#: and storage/, by the names that do it: making files durable, writing them positionally or
#: around the page cache, digesting a store's files for integrity (block or keyed digests:
#: the formula lives in storage/manifest.py, which a format calls, never rewrites) and
#: computing statistics. A digest a format's spec defines as data (pkl.gz's sha256, zarr's
#: per-sample content digest, a ``datasets`` fingerprint) is encoding, not integrity.
LEFT_TO_THE_PIPELINE = {
    "durable": {"fsync", "fdatasync", "sync_file_range", "syncfs", "sync", "sync_files"}
    | {"sync_paths", "fsync_dir"},
    "writes": {"writev", "pwritev", "pwrite", "pwrite_all", "start_writeback", "DirectFile"}
    | {"Appender"},
    "integrity hashing": {"BlockHasher", "KeyedHasher", "block_keys", "digest_blocks"}
    | {"block_digests", "digest_ranges", "hash_file_blocks", "hash_ranges", "xxh3_64"}
    | {"xxh3_64_intdigest", "xxh3_64_digest"},
    "statistics": {"moments", "chunk_moments", "RunningStats.of", "RunMoments"},
}


def _names(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            base = node.value.id if isinstance(node.value, ast.Name) else ""
            yield node, node.attr
            yield node, f"{base}.{node.attr}"
        elif isinstance(node, ast.Name):
            yield node, node.id
        elif isinstance(node, ast.alias):
            yield node, node.name.rsplit(".", 1)[-1]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node, node.value


def test_no_format_module_makes_files_durable_hashes_them_or_computes_statistics():
    formats = SRC / "actstore" / "formats"
    found = []
    for path in sorted(formats.rglob("*.py")):
        if path.parent == formats:
            continue  # the contracts and the pipeline themselves
        for node, name in _names(ast.parse(path.read_text())):
            for job, names in LEFT_TO_THE_PIPELINE.items():
                if name in names:
                    found.append(f"{path.relative_to(SRC)}:{node.lineno} {name} ({job})")
    assert found == []


@pytest.mark.parametrize("value", ["abc", "0", "-2", "1.5"])
def test_a_bad_thread_count_is_one_line_before_anything_is_written(tmp_path, monkeypatch, value):
    monkeypatch.setenv("ACTSTORE_WRITER_THREADS", value)
    with pytest.raises(ConfigError, match="ACTSTORE_WRITER_THREADS must be a whole number"):
        SaevWriter.from_plan(make_plan(), Location.parse(tmp_path), SaevOptions())
    assert list(tmp_path.iterdir()) == []
