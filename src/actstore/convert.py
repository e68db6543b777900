"""Convert a store between formats, streaming, then verify the result: every row, or a
one-line refusal where the target cannot hold what the store holds (sites it does not
store, examples of different lengths into a fixed-length format), before anything is
written where the target's options say so (:meth:`FormatWriter.convert_options`); a
conversion whose verification fails removes the store it published (:func:`withdraw`).

Conversion is written once against the contracts every format keeps: the source reader's
blocks (rows example-major, then token; blocks at the same index of two sites cover the
same tokens) become capture batches of ``batch_size`` examples for the target format's
writer (``FormatSpec.open_writer``), so a new format converts to and from every other
without code here. Memory stays bounded by one batch plus what the target writer buffers
(one shard at most), plus one decoded source shard when the source decodes whole shards
(pkl.gz). The target keeps every value its dtype can hold: float32 to float32
is exact, float32 to float16 rounds (the largest absolute error introduced is reported),
float16 to float32 is exact. Verification then re-reads both stores block by block and
checks every row equals the source row cast to the target dtype.

The source reader's ``capture_plan()`` says what the store holds (model, sites, dataset
description, CLS, classes), and its ``example_batches()``, when the format keeps more per
example than blocks show (texts, ragged lengths), streams whole examples; otherwise
batches are built from blocks, with token ids from ``reader.tokens`` and labels from
``reader.labels`` (see :class:`~actstore.formats.base.ReaderBase`).

Example:
    >>> import tempfile
    >>> from actstore.testing import FormatCase, make_acts, make_batches, make_plan
    >>> plan, out = make_plan(), tempfile.TemporaryDirectory()
    >>> batches = make_batches(plan, make_acts(plan))
    >>> saev = FormatCase("saev").write(f"{out.name}/saev", plan, batches)
    >>> result = convert(saev, f"{out.name}/acts-pkl", to="pickle", progress=False)
    >>> result.location.name, result.max_abs_error  # every row read back and compared
    ('acts-pkl', {'resid.1': 0.0, 'resid.3': 0.0})
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from .batch import Batch, CapturePlan
from .errors import (
    ActstoreError,
    ConfigError,
    CorruptStoreError,
    LayerNotStoredError,
    OtherCaptureError,
)
from .formats import open_store
from .formats.base import ReaderBase
from .formats.identity import explain_other_capture
from .formats.registry import FormatSpec, available_formats, detect_format, get_format
from .formats.writerbase import WriterBase
from .progress import bar_switch
from .sites import Site
from .storage.location import Location

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ConvertResult:
    """What a conversion wrote and what verification found."""

    location: Any
    """The target store (what its writer's ``close()`` returned)."""
    source_format: str
    target_format: str
    n_examples: int
    rows: dict[str, int]
    """Rows (tokens) per site, checked in both stores."""
    max_abs_error: dict[str, float]
    """Per site: the largest ``|source - target|`` (0.0 where the conversion is exact)."""
    verified: bool
    already_complete: bool
    seconds: float
    stored_dtype: str = "float32"
    """The dtype the target stores values in (what any rounding rounded to)."""
    dropped: dict[str, str] = field(default_factory=dict)
    """What the source recorded that the target does not keep: field -> why."""

    @property
    def lossless(self) -> bool:
        return all(err == 0.0 for err in self.max_abs_error.values())


# ---------------------------------------------------------------------- the source side


def source_plan(reader: ReaderBase) -> CapturePlan:
    """The capture plan a store was written from."""
    return reader.capture_plan()


def provenance(reader: ReaderBase, format_name: str) -> dict[str, Any]:
    """What identifies the store ``reader`` reads as the source of a conversion: its
    format, its store id and the digest of its root manifest (which covers every byte it
    holds), and the precision its values are stored at. A store another tool wrote (no
    manifest) is named by its location instead."""
    out: dict[str, Any] = {"format": format_name, "dtype": reader.stored_dtype()}
    manifest = reader.checks.manifest
    if manifest is None:
        out["location"] = str(reader.url)
    else:
        import xxhash

        out["store_id"] = manifest.store_id
        out["manifest"] = xxhash.xxh3_128_hexdigest(manifest.to_bytes())
    return out


def converted_plan(reader: ReaderBase, format_name: str) -> CapturePlan:
    """The plan of a conversion of ``reader``'s store: its capture plan, with the source
    store's identity and precision in ``data["converted_from"]``, so the converted store
    never takes the name (saev's content hash) or the record of a capture, nor of a
    conversion of another store or of the same data at another precision."""
    plan = source_plan(reader)
    data = {**plan.data, "converted_from": provenance(reader, format_name)}
    return dataclasses.replace(plan, data=data)


def example_batches(
    reader: ReaderBase, plan: CapturePlan, batch_size: int, start: int = 0
) -> Iterator[Batch]:
    """The stored examples ``start, start + 1, ...`` as batches of ``batch_size``."""
    native = reader.example_batches(batch_size, start)
    if native is not None:
        yield from _only_sites(native, plan)
        return
    names = _reader_sites(reader, plan)
    blocks = [reader.blocks(name) for name in names]
    if len({len(b) for b in blocks}) > 1:
        raise CorruptStoreError("the sites of this store have different block lists")
    t, d = plan.tokens_per_example, plan.d_model
    tokens, labels = reader.tokens, reader.labels
    if labels is not None and np.ndim(labels) == 2:  # saev: one label per patch
        labels = np.asarray(labels)[:, 0]
    pending: list[list[np.ndarray]] = [[] for _ in names]
    pending_rows, row = 0, 0  # rows held in `pending`; global row of the next block
    first_example = start
    for i in range(len(blocks[0])):
        n_rows = blocks[0][i].n_rows
        if row + n_rows <= start * t:
            row += n_rows
            continue
        skip = max(0, start * t - row)
        for k, name in enumerate(names):
            pending[k].append(reader.read_block(blocks[k][i])[skip:])
        pending_rows += n_rows - skip
        row += n_rows
        while pending_rows >= batch_size * t or (i == len(blocks[0]) - 1 and pending_rows):
            if pending_rows % t and pending_rows < batch_size * t:
                raise ConfigError(
                    f"{reader.url}: rows do not divide into "
                    f"examples of {t} tokens; only fixed-length stores convert"
                )
            take = min(batch_size, pending_rows // t)
            acts = {}
            for k, site in enumerate(plan.sites):
                rows = np.concatenate(pending[k]) if len(pending[k]) > 1 else pending[k][0]
                acts[str(site)] = torch.from_numpy(
                    np.ascontiguousarray(rows[: take * t]).reshape(take, t, d)
                )
                pending[k] = [rows[take * t :]] if rows.shape[0] > take * t else []
            pending_rows -= take * t
            ids = np.arange(first_example, first_example + take, dtype=np.int64)
            yield Batch(
                acts=acts,
                example_ids=ids,
                token_ids=None if tokens is None else np.asarray(tokens[ids[0] : ids[-1] + 1]),
                labels=None if labels is None else np.asarray(labels[ids], dtype=np.int64),
            )
            first_example += take


def _only_sites(batches: Iterator[Batch], plan: CapturePlan) -> Iterator[Batch]:
    """``batches`` with the activations of ``plan``'s sites only (a ``--sites`` choice)."""
    keep = {str(site) for site in plan.sites}
    for batch in batches:
        acts = {name: acts for name, acts in batch.acts.items() if name in keep}
        yield batch if len(acts) == len(batch.acts) else dataclasses.replace(batch, acts=acts)


def _reader_sites(reader: ReaderBase, plan: CapturePlan) -> list[Site]:
    """The reader's stored sites, in the plan's site order."""
    return [reader.site(site) for site in plan.sites]


# ---------------------------------------------------------------------- convert


def select_sites(plan: CapturePlan, sites: Sequence[str] | None, reader: ReaderBase) -> CapturePlan:
    """``plan`` with only ``sites`` (any spelling the reader takes, native names included;
    None: all), each one the store holds."""
    if not sites:
        return plan
    chosen: list[Site] = []
    for name in sites:
        try:
            site = reader.site(name)
        except LayerNotStoredError as err:
            stored = ", ".join(str(s) for s in plan.sites)
            raise ConfigError(
                f"--sites {name}: {reader.url} does not hold it; it holds {stored}"
            ) from err
        except ConfigError as err:
            raise ConfigError(f"--sites {name}: {err}") from err
        if site in chosen:
            raise ConfigError(f"--sites names {site} twice")
        chosen.append(site)
    return dataclasses.replace(plan, sites=tuple(chosen))


def _accepts(spec: FormatSpec, plan: CapturePlan, options: Any = None) -> bool:
    """Whether format ``spec`` stores ``plan`` (its writer, opened in a scratch directory
    and aborted, does not refuse it)."""
    quiet = logging.root.manager.disable
    logging.disable(logging.INFO)  # a probe is not news
    try:
        with tempfile.TemporaryDirectory(prefix="actstore-convert-probe-") as scratch:
            try:
                writer = spec.open_writer(plan, scratch, options or spec.options())
            except ActstoreError:
                return False
            writer.abort()
            return True
    finally:
        logging.disable(quiet)


def open_target(
    spec: FormatSpec, plan: CapturePlan, target: str, options: Any, source: Any, source_format: str
) -> WriterBase:
    """The target's writer; a format that cannot hold some of the store's sites is
    explained in terms of converting: which sites it can take (``--sites``) and which
    other formats take them all."""
    try:
        return spec.open_writer(plan, target, options)
    except OtherCaptureError as err:  # says what differs
        raise explain_other_capture(err, plan) from None
    except ConfigError as err:
        kept = tuple(s for s in plan.sites if s.kind == "resid")
        if len(kept) == len(plan.sites) or not _accepts(spec, _only(plan, kept), options):
            raise
        others = ", ".join(str(s) for s in plan.sites if s not in kept)
        hints = [f"convert the residual stream alone with --sites {','.join(map(str, kept))}"]
        takers = [
            other.name
            for other in available_formats()
            if other.name not in (spec.name, source_format) and _accepts(other, plan)
        ]
        if takers:
            either = ", ".join(takers[:-1]) + (" or " if len(takers) > 1 else "") + takers[-1]
            hints.append(f"or convert every site to {either}")
        raise ConfigError(
            f"{spec.name} stores the residual stream only, and {source} also holds {others}: "
            + " ".join(hints)
        ) from err


def _only(plan: CapturePlan, sites: tuple[Site, ...]) -> CapturePlan:
    return dataclasses.replace(plan, sites=sites) if sites else plan


def convert(
    source: str | Path,
    target: str | Path,
    *,
    to: str,
    options: Any = None,
    batch_size: int = 64,
    verify: bool = True,
    progress: bool = True,
    sites: Sequence[str] | None = None,
) -> ConvertResult:
    """Convert the store at ``source`` into format ``to`` at ``target`` (that format's
    ``--out``: a directory, or a URL for object storage). ``sites`` picks the sites to
    convert (default: all). Rerunning an interrupted conversion resumes it; a finished one
    is only verified."""
    from .capture.outdir import check_not_inside_a_store, check_output

    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, not {batch_size}")
    t0 = time.perf_counter()
    src_spec = detect_format(str(source))
    dst_spec = get_format(to)
    check_not_inside_a_store(str(target), what="the target")
    check_output(str(target), what="the target")
    reader = src_spec.open_reader(str(source))
    try:
        return _convert(
            reader, src_spec, dst_spec, target, options, batch_size, verify, progress, sites, t0
        )
    finally:
        reader.close()


def _convert(
    reader: ReaderBase,
    src_spec: FormatSpec,
    dst_spec: FormatSpec,
    target: str | Path,
    options: Any,
    batch_size: int,
    verify: bool,
    progress: bool,
    sites: Sequence[str] | None,
    t0: float,
) -> ConvertResult:
    source, to = reader.url, dst_spec.name
    plan = select_sites(converted_plan(reader, src_spec.name), sites, reader)
    options = options if options is not None else dst_spec.options()
    # every row or none: a format of fixed-size files picks one that holds them all
    options = dst_spec.writer.convert_options(plan, options)
    from .capture.outdir import check_out_target

    check_out_target(str(target), dst_spec, options, plan, what="the target")
    writer = open_target(dst_spec, plan, str(target), options, source, src_spec.name)
    already = writer.complete
    if already:
        location = writer.close()
        log.info("%s already holds this conversion; verifying it", location)
    else:
        start = writer.resume_from
        if start:
            log.info("resuming the conversion at example %d of %d", start, plan.n_examples)
        try:
            with tqdm(
                total=plan.n_examples,
                initial=start,
                unit="ex",
                desc=f"convert to {to}",
                **bar_switch(progress),
                dynamic_ncols=True,
            ) as bar:
                for batch in example_batches(reader, plan, batch_size, start):
                    writer.write(batch)
                    bar.update(batch.n_examples)
        except BaseException:
            writer.abort()
            raise
        location = writer.close()
    rows: dict[str, int] = {}
    errors: dict[str, float] = {}
    target_reader = open_store(location)
    try:
        if verify:
            rows, errors = compare_stores(
                reader,
                target_reader,
                plan,
                stored_dtype=target_reader.stored_dtype(),
                progress=progress,
            )
        dropped = dropped_fields(plan, target_reader.capture_plan(), dst_spec.name)
        stored_dtype = target_reader.stored_dtype()
    except CorruptStoreError as err:
        target_reader.close()
        if already:  # published before this command: not this command's to remove
            raise
        withdraw(location)  # a conversion that fails publishes nothing
        raise CorruptStoreError(
            f"{err}; the store written at {location} was removed (nothing is published)"
        ) from err
    finally:
        target_reader.close()
    for name, why in dropped.items():
        log.info("%s: %s", name, why)
    result = ConvertResult(
        location=location,
        source_format=src_spec.name,
        target_format=dst_spec.name,
        n_examples=plan.n_examples,
        rows=rows,
        max_abs_error=errors,
        verified=verify,
        already_complete=already,
        seconds=time.perf_counter() - t0,
        stored_dtype=stored_dtype,
        dropped=dropped,
    )
    log.info(
        "converted %s (%s) to %s (%s) in %.1fs",
        source,
        src_spec.name,
        location,
        dst_spec.name,
        result.seconds,
    )
    return result


def withdraw(location: Any) -> None:
    """Remove the store this conversion just published at ``location`` (local or object
    storage): its root manifest first, so no reader takes what is left if removal stops
    half way."""
    from .storage.manifest import MANIFEST
    from .storage.object import join_key, open_location

    store, prefix = open_location(str(location))
    store.delete(join_key(prefix, MANIFEST))
    store.delete_tree(prefix)
    if Location.parse(location).is_local:
        from .storage import remove_tree

        path = Location.parse(location).path()
        if path.exists():
            remove_tree(path)


#: What a capture plan records beyond the values, as conversion reports it.
_CARRIED = {
    "ckpt": "the model checkpoint",
    "family": "the model family",
    "has_cls": "that token 0 of each example is a CLS token",
    "classes": "the class names",
    "has_labels": "the labels",
    "has_tokens": "the token ids",
    "dataset_root": "the dataset location",
    "data": "the dataset description",
}


def dropped_fields(source: CapturePlan, target: CapturePlan, target_format: str) -> dict[str, str]:
    """What ``source`` records that the store converted to ``target`` no longer says."""
    out, a, b = {}, source.to_json_dict(), target.to_json_dict()
    for name, what in _CARRIED.items():
        before, after = a[name], b[name]
        if before == after or before in (None, False, "", {}, "unknown"):
            continue
        value = "" if isinstance(before, bool) else f" ({before!r})"
        out[name] = f"the {target_format} store does not keep {what}{value}"
    return out


def compare_stores(
    source: Any,
    target: Any,
    plan: CapturePlan | None = None,
    *,
    stored_dtype: str | None = None,
    progress: bool = False,
) -> tuple[dict[str, int], dict[str, float]]:
    """Check that every row of every site of ``source`` is in ``target``, in order, equal to
    the source row rounded to the dtype the target stores (``stored_dtype``, e.g.
    ``"bfloat16"``; default: the target reader's dtype). Returns rows and the max abs
    error per site; raises :class:`CorruptStoreError` naming the first difference."""
    plan = plan or source_plan(source)
    stored = stored_dtype or target.stored_dtype()
    src_names, dst_names = _reader_sites(source, plan), _reader_sites(target, plan)
    rows = {str(site): 0 for site in plan.sites}
    errors = {str(site): 0.0 for site in plan.sites}
    total = sum(b.n_rows for name in src_names for b in source.blocks(name))
    # one stream per site, advanced in turn: block i of every site is read together, so a
    # reader that decodes whole shards (pkl.gz) decodes each once
    held = _stored_positions(source, target, plan, src_names[0], dst_names[0])
    streams = {
        str(site): _aligned(_row_chunks(source, a), _stored_rows(_row_chunks(target, b), held))
        for site, a, b in zip(plan.sites, src_names, dst_names)
    }
    with tqdm(
        total=total, unit="row", desc="verify", **bar_switch(progress), dynamic_ncols=True
    ) as bar:
        while streams:
            for site, stream in list(streams.items()):
                pair = next(stream, None)
                if pair is None:
                    del streams[site]
                    continue
                a, b = pair
                expected = as_stored(a, stored)
                got = b if b.dtype == np.float32 else b.astype(np.float32)
                if not np.array_equal(expected, got, equal_nan=True):
                    bad = int(np.flatnonzero((expected != got).any(axis=1))[0])
                    raise CorruptStoreError(
                        f"site {site}: row {rows[site] + bad} differs between the stores "
                        f"beyond rounding to {stored}; the conversion is not faithful"
                    )
                if a.size and not np.array_equal(expected, a, equal_nan=True):  # rounded
                    diff = np.abs(a.astype(np.float64) - got.astype(np.float64))
                    errors[site] = max(errors[site], float(np.nanmax(diff)))
                rows[site] += a.shape[0]
                bar.update(a.shape[0])
    return rows, errors


def as_stored(rows: np.ndarray, dtype: str) -> np.ndarray:
    """``rows`` rounded to ``dtype`` (``bfloat16`` through torch), returned as float32.

    Example:
        >>> as_stored(np.array([[1.0001]], dtype=np.float32), "float16")
        array([[1.]], dtype=float32)
    """
    rows = np.asarray(rows)
    if dtype == "bfloat16":
        tensor = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32))
        return tensor.to(torch.bfloat16).to(torch.float32).numpy()
    if rows.dtype == np.float32 and np.dtype(dtype) == np.float32:
        return rows
    return rows.astype(dtype).astype(np.float32)


def _stored_positions(
    source: Any, target: Any, plan: CapturePlan, a: Site, b: Site
) -> np.ndarray | None:
    """Flat bool ``[n x T]``: the positions a source that stores only some of them
    (``source.token_mask``) holds, when the target holds every position (it did not drop
    the others: they are NaN there); None when both hold the same rows."""
    mask = source.token_mask
    if mask is None:
        return None
    held = sum(block.n_rows for block in target.blocks(b))
    if held == sum(block.n_rows for block in source.blocks(a)):
        return None
    if held != plan.n_examples * plan.tokens_per_example:
        raise CorruptStoreError("the stores hold different numbers of rows")
    return np.asarray(mask[:], dtype=bool).reshape(-1)


def _stored_rows(chunks: Iterator[np.ndarray], stored: np.ndarray | None) -> Iterator[np.ndarray]:
    """The rows of ``chunks`` at the ``stored`` positions (all of them when None); the
    others must be NaN (the source stores no value there)."""
    if stored is None:
        yield from chunks
        return
    at = 0
    for rows in chunks:
        keep = stored[at : at + len(rows)]
        at += len(rows)
        if not np.isnan(rows[~keep]).all():
            raise CorruptStoreError(
                "the converted store holds values where the source stores none; the "
                "conversion is not faithful"
            )
        yield rows[keep]


def _row_chunks(reader: Any, site: Site) -> Iterator[np.ndarray]:
    for block in reader.blocks(site):
        yield reader.read_block(block)


def _aligned(
    left: Iterator[np.ndarray], right: Iterator[np.ndarray]
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Pairs of equally long row runs from two streams of row chunks, which must end
    together (else the stores hold different numbers of rows)."""
    a: np.ndarray | None = np.empty((0, 0))
    b: np.ndarray | None = np.empty((0, 0))
    while True:
        if a is not None and not len(a):
            a = next(left, None)
        if b is not None and not len(b):
            b = next(right, None)
        if a is None and b is None:
            return
        if a is None or b is None:
            raise CorruptStoreError("the stores hold different numbers of rows")
        n = min(len(a), len(b))
        if n:
            yield a[:n], b[:n]
        a, b = a[n:], b[n:]
