"""Write one prompt/response store (``activations.zarr``) from capture batches.

Each batch holds ``B`` samples laid out as prompt tokens then response tokens (then padding)
along the token axis, with ``Batch.extras["prompt_len"]`` and ``["response_len"]`` giving the
full lengths. A batch without them is stored as prompts only (response length 0), so any
capture or conversion can target this format. The writer truncates to ``P_max``/``R_max``,
casts to float16, and writes ``(B, L, P_max, H)`` and ``(B, L, R_max, H)`` slabs: whole
chunks, since chunks are ``(1, 1, T_chunk, H)``. Chunks that would hold only padding are not
stored (zarr's default; readers return the fill value 0 for them, bit-exactly).

Besides the spec's arrays the writer keeps the untruncated lengths, token ids (fill -1),
an xxh3-128 digest per sample (``verify`` recomputes it), exact running statistics per
site in ``meta/statistics.json``, computed from the activations as captured (before the
float16 cast) over every stored (unpadded) prompt and response token, and an xxh3-64
digest of every activation chunk file in ``meta/chunksums.<part>.npy`` (uint64
``[n_samples, n_layers, n_chunks]``, 0 for a chunk not stored): readers check each chunk
they read against it, and a chunk it lists but the store lacks is an error, not zeros.
The writer holds the store's lock (:mod:`actstore.storage.lock`) while it writes, in
``.<name>.resumable.partial`` beside the store. Every ``checkpoint_s`` seconds (at the end
of a ``write``) it makes its state durable: buffered per-sample rows are written, files
synced, the chunk checksums saved, then ``meta/progress.json`` records the samples written
with the statistics, truncation counts and text file sizes. A rerun with the same
fingerprint resumes from the last checkpoint (``resume_from``); the result equals an
uninterrupted capture. Other unfinished writes of the store (dead writers') are removed.

Example:
    >>> writer = ZarrWriter.from_plan(plan, "out", ZarrOptions(r_max=64))  # doctest: +SKIP
    >>> for batch in batches: writer.write(batch)  # doctest: +SKIP
    >>> writer.close()  # doctest: +SKIP
    PosixPath('out/activations.zarr')
"""

from __future__ import annotations

import ctypes
import datetime as dt
import hashlib
import json
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from ..._version import __version__
from ...batch import SPLITS, Batch, CapturePlan, sample_key
from ...errors import CaptureError, ConfigError, CorruptStoreError, StoreExistsError
from ...faults import point
from ...stats import RunningStats
from ...storage import atomic_write_json, read_json
from ...storage.local import atomic_write
from ...storage.lock import StoreLock
from ..base import WriterBase
from .layout import (
    ACT_DTYPE,
    ACTIVATIONS,
    CHUNKSUMS,
    CONFIG_FILE,
    DIGEST,
    FORMAT_TAG,
    FULL_LENGTHS,
    LENGTHS,
    PARTS,
    SAMPLE_KEY,
    SCHEMA_VERSION,
    STATISTICS_FILE,
    STORE_NAME,
    TEXT_FILES,
    TOKEN_IDS,
    ZarrLayout,
    choose_layout,
    chunk_key,
)
from .options import ZarrOptions
from .store import (
    OPTIONAL_ARRAYS,
    RowAppender,
    byte_view,
    create_arrays,
    publish,
    sample_arrays,
    zarr_module,
)

#: The writer's last checkpoint inside its unfinished store (removed before publishing).
PROGRESS_FILE = "meta/progress.json"

log = logging.getLogger(__name__)


def store_path(out: str | Path) -> Path:
    """``out`` itself if it ends in ``.zarr``, else ``out/activations.zarr``."""
    out = Path(out).expanduser()
    return out if out.suffix == ".zarr" else out / STORE_NAME


def plan_lengths(plan: CapturePlan) -> tuple[np.ndarray, np.ndarray]:
    """Full prompt and response lengths of every sample of ``plan``.

    A prompt/response source puts them in ``plan.extras``; otherwise every example is a
    prompt of ``tokens_per_example`` tokens with no response.
    """
    if "prompt_lengths" in plan.extras:
        return (
            np.asarray(plan.extras["prompt_lengths"], dtype=np.int64),
            np.asarray(plan.extras["response_lengths"], dtype=np.int64),
        )
    return (
        np.full(plan.n_examples, plan.tokens_per_example, dtype=np.int64),
        np.zeros(plan.n_examples, dtype=np.int64),
    )


def store_attrs(
    plan: CapturePlan, options: ZarrOptions, choice_attrs: dict[str, Any], layout: ZarrLayout
) -> dict[str, Any]:
    """The global attributes (``.zattrs``) of a store captured by ``plan``.

    The writer adds the truncation record of the samples it stored and the creation time.
    """
    dataset = options.dataset_name or Path(plan.dataset_root).name or plan.dataset_root
    attrs = {
        "model_id": plan.ckpt,
        "model_family": plan.family,
        "model_num_layers": plan.n_model_layers,
        "dataset": dataset,
        "dataset_root": plan.dataset_root,
        "statistics": STATISTICS_FILE,
        "config": CONFIG_FILE,
        "actstore_version": __version__,
        "git_commit": _git_commit(),
        **choice_attrs,
        **layout_attrs(layout),
    }
    attrs["fingerprint"] = fingerprint(attrs, plan.data, options)
    return attrs


def layout_attrs(layout: ZarrLayout) -> dict[str, Any]:
    """The attributes every store carries about its layout (the writer always sets them)."""
    return {
        "format": FORMAT_TAG,
        "schema_version": SCHEMA_VERSION,
        "num_layers": layout.n_layers,
        "layers": list(layout.layers),
        "sites": list(layout.sites),
        "hidden_size": layout.hidden_size,
        "dtype": "float16",
        "n_samples": layout.n_samples,
        "P_max": layout.p_max,
        "R_max": layout.r_max,
        "T_max": layout.p_max + layout.r_max,
        "T_chunk_prompt": layout.t_chunk_prompt,
        "T_chunk_response": layout.t_chunk_response,
        "chunks": {p: list(layout.chunk_shape(p)) for p in PARTS},
        "prompt_keep": layout.prompt_keep,
        "layout": layout.to_dict(),
    }


def fingerprint(attrs: dict[str, Any], data: dict[str, Any], options: ZarrOptions) -> str:
    """sha256 of what determines a store's content (a rerun with the same one is a no-op)."""
    keep = {
        k: v
        for k, v in attrs.items()
        if k not in ("git_commit", "actstore_version", "fingerprint", "shard")
    }
    text = json.dumps(
        {"attrs": keep, "data": data, "options": options.__dict__}, sort_keys=True, default=str
    )
    return hashlib.sha256(text.encode()).hexdigest()


def _git_commit() -> str | None:
    """The git commit of the actstore checkout that wrote the store, when it is one."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


class ZarrWriter(WriterBase):
    """Writes one store; nothing is visible at ``path`` until :meth:`close` publishes it.

    ``id_offset`` is the global id of this store's first sample (shards of a run); batches
    must arrive in id order. ``complete`` is True when ``path`` already holds a store with
    the same fingerprint (the capture is done); any other existing store is refused.
    ``out_dir``: the directory the capture was given (default ``path``), which the names of
    :meth:`sealed_files` are relative to.
    """

    def __init__(
        self,
        layout: ZarrLayout,
        path: str | Path,
        *,
        attrs: dict[str, Any],
        config: dict[str, Any] | None = None,
        id_offset: int = 0,
        token_ids: bool = True,
        optional: tuple[str, ...] = (),
        break_lock: bool = False,
        checkpoint_s: float = 30.0,
        out_dir: str | Path | None = None,
    ) -> None:
        self.layout = layout
        self.final_path = Path(path).expanduser().resolve()
        self.attrs = dict(attrs)
        self.config = config or {}
        self.id_offset = int(id_offset)
        self.token_ids = token_ids
        for name in optional:
            if name not in OPTIONAL_ARRAYS:
                raise ConfigError(
                    f"unknown optional array {name!r}; known: {list(OPTIONAL_ARRAYS)}"
                )
        self.optional = tuple(optional)
        self.complete = False
        self.resume_from = 0
        self._written = 0
        self._durable = 0
        #: The directory the capture was given (``sealed_files`` names are relative to it).
        self.out_dir = Path(out_dir).expanduser().resolve() if out_dir else self.final_path
        self._tmp: Path | None = None
        self._lock = StoreLock.acquire(self.final_path, break_lock=break_lock)
        if self.final_path.exists():
            self._lock.release()
            self._check_existing()
            return
        self.checkpoint_s = checkpoint_s
        self._last_checkpoint = time.monotonic()
        self._tmp = self.final_path.parent / f".{self.final_path.name}.resumable.partial"
        self._remove_stale_partials()
        self._chunksums = {
            p: np.zeros((layout.n_samples, layout.n_layers, layout.n_chunks(p)), dtype="<u8")
            for p in PARTS
        }
        self._stats = [RunningStats(layout.hidden_size) for _ in layout.sites]
        self._truncated = {p: 0 for p in PARTS}
        self._texts: dict[str, Any] | None = None
        progress = self._read_progress()
        if progress is None:
            if self._tmp.exists():
                shutil.rmtree(self._tmp)
            self._tmp.mkdir(parents=True)
            self._root = create_arrays(
                self._tmp, layout, token_ids=token_ids, optional=self.optional
            )
        else:
            self._root = zarr_module().open_group(str(self._tmp), mode="r+", zarr_format=2)
        arrays = self._root["arrays"]
        self._acts = {p: arrays[ACTIVATIONS[p].split("/", 1)[1]] for p in PARTS}
        written = 0 if progress is None else int(progress["written"])
        self._rows = {
            path: RowAppender(arrays[path.split("/", 1)[1]], written)
            for path in self._sample_array_paths()
        }
        if progress is not None:
            self._resume(progress)

    def _read_progress(self) -> dict[str, Any] | None:
        """The last checkpoint of an unfinished write of this same store, if any."""
        path = self._tmp / PROGRESS_FILE
        if not path.exists():
            return None
        try:
            progress = read_json(path)
            ok = (
                progress["fingerprint"] == self.attrs.get("fingerprint")
                and progress["layout"] == self.layout.to_dict()
                and progress["optional"] == list(self.optional)
                and progress["token_ids"] == self.token_ids
            )
        except (CorruptStoreError, KeyError, TypeError) as err:
            log.warning("%s is unreadable (%s); starting over", path, err)
            return None
        if not ok:
            log.warning("%s belongs to another capture; starting over", self._tmp)
            return None
        return progress

    def _resume(self, progress: dict[str, Any]) -> None:
        self._written = self._durable = int(progress["written"])
        self.resume_from = self.id_offset + self._written
        self._stats = [RunningStats.from_dict(d) for d in progress["stats"]]
        self._truncated = {p: int(progress["truncated"][p]) for p in PARTS}
        for part in PARTS:
            self._chunksums[part][:] = np.load(self._tmp / CHUNKSUMS[part], allow_pickle=False)
        texts = progress["texts"]
        if texts is not None:
            self._texts = {}
            for part, size in texts.items():
                f = (self._tmp / TEXT_FILES[part]).open("r+", encoding="utf-8")
                f.truncate(size)
                f.seek(size)
                self._texts[part] = f
        log.info("resuming %s at sample %d", self._tmp, self._written)
        point("zarr.resumed")

    def _checkpoint(self) -> None:
        """Make everything written so far durable, then record it (see the module doc)."""
        for appender in self._rows.values():
            appender.checkpoint()
        sizes = None
        if self._texts is not None:
            sizes = {}
            for part, f in self._texts.items():
                f.flush()
                os.fsync(f.fileno())
                sizes[part] = f.tell()
        (self._tmp / "meta").mkdir(exist_ok=True)
        for part in PARTS:
            with atomic_write(self._tmp / CHUNKSUMS[part]) as f:
                np.save(f, self._chunksums[part])
        _sync_filesystem(self._tmp)
        point("zarr.synced")
        atomic_write_json(
            self._tmp / PROGRESS_FILE,
            {
                "fingerprint": self.attrs.get("fingerprint"),
                "layout": self.layout.to_dict(),
                "optional": list(self.optional),
                "token_ids": self.token_ids,
                "written": self._written,
                "stats": [s.to_dict() for s in self._stats],
                "truncated": self._truncated,
                "texts": sizes,
            },
            indent=None,
        )
        self._last_checkpoint = time.monotonic()
        self._durable = self._written
        point("zarr.checkpointed")

    @classmethod
    def from_plan(
        cls, plan: CapturePlan, out: str | Path, options: ZarrOptions | None = None
    ) -> ZarrWriter:
        """The writer for a capture plan: ``out/activations.zarr`` (or ``out`` if it ends in
        ``.zarr``), with ``P_max``/``R_max``/``T_chunk`` chosen from the plan's lengths."""
        layout, kwargs = _plan_writer_args(plan, options or ZarrOptions())
        return cls(layout, store_path(out), out_dir=out, **kwargs)

    @classmethod
    def for_shard(
        cls,
        plan: CapturePlan,
        run_dir: str | Path,
        index: int,
        n_shards: int,
        options: ZarrOptions | None = None,
    ) -> ZarrWriter:
        """The writer of shard ``index`` of ``n_shards`` of a sharded run of ``plan``: the
        layout is chosen from the whole plan, so every shard agrees; the writer takes the
        examples of its :attr:`example_range` (capture feeds it only those)."""
        from .shards import shard_writer

        layout, kwargs = _plan_writer_args(plan, options or ZarrOptions())
        return shard_writer(layout, run_dir, index, n_shards, **kwargs)

    @property
    def example_range(self) -> tuple[int, int]:
        """Global ids ``(start, stop)`` of the samples this store holds."""
        return self.id_offset, self.id_offset + self.layout.n_samples

    def _sample_array_paths(self) -> list[str]:
        return list(sample_arrays(self.layout, token_ids=self.token_ids, optional=self.optional))

    def _check_existing(self) -> None:
        from .reader import ZarrReader

        found = ZarrReader(self.final_path).attrs.get("fingerprint")
        if found is None or found != self.attrs.get("fingerprint"):
            raise StoreExistsError(
                f"{self.final_path} already holds a different store (another model, dataset, "
                "layout or options); choose another --out or move it away"
            )
        self.complete = True
        self.resume_from = self.id_offset + self.layout.n_samples
        log.info(
            "%s is already published with the same fingerprint; nothing to write", self.final_path
        )

    def _remove_stale_partials(self) -> None:
        """Delete unfinished writes of this store but the resumable one: holding its lock,
        no live writer has one."""
        parent = self.final_path.parent
        if parent.is_dir():
            for stale in sorted(parent.glob(f".{self.final_path.name}.*.partial")):
                if stale != self._tmp:
                    log.warning("removing %s, the unfinished write of a dead writer", stale)
                    shutil.rmtree(stale, ignore_errors=True)

    # ------------------------------------------------------------------ writing

    def write(self, batch: Batch) -> None:
        """Store ``batch``'s samples (ids must continue where the last batch ended; samples
        before that, e.g. before a shard's range, are skipped)."""
        if self.complete:
            raise CaptureError(f"{self.final_path} is already published")
        if self._tmp is None:
            raise CaptureError("this writer was closed or aborted")
        lay = self.layout
        lo = self._written
        keep = batch.example_ids >= self.id_offset + lo  # rows before this store's range
        if not keep.all():
            batch = batch.select(keep)
        n = batch.n_examples
        if n == 0:
            return
        expected = np.arange(self.id_offset + lo, self.id_offset + lo + n)
        if not np.array_equal(batch.example_ids, expected):
            raise CaptureError(
                f"batches must arrive in sample order: expected ids from "
                f"{self.id_offset + lo}, got {batch.example_ids[:4].tolist()}..."
            )
        if lo + n > lay.n_samples:
            raise CaptureError(f"more samples than the {lay.n_samples} this store was sized for")
        p_full, r_full = _batch_lengths(batch)
        kept = [lay.kept(int(p), int(r)) for p, r in zip(p_full, r_full)]
        # padded to whole chunks, as zarr stores edge chunks (the chunk digests need it)
        padded = {
            p: np.zeros(
                (n, lay.n_layers, lay.n_chunks(p) * lay.t_chunk(p), lay.hidden_size), ACT_DTYPE
            )
            for p in PARTS
        }
        prompt = padded["prompt"][:, :, : lay.p_max]
        response = padded["response"][:, :, : lay.r_max]
        for layer_idx, site in enumerate(lay.sites):
            tensor = batch.acts.get(site)
            if tensor is None:
                raise CaptureError(f"batch lacks site {site}; it has {sorted(batch.acts)}")
            if tuple(tensor.shape) != (n, batch.n_tokens, lay.hidden_size):
                raise CaptureError(
                    f"site {site} has shape {tuple(tensor.shape)}; expected "
                    f"({n}, {batch.n_tokens}, {lay.hidden_size})"
                )
            half = tensor.detach().to(torch.float16).numpy()
            exact = tensor.detach()
            if exact.dtype not in (torch.float32, torch.float64):
                exact = exact.to(torch.float32)
            exact = exact.numpy()
            stats = self._stats[layer_idx]  # over the stored tokens, as captured
            for b, (p0, pk, r0, rk) in enumerate(kept):
                prompt[b, layer_idx, :pk] = half[b, p0 : p0 + pk]
                response[b, layer_idx, :rk] = half[b, r0 : r0 + rk]
                if p0 + pk == r0:  # kept prompt and response tokens are adjacent
                    stats.update(exact[b, p0 : r0 + rk])
                else:
                    stats.update(exact[b, p0 : p0 + pk])
                    stats.update(exact[b, r0 : r0 + rk])
        self._acts["prompt"][lo : lo + n] = prompt
        self._acts["response"][lo : lo + n] = response
        for part, data in padded.items():
            self._chunksums[part][lo : lo + n] = chunk_digests(data, lay.n_chunks(part))
        self._append_sample_rows(batch, lo, p_full, r_full, kept, prompt, response)
        self._truncated["prompt"] += int(np.count_nonzero(p_full > lay.p_max))
        self._truncated["response"] += int(np.count_nonzero(r_full > lay.r_max))
        self._written += n
        point("zarr.written")
        if time.monotonic() - self._last_checkpoint >= self.checkpoint_s:
            self._checkpoint()

    def _append_sample_rows(
        self,
        batch: Batch,
        lo: int,
        p_full: np.ndarray,
        r_full: np.ndarray,
        kept: list[tuple[int, int, int, int]],
        prompt: np.ndarray,
        response: np.ndarray,
    ) -> None:
        n, lay, extras = batch.n_examples, self.layout, batch.extras
        rows = self._rows
        rows[LENGTHS["prompt"]].append(np.array([k[1] for k in kept], dtype=np.int32))
        rows[LENGTHS["response"]].append(np.array([k[3] for k in kept], dtype=np.int32))
        rows[FULL_LENGTHS["prompt"]].append(p_full.astype(np.int32))
        rows[FULL_LENGTHS["response"]].append(r_full.astype(np.int32))
        if self.token_ids:
            if batch.token_ids is None:
                raise CaptureError("this store keeps token ids but the batch has none")
            for part, width in (("prompt", lay.p_max), ("response", lay.r_max)):
                ids = np.full((n, width), -1, dtype=np.int32)
                for b, (p0, pk, r0, rk) in enumerate(kept):
                    start, count = (p0, pk) if part == "prompt" else (r0, rk)
                    ids[b, :count] = batch.token_ids[b, start : start + count]
                rows[TOKEN_IDS[part]].append(ids)
        prompts, responses = _batch_texts(batch)
        keys = extras.get("sample_key")
        if keys is None:
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
                for b in range(n)
            ]
        keys = [k if isinstance(k, bytes) else str(k).encode("ascii") for k in keys]
        rows[SAMPLE_KEY].append(np.array(keys, dtype="|S64"))
        digests = [_digest(prompt[b], response[b]) for b in range(n)]
        rows[DIGEST].append(np.array(digests, dtype="|S32"))
        for name in self.optional:
            values = extras.get(name)
            if values is None:
                raise CaptureError(f"this store keeps {name} but the batch has none")
            if name == "split":
                values = [SPLITS.get(v, v) if isinstance(v, str) else v for v in values]
            rows[OPTIONAL_ARRAYS[name][0]].append(np.asarray(values, dtype=np.int8))
        self._write_texts(lo, keys, prompts, responses)

    def _write_texts(
        self, lo: int, keys: list[bytes], prompts: list[str] | None, responses: list[str] | None
    ) -> None:
        if self._texts is None:  # the first batch decides which text files exist
            self._texts = {}
            for part, texts in (("prompt", prompts), ("response", responses)):
                if texts is not None:
                    path = self._tmp / TEXT_FILES[part]
                    path.parent.mkdir(exist_ok=True)
                    self._texts[part] = path.open("w", encoding="utf-8")
        for part, texts in (("prompt", prompts), ("response", responses)):
            f = self._texts.get(part)
            if f is None:
                continue
            if texts is None:
                raise CaptureError(f"earlier batches had {part} texts but this one has none")
            for b, text in enumerate(texts):
                record = {"i": lo + b, "sample_key": keys[b].decode(), part: text}
                f.write(json.dumps(record, ensure_ascii=False) + "\n")

    def sealed_files(self) -> list[tuple[str, Path]]:
        """Activation chunk files of the samples up to the last checkpoint: synced, and never
        written again (a resumed write starts after them). Per-sample arrays, metadata and
        text files change until :meth:`close`, so they are not listed; nor is anything once
        the store is published or aborted (the publish sends it all)."""
        if self._tmp is None or not self._durable:
            return []
        prefix = self.final_path.relative_to(self.out_dir).as_posix()
        prefix = "" if prefix == "." else prefix + "/"
        out = []
        for part in PARTS:
            directory = ACTIVATIONS[part]
            sep = self._acts[part].metadata.dimension_separator
            for index in zip(*np.nonzero(self._chunksums[part][: self._durable])):
                key = f"{directory}/{chunk_key((*index, 0), sep)}"
                out.append((prefix + key, self._tmp / key))
        return out

    # ------------------------------------------------------------------ publish

    def close(self) -> Path:
        """Write the remaining rows, metadata and statistics; consolidate and publish."""
        if self.complete:
            return self.final_path
        if self._tmp is None:
            raise CaptureError("this writer was aborted; nothing to publish")
        lay = self.layout
        if self._written != lay.n_samples:
            self.abort()
            raise CaptureError(
                f"only {self._written} of {lay.n_samples} samples were written; "
                "nothing was published (rerun the capture)"
            )
        for appender in self._rows.values():
            appender.close()
        for f in (self._texts or {}).values():
            f.close()
        self._texts = {}
        (self._tmp / "meta").mkdir(exist_ok=True)
        atomic_write_json(
            self._tmp / STATISTICS_FILE,
            {"sites": {site: self._stats[i].to_dict() for i, site in enumerate(lay.sites)}},
            indent=None,
        )
        atomic_write_json(self._tmp / CONFIG_FILE, self.config)
        for part in PARTS:
            with atomic_write(self._tmp / CHUNKSUMS[part]) as f:
                np.save(f, self._chunksums[part])
        attrs = {**self.attrs, **layout_attrs(lay)}
        attrs.update(truncation_attrs_from_counts(self._truncated, lay.n_samples))
        attrs["created_at"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        attrs["optional_arrays"] = list(self.optional)
        attrs["text_files"] = [TEXT_FILES[p] for p in PARTS if (self._tmp / TEXT_FILES[p]).exists()]
        self._root.attrs.update(attrs)
        (self._tmp / PROGRESS_FILE).unlink(missing_ok=True)
        tmp, self._tmp = self._tmp, None
        point("zarr.closing")
        publish(tmp, self.final_path)
        point("zarr.published")
        self._lock.release()
        self.complete = True
        log.info(
            "published %s (%d samples, P_max %d, R_max %d)",
            self.final_path,
            lay.n_samples,
            lay.p_max,
            lay.r_max,
        )
        return self.final_path

    def abort(self) -> None:
        """Stop without publishing; the temporary store is kept only if it holds a
        checkpoint a rerun can resume from."""
        for f in (self._texts or {}).values():
            f.close()
        self._texts = {}
        if self._tmp is not None:
            if not (self._tmp / PROGRESS_FILE).exists():  # else a rerun resumes from it
                shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        if self._lock is not None:
            self._lock.release()


def _sync_filesystem(path: Path) -> None:
    """Flush every dirty page of the file system holding ``path`` (Linux ``syncfs``; the
    whole system's elsewhere): zarr writes chunk files through its own store, so they are
    not fsynced one by one."""
    try:
        syncfs = ctypes.CDLL(None, use_errno=True).syncfs
    except (AttributeError, OSError):
        os.sync()
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if syncfs(fd) != 0:
            os.sync()
    finally:
        os.close(fd)


def chunk_digests(data: np.ndarray, n_chunks: int) -> np.ndarray:
    """xxh3-64 of each activation chunk of ``data`` (``[n, L, n_chunks * T_chunk, H]``
    float16, zero-padded to whole chunks): uint64 ``[n, L, n_chunks]``, 0 where the chunk
    holds only zeros (zarr does not store it)."""
    n, n_layers = data.shape[:2]
    if n_chunks == 0:
        return np.zeros((n, n_layers, 0), dtype="<u8")
    chunks = data.reshape(n, n_layers, n_chunks, -1)
    stored = (chunks != 0).any(axis=3)
    out = np.zeros((n, n_layers, n_chunks), dtype="<u8")
    for index in zip(*np.nonzero(stored)):
        out[index] = xxhash.xxh3_64_intdigest(byte_view(chunks[index])) or 1
    return out


def plan_store(plan: CapturePlan, options: ZarrOptions) -> tuple[ZarrLayout, dict, dict]:
    """Layout, attributes and ``meta/config.json`` content of the store for ``plan``."""
    prompt_lengths, response_lengths = plan_lengths(plan)
    choice = choose_layout(
        n_samples=plan.n_examples,
        sites=[str(s) for s in plan.sites],
        layers=plan.layers,
        hidden_size=plan.d_model,
        prompt_lengths=prompt_lengths,
        response_lengths=response_lengths,
        p_max=options.p_max,
        r_max=options.r_max,
        quantile=options.quantile,
        t_chunk_prompt=options.t_chunk_prompt,
        t_chunk_response=options.t_chunk_response,
        prompt_keep=options.prompt_keep,
    )
    attrs = store_attrs(plan, options, choice.attrs, choice.layout)
    config = {
        "model": {
            "ckpt": plan.ckpt,
            "family": plan.family,
            "modality": plan.modality,
            "n_layers": plan.n_model_layers,
            "d_model": plan.d_model,
            "has_cls": plan.has_cls,
        },
        "sites": [str(s) for s in plan.sites],
        "classes": plan.classes,
        "dataset": {"root": plan.dataset_root, **plan.data},
        "options": dict(options.__dict__),
        "layout": choice.layout.to_dict(),
        "batch_size": plan.batch_size,
    }
    return choice.layout, attrs, config


def _plan_writer_args(plan: CapturePlan, options: ZarrOptions) -> tuple[ZarrLayout, dict[str, Any]]:
    layout, attrs, config = plan_store(plan, options)
    optional = tuple(k for k in OPTIONAL_ARRAYS if plan.extras.get(f"has_{k}"))
    return layout, {
        "attrs": attrs,
        "config": config,
        "token_ids": plan.has_tokens,
        "optional": optional,
    }


def truncation_attrs_from_counts(counts: dict[str, int], n: int) -> dict[str, Any]:
    """The spec's truncation record from per-part counts over ``n`` samples."""
    return {
        f"{p}_truncated_{k}": (counts[p] if k == "count" else counts[p] / n)
        for p in PARTS
        for k in ("count", "fraction")
    }


def _digest(prompt: np.ndarray, response: np.ndarray) -> bytes:
    h = xxhash.xxh3_128()
    h.update(byte_view(np.ascontiguousarray(prompt)))
    h.update(byte_view(np.ascontiguousarray(response)))
    return h.hexdigest().encode("ascii")


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


def _batch_texts(batch: Batch) -> tuple[list[str] | None, list[str] | None]:
    prompts = batch.extras.get("prompt_text", batch.texts)
    responses = batch.extras.get("response_text")
    return (
        None if prompts is None else [str(t) for t in prompts],
        None if responses is None else [str(t) for t in responses],
    )


__all__ = ["ZarrWriter", "plan_store", "store_attrs", "store_path"]
