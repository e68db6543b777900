"""The reading rules of :class:`~actstore.testing.ConformanceSuite` (a mixin it inherits):
exact round trips through blocks, site spellings, reads by example, site and token,
tokens, statistics against numpy, pickling, thread safety, scatter reads, block extents, the
loader, CLS rows, the capture plan, detection and ``describe()``."""

from __future__ import annotations

import pickle
import random
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import torch

from ..errors import ActstoreError
from ..sites import Site
from .case import FormatCase

#: The keys of ``describe()`` that ``actstore inspect``, ``ls`` and the S3 listing read.
DESCRIBE_KEYS = {"path", "format", "model", "sites", "shape", "dtype", "d_model", "bytes", "files"}


class ReadingRules:
    """The rules about reading a store, as pytest tests (collected through
    :class:`~actstore.testing.ConformanceSuite`, whose fixture ``store`` they use)."""

    case: FormatCase

    if TYPE_CHECKING:

        def _expected(self, plan: Any, acts: dict[str, np.ndarray], site: Site) -> np.ndarray: ...

        def _rows(self, reader: Any, site: Any) -> np.ndarray: ...

    def test_round_trip_through_blocks(self, store):
        plan, acts, location = store
        reader = self.case.open(location)
        assert reader.d_model == plan.d_model
        assert np.dtype(reader.dtype) == np.dtype(self.case.stored_dtype)
        assert reader.sites == plan.sites, "reader.sites lists the stored Sites in plan order"
        for site in plan.sites:
            np.testing.assert_array_equal(
                self._rows(reader, site), self._expected(plan, acts, site)
            )

    def test_read_block_into_buffer(self, store):
        plan, acts, location = store
        reader = self.case.open(location)
        block = reader.blocks(plan.sites[0])[-1]
        out = np.full((block.n_rows, plan.d_model), np.nan, dtype=reader.dtype)
        got = reader.read_block(block, out=out)
        assert got is out or np.shares_memory(got, out)
        np.testing.assert_array_equal(
            out, self._expected(plan, acts, plan.sites[0])[-block.n_rows :]
        )

    def test_blocks_cover_every_row_once_and_align_across_sites(self, store):
        plan, _, location = store
        reader = self.case.open(location)
        per_site = [reader.blocks(s) for s in plan.sites]
        for blocks in per_site:
            assert sum(b.n_rows for b in blocks) == plan.n_examples * plan.tokens_per_example
            assert len({(b.site, b.loc) for b in blocks}) == len(blocks)
        assert [b.n_rows for b in per_site[0]] == [b.n_rows for b in per_site[1]]

    def test_every_site_spelling_reads_the_same_blocks(self, store):
        """``blocks()`` takes any spelling of a stored site: the Site, its name, its layer
        (residual stream), a layer counted from the model's end, its TransformerLens hook."""
        plan, _, location = store
        reader = self.case.open(location)
        for site in plan.sites:
            want = reader.blocks(site)
            spellings: list[Any] = [str(site), Site.parse(str(site))]
            if site.kind == "resid":
                spellings += [site.layer, site.layer - plan.n_model_layers]
            hook = site.tl_name_in(plan.family)
            if hook is not None:
                spellings.append(hook)
            for spelling in spellings:
                assert reader.site(spelling) == site, spelling
                assert reader.blocks(spelling) == want, spelling
        with pytest.raises(ActstoreError):
            reader.blocks("resid.2")  # not stored: one clear error naming what is

    def test_reads_by_example_site_and_token(self, store):
        """The README's read example, written once in ``ReaderBase`` over the format's
        block reads: ``shape``, ``len``, ``reader[example, site, token]`` with ints,
        negative ints, slices and int arrays, ``tokens[example]``, ``statistics(site)``."""
        from ..errors import IndexOutOfRangeError

        plan, acts, location = store
        reader = self.case.open(location)
        want = {s: self.case.expected_examples(plan, acts, s) for s in plan.sites}
        site, n = plan.sites[-1], plan.n_examples
        t = want[site].shape[1]
        assert reader.shape == (n, len(plan.sites), t, plan.d_model)
        assert len(reader) == n
        e = n // 2
        np.testing.assert_array_equal(reader[e, site, 0], want[site][e, 0])
        np.testing.assert_array_equal(reader[e, str(site), -1], want[site][e, -1])
        np.testing.assert_array_equal(reader[0:8, site], want[site][0:8])
        np.testing.assert_array_equal(reader[[3, 1], site, 1:3], want[site][[3, 1], 1:3])
        np.testing.assert_array_equal(reader[-1, site, [2, 0]], want[site][-1, [2, 0]])
        np.testing.assert_array_equal(reader[e], np.stack([want[s][e] for s in plan.sites]))
        assert reader[0:8, site].dtype == np.dtype(reader.dtype)
        if reader.tokens is not None:
            np.testing.assert_array_equal(
                np.asarray(reader.tokens[e]), self.case.expected_tokens(plan)[e]
            )
        stats = reader.statistics(site)
        assert stats is not None
        rows = self.case.expected_rows(plan, acts, site).astype(np.float64)
        np.testing.assert_allclose(stats.mean, rows.mean(0), rtol=1e-6, atol=1e-9)
        with pytest.raises(IndexOutOfRangeError):
            reader[n, site]
        with pytest.raises(ActstoreError):
            reader[0, "resid.2"]  # not stored

    def test_tokens_follow_has_tokens(self, store):
        """``capture_plan().has_tokens`` says whether ``tokens`` holds the ids captured."""
        plan, _, location = store
        reader = self.case.open(location)
        if reader.capture_plan().has_tokens:
            assert reader.tokens is not None
            np.testing.assert_array_equal(
                np.asarray(reader.tokens), self.case.expected_tokens(plan)
            )
        else:
            assert reader.tokens is None

    def test_statistics_match_numpy(self, store):
        plan, acts, location = store
        reader = self.case.open(location)
        for site in plan.sites:
            stats = reader.statistics(site)
            assert stats is not None
            rows = self._expected(plan, acts, site).astype(np.float64)
            assert stats.count == rows.shape[0]
            np.testing.assert_allclose(stats.mean, rows.mean(0), rtol=1e-6, atol=1e-9)
            np.testing.assert_allclose(stats.var, rows.var(0), rtol=1e-6)
            np.testing.assert_allclose(
                stats.norm_mean, np.linalg.norm(rows, axis=1).mean(), rtol=1e-6
            )

    def test_reader_pickles_for_dataloader_workers(self, store):
        plan, _acts, location = store
        reader = self.case.open(location)
        site = plan.sites[1]
        reader.read_block(reader.blocks(site)[0])  # open handles first
        clone = pickle.loads(pickle.dumps(reader))
        block = clone.blocks(site)[1]
        np.testing.assert_array_equal(clone.read_block(block), reader.read_block(block))

    def test_read_block_is_thread_safe(self, store):
        plan, _, location = store
        reader = self.case.open(location)
        blocks = [b for s in plan.sites for b in reader.blocks(s)]
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

    def test_scatter_read_equals_read_block(self, store):
        plan, _, location = store
        reader = self.case.open(location)
        rng = np.random.default_rng(1)
        for site in plan.sites:
            for block in reader.blocks(site):
                want = reader.read_block(block)
                rows = rng.permutation(2 * block.n_rows)[: block.n_rows]
                rows[::3] = -1  # skipped rows
                out = np.zeros((2 * block.n_rows, plan.d_model), dtype=reader.dtype)
                reader.read_block_scatter(block, out, rows)
                keep = rows >= 0
                np.testing.assert_array_equal(out[rows[keep]], want[keep])
                untouched = np.setdiff1d(np.arange(len(out)), rows[keep])
                assert not out[untouched].any()

    def test_block_extents_hold_the_rows_read_block_returns(self, store):
        """A block that says where it lies raw (``block_extent``: the loader then gathers
        from the mapped file, checking it in place) holds exactly ``read_block``'s rows
        there, and its bytes are whole blocks of the manifest."""
        plan, _, location = store
        reader = self.case.open(location)
        for site in plan.sites:
            for block in reader.blocks(site):
                extent = reader.block_extent(block)
                if extent is None:
                    continue
                item = torch.empty(0, dtype=extent.dtype).element_size()
                raw = reader.files.read_range(
                    extent.name, extent.offset, block.n_rows * plan.d_model * item
                )
                rows = torch.frombuffer(bytearray(raw), dtype=extent.dtype)
                want = torch.from_numpy(np.ascontiguousarray(reader.read_block(block)))
                assert torch.equal(rows.view(block.n_rows, -1).to(want.dtype), want)
                reader.checks.check(extent.name, extent.offset, raw)

    def test_the_loader_serves_every_row_once_with_its_values(self, store, monkeypatch):
        """``ActivationLoader`` over the store, both sites aligned, gathering from the
        mapped files (where the format says where blocks lie) and from windows read into
        buffers (``ACTSTORE_MAP=0``; the only way for other formats): every row exactly
        once per epoch, with exactly its stored values."""
        from ..loader import ActivationLoader

        plan, acts, location = store
        want = [self._expected(plan, acts, site) for site in plan.sites]
        n_rows = plan.n_examples * plan.tokens_per_example
        paths = set()
        for setting in ("1", "0"):
            monkeypatch.setenv("ACTSTORE_MAP", setting)
            loader = ActivationLoader(
                self.case.open(location),
                sites=list(plan.sites),
                batch_size=7,
                pool_blocks=2,
                return_index=True,
            )
            paths.add(loader.mapped)
            for _ in range(2):
                batches = [(b.acts.numpy().copy(), b.rows.numpy()) for b in loader]
                rows = np.concatenate([r for _, r in batches])
                assert sorted(rows.tolist()) == list(range(n_rows))
                got = np.concatenate([x for x, _ in batches])
                for k, rows_k in enumerate(want):
                    np.testing.assert_array_equal(got[:, k], rows_k[rows].astype(got.dtype))
            loader.close()  # no read of the next epoch outlives the test (or its server)
        assert False in paths  # ACTSTORE_MAP=0 reads windows into buffers

    def test_cls_rows_mark_token_zero_or_nothing(self, store):
        plan, _, location = store
        reader = self.case.open(location)
        for block in reader.blocks(plan.sites[0]):
            rows = reader.cls_rows(block)
            # this plan keeps no CLS token: a format marks none, or says it keeps none
            assert rows is None or len(rows) == 0

    def test_capture_plan_gives_back_the_plan(self, store):
        plan, _, location = store
        got = self.case.open(location).capture_plan()
        assert got.sites == plan.sites
        assert (got.n_examples, got.tokens_per_example, got.d_model, got.family) == (
            plan.n_examples,
            plan.tokens_per_example,
            plan.d_model,
            plan.family,
        )

    def test_detected_as_its_format_and_described(self, store, tmp_path):
        from ..formats import detect_format
        from ..formats.registry import format_of

        _, _, location = store
        assert detect_format(location).name == self.case.format
        empty = tmp_path / "empty"
        empty.mkdir()
        assert format_of(empty) is None
        summary = self.case.open(location).describe()
        missing = DESCRIBE_KEYS - set(summary)
        assert not missing, f"describe() lacks {sorted(missing)}"
