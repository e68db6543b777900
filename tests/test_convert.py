"""Conversion between every pair of registered formats, streamed and verified.

The matrix is parametrized over the format registry, so a newly registered format joins
it without changes here (give it small-shard options in SMALL_SHARDS to exercise several
shards).
"""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest
from typer.testing import CliRunner

from actstore.cli import app
from actstore.convert import (
    as_stored,
    compare_stores,
    convert,
    converted_plan,
    example_batches,
    source_plan,
)
from actstore.errors import ConfigError, CorruptStoreError
from actstore.formats import open_store
from actstore.formats.registry import FORMAT_NAMES, available_formats, get_format, parse_options
from actstore.sites import Site
from actstore.testing import make_acts, make_batches, make_plan

FORMATS = [spec.name for spec in available_formats()]
#: Options that cut the 23-example test store into several shards/files.
SMALL_SHARDS = {
    "saev": ["patches_per_shard=60"],
    "pickle": ["samples_per_shard=5"],
    "activault": ["rows_per_file=1"],
    "saelens": ["examples_per_shard=10", "block_kb=1"],
}


def options(fmt: str):
    spec = get_format(fmt)
    known = {f for f in spec.options.__dataclass_fields__}
    return parse_options(spec, [o for o in SMALL_SHARDS.get(fmt, []) if o.split("=")[0] in known])


def write_store(fmt: str, out, plan, acts) -> str:
    writer = get_format(fmt).open_writer(plan, str(out), options(fmt))
    for batch in make_batches(plan, acts):
        writer.write(batch)
    return str(writer.close())


def rows_of(reader, site) -> np.ndarray:
    return np.concatenate([reader.read_block(b) for b in reader.blocks(site)])


def test_every_registered_format_takes_part():
    assert {"saev", "pickle"} <= set(FORMATS)
    missing = [name for name in FORMAT_NAMES if name not in FORMATS]
    assert not missing or logging.getLogger(__name__).warning("not installed: %s", missing) is None


@pytest.mark.parametrize("target", FORMATS)
@pytest.mark.parametrize("source", FORMATS)
def test_round_trip_between_formats(source, target, tmp_path):
    plan = make_plan()
    acts = make_acts(plan)
    src = write_store(source, tmp_path / "src", plan, acts)
    src_dtype, dst_dtype = get_format(source).stored_dtype, get_format(target).stored_dtype

    there = convert(
        src, tmp_path / "there", to=target, options=options(target), batch_size=7, progress=False
    )
    assert there.verified and (there.source_format, there.target_format) == (source, target)
    assert there.n_examples == plan.n_examples
    assert there.rows == {str(s): plan.n_examples * plan.tokens_per_example for s in plan.sites}
    for site in plan.sites:
        original = as_stored(acts[str(site)].reshape(-1, plan.d_model), src_dtype)
        stored = as_stored(original, dst_dtype)
        np.testing.assert_array_equal(rows_of(open_store(there.location), site), stored)
        exact = np.array_equal(stored, original)
        want = float(np.abs(stored.astype(np.float64) - original).max())
        assert there.max_abs_error[str(site)] == want and (want == 0.0) == exact

    back = convert(
        there.location, tmp_path / "back", to=source, options=options(source), progress=False
    )
    assert back.verified and back.rows == there.rows
    for site in plan.sites:
        once = as_stored(acts[str(site)].reshape(-1, plan.d_model), src_dtype)
        np.testing.assert_array_equal(
            rows_of(open_store(back.location), site),
            as_stored(as_stored(once, dst_dtype), src_dtype),
        )


def test_lossless_round_trip_keeps_tokens_and_metadata(tmp_path):
    plan = make_plan()
    acts = make_acts(plan)
    src = write_store("saev", tmp_path / "src", plan, acts)
    pkl = convert(src, tmp_path / "pkl", to="pickle", progress=False)
    assert pkl.lossless
    back = convert(
        pkl.location, tmp_path / "back", to="saev", options=options("saev"), progress=False
    )
    a, b = open_store(src), open_store(back.location)
    # a conversion is never named as a capture (issue 30): the metadata differs in `data`
    # only, which says which store the values came from and at what precision
    assert back.location.name != a.path.name
    ma, mb = (json.loads((p / "metadata.json").read_text()) for p in (a.path, back.location))
    assert {k: v for k, v in ma.items() if k != "data"} == {
        k: v for k, v in mb.items() if k != "data"
    }
    origin = b.capture_plan().data["converted_from"]
    assert (origin["format"], origin["dtype"]) == ("pickle", "float32")
    assert origin["store_id"] == open_store(pkl.location).checks.manifest.store_id
    assert b.capture_plan().data["converted_from"] != a.capture_plan().data.get("converted_from")
    np.testing.assert_array_equal(b.tokens, a.tokens)
    for name in ("shards.json", "tokens.bin", "acts000000.bin", "acts000004.bin"):
        assert (back.location / name).read_bytes() == (a.path / name).read_bytes(), name
    for layer in a.layers:  # statistics agree to float64 rounding (folded in other chunks)
        np.testing.assert_allclose(b.statistics(layer).mean, a.statistics(layer).mean, rtol=1e-12)
        np.testing.assert_allclose(b.statistics(layer).var, a.statistics(layer).var, rtol=1e-10)


def test_source_plan_rebuilds_the_capture(tmp_path):
    plan = make_plan()
    src = open_store(write_store("saev", tmp_path / "src", plan, make_acts(plan)))
    got = source_plan(src)
    assert (
        got.ckpt,
        got.family,
        got.sites,
        got.d_model,
        got.tokens_per_example,
        got.n_examples,
        got.data,
        got.has_tokens,
    ) == (
        plan.ckpt,
        plan.family,
        plan.sites,
        plan.d_model,
        plan.tokens_per_example,
        plan.n_examples,
        plan.data,
        True,
    )


def test_conversion_streams_in_bounded_batches(tmp_path):
    plan = make_plan()
    acts = make_acts(plan)
    reader = open_store(write_store("saev", tmp_path / "src", plan, acts))
    reads = []
    read_block = reader.read_block
    reader.read_block = lambda block, out=None: reads.append(block) or read_block(block, out)
    batches = example_batches(reader, plan, batch_size=4)
    first = next(batches)
    assert first.n_examples == 4 and len(reads) == 4 * len(plan.sites)  # one example per block
    rest = list(batches)
    assert [b.n_examples for b in rest] == [4, 4, 4, 4, 3]
    np.testing.assert_array_equal(rest[-1].acts["resid.3"].numpy(), acts["resid.3"][20:])
    np.testing.assert_array_equal(rest[-1].token_ids, reader.tokens[20:])
    resumed = list(example_batches(reader, plan, batch_size=4, start=10))
    assert resumed[0].example_ids.tolist() == [10, 11, 12, 13]


def test_interrupted_conversion_resumes(tmp_path):
    plan = make_plan()
    acts = make_acts(plan)
    src = write_store("saev", tmp_path / "src", plan, acts)
    plan = converted_plan(open_store(src), "saev")  # what convert writes: the source named
    writer = get_format("pickle").open_writer(plan, str(tmp_path / "pkl"), options("pickle"))
    for batch in example_batches(open_store(src), plan, 4):
        if batch.example_ids[0] >= 12:
            break
        writer.write(batch)
    writer.abort()  # 2 finished shards (10 examples) are durable
    result = convert(src, tmp_path / "pkl", to="pickle", options=options("pickle"), progress=False)
    assert result.verified and result.lossless and not result.already_complete
    again = convert(src, tmp_path / "pkl", to="pickle", options=options("pickle"), progress=False)
    assert again.already_complete and again.verified


def test_verification_catches_a_different_store(tmp_path):
    plan = make_plan()
    acts = make_acts(plan, seed=1)
    a = open_store(write_store("pickle", tmp_path / "a", plan, acts))
    changed = {k: v.copy() for k, v in acts.items()}
    changed["resid.3"][10, 2, 5] += 1e-3
    b = open_store(write_store("pickle", tmp_path / "b", plan, changed))
    with pytest.raises(CorruptStoreError, match="site resid.3: row 62 differs"):
        compare_stores(a, b)
    head = {k: v[:20] for k, v in acts.items()}
    short = open_store(write_store("pickle", tmp_path / "c", make_plan(n_examples=20), head))
    with pytest.raises(CorruptStoreError, match="different numbers of rows"):
        compare_stores(a, short, source_plan(a))


def test_unsupported_target_is_a_clear_error(tmp_path):
    plan = make_plan(sites=(Site("mlp_out", 1),))
    src = write_store("zarr", tmp_path / "z", plan, make_acts(plan)) if "zarr" in FORMATS else None
    if src is None:
        pytest.skip("needs the zarr format for an mlp_out store")
    with pytest.raises(ConfigError, match="residual stream"):
        convert(src, tmp_path / "s", to="saev", progress=False)


runner = CliRunner()


def test_convert_command(tmp_path):
    plan = make_plan()
    src = write_store("saev", tmp_path / "src", plan, make_acts(plan))
    result = runner.invoke(
        app,
        [
            "convert",
            src,
            str(tmp_path / "pkl"),
            "--to",
            "pickle",
            "--opt",
            "samples_per_shard=8",
            "--no-progress",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "Converted 23 examples from saev to pickle" in result.output
    assert "site resid.1: 138 rows verified, exact" in result.output
    assert len(open_store(tmp_path / "pkl").shards) == 3
    if "zarr" in FORMATS:
        half = runner.invoke(
            app, ["convert", src, str(tmp_path / "z"), "--to", "zarr", "--no-progress"]
        )
        assert half.exit_code == 0, half.output
        assert "max abs error" in half.output and "float16 rounding" in half.output
    help_text = runner.invoke(app, ["convert", "--help"]).output
    assert "--to" in help_text and "pickle" in help_text and "Examples" in help_text


def test_convert_to_and_from_object_storage(s3, tmp_path):
    plan = make_plan()
    acts = make_acts(plan)
    src = write_store("pickle", tmp_path / "src", plan, acts)
    up = convert(src, s3.url("run"), to="activault", options=options("activault"), progress=False)
    assert up.location == s3.url("run") and up.verified
    assert max(up.max_abs_error.values()) > 0  # bfloat16
    down = convert(up.location, tmp_path / "back", to="pickle", progress=False)
    assert down.lossless and down.rows == up.rows
    np.testing.assert_array_equal(
        rows_of(open_store(down.location), plan.sites[0]),
        as_stored(acts["resid.1"].reshape(-1, plan.d_model), "bfloat16"),
    )


def test_report_names_the_target_dtype_and_what_it_drops(tmp_path):
    plan = make_plan(has_tokens=True)
    src = write_store("saev", tmp_path / "src", plan, make_acts(plan))
    result = convert(src, tmp_path / "zarr", to="zarr", progress=False)
    # zarr keeps float16 values, and the token ids (prompt tokens of a packed capture)
    assert result.stored_dtype == "float16" and not result.lossless
    assert not result.dropped
    zarr = open_store(result.location)
    np.testing.assert_array_equal(zarr.tokens, open_store(src).tokens)
    lossless = convert(src, tmp_path / "pkl", to="pickle", progress=False)
    assert lossless.stored_dtype == "float32" and lossless.lossless and not lossless.dropped


@pytest.mark.parametrize("source", ["zarr", "activault"])
def test_conversion_keeps_examples_and_cls(source, tmp_path):
    """zarr and Activault stores carry their capture plan into saev: examples, tokens per
    example and the CLS flag come back as captured (not rows/files guessed)."""
    plan = make_plan(has_cls=True, has_tokens=False, family="dinov2", modality="image")
    src = write_store(source, tmp_path / "src", plan, make_acts(plan))
    result = convert(src, tmp_path / "saev", to="saev", progress=False)
    got = open_store(result.location).capture_plan()
    assert (got.n_examples, got.tokens_per_example, got.has_cls, got.family) == (
        plan.n_examples,
        plan.tokens_per_example,
        True,
        "dinov2",
    )


def test_a_conversion_to_activault_keeps_every_row_or_publishes_nothing(tmp_path):
    """Issue 38 (4): ``convert <saev> out --to activault`` published the run, then failed
    with "the stores hold different numbers of rows": Activault files are all one size and
    the writer dropped the tail under one file. A conversion now picks a file size that
    holds every row, and a size given that cannot is refused before anything is written."""

    from forked import pythonpath, run_actstore

    from actstore.formats.activault import ActivaultOptions
    from actstore.formats.activault.run import file_shape

    plan = make_plan(n_examples=100, tokens_per_example=16)
    src = write_store("saev", tmp_path / "src", plan, make_acts(plan))
    rows, seq = file_shape(plan, ActivaultOptions())
    assert (100 * 16) % (rows * seq)  # the default file size leaves a tail
    done = convert(src, tmp_path / "av", to="activault", progress=False)
    assert done.verified and done.rows == {str(s): 100 * 16 for s in plan.sites}
    assert open_store(done.location).n_rows(plan.sites[0]) == 100 * 16
    env = {**os.environ, "PYTHONPATH": pythonpath(), "TQDM_DISABLE": "1"}
    target = tmp_path / "av7"
    args = ["convert", src, str(target), "--to", "activault", "--opt", "rows_per_file=7"]
    proc = run_actstore(*args, "--no-progress", env=env, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert "rows_per_file=5" in line and "keeps every row" in line
    assert not target.exists()


@pytest.mark.parametrize("fmt", ["saev", "activault"])
def test_withdraw_removes_a_store_it_published(tmp_path, fmt):
    """What a conversion whose verification fails calls on the store it just published:
    nothing of it is left (its root manifest goes first)."""
    from actstore.convert import withdraw

    plan = make_plan()
    location = write_store(fmt, tmp_path / "out", plan, make_acts(plan))
    assert open_store(location).n_examples == plan.n_examples
    withdraw(location)
    assert not os.path.exists(location)
