"""The Writer/Reader conformance suite every storage format runs.

A format opts in with a small adapter and a subclass:

    class SaevCase(FormatCase): ...             # how to write, open and damage a store
    class TestSaevConformance(ConformanceSuite):
        case = SaevCase()

The suite checks: exact round trip through blocks (or exact after the format's dtype
cast), blocks cover every row once and align across sites, an unpublished store is not
readable, damaged data is rejected, statistics match numpy, readers pickle (DataLoader
workers), verify() passes and describe() summarises; and the optional capabilities of
``ReaderBase``/``WriterBase``: a scatter read equals ``read_block``, ``cls_rows`` marks
token 0 of each example or nothing, ``read_block`` is thread-safe under 8 concurrent
readers, ``capture_plan()`` gives back the plan, and a writer aborted after k batches and
reopened resumes to the same store as an uninterrupted one.
"""

from __future__ import annotations

import pickle
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from actstore.batch import Batch, CapturePlan
from actstore.errors import ActstoreError
from actstore.sites import Site

N_EXAMPLES, N_TOKENS, D_MODEL = 23, 6, 8
SITES = (Site("resid", 1), Site("resid", 3))


def saev_writer(md, root, *, has_tokens=False, has_labels=False, classes=None, **kw):
    """The :class:`SaevWriter` of a capture whose plan gives saev metadata ``md``."""
    from actstore.formats.saev import SaevWriter

    plan, options = saev_plan(md, has_tokens=has_tokens, has_labels=has_labels, classes=classes)
    return SaevWriter(plan, Path(root), options, **kw)


def saev_plan(md, *, has_tokens=False, has_labels=False, classes=None):
    """``(plan, options)`` of a capture whose saev metadata is ``md``."""
    from actstore.formats.saev import SaevOptions
    from actstore.formats.saev.reader import _decode_data

    plan = CapturePlan(
        ckpt=md.ckpt,
        family=md.family,
        modality="image" if md.family in ("clip", "siglip", "dinov2") else "text",
        sites=tuple(Site("resid", layer) for layer in md.layers),
        n_model_layers=max(md.layers) + 1,
        d_model=md.d_model,
        tokens_per_example=md.tokens_per_ex,
        has_cls=md.cls_token,
        n_examples=md.n_examples,
        dataset_root=md.dataset,
        data=_decode_data(md.data),
        classes=classes,
        has_labels=has_labels,
        has_tokens=has_tokens,
        batch_size=4,
    )
    return plan, SaevOptions(dialect=md.dialect, patches_per_shard=md.patches_per_shard)


def resign(store: Path, *, summary: dict | None = None) -> None:
    """Rewrite the root manifest of local store ``store`` over its files as they are now: what
    an attacker with write access (or a careless tool) could do. Keyed digests and the
    manifest's own digest then match again; only an HMAC key tells it apart."""
    from actstore.storage.manifest import (
        MANIFEST,
        OWN_FILES,
        ManifestBuilder,
        RootManifest,
        skipped,
    )

    store = Path(store)
    old = RootManifest.from_bytes((store / MANIFEST).read_bytes(), MANIFEST)
    builder = ManifestBuilder(format=old.format, store_id=old.store_id, record=old.record)
    for path in sorted(store.rglob("*")):
        name = path.relative_to(store).as_posix()
        if not path.is_file() or name in OWN_FILES or skipped(name, old.skip):
            continue
        entry = old.files.get(name)
        if entry is not None and entry.ranges is not None:
            builder.add_file(store, name, ranges=[r for r in entry.ranges if r[1]])
        else:
            builder.add_file(store, name, unit=entry.unit if entry else 0)
    builder.skip = dict(old.skip)
    for name in OWN_FILES:
        if (store / name).exists():
            (store / name).chmod(0o644)
    builder.write(store, summary=summary if summary is not None else old.summary)


def make_plan(**overrides: Any) -> CapturePlan:
    values = {
        "ckpt": "tiny-test-model",
        "family": "gpt2",
        "modality": "text",
        "sites": SITES,
        "n_model_layers": 4,
        "d_model": D_MODEL,
        "tokens_per_example": N_TOKENS,
        "has_cls": False,
        "n_examples": N_EXAMPLES,
        "dataset_root": "/nowhere",
        "data": {"kind": "test"},
        "classes": None,
        "has_labels": False,
        "has_tokens": True,
        "batch_size": 4,
    }
    values.update(overrides)
    return CapturePlan(**values)


def make_acts(plan: CapturePlan, seed: int = 0) -> dict[str, np.ndarray]:
    """Activations per site ``[N, T, D]`` float32 with varied magnitudes."""
    rng = np.random.default_rng(seed)
    shape = (plan.n_examples, plan.tokens_per_example, plan.d_model)
    return {
        str(s): (rng.standard_normal(shape) * (1 + i)).astype(np.float32)
        for i, s in enumerate(plan.sites)
    }


def make_batches(plan: CapturePlan, acts: dict[str, np.ndarray]) -> list[Batch]:
    out = []
    n, t = plan.n_examples, plan.tokens_per_example
    tokens = (np.arange(n * t, dtype=np.int64).reshape(n, t) % 250) + 4
    for lo in range(0, n, plan.batch_size):
        hi = min(lo + plan.batch_size, n)
        out.append(
            Batch(
                acts={k: torch.from_numpy(v[lo:hi].copy()) for k, v in acts.items()},
                example_ids=np.arange(lo, hi, dtype=np.int64),
                token_ids=tokens[lo:hi].astype(np.int32),
                texts=[f"example {i}" for i in range(lo, hi)],
            )
        )
    return out


class FormatCase:
    """Adapter between the suite and one format. Override the methods marked so."""

    #: numpy dtype the format stores activations in (rows are compared after this cast).
    stored_dtype: str = "float32"

    def open_writer(self, root: Path, plan: CapturePlan, batches: list[Batch]):
        """``(writer, batches)``: a writer for the store under ``root`` (reopening it if
        one was begun there) and the batches to give it. (override)"""
        raise NotImplementedError

    def write(self, root: Path, plan: CapturePlan, batches: list[Batch]) -> str:
        """Write and publish a store; return its location."""
        writer, batches = self.open_writer(root, plan, batches)
        for batch in batches:
            writer.write(batch)
        return str(writer.close())

    def write_unpublished(self, root: Path, plan: CapturePlan, batches: list[Batch]) -> str:
        """Write some batches, abort; return where the store would have been. (override)"""
        raise NotImplementedError

    def damage(self, location: str) -> None:
        """Truncate or corrupt one data file of a published store. (override)"""
        raise NotImplementedError

    def open(self, location: str):
        from actstore.formats import open_store

        return open_store(location)

    def site_name(self, site: Site) -> Any:
        """The reader's name for ``site`` (saev: the layer int)."""
        return str(site)

    def expected_rows(
        self, plan: CapturePlan, acts: dict[str, np.ndarray], site: Site
    ) -> np.ndarray:
        """Rows of ``site`` in storage order: example-major, then token."""
        return acts[str(site)].reshape(-1, plan.d_model)


class ConformanceSuite:
    """Generic tests; subclasses set ``case``."""

    case: FormatCase

    @pytest.fixture
    def store(self, tmp_path):
        plan = make_plan()
        acts = make_acts(plan)
        location = self.case.write(tmp_path / "store", plan, make_batches(plan, acts))
        return plan, acts, location

    def _expected(self, plan, acts, site):
        rows = self.case.expected_rows(plan, acts, site)
        return rows.astype(self.case.stored_dtype)

    def test_round_trip_through_blocks(self, store):
        plan, acts, location = store
        reader = self.case.open(location)
        assert reader.d_model == plan.d_model
        assert np.dtype(reader.dtype) == np.dtype(self.case.stored_dtype)
        for site in plan.sites:
            blocks = reader.blocks(self.case.site_name(site))
            rows = np.concatenate([reader.read_block(b) for b in blocks])
            np.testing.assert_array_equal(rows, self._expected(plan, acts, site))

    def test_read_block_into_buffer(self, store):
        plan, acts, location = store
        reader = self.case.open(location)
        block = reader.blocks(self.case.site_name(plan.sites[0]))[-1]
        out = np.full((block.n_rows, plan.d_model), np.nan, dtype=reader.dtype)
        got = reader.read_block(block, out=out)
        assert got is out or np.shares_memory(got, out)
        np.testing.assert_array_equal(
            out, self._expected(plan, acts, plan.sites[0])[-block.n_rows :]
        )

    def test_blocks_cover_every_row_once_and_align_across_sites(self, store):
        plan, _, location = store
        reader = self.case.open(location)
        per_site = [reader.blocks(self.case.site_name(s)) for s in plan.sites]
        for blocks in per_site:
            assert sum(b.n_rows for b in blocks) == plan.n_examples * plan.tokens_per_example
            assert len({(b.site, b.loc) for b in blocks}) == len(blocks)
        assert [b.n_rows for b in per_site[0]] == [b.n_rows for b in per_site[1]]

    def test_unpublished_store_is_not_readable(self, tmp_path):
        plan = make_plan()
        batches = make_batches(plan, make_acts(plan))
        location = self.case.write_unpublished(tmp_path / "store", plan, batches[:3])
        with pytest.raises(ActstoreError):
            self.case.open(location)

    def test_damaged_store_is_rejected(self, store):
        plan, _, location = store
        self.case.damage(location)
        with pytest.raises(ActstoreError):
            reader = self.case.open(location)
            report = reader.verify()
            for site in plan.sites:
                for block in reader.blocks(self.case.site_name(site)):
                    reader.read_block(block)
            if not report.ok:
                raise ActstoreError("; ".join(report.faults))

    def test_statistics_match_numpy(self, store):
        plan, acts, location = store
        reader = self.case.open(location)
        for site in plan.sites:
            stats = reader.statistics(self.case.site_name(site))
            assert stats is not None
            rows = acts[str(site)].reshape(-1, plan.d_model).astype(np.float64)
            assert stats.count == rows.shape[0]
            np.testing.assert_allclose(stats.mean, rows.mean(0), rtol=1e-9, atol=1e-12)
            np.testing.assert_allclose(stats.var, rows.var(0), rtol=1e-9)
            np.testing.assert_allclose(
                stats.norm_mean, np.linalg.norm(rows, axis=1).mean(), rtol=1e-9
            )

    def test_reader_pickles_for_dataloader_workers(self, store):
        plan, _acts, location = store
        reader = self.case.open(location)
        site = self.case.site_name(plan.sites[1])
        reader.read_block(reader.blocks(site)[0])  # open handles first
        clone = pickle.loads(pickle.dumps(reader))
        block = clone.blocks(site)[1]
        np.testing.assert_array_equal(clone.read_block(block), reader.read_block(block))

    def test_verify_and_describe(self, store):
        _, _, location = store
        reader = self.case.open(location)
        report = reader.verify()
        assert report.ok, report.faults
        summary = reader.describe()
        assert {"format", "bytes"} <= set(summary)

    # ------------------------------------------------------------------ optional capabilities

    def test_scatter_read_equals_read_block(self, store):
        plan, _, location = store
        reader = self.case.open(location)
        rng = np.random.default_rng(1)
        for site in plan.sites:
            for block in reader.blocks(self.case.site_name(site)):
                want = reader.read_block(block)
                rows = rng.permutation(2 * block.n_rows)[: block.n_rows]
                rows[::3] = -1  # skipped rows
                out = np.zeros((2 * block.n_rows, plan.d_model), dtype=reader.dtype)
                reader.read_block_scatter(block, out, rows)
                keep = rows >= 0
                np.testing.assert_array_equal(out[rows[keep]], want[keep])
                untouched = np.setdiff1d(np.arange(len(out)), rows[keep])
                assert not out[untouched].any()

    def test_cls_rows_mark_token_zero_or_nothing(self, store):
        plan, _, location = store
        reader = self.case.open(location)
        for block in reader.blocks(self.case.site_name(plan.sites[0])):
            rows = reader.cls_rows(block)
            # this plan keeps no CLS token: a format marks none, or says it keeps none
            assert rows is None or len(rows) == 0

    def test_read_block_is_thread_safe(self, store):
        plan, _, location = store
        reader = self.case.open(location)
        blocks = [b for s in plan.sites for b in reader.blocks(self.case.site_name(s))]
        want = [reader.read_block(b).copy() for b in blocks]

        def read_all(seed: int) -> bool:
            order = list(range(len(blocks)))
            random.Random(seed).shuffle(order)
            return all(
                np.array_equal(reader.read_block(blocks[i]), want[i], equal_nan=True)
                for _ in range(3)
                for i in order
            )

        with ThreadPoolExecutor(8) as pool:
            assert all(pool.map(read_all, range(8)))

    def test_capture_plan_gives_back_the_plan(self, store):
        plan, _, location = store
        got = self.case.open(location).capture_plan()
        assert got.sites == plan.sites
        assert (got.n_examples, got.tokens_per_example, got.d_model) == (
            plan.n_examples,
            plan.tokens_per_example,
            plan.d_model,
        )

    def test_resumed_writer_equals_uninterrupted(self, tmp_path, store):
        plan, acts, location = store
        batches = make_batches(plan, acts)
        root = tmp_path / "resumed"
        writer, given = self.case.open_writer(root, plan, batches)
        for batch in given[:3]:
            writer.write(batch)
        writer.abort()
        writer, given = self.case.open_writer(root, plan, batches)
        start = writer.resume_from
        assert 0 <= start <= 3 * plan.batch_size
        # as capture does: whole batches from the one holding the first missing example
        for batch in given:
            if batch.example_ids[-1] >= start:
                writer.write(batch)
        resumed = self.case.open(str(writer.close()))
        original = self.case.open(location)
        for site in plan.sites:
            name = self.case.site_name(site)
            a = np.concatenate([original.read_block(b) for b in original.blocks(name)])
            b = np.concatenate([resumed.read_block(b) for b in resumed.blocks(name)])
            np.testing.assert_array_equal(a, b)
            sa, sb = original.statistics(name), resumed.statistics(name)
            assert sa.count == sb.count
            np.testing.assert_array_equal(sa.mean, sb.mean)
            np.testing.assert_array_equal(sa.var, sb.var)
