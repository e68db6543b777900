"""Read prompt/response activation stores: one ``activations.zarr`` or a sharded run
(``manifest.json`` + ``shards/shard-XXXX.zarr``) through the same :class:`ZarrReader`.

Each store is opened as a :class:`~.meta.StoreMeta` (metadata checked against the root
manifest and the declared layout). Because the activation arrays are uncompressed Zarr v2,
a chunk file holds exactly ``T_chunk * H`` float16 values in C order; :meth:`ZarrReader.read`
reads the ``ceil(len / T_chunk)`` chunk files of one ``(sample, layer)``, each checked
against its keyed digest, touching no other chunk and no other file. A missing chunk is the
fill value 0, as in zarr. The reader holds no open files between calls, so it pickles into
DataLoader workers and each worker reads independently. Local directories and
``s3://bucket/prefix`` are read the same way, through :mod:`actstore.storage.files`.

:class:`ZarrReader` is built in layers: :mod:`.index` (the stores, opened and checked, and
their layout), :mod:`.access` (samples, batches, per-sample fields); this module adds the
loader's blocks, conversion, statistics, ``describe`` and ``verify``
(:mod:`.verify` checks each store's content).

Example:
    >>> import tempfile
    >>> from actstore.testing import FormatCase, make_acts, make_batches, make_plan
    >>> plan, out = make_plan(), tempfile.TemporaryDirectory()  # 6-token prompts, no response
    >>> batches = make_batches(plan, make_acts(plan))
    >>> r = ZarrReader(FormatCase("zarr").write(out.name, plan, batches))
    >>> r.read(12, "resid.3", "prompt").shape  # sample 12: (prompt_len[12], H)
    (6, 8)
    >>> batch = r.random_batch(4, np.random.default_rng(0), part="prompt")  # 4 samples x 2 layers
    >>> batch["acts"].shape
    (4, 2, 6, 8)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from ...batch import Batch, CapturePlan
from ...errors import ConfigError, CorruptStoreError
from ...sites import Site
from ...stats import RunningStats, merge_all
from ..blocks import Block
from ..report import VerifyReport
from .access import ZarrAccess
from .index import MANIFEST
from .layout import (
    ACT_DTYPE,
    FORMAT_TAG,
    FULL_LENGTHS,
    PARTS,
    RUN_FORMAT_TAG,
    SAMPLE_KEY,
    STATISTICS_FILE,
    STORE_NAME,
    TOKEN_IDS,
)
from .store import OPTIONAL_ARRAYS
from .verify import verify_store_content

if TYPE_CHECKING:
    import torch
else:
    from ..._lazy import torch


def detect(files) -> bool:
    """A run (``manifest.json`` of a zarr run), a store (``.zattrs`` with actstore's format
    tag) or a folder holding ``activations.zarr``; damaged metadata of ours is claimed."""
    for name, tag in (
        (MANIFEST, RUN_FORMAT_TAG),
        (".zattrs", FORMAT_TAG),
        (f"{STORE_NAME}/.zattrs", FORMAT_TAG),
    ):
        if not files.exists(name):
            continue
        try:
            doc = files.read_json(name)
        except CorruptStoreError:
            return name != MANIFEST
        return isinstance(doc, dict) and doc.get("format") == tag
    return False


class ZarrReader(ZarrAccess):
    """Random access, training batches and loader blocks over one store or a sharded run.

    Every method that takes a site takes any spelling (``"resid.6"``, ``6``, ``-1``...).
    ``cache_dir`` / ``cache_bytes`` / ``s3``: the local cache tier and S3 settings of a remote
    store (see :func:`~actstore.storage.files.open_files`; default ``$ACTSTORE_CACHE``).
    """

    format_name = "zarr"

    def __repr__(self) -> str:
        lay = self.layout
        return (
            f"ZarrReader({self.url!r}, n_samples={lay.n_samples}, sites={list(lay.sites)}, "
            f"P_max={lay.p_max}, R_max={lay.r_max}, H={lay.hidden_size}, "
            f"stores={len(self.stores)})"
        )

    # ------------------------------------------------------------------ blocks (loader)

    def site_blocks(self, site: Site) -> list[Block]:
        """One block per (sample, part) with at least one stored token, in storage order
        (sample 0 prompt, sample 0 response, sample 1 prompt, ...): the same list, up to the
        site, for every site. ``loc = (store, local sample, part 0/1, layer position)``."""
        layer_idx = self._layer_index(site)
        out = []
        for k, store in enumerate(self.stores):
            p, r = store.lengths["prompt"], store.lengths["response"]
            for local in range(store.n_samples):
                if p[local]:
                    out.append(Block(site=site, n_rows=int(p[local]), loc=(k, local, 0, layer_idx)))
                if r[local]:
                    out.append(Block(site=site, n_rows=int(r[local]), loc=(k, local, 1, layer_idx)))
        return out

    def read_block(self, block: Block, out: np.ndarray | None = None) -> np.ndarray:
        """Rows of ``block`` as ``[n_rows, H]`` float16, checked."""
        k, local, part_idx, layer_idx = block.loc
        if out is None:
            out = np.empty((block.n_rows, self.layout.hidden_size), dtype=ACT_DTYPE)
        elif out.shape != (block.n_rows, self.layout.hidden_size) or out.dtype != ACT_DTYPE:
            raise ConfigError(
                f"out must be float16 of shape {(block.n_rows, self.layout.hidden_size)}, not {out.dtype} {out.shape}"
            )
        self.stores[k].read_rows(PARTS[part_idx], local, layer_idx, out)
        return out

    def block_rows(self, block: Block) -> tuple[np.ndarray, np.ndarray]:
        """(global sample index, token position within its part) of each row of ``block``."""
        k, local, _, _ = block.loc
        return (
            np.full(block.n_rows, self.stores[k].offset + local, dtype=np.int64),
            np.arange(block.n_rows, dtype=np.int64),
        )

    # ------------------------------------------------------------------ conversion

    def capture_plan(self) -> CapturePlan:
        """The capture this store came from (``meta/config.json`` and the attributes). The
        plan's ``tokens_per_example`` is every sample's stored token count when they are
        all equal (a fixed-length store, which converts to any format), else ``P_max +
        R_max``; ``extras`` holds every sample's full prompt and response lengths."""
        lay, attrs = self.layout, self.attrs
        config = self.config
        model, dataset = config.get("model") or {}, dict(config.get("dataset") or {})
        family = str(model.get("family") or attrs.get("model_family") or "unknown")
        full_p, full_r = (
            self._concat(FULL_LENGTHS["prompt"]),
            self._concat(FULL_LENGTHS["response"]),
        )
        extras: dict[str, Any] = {}
        if (
            full_p is not None
            and full_r is not None
            and (full_r.any() or (full_p != lay.p_max).any())
        ):
            extras = {"prompt_lengths": full_p.tolist(), "response_lengths": full_r.tolist()}
        for name in self.attrs.get("optional_arrays", []):
            extras[f"has_{name}"] = True
        return CapturePlan(
            ckpt=str(model.get("ckpt") or attrs.get("model_id") or "unknown"),
            family=family,
            modality=str(model.get("modality") or "text"),
            sites=self.sites,
            n_model_layers=int(
                model.get("n_layers") or attrs.get("model_num_layers") or max(lay.layers) + 1
            ),
            d_model=lay.hidden_size,
            tokens_per_example=self._width(),
            has_cls=bool(model.get("has_cls", False)),
            n_examples=lay.n_samples,
            dataset_root=str(dataset.pop("root", None) or attrs.get("dataset_root") or ""),
            data=dataset,
            classes=config.get("classes"),
            has_labels=False,
            has_tokens=self._concat(TOKEN_IDS["prompt"]) is not None,
            batch_size=int(config.get("batch_size") or 32),
            extras=extras,
        )

    def _width(self) -> int:
        """Tokens per example of a fixed-length store, else ``P_max + R_max``."""
        lengths = self.prompt_len + self.response_len
        if len(lengths) and (lengths == lengths[0]).all():
            return int(lengths[0])
        return self.layout.p_max + self.layout.r_max

    def example_batches(self, batch_size: int, start: int = 0) -> Iterator[Batch]:
        """The stored samples as capture batches: prompt then response tokens (padded to
        ``P_max + R_max``), their full lengths, token ids, texts, keys and optional arrays:
        what a capture of this store's layout hands a writer."""
        lay = self.layout
        width = self._width()
        keys = self._concat(SAMPLE_KEY)
        full = {p: self._concat(FULL_LENGTHS[p]) for p in PARTS}
        optional = {
            name: self._concat(OPTIONAL_ARRAYS[name][0])
            for name in self.attrs.get("optional_arrays", [])
        }
        ids = self.tokens
        for lo in range(start, lay.n_samples, batch_size):
            hi = min(lo + batch_size, lay.n_samples)
            n = hi - lo
            acts = {s: np.zeros((n, width, lay.hidden_size), np.float32) for s in lay.sites}
            p_len, r_len = self.prompt_len[lo:hi], self.response_len[lo:hi]
            token_ids = None if ids is None else np.zeros((n, width), np.int64)
            for j, i in enumerate(range(lo, hi)):
                p, r = int(p_len[j]), int(r_len[j])
                for li, site in enumerate(lay.sites):
                    acts[site][j, :p] = self.read_index(i, li, "prompt")
                    acts[site][j, p : p + r] = self.read_index(i, li, "response")
                if token_ids is not None and ids is not None:  # both or neither
                    token_ids[j, :p] = ids[i, :p]
                    token_ids[j, p : p + r] = ids[i, lay.p_max : lay.p_max + r]
            extras: dict[str, Any] = {
                "prompt_len": p_len.astype(np.int64),
                "response_len": r_len.astype(np.int64),
            }
            for part in PARTS:
                part_full = full[part]
                if part_full is not None:
                    extras[f"{part}_len_full"] = part_full[lo:hi].astype(np.int64)
            if keys is not None:
                extras["sample_key"] = list(keys[lo:hi])
            for name, values in optional.items():
                if values is not None:
                    extras[name] = values[lo:hi]
            prompts = [self.text(i, "prompt") for i in range(lo, hi)]
            texts = [t for t in prompts if t is not None]
            responses = [self.text(i, "response") for i in range(lo, hi)]
            if responses[0] is not None:
                extras["response_text"] = responses
            yield Batch(
                acts={s: torch.from_numpy(a) for s, a in acts.items()},
                example_ids=np.arange(lo, hi, dtype=np.int64),
                token_ids=token_ids,
                texts=texts if len(texts) == n else None,
                extras=extras,
            )

    # ------------------------------------------------------------------ statistics

    def site_statistics(self, site: Site) -> RunningStats | None:
        """Exact running statistics of ``site`` over every stored token (merged over shards)."""
        if site not in self._stats:
            parts = []
            for store in self.stores:
                if not store.exists(STATISTICS_FILE):
                    return None
                doc = store.checks.read_json(STATISTICS_FILE)
                try:
                    parts.append(RunningStats.from_dict(doc["sites"][str(site)]))
                except (KeyError, TypeError) as err:
                    raise CorruptStoreError(
                        f"{store.url_of(STATISTICS_FILE)} has no statistics for {site}"
                    ) from err
            self._stats[site] = merge_all(parts)
        return self._stats[site]

    # ------------------------------------------------------------------ summary / verify

    def describe_format(self) -> dict[str, Any]:
        lay = self.layout
        trunc = {p: sum(s.attrs.get(f"{p}_truncated_count", 0) for s in self.stores) for p in PARTS}
        n_files = (
            sum(len(s.files.list()) for s in self.stores)
            if len(self.stores) > 1
            else len(self.files.list())
        )
        return {
            "format": f"zarr v2 prompt/response store ({FORMAT_TAG} {self.attrs.get('schema_version')})",
            "shape": (
                f"{lay.n_samples} samples x {lay.n_layers} sites {list(lay.sites)} x "
                f"(P_max {lay.p_max} + R_max {lay.r_max}) tokens x {lay.hidden_size} dims float16"
            ),
            "files": n_files,
            "n_samples": lay.n_samples,
            "P_max": lay.p_max,
            "R_max": lay.r_max,
            "chunks": f"prompt (1, 1, {lay.t_chunk_prompt}, {lay.hidden_size}), response "
            f"(1, 1, {lay.t_chunk_response}, {lay.hidden_size})",
            "truncated": f"{trunc['prompt']} prompts, {trunc['response']} responses",
            "stored_tokens": f"{int(self.prompt_len.sum())} prompt, {int(self.response_len.sum())} response",
            "stores": len(self.stores),
        }

    def verify(self, *, progress: Any = None) -> VerifyReport:
        """Every file each store's root manifest lists, every activation chunk against its
        keyed digest (and every chunk file present is one the digests record), every
        sample's content digest, the lengths, text files, statistics and non-finite values."""
        report = VerifyReport(self.url)
        if self.manifest is not None:
            n_files, n_bytes = self.checks.verify(report.faults, progress=progress)
            report.files_checked += n_files
            report.bytes_checked += n_bytes
        non_finite = 0
        for store in self.stores:
            n_files, n_bytes = store.checks.verify(report.faults, progress=progress)
            report.files_checked += n_files
            report.bytes_checked += n_bytes
            non_finite += verify_store_content(store, report, progress)
        if non_finite:
            report.notes.append(f"{non_finite} activation values are NaN or infinite")
        return report

    def close(self) -> None:
        for store in self.stores:
            store.files.close()
        self.files.close()
