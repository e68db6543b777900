"""The rules every storage format keeps, as pytest tests: :class:`ConformanceSuite` (its
reading rules are :class:`~actstore.testing.reading_rules.ReadingRules`', a mixin it inherits)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ..errors import ActstoreError, CorruptStoreError
from ..sites import Site
from ..storage.location import Location
from .case import FormatCase
from .data import make_acts, make_labels, rich_overrides
from .reading_rules import DESCRIBE_KEYS, ReadingRules


class ConformanceSuite(ReadingRules):
    """Subclass it in a test module and set :attr:`case`; pytest collects every rule.

    The S3 rule needs a fixture ``conformance_s3_url`` (``name -> s3://...`` on a test
    server) from the project's conftest; without it that rule is skipped, saying why.
    """

    case: FormatCase

    @pytest.fixture
    def store(self, request: Any, tmp_path_factory: Any) -> tuple[Any, dict[str, np.ndarray], str]:
        """The suite's plain capture, ``(plan, acts, location)``, for the rules that only read
        it: written once per test class when it is a local directory (a published store's
        files are read-only), else (object storage) once per test. A rule that damages a
        store writes its own (:meth:`fresh_store`)."""
        shared = _SHARED_STORES.get(request.cls)
        if shared is None:
            plan, acts, location = self._write_store(
                tmp_path_factory.mktemp(f"store-{request.cls.__name__}")
            )
            if Location.parse(location).is_local:
                _SHARED_STORES[request.cls] = plan, acts, location
        else:
            plan, acts, location = shared
        return plan, {k: v.copy() for k, v in acts.items()}, location

    @pytest.fixture
    def fresh_store(self, tmp_path: Any) -> tuple[Any, dict[str, np.ndarray], str]:
        """The suite's plain capture, written for this test alone."""
        return self._write_store(tmp_path)

    def _write_store(self, root: Any) -> tuple[Any, dict[str, np.ndarray], str]:
        plan = self.case.plan()
        acts = make_acts(plan)
        location = self.case.write(root / "store", plan, self.case.batches(plan, acts))
        return plan, acts, location

    def _expected(self, plan: Any, acts: dict[str, np.ndarray], site: Site) -> np.ndarray:
        return self.case.expected_rows(plan, acts, site)

    def _rows(self, reader: Any, site: Any) -> np.ndarray:
        return np.concatenate([reader.read_block(b) for b in reader.blocks(site)])

    # ------------------------------------------------------------------ what it holds

    def _rich_store(self, tmp_path: Any, features: Any) -> tuple[Any, dict[str, np.ndarray], str]:
        """A bfloat16 capture with ``features`` (:data:`~actstore.testing.data.FEATURES`)."""
        plan = self.case.plan(**rich_overrides(features))
        acts = make_acts(plan, dtype="bfloat16")
        batches = [
            dataclasses.replace(b, acts={k: v.to(torch.bfloat16) for k, v in b.acts.items()})
            for b in self.case.batches(plan, acts)
        ]
        return plan, acts, self.case.write(tmp_path / "rich", plan, batches)

    def test_bf16_attention_mlp_cls_and_labels_round_trip(self, tmp_path):
        """A bfloat16 capture of attention and MLP sites beside the residual stream, with a
        CLS token and class labels (less what the case's ``cannot_hold`` declares): every
        site's rows come back as stored, CLS rows are marked, labels and class names come
        back, and ``capture_plan()`` says so."""
        plan, acts, location = self._rich_store(tmp_path, self.case.holds)
        reader = self.case.open(location)
        assert reader.sites == plan.sites
        got = reader.capture_plan()
        assert (got.has_cls, got.has_labels) == (plan.has_cls, plan.has_labels), (
            "capture_plan() gives back has_cls and has_labels"
        )
        for site in plan.sites:
            np.testing.assert_array_equal(
                self._rows(reader, site), self._expected(plan, acts, site), err_msg=str(site)
            )
        t = plan.tokens_per_example
        for site in plan.sites:
            marked, first = [], 0
            for block in reader.blocks(site):
                rows = reader.cls_rows(block)
                if rows is not None:
                    marked.extend((first + rows).tolist())
                first += block.n_rows
            want = list(range(0, plan.n_examples * t, t)) if plan.has_cls else []
            assert sorted(marked) == want, f"cls_rows of {site} mark token 0 of every example"
        if plan.has_labels:
            assert reader.labels is not None, "the plan keeps labels: reader.labels"
            labels = np.asarray(reader.labels)
            if labels.ndim == 2:  # per token (saev's labels.bin): the same along each row
                assert (labels == labels[:, :1]).all()
                labels = labels[:, 0]
            np.testing.assert_array_equal(labels, make_labels(plan))
            assert list(reader.classes or []) == plan.classes
        else:
            assert reader.labels is None

    def test_what_the_format_cannot_hold_is_refused_or_not_claimed(self, tmp_path):
        """Each feature the case declares it cannot hold (``FormatCase.cannot_hold``) is
        refused with one ActstoreError when written, or left out of the published store
        without a claim: the site is not served, no CLS row is marked, no labels."""
        for feature, why in self.case.cannot_hold.items():
            try:
                plan, _, location = self._rich_store(tmp_path / feature, [feature])
            except ActstoreError:
                continue  # refused, naming the problem
            reader = self.case.open(location)
            got = reader.capture_plan()
            claim = f"{self.case!r} cannot hold {feature} ({why}) but"
            if feature in ("attn_out", "mlp_out"):
                (site,) = [s for s in plan.sites if s.kind == feature]
                with pytest.raises(ActstoreError):
                    reader.site(site)
                assert site not in got.sites, f"{claim} its capture_plan() lists {site}"
            elif feature == "cls":
                assert not got.has_cls, f"{claim} its capture_plan() says has_cls"
                for block in reader.blocks(plan.sites[0]):
                    rows = reader.cls_rows(block)
                    assert rows is None or not len(rows), f"{claim} marks CLS rows"
            else:
                assert not got.has_labels and reader.labels is None, f"{claim} serves labels"

    # ------------------------------------------------------------------ integrity

    def test_unpublished_store_is_not_readable(self, tmp_path):
        plan = self.case.plan()
        batches = self.case.batches(plan, make_acts(plan))
        location = self.case.write_unpublished(tmp_path / "store", plan, batches[:3])
        with pytest.raises(ActstoreError):
            self.case.open(location)

    def test_damaged_store_is_rejected(self, fresh_store):
        """A flipped byte is refused both ways: ``verify()`` reports it, and reading the
        blocks raises :class:`CorruptStoreError` (unless the store is refused at open)."""
        plan, _, location = fresh_store
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

    @pytest.mark.timeout(1200)  # a process and two writes per fault point
    def test_resume_after_a_crash_at_each_fault_point_is_byte_identical(self, tmp_path):
        """Killed at each fault point its writer reaches (:mod:`actstore.faults`), and
        between two batches, then rerun: every file's name and bytes equal those of the
        store written in one go (both with ``SOURCE_DATE_EPOCH`` set), and nothing is left
        beside it (no partial directory, no lock). See :mod:`actstore.testing.crash`."""
        from ..faults import CRASH_EXIT
        from .crash import crash_and_resume, differences, store_bytes

        if self.case.check_crashes is not True:
            pytest.skip(f"{self.case!r}: {self.case.check_crashes or 'check_crashes=False'}")
        outcome = crash_and_resume(self.case, tmp_path / "crashes")
        want = store_bytes(outcome.reference)
        assert want, f"the reference store at {outcome.reference} holds no files"
        beside = _tree(Path(outcome.reference_out).parent)
        problems = []
        for run in outcome.runs:
            if run.crash_code != CRASH_EXIT:
                problems.append(
                    f"{run.crash}: the writer did not die there (exit {run.crash_code}): "
                    f"{run.crash_stderr[-2000:]}"
                )
            elif run.rerun_code != 0:
                problems.append(
                    f"{run.crash}: the rerun failed (exit {run.rerun_code}): "
                    f"{run.rerun_stderr[-2000:]}"
                )
            else:
                diffs = differences(store_bytes(run.location), want)
                if diffs:
                    problems.append(f"{run.crash}: {'; '.join(diffs[:6])}")
                if Location.parse(run.location).is_local:
                    left = _tree(Path(run.out).parent)
                    if left != beside:
                        extra = sorted(set(left) - set(beside))[:6]
                        problems.append(f"{run.crash}: left beside the store: {extra}")
        assert not problems, "\n".join(problems)

    def test_a_writer_keeps_no_reference_to_a_batch_after_write(self, tmp_path):
        """Once ``write(batch)`` returns, the batch is the caller's again (capture reuses its
        buffers): overwriting every tensor and array of each batch right after writing it
        changes nothing in the store."""
        plan = self.case.plan()
        acts = make_acts(plan)
        writer, given = self.case.open_writer(
            tmp_path / "store", plan, self.case.batches(plan, acts)
        )
        for batch in given:
            writer.write(batch)
            for tensor in batch.acts.values():
                tensor.fill_(float("nan"))
            for array in (batch.token_ids, batch.labels):
                if isinstance(array, np.ndarray) and array.flags.writeable:
                    array.fill(0)
        reader = self.case.open(str(writer.close()))
        for site in plan.sites:
            np.testing.assert_array_equal(
                self._rows(reader, site), self._expected(plan, acts, site), err_msg=str(site)
            )
        if reader.tokens is not None:
            np.testing.assert_array_equal(
                np.asarray(reader.tokens), self.case.expected_tokens(plan)
            )

    def test_detect_claims_a_damaged_index(self, fresh_store):
        """A store whose index files (``FormatSpec.manifests``) are damaged is still claimed
        by its format's ``detect``, so opening it names the fault instead of "not a store"."""
        from ..formats import detect_format

        _, _, location = fresh_store
        listed = Location.parse(location).files(cache=False).list()
        names = [n for n in self.case.spec.manifests if n in listed]
        assert names, f"the store holds none of its index files {self.case.spec.manifests}"
        for name in names:
            original = self.case.overwrite(location, name, b'{"damaged": ')
            try:
                files = Location.parse(location).files(cache=False)
                assert self.case.spec.detect(files), f"detect does not claim a damaged {name}"
                assert detect_format(location).name == self.case.format
                with pytest.raises(ActstoreError):
                    self.case.open(location)
            finally:
                self.case.overwrite(location, name, original)

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


#: Test class -> its shared local store (:meth:`ConformanceSuite.store`).
_SHARED_STORES: dict[type, tuple[Any, dict[str, np.ndarray], str]] = {}


def _tree(root: Path) -> list[str]:
    """Every file and folder under ``root``, relative."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


__all__ = ["DESCRIBE_KEYS", "ConformanceSuite"]
