"""The rules every storage format keeps, as pytest tests: :class:`ConformanceSuite`."""

from __future__ import annotations

import pickle
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from ..errors import ActstoreError, CorruptStoreError
from ..sites import Site
from .case import FormatCase
from .data import make_acts

#: The keys of ``describe()`` that ``actstore inspect``, ``ls`` and the S3 listing read.
DESCRIBE_KEYS = {"path", "format", "model", "sites", "shape", "dtype", "d_model", "bytes", "files"}


class ConformanceSuite:
    """Subclass it in a test module and set :attr:`case`; pytest collects every rule.

    The S3 rule needs a fixture ``conformance_s3_url`` (``name -> s3://...`` on a test
    server) from the project's conftest; without it that rule is skipped, saying why.
    """

    case: FormatCase

    @pytest.fixture
    def store(self, tmp_path: Any) -> tuple[Any, dict[str, np.ndarray], str]:
        plan = self.case.plan()
        acts = make_acts(plan)
        location = self.case.write(tmp_path / "store", plan, self.case.batches(plan, acts))
        return plan, acts, location

    def _expected(self, plan: Any, acts: dict[str, np.ndarray], site: Site) -> np.ndarray:
        return self.case.expected_rows(plan, acts, site)

    def _rows(self, reader: Any, site: Any) -> np.ndarray:
        return np.concatenate([reader.read_block(b) for b in reader.blocks(site)])

    # ------------------------------------------------------------------ reading

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

    # ------------------------------------------------------------------ integrity

    def test_unpublished_store_is_not_readable(self, tmp_path):
        plan = self.case.plan()
        batches = self.case.batches(plan, make_acts(plan))
        location = self.case.write_unpublished(tmp_path / "store", plan, batches[:3])
        with pytest.raises(ActstoreError):
            self.case.open(location)

    def test_damaged_store_is_rejected(self, store):
        """A flipped byte is refused both ways: ``verify()`` reports it, and reading the
        blocks raises :class:`CorruptStoreError` (unless the store is refused at open)."""
        plan, _, location = store
        self.case.damage(location)
        try:
            reader = self.case.open(location)
        except CorruptStoreError:
            return  # refused at open: nothing of it is served
        report = reader.verify()
        assert not report.ok, "verify() did not find the damaged byte"
        with pytest.raises(CorruptStoreError):
            for site in plan.sites:
                for block in reader.blocks(site):
                    reader.read_block(block)

    def test_verify_passes_on_a_good_store(self, store):
        _, _, location = store
        report = self.case.open(location).verify()
        assert report.ok, report.faults
        assert report.files_checked > 1 and report.bytes_checked > 0

    # ------------------------------------------------------------------ writing

    def test_resumed_writer_equals_uninterrupted(self, tmp_path, store):
        plan, acts, location = store
        batches = self.case.batches(plan, acts)
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
            np.testing.assert_array_equal(self._rows(original, site), self._rows(resumed, site))
            sa, sb = original.statistics(site), resumed.statistics(site)
            assert sa is not None and sb is not None and sa.count == sb.count
            np.testing.assert_array_equal(sa.mean, sb.mean)
            np.testing.assert_array_equal(sa.var, sb.var)

    def test_a_second_writer_is_refused_until_the_first_stops(self, tmp_path):
        """Two captures into one store: the second is refused with one line naming the
        first; once the first stops (abort, or its process dies), the store is free."""
        from ..errors import StoreLockedError

        plan = self.case.plan()
        batches = self.case.batches(plan, make_acts(plan))
        first, given = self.case.open_writer(tmp_path / "store", plan, batches)
        try:
            first.write(given[0])
            with pytest.raises(StoreLockedError) as refused:
                self.case.open_writer(tmp_path / "store", plan, batches)
            assert len(str(refused.value).splitlines()) == 1
        finally:
            first.abort()
        again, _ = self.case.open_writer(tmp_path / "store", plan, batches)
        again.abort()

    def test_parts_merge_into_the_one_process_store(self, tmp_path, store):
        """Captured in two parts (as two machines would) and merged: the same rows and
        statistics as the one-process store."""
        if self.case.spec.parts is None:
            pytest.skip(f"format {self.case.format!r} declares no parts (FormatSpec.parts)")
        parts = self.case.spec.parts()
        plan, acts, location = store
        batches = self.case.batches(plan, acts)
        options = self.case.writer_options()
        final = parts.final_location(plan, str(tmp_path / "parts"), options)
        for sl in parts.slices(plan, options, 2):
            if sl.empty:
                continue
            writer = parts.part_writer(plan, final, options, sl)
            for batch in batches:
                keep = (batch.example_ids >= sl.start) & (batch.example_ids < sl.stop)
                if keep.any():
                    writer.write(batch.select(keep))
            writer.close()
        merged = self.case.open(str(parts.merge(parts.list_parts(final), final)))
        original = self.case.open(location)
        for site in plan.sites:
            np.testing.assert_array_equal(self._rows(merged, site), self._rows(original, site))
            sa, sb = original.statistics(site), merged.statistics(site)
            assert sa is not None and sb is not None and sa.count == sb.count
            np.testing.assert_allclose(sb.mean, sa.mean, rtol=1e-12)
        assert merged.verify().ok

    def test_converts_both_ways(self, store, tmp_path):
        """Converted to another format and back: the same rows (after this format's cast)."""
        from ..convert import convert

        other = self.case.round_trip_through
        if other is None:
            pytest.skip(f"{self.case!r} sets round_trip_through=None")
        if other == self.case.format:
            other = "pickle"
        plan, acts, location = store
        there = convert(location, tmp_path / "there", to=other, progress=False).location
        back = convert(
            there,
            tmp_path / "back",
            to=self.case.format,
            options=self.case.writer_options(),
            progress=False,
        ).location
        reader = self.case.open(str(back))
        for site in plan.sites:
            np.testing.assert_array_equal(
                self._rows(reader, site), self._expected(plan, acts, site)
            )

    def test_round_trip_on_s3(self, request, tmp_path):
        """Written straight to ``s3://`` (staged, uploaded, manifest last) and read back."""
        try:
            url_for = request.getfixturevalue("conformance_s3_url")
        except pytest.FixtureLookupError:
            pytest.skip("no `conformance_s3_url` fixture: the project provides no S3 test server")
        plan = self.case.plan()
        acts = make_acts(plan)
        url = url_for(f"{self.case.format}-{request.node.name}")
        location = self.case.write(url, plan, self.case.batches(plan, acts))
        reader = self.case.open(location)
        assert not reader.location.is_local
        for site in plan.sites:
            np.testing.assert_array_equal(
                self._rows(reader, site), self._expected(plan, acts, site)
            )
        assert reader.verify().ok
