"""Write one prompt/response store (``activations.zarr``): the format's part of the crash
protocol.

:class:`ZarrWriter` is a :class:`~actstore.formats.writer.ShardedWriter` (which owns the
partial directory, progress record, verified resume, statistics, root manifest and
publication). Each batch holds ``B`` samples laid out as prompt tokens then response tokens
(then padding) along the token axis, with ``Batch.extras["prompt_len"]`` and
``["response_len"]`` giving the full lengths; a batch without them is stored as prompts only.
The writer truncates to ``P_max``/``R_max``, casts to float16 and writes each chunk
``(1, 1, T_chunk, H)`` of the ``(N, L, P_max, H)`` and ``(N, L, R_max, H)`` arrays as its
own file through the write pipeline, byte for byte what zarr-python would write (the arrays
have no compressor and no filters: a chunk file is the chunk's raw bytes); zarr-python
creates the arrays and writes the small per-sample ones. Chunks that would hold only +0.0
(padding) are not stored (zarr's default; readers return the fill value 0 for them,
bit-exactly).

A writer shard is ``S`` consecutive samples, and the per-sample arrays (lengths, token ids,
keys, content digests, optional labels) are chunked ``S`` rows at a time, so a shard writes
exactly one chunk of each: when it is full they are written, the file system synced, and
the shard's keyed chunk digests saved in ``meta/chunksums/<part>.<shard>.npy``; the base
then records the shard. Activation chunk files are not listed in the root manifest one by
one (a store may hold millions): the chunk digest files are, and readers check every chunk
against them; so does a resumed capture, for the chunks of every shard it keeps. Text files
(``text/prompts.jsonl``...) grow as per-example side files. Statistics are over every
stored (unpadded) prompt and response token, as stored (after the float16 cast): they
describe the values a reader serves.

Example:
    >>> import dataclasses, tempfile
    >>> from actstore.testing import make_acts, make_batches, make_plan
    >>> plan, out = make_plan(), tempfile.TemporaryDirectory()  # 23 samples of 6 tokens
    >>> p = 1 + np.arange(23) % 5  # prompt tokens of each sample; the rest is its response
    >>> writer = ZarrWriter.from_plan(plan, Location.parse(out.name), ZarrOptions(r_max=64))
    >>> for b in make_batches(plan, make_acts(plan)):
    ...     lengths = {"prompt_len": p[b.example_ids], "response_len": 6 - p[b.example_ids]}
    ...     writer.write(dataclasses.replace(b, extras=lengths))
    >>> writer.close().relative_to(out.name)
    PosixPath('activations.zarr')
"""

from __future__ import annotations

import datetime as dt
import functools
import io
import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from ...batch import SPLITS, Batch, CapturePlan, sample_key
from ...errors import CaptureError
from ...sites import Site
from ...stats import RunningStats
from ...storage import atomic_write_json
from ...storage.local import load_json
from ...storage.location import Location
from ..pipeline import ShardOutput
from ..shard import ShardRecord, ShardSink
from ..writer import ShardedWriter
from .layout import (
    ACT_DTYPE,
    ACTIVATIONS,
    CONFIG_FILE,
    DIGEST,
    FULL_LENGTHS,
    LENGTHS,
    PARTS,
    SAMPLE_KEY,
    STATISTICS_FILE,
    STORE_NAME,
    TEXT_FILES,
    TOKEN_IDS,
    chunk_id,
    chunk_key,
    chunksums_name,
    parse_chunk_key,
    shard_path,
    shard_ranges,
)
from .options import ZarrOptions
from .plan import (
    layout_attrs,
    plan_store,
    samples_per_shard,
    store_attrs,
    truncation_attrs_from_counts,
)
from .store import (
    OPTIONAL_ARRAYS,
    consolidate,
    create_arrays,
    sample_arrays,
    zarr_module,
)

if TYPE_CHECKING:
    import torch
else:
    from ..._lazy import torch

log = logging.getLogger(__name__)


class ZarrWriter(ShardedWriter):
    """Writes one store; nothing is visible at its location until :meth:`close` publishes.

    With ``example_range=(start, stop)`` (and ``run_shard``) it writes one shard of a run:
    a complete store of global samples ``[start, stop)`` (see :mod:`.shards`).
    """

    format_name = "zarr"
    options_type = ZarrOptions
    ragged_tokens = True
    stored_dtype = "float16"

    def __init__(
        self,
        plan: CapturePlan,
        output: Location,
        options: ZarrOptions | None = None,
        *,
        example_range: tuple[int, int] | None = None,
        store: Location | None = None,
        run_shard: dict[str, int] | None = None,
    ) -> None:
        zarr_module()  # zarr-python missing: one clear line before anything is created
        options = options or ZarrOptions()
        layout, attrs, config = plan_store(plan, options)
        start, stop = example_range if example_range is not None else (0, plan.n_examples)
        self.layout = layout.with_samples(stop - start)
        self.attrs = dict(attrs)
        if run_shard is not None:
            self.attrs["shard"] = {**run_shard, "start": start, "stop": stop}
        self.config = config
        self.token_ids = plan.has_tokens
        self.optional = tuple(k for k in OPTIONAL_ARRAYS if plan.extras.get(f"has_{k}"))
        self.id_offset = start
        self.rows = samples_per_shard(self.layout, options)
        super().__init__(
            plan=plan,
            store=store or self.store_location(plan, output, options),
            output=output,
            options=options,
            record={
                "fingerprint": self.attrs["fingerprint"],
                "layout": self.layout.to_dict(),
                "optional": list(self.optional),
                "token_ids": self.token_ids,
                "samples": [start, stop],
                "shard_rows": max(1, min(self.rows, self.layout.n_samples)),  # the chunk
            },
            examples_per_shard=self.rows,
            example_range=example_range,
            part=False,
        )

    @classmethod
    def store_location(cls, plan: CapturePlan, location: Location, options: Any) -> Location:
        """``out/activations.zarr``, or ``out`` itself if it ends in ``.zarr``."""
        location = Location.parse(location)
        return location if location.name.endswith(".zarr") else location.child(STORE_NAME)

    @classmethod
    def shard_examples(cls, plan: CapturePlan, options: Any) -> int:
        options = options or ZarrOptions()
        return samples_per_shard(plan_store(plan, options)[0], options)

    @classmethod
    def for_shard(
        cls,
        plan: CapturePlan,
        run_dir: str | os.PathLike,
        index: int,
        n_shards: int,
        options: ZarrOptions | None = None,
    ) -> ZarrWriter:
        """The writer of shard ``index`` of ``n_shards`` of a sharded run of ``plan``: the
        layout is chosen from the whole plan, so every shard agrees; the writer takes the
        examples of its :attr:`example_range` (capture feeds it only those)."""
        start, stop = shard_ranges(plan.n_examples, n_shards)[index]
        store = Location.parse(shard_path(run_dir, index))
        return cls(
            plan,
            store.parent,
            options or ZarrOptions(),
            example_range=(start, stop),
            store=store,
            run_shard={"index": index, "n_shards": n_shards},
        )

    # ------------------------------------------------------------------ the format's part

    def init_files(self, directory: Path) -> None:
        create_arrays(
            directory,
            self.layout,
            token_ids=self.token_ids,
            optional=self.optional,
            sample_rows=self.rows,
        )

    def manifest_skip(self) -> tuple[str, ...]:
        return tuple(ACTIVATIONS.values())

    def put_files(self, entry: ShardRecord) -> Iterable[tuple[str, str, int]] | None:
        """Every activation chunk of the shard's samples, as its chunk digest files record
        it (stored with its digest, or 0: absent), which the progress record does not
        list: a shard with a damaged, missing or stray chunk is written again."""
        index = entry.index
        lay = self.layout
        lo, hi = (x - self.id_offset for x in self.shard_bounds(index))
        found = []
        for part in PARTS:
            folder = ACTIVATIONS[part]
            try:
                sums = np.load(self.partial / chunksums_name(part, index), allow_pickle=False)
                zarray = (self.partial / folder / ".zarray").read_bytes()
                separator = load_json(zarray).get("dimension_separator", ".")
            except (OSError, ValueError, AttributeError):
                return None
            if sums.shape != (hi - lo, lay.n_layers, lay.n_chunks(part)) or sums.dtype != "<u8":
                return None
            for i, layer, c in np.ndindex(*sums.shape):
                name = f"{folder}/{chunk_key((lo + i, layer, c, 0), separator)}"
                found.append((name, chunk_id(part, lo + i, layer, c), int(sums[i, layer, c])))
        return found

    def discard_after(self, directory: Path, position: int) -> None:
        first = position - self.id_offset
        for part in PARTS:
            folder = directory / ACTIVATIONS[part]
            if not folder.is_dir():
                continue
            for dirpath, _, names in os.walk(folder):
                for name in names:
                    if name.startswith("."):
                        continue
                    rel = (Path(dirpath) / name).relative_to(folder).as_posix()
                    key = parse_chunk_key(rel, "/" if "/" in rel else ".")
                    if key is not None and key[0] >= first:
                        (Path(dirpath) / name).unlink()

    def open_shard(self, index: int, directory: Path) -> ShardSink:
        return _ZarrShard(self, index, directory)

    def stat_rows(self, batch: Batch, acts: Mapping[Site, torch.Tensor]) -> dict[Site, np.ndarray]:
        """Every stored (unpadded) prompt and response token, as stored (float16), sample by
        sample: the statistics describe the values a reader serves, as in every format.
        When every sample keeps the same token positions with its response right after its
        prompt (no prompt cut with ``prompt_keep="first"``), they are one slice of each site:
        a view when it is all the batch's tokens, else one copy."""
        p_full, r_full = _batch_lengths(batch)
        kept = [self.layout.kept(int(p), int(r)) for p, r in zip(p_full, r_full)]
        spans = {(p0, r0 + rk) for p0, _, r0, rk in kept}
        contiguous = all(p0 + pk == r0 for p0, pk, r0, _ in kept)
        one = spans.pop() if contiguous and len(spans) == 1 else None
        out = {}
        for site in self.sites:
            exact = acts[site].numpy()
            if one is not None:
                start, stop = one
                out[site] = (
                    exact if (start, stop) == (0, exact.shape[1]) else exact[:, start:stop]
                ).reshape(-1, self.plan.d_model)
                continue
            rows = []
            for b, (p0, pk, r0, rk) in enumerate(kept):
                rows.append(exact[b, p0 : p0 + pk])
                rows.append(exact[b, r0 : r0 + rk])
            out[site] = (
                np.concatenate(rows) if rows else np.empty((0, self.plan.d_model), np.float16)
            )
        return out

    def side_rows(self, batch: Batch) -> dict[str, bytes]:
        """One JSON line per sample and part in ``text/prompts.jsonl`` /
        ``text/responses.jsonl``, when the batch carries texts."""
        prompts, responses = _batch_texts(batch)
        keys = _sample_keys(batch)
        out = {}
        for part, texts in (("prompt", prompts), ("response", responses)):
            if texts is None:
                continue
            lines = [
                json.dumps(
                    {"i": int(i) - self.id_offset, "sample_key": k.decode(), part: t},
                    ensure_ascii=False,
                )
                + "\n"
                for i, k, t in zip(batch.example_ids.tolist(), keys, texts)
            ]
            out[TEXT_FILES[part]] = "".join(lines).encode("utf-8")
        return out

    def write_index(
        self, directory: Path, shards: Sequence[ShardRecord], stats: dict[Site, RunningStats]
    ) -> None:
        """``meta/statistics.json``, ``meta/config.json``, the group's attributes, then the
        consolidated metadata (``.zmetadata``)."""
        lay = self.layout
        (directory / "meta").mkdir(exist_ok=True)
        atomic_write_json(
            directory / STATISTICS_FILE,
            {"sites": {str(site): st.to_dict() for site, st in stats.items()}},
            indent=None,
        )
        atomic_write_json(directory / CONFIG_FILE, self.config)
        counts = {
            p: sum(int(e.info[_shard_marker(e)]["truncated"][p]) for e in shards) for p in PARTS
        }
        attrs = {**self.attrs, **layout_attrs(lay)}
        attrs.update(truncation_attrs_from_counts(counts, lay.n_samples))
        attrs["created_at"] = dt.datetime.fromtimestamp(self.started, dt.UTC).isoformat(
            timespec="seconds"
        )
        attrs["optional_arrays"] = list(self.optional)
        attrs["text_files"] = [TEXT_FILES[p] for p in PARTS if (directory / TEXT_FILES[p]).exists()]
        root = zarr_module().open_group(str(directory), mode="r+", zarr_format=2)
        root.attrs.update(attrs)
        consolidate(directory)


def _shard_marker(entry: ShardRecord) -> str:
    """The file of a shard record that carries the shard's info (its first chunk digests)."""
    return next(n for n in entry.files if n.startswith("meta/chunksums/"))


class _ZarrShard(ShardSink):
    """One writer shard: each activation chunk file written whole through the pipeline
    (:meth:`ShardOutput.put`) as batches come, the shard's chunk of every per-sample array
    (through zarr-python) and its chunk digests when it is full.

    The activation arrays have no compressor and no filters, dtype ``<f2``, C order and
    chunks ``(1, 1, T_chunk, H)``: a chunk file is the chunk's raw bytes, tokens past the
    sample's kept ones (and past ``P_max``/``R_max`` in an edge chunk) zero. A chunk
    whose bits are all zero (the fill value) is not stored, as zarr-python does not store
    it (``write_empty_chunks=False``); a chunk of -0.0 is. A whole chunk of kept tokens is
    written from the batch's memory as it lies (a view), only a chunk the sample's tokens
    end in is copied, into a zeroed buffer."""

    def __init__(self, writer: ZarrWriter, index: int, directory: Path) -> None:
        self.w, self.index, self.directory = writer, index, directory
        lo, hi = writer.shard_bounds(index)
        self.lo, self.n_rows = lo - writer.id_offset, hi - lo
        self.root = zarr_module().open_group(str(directory), mode="r+", zarr_format=2)
        arrays = self.root["arrays"]
        lay = writer.layout
        self.separator = {
            p: arrays[ACTIVATIONS[p].split("/", 1)[1]].metadata.dimension_separator for p in PARTS
        }
        self.sums = {
            p: np.zeros((self.n_rows, lay.n_layers, lay.n_chunks(p)), dtype="<u8") for p in PARTS
        }
        self._zeros = bytes(max(lay.p_max, lay.r_max) * lay.hidden_size * ACT_DTYPE.itemsize)
        self._chunks: dict[str, list[str]] = {p: [] for p in PARTS}
        self.rows: dict[str, list[np.ndarray]] = {}
        self.filled = 0
        self.truncated = {p: 0 for p in PARTS}

    def open(self, out: ShardOutput) -> None:
        """Chunk files are put whole as batches come (:meth:`append`)."""

    def append(self, batch: Batch, acts: Mapping[Site, torch.Tensor], out: ShardOutput) -> None:
        lay = self.w.layout
        n = batch.n_examples
        p_full, r_full = _batch_lengths(batch)
        kept = [lay.kept(int(p), int(r)) for p, r in zip(p_full, r_full)]
        halves = []  # [n, T, H] float16 of each position of the L axis
        for site in lay.sites:
            tensor = acts.get(Site.parse(site))
            if tensor is None:
                raise CaptureError(f"batch lacks site {site}; it has {sorted(batch.acts)}")
            if tuple(tensor.shape) != (n, batch.n_tokens, lay.hidden_size):
                raise CaptureError(
                    f"site {site} has shape {tuple(tensor.shape)}; expected "
                    f"({n}, {batch.n_tokens}, {lay.hidden_size})"
                )
            half = tensor.numpy()
            if half.dtype != ACT_DTYPE or not half.flags.c_contiguous:
                half = np.ascontiguousarray(half, dtype=ACT_DTYPE)
            halves.append(half)
        spans = {
            "prompt": [(p0, pk) for p0, pk, _, _ in kept],
            "response": [(r0, rk) for _, _, r0, rk in kept],
        }
        first = self.lo + self.filled
        done = out.map(
            functools.partial(self._put_sample, halves, spans, first, out), range(n)
        )  # per sample on the CPU pool: its chunks hashed and put, its content digest
        for part in PARTS:
            for names, _ in done:
                self._chunks[part].extend(names[part])
        digests = [digest for _, digest in done]
        p_full, r_full = _full_lengths(batch, p_full, r_full)
        self._sample_rows(batch, p_full, r_full, kept, digests)
        self.truncated["prompt"] += int(np.count_nonzero(p_full > lay.p_max))
        self.truncated["response"] += int(np.count_nonzero(r_full > lay.r_max))
        self.filled += n

    def _put_sample(
        self,
        halves: list[np.ndarray],
        spans: dict[str, list[tuple[int, int]]],
        first: int,
        out: ShardOutput,
        b: int,
    ) -> tuple[dict[str, list[str]], bytes]:
        """Put every stored chunk of sample ``b`` of the batch (both parts, every layer),
        recording each chunk's keyed digest (0 for a chunk not stored); returns the chunk
        files put, per part, and the sample's content digest."""
        names = {
            part: self._put_chunks(part, halves, b, spans[part][b], first, out) for part in PARTS
        }
        return names, self._content_digest(halves, b, spans)

    def _put_chunks(
        self,
        part: str,
        halves: list[np.ndarray],
        b: int,
        span: tuple[int, int],
        first: int,
        out: ShardOutput,
    ) -> list[str]:
        """Put sample ``b``'s stored chunks of ``part`` (every layer), recording each
        chunk's keyed digest (0 for a chunk not stored); returns the names put."""
        lay = self.w.layout
        t_chunk, n_chunks = lay.t_chunk(part), lay.n_chunks(part)
        if n_chunks == 0:
            return []
        folder, separator = ACTIVATIONS[part], self.separator[part]
        sums = self.sums[part]
        start, count = span
        i, names = first + b, []
        for layer, half in enumerate(halves):
            tokens = half[b, start : start + count]
            for c in range(-(-count // t_chunk)):  # chunks past the kept tokens: zeros
                t0 = c * t_chunk
                if t0 + t_chunk <= count:
                    data = tokens[t0 : t0 + t_chunk]
                else:  # the chunk the sample's tokens end in: a zero-padded copy
                    data = np.zeros((t_chunk, lay.hidden_size), ACT_DTYPE)
                    data[: count - t0] = tokens[t0:]
                name = f"{folder}/{chunk_key((i, layer, c, 0), separator)}"
                cid = chunk_id(part, i, layer, c)
                # a chunk of only +0.0 is not put: zarr leaves it to the fill value
                digest = out.put(name, data, ident=cid, skip_zero=True)
                sums[i - self.lo, layer, c] = digest
                if digest:
                    names.append(name)
        return names

    def _content_digest(
        self, halves: list[np.ndarray], b: int, spans: dict[str, list[tuple[int, int]]]
    ) -> bytes:
        """xxh3-128 of sample ``b``'s stored ``[L, P_max, H]`` prompt then ``[L, R_max, H]``
        response values (padding zeros included), fed piece by piece."""
        lay, h = self.w.layout, xxhash.xxh3_128()
        zeros = memoryview(self._zeros)
        row = lay.hidden_size * ACT_DTYPE.itemsize
        for part in PARTS:
            start, count = spans[part][b]
            pad = (lay.max_len(part) - count) * row
            for half in halves:
                h.update(half[b, start : start + count].data)
                if pad:
                    h.update(zeros[:pad])
        return h.hexdigest().encode("ascii")

    def _add(self, path: str, values: np.ndarray) -> None:
        self.rows.setdefault(path, []).append(values)

    def _sample_rows(self, batch, p_full, r_full, kept, digests) -> None:
        w, lay, n = self.w, self.w.layout, batch.n_examples
        self._add(LENGTHS["prompt"], np.array([k[1] for k in kept], dtype=np.int32))
        self._add(LENGTHS["response"], np.array([k[3] for k in kept], dtype=np.int32))
        self._add(FULL_LENGTHS["prompt"], p_full.astype(np.int32))
        self._add(FULL_LENGTHS["response"], r_full.astype(np.int32))
        if w.token_ids:
            if batch.token_ids is None:
                raise CaptureError("this store keeps token ids but the batch has none")
            for part, width in (("prompt", lay.p_max), ("response", lay.r_max)):
                ids = np.full((n, width), -1, dtype=np.int32)
                for b, (p0, pk, r0, rk) in enumerate(kept):
                    start, count = (p0, pk) if part == "prompt" else (r0, rk)
                    ids[b, :count] = batch.token_ids[b, start : start + count]
                self._add(TOKEN_IDS[part], ids)
        self._add(SAMPLE_KEY, np.array(_sample_keys(batch), dtype="|S64"))
        self._add(DIGEST, np.array(digests, dtype="|S32"))
        for name in w.optional:
            values = batch.extras.get(name)
            if values is None:
                raise CaptureError(f"this store keeps {name} but the batch has none")
            if name == "split":
                values = [SPLITS.get(v, v) if isinstance(v, str) else v for v in values]
            self._add(OPTIONAL_ARRAYS[name][0], np.asarray(values, dtype=np.int8))

    def finish(self, out: ShardOutput) -> None:
        w = self.w
        arrays = self.root["arrays"]
        for path in sample_arrays(w.layout, token_ids=w.token_ids, optional=w.optional):
            array = arrays[path.split("/", 1)[1]]
            array[self.lo : self.lo + self.n_rows] = np.concatenate(self.rows[path])
            key = chunk_key(
                (self.lo // w.rows, *(0,) * (array.ndim - 1)), array.metadata.dimension_separator
            )
            if (self.directory / path / key).is_file():  # zarr skips chunks of fill values
                out.adopt(f"{path}/{key}")
        for part in PARTS:
            buf = io.BytesIO()
            np.save(buf, self.sums[part], allow_pickle=False)
            name = chunksums_name(part, self.index)
            out.declare(name)
            out.write(name, buf.getbuffer())

    def info(self) -> dict[str, dict[str, Any]]:
        return {chunksums_name(part, self.index): {"truncated": self.truncated} for part in PARTS}

    def chunk_files(self) -> list[str]:
        """The activation chunk files this shard put (checked through its chunk digests),
        in part, sample, layer, chunk order."""
        return [name for part in PARTS for name in self._chunks[part]]


def _sample_keys(batch: Batch) -> list[bytes]:
    keys = batch.extras.get("sample_key")
    if keys is None:
        prompts, responses = _batch_texts(batch)
        p_full, r_full = _batch_lengths(batch)
        keys = [
            sample_key(
                prompt=None if prompts is None else prompts[b],
                response=None if responses is None else responses[b],
                prompt_ids=None if batch.token_ids is None else batch.token_ids[b, : p_full[b]],
                response_ids=None
                if batch.token_ids is None
                else batch.token_ids[b, p_full[b] : p_full[b] + r_full[b]],
                fallback=str(int(batch.example_ids[b])),
            )
            for b in range(batch.n_examples)
        ]
    return [k if isinstance(k, bytes) else str(k).encode("ascii") for k in keys]


def _batch_lengths(batch: Batch) -> tuple[np.ndarray, np.ndarray]:
    n, t = batch.n_examples, batch.n_tokens
    if "prompt_len" in batch.extras:
        p = np.asarray(batch.extras["prompt_len"], dtype=np.int64).reshape(n)
        r = np.asarray(batch.extras.get("response_len", np.zeros(n)), dtype=np.int64).reshape(n)
    else:
        p, r = np.full(n, t, dtype=np.int64), np.zeros(n, dtype=np.int64)
    if (p < 0).any() or (r < 0).any() or (p + r > t).any():
        raise CaptureError(
            f"prompt_len + response_len must fit the batch's {t} tokens; got "
            f"{p.tolist()} + {r.tolist()}"
        )
    return p, r


def _full_lengths(batch: Batch, p: np.ndarray, r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The untruncated lengths: ``extras["prompt_len_full"]``/``["response_len_full"]`` when a
    batch carries tokens already truncated (a merge of stored samples), else the batch's own."""
    n = batch.n_examples
    p = np.asarray(batch.extras.get("prompt_len_full", p), dtype=np.int64).reshape(n)
    r = np.asarray(batch.extras.get("response_len_full", r), dtype=np.int64).reshape(n)
    return p, r


def _batch_texts(batch: Batch) -> tuple[list[str] | None, list[str] | None]:
    prompts = batch.extras.get("prompt_text", batch.texts)
    responses = batch.extras.get("response_text")
    return (
        None if prompts is None else [str(t) for t in prompts],
        None if responses is None else [str(t) for t in responses],
    )


__all__ = ["ZarrWriter", "plan_store", "store_attrs"]
