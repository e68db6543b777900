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

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ...batch import Batch, CapturePlan
from ...errors import ConfigError, CorruptStoreError, IndexOutOfRangeError, StoreNotFoundError
from ...sites import Site
from ...stats import RunningStats, merge_all
from ...storage.integrity import Integrity
from ...storage.local import load_json
from ..base import Block, ReaderBase, VerifyReport, summary_of
from ..metacheck import Fields
from .layout import (
    ACT_DTYPE,
    CONFIG_FILE,
    FORMAT_TAG,
    FULL_LENGTHS,
    PARTS,
    RUN_FORMAT_TAG,
    SAMPLE_KEY,
    STATISTICS_FILE,
    STORE_NAME,
    TEXT_FILES,
    TOKEN_IDS,
)
from .meta import StoreMeta
from .store import OPTIONAL_ARRAYS
from .verify import verify_store_content

if TYPE_CHECKING:
    import torch
else:
    from ..._lazy import torch

MANIFEST = "manifest.json"


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


class ZarrReader(ReaderBase):
    """Random access, training batches and loader blocks over one store or a sharded run.

    Every method that takes a site takes any spelling (``"resid.6"``, ``6``, ``-1``...).
    ``cache_dir`` / ``cache_bytes`` / ``s3``: the local cache tier and S3 settings of a remote
    store (see :func:`~actstore.storage.files.open_files`; default ``$ACTSTORE_CACHE``).
    """

    format_name = "zarr"

    def open_index(self) -> None:
        """The store's (or each store of a run's) metadata, digests and lengths, checked."""
        self.manifest: dict[str, Any] | None = None
        if self.files.exists(MANIFEST):
            self.stores = self._open_run()
        else:
            root = self.location
            if not self.files.exists(".zmetadata") and self.files.exists(
                f"{STORE_NAME}/.zmetadata"
            ):
                root = root.child(STORE_NAME)
                self.location = root
                self.files = root.files(**self.cache_options)
            elif not self.files.exists(".zmetadata") and any(
                n.startswith("shards/") for n in self.files.list()
            ):
                raise StoreNotFoundError(
                    f"{self.url} has shards but no {MANIFEST} (written last): an unfinished "
                    "run or copy; write it with write_manifest, or rerun the copy"
                )
            self.stores = [StoreMeta.open(root, verify_reads=self.verify_reads, files=self.files)]
            self.checks = self.stores[0].checks
        first = self.stores[0]
        self.layout = first.layout.with_samples(sum(s.n_samples for s in self.stores))
        self._starts = np.array([s.offset for s in self.stores], dtype=np.int64)
        self.prompt_len = np.concatenate([s.lengths["prompt"] for s in self.stores])
        self.response_len = np.concatenate([s.lengths["response"] for s in self.stores])
        self._stats: dict[Site, RunningStats] = {}
        self._text_index: dict[tuple[int, str], np.ndarray] = {}

    def check_summary(self) -> None:
        """Each store against what its writer published (a run's own manifest lists only
        ``manifest.json``)."""
        for store in self.stores:
            rows = int(store.lengths["prompt"].sum()) + int(store.lengths["response"].sum())
            store.checks.check_summary(
                summary_of(
                    sites=store.layout.sites, d_model=self.d_model, dtype="float16", rows=rows
                )
            )

    def _open_run(self) -> list[StoreMeta]:
        """The stores of a run, checked against its manifest (and the run's root manifest)."""
        self.checks = Integrity.open(
            self.files, ours=True, verify_reads=self.verify_reads, format="zarr"
        )
        where = self.files.url_of(MANIFEST)
        manifest = self.checks.read_json(MANIFEST)
        if not isinstance(manifest, dict) or manifest.get("format") != RUN_FORMAT_TAG:
            raise CorruptStoreError(f"{where} is not an actstore zarr run manifest")
        try:
            entries = list(manifest["shards"])
            total = int(manifest["n_samples"])
        except (KeyError, TypeError, ValueError) as err:
            raise CorruptStoreError(f"{where} lacks {err}; re-create the manifest") from None
        stores: list[StoreMeta] = []
        start = 0
        for entry in entries:
            store = StoreMeta.open(
                self.location.child(str(entry["path"])),
                offset=start,
                verify_reads=self.verify_reads,
                cache=self.cache_options,
            )
            if int(entry["start"]) != start or int(entry["n_samples"]) != store.n_samples:
                raise CorruptStoreError(
                    f"{where}: shard {entry['path']} should start at {start} with "
                    f"{store.n_samples} samples; it says {entry}"
                )
            if stores and not store.layout.same_bytes_as(stores[0].layout):
                raise CorruptStoreError(
                    f"{store.location} has another layout than {stores[0].location}"
                )
            stores.append(store)
            start += store.n_samples
        if not stores or start != total:
            raise CorruptStoreError(f"{where} declares {total} samples; its shards hold {start}")
        self.manifest = manifest
        return stores

    @property
    def stores_paths(self) -> list[str]:
        return [s.location.url for s in self.stores]

    # ------------------------------------------------------------------ properties

    @property
    def attrs(self) -> dict[str, Any]:
        """Global attributes (of the first store, for a run)."""
        return self.stores[0].attrs

    @property
    def config(self) -> dict[str, Any]:
        """``meta/config.json`` of the first store ({} if absent)."""
        first = self.stores[0]
        if not first.exists(CONFIG_FILE):
            return {}
        doc = first.checks.read_json(CONFIG_FILE)
        f = Fields(doc, first.url_of(CONFIG_FILE))
        model = f.obj("model", optional=True)
        if model is not None:
            m = Fields(model, f"{first.url_of(CONFIG_FILE)}: model")
            for key in ("ckpt", "family", "modality"):
                m.text(key, optional=True)
            m.count("n_layers", lo=1, optional=True)
            m.flag("has_cls", optional=True)
        f.obj("dataset", optional=True)
        f.obj("options", optional=True)
        f.texts("classes", optional=True)
        f.count("batch_size", lo=1, optional=True)
        return doc

    @property
    def sites(self) -> tuple[Site, ...]:
        return tuple(Site.parse(s) for s in self.layout.sites)

    @property
    def layers(self) -> tuple[int, ...]:
        return self.layout.layers

    @property
    def family(self) -> str:
        return str(self.attrs.get("model_family") or "unknown")

    @property
    def n_model_layers(self) -> int:
        return int(self.attrs.get("model_num_layers") or max(self.layout.layers) + 1)

    @property
    def d_model(self) -> int:
        return self.layout.hidden_size

    @property
    def dtype(self) -> np.dtype:
        return ACT_DTYPE

    @property
    def n_samples(self) -> int:
        return self.layout.n_samples

    @property
    def n_examples(self) -> int:
        return self.layout.n_samples

    @property
    def tokens_per_example(self) -> int:
        """``P_max + R_max``: ``reader[...]``'s token axis is the padded prompt, then the
        padded response."""
        return self.layout.p_max + self.layout.r_max

    def n_rows(self, site: Any) -> int:
        self.site(site)
        return int(self.prompt_len.sum()) + int(self.response_len.sum())

    def lengths(self, part: str) -> np.ndarray:
        """Stored (capped) lengths of ``part`` for every sample."""
        if part not in PARTS:
            raise ConfigError(f"part must be 'prompt' or 'response', not {part!r}")
        return self.prompt_len if part == "prompt" else self.response_len

    def __repr__(self) -> str:
        lay = self.layout
        return (
            f"ZarrReader({self.url!r}, n_samples={lay.n_samples}, sites={list(lay.sites)}, "
            f"P_max={lay.p_max}, R_max={lay.r_max}, H={lay.hidden_size}, "
            f"stores={len(self.stores)})"
        )

    def _layer_index(self, site: Any) -> int:
        return self.layout.sites.index(str(self.site(site)))

    # ------------------------------------------------------------------ locating

    def locate(self, index: int) -> tuple[int, int]:
        """``(store number, local index)`` of global sample ``index`` (the manifest mapping)."""
        n = self.layout.n_samples
        if not -n <= index < n:
            raise IndexOutOfRangeError(f"sample {index} out of range (0..{n - 1})")
        index = int(index) % n
        if len(self.stores) == 1:
            return 0, index
        k = int(np.searchsorted(self._starts, index, side="right")) - 1
        return k, index - self.stores[k].offset

    # ------------------------------------------------------------------ random access

    def read(
        self,
        i: int,
        site: Any,
        part: str = "prompt",
        *,
        trim: bool = True,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """Activations of sample ``i`` at ``site`` for ``part``: ``(len_i, H)`` float16 with
        ``trim`` (the stored real tokens), else ``(P_max or R_max, H)`` zero-padded.

        Reads only the chunks of this ``(sample, layer)`` that hold the requested tokens,
        each checked.

        Example:
            >>> import tempfile
            >>> from actstore.testing import FormatCase, make_acts, make_batches, make_plan
            >>> plan, out = make_plan(), tempfile.TemporaryDirectory()  # 6-token prompts
            >>> batches = make_batches(plan, make_acts(plan))
            >>> reader = ZarrReader(FormatCase("zarr").write(out.name, plan, batches))
            >>> reader.read(0, "resid.3", "prompt").shape, reader.read(0, 3, trim=False).shape
            ((6, 8), (6, 8))
        """
        return self.read_index(i, self._layer_index(site), part, trim=trim, out=out)

    def read_index(
        self,
        i: int,
        layer_idx: int,
        part: str = "prompt",
        *,
        trim: bool = True,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """:meth:`read` with the position on the ``L`` axis instead of the site."""
        lay = self.layout
        max_len = lay.max_len(part)  # checks part
        if not 0 <= layer_idx < lay.n_layers:
            raise IndexOutOfRangeError(
                f"layer position {layer_idx} out of range (0..{lay.n_layers - 1})"
            )
        k, local = self.locate(i)
        store = self.stores[k]
        n_real = int(store.lengths[part][local])
        n_rows = n_real if trim else max_len
        if out is None:
            out = np.empty((n_rows, lay.hidden_size), dtype=ACT_DTYPE)
        elif (
            out.shape != (n_rows, lay.hidden_size)
            or out.dtype != ACT_DTYPE
            or not out.flags.c_contiguous
        ):
            raise ConfigError(
                f"out must be a C-contiguous float16 array of shape "
                f"{(n_rows, lay.hidden_size)}, not {out.dtype} {out.shape}"
            )
        store.read_rows(part, local, layer_idx, out[:n_real])
        out[n_real:] = 0  # padding is zeros (the writer stores it so; verify checks it)
        return out

    def read_examples(
        self, examples: np.ndarray, sites: Sequence[Site], tokens: slice | np.ndarray
    ) -> np.ndarray:
        """Over the padded ``P_max + R_max`` tokens (prompt then response, float16; zeros
        past each part's length), checked."""
        lay = self.layout
        layer_ids = [self._layer_index(site) for site in sites]
        out = np.zeros(
            (len(examples), len(layer_ids), lay.p_max + lay.r_max, lay.hidden_size), ACT_DTYPE
        )
        for j, i in enumerate(examples.tolist()):
            for m, li in enumerate(layer_ids):
                out[j, m, : lay.p_max] = self.read_index(i, li, "prompt", trim=False)
                out[j, m, lay.p_max :] = self.read_index(i, li, "response", trim=False)
        return out[:, :, tokens]

    def read_batch(
        self,
        samples: Sequence[int] | np.ndarray,
        layers: Sequence[Sequence[Any]] | np.ndarray,
        part: str = "response",
        *,
        trim: bool = False,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Stack ``read(samples[j], layers[j][m], part)`` into ``acts[b, k, T, H]`` (zero-padded
        to ``P_max``/``R_max``, or to the longest of these samples with ``trim``) and return it
        with the lengths ``[b]``. ``layers`` is ``[b, k]`` sites in any spelling."""
        samples = np.asarray(samples, dtype=np.int64).reshape(-1)
        layer_idx = np.array(
            [[self._layer_index(x) for x in row] for row in layers], dtype=np.int64
        ).reshape(len(samples), -1)
        return self.read_batch_index(samples, layer_idx, part, trim)

    def random_batch(
        self,
        b: int,
        rng: np.random.Generator,
        *,
        n_layers: int = 2,
        part: str = "response",
        trim: bool = False,
    ) -> dict[str, np.ndarray]:
        """The training pattern: ``b`` random samples, ``n_layers`` distinct random layers each.

        Returns ``acts [b, n_layers, T, H]``, ``lengths [b]``, ``samples [b]`` and
        ``layers [b, n_layers]`` (block indices; ``sites`` gives the names).
        """
        lay = self.layout
        if not 1 <= n_layers <= lay.n_layers:
            raise ConfigError(f"n_layers must lie in 1..{lay.n_layers}, not {n_layers}")
        samples = rng.integers(0, lay.n_samples, size=b)
        layer_idx = np.stack(
            [rng.choice(lay.n_layers, size=n_layers, replace=False) for _ in range(b)]
        )
        acts, lengths = self.read_batch_index(samples, layer_idx, part, trim)
        return {
            "acts": acts,
            "lengths": lengths,
            "samples": samples,
            "layers": np.asarray(lay.layers)[layer_idx],
            "sites": np.asarray(lay.sites)[layer_idx],
        }

    def read_batch_index(
        self, samples: np.ndarray, layer_idx: np.ndarray, part: str = "response", trim: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`read_batch` with positions on the ``L`` axis (``layer_idx [b, k]``)."""
        lengths = self.lengths(part)[samples]
        width = int(lengths.max(initial=0)) if trim else self.layout.max_len(part)
        acts = np.zeros(
            (len(samples), layer_idx.shape[1], width, self.layout.hidden_size), dtype=ACT_DTYPE
        )
        for j, i in enumerate(samples):
            k, local = self.locate(int(i))
            for m, idx in enumerate(layer_idx[j]):
                self.stores[k].read_rows(part, local, int(idx), acts[j, m, : lengths[j]])
        return acts, lengths

    def dataset(
        self, part: str = "response", *, n_layers: int = 2, seed: int = 0, trim: bool = False
    ):
        """A torch map-style Dataset of the training pattern (see :class:`ZarrPairDataset`)."""
        from .dataset import ZarrPairDataset

        return ZarrPairDataset(self, part=part, n_layers=n_layers, seed=seed, trim=trim)

    # ------------------------------------------------------------------ per-sample fields

    def _concat(self, name: str) -> np.ndarray | None:
        parts = [store.array(name) for store in self.stores]
        arrays = [p for p in parts if p is not None]
        return np.concatenate(arrays) if len(arrays) == len(parts) else None

    def array(self, name: str) -> np.ndarray | None:
        """A per-sample array over all samples (``"sample_key"``, ``"hallu_label"``, ``"split"``,
        ``"prompt_len_full"``, ``"prompt_token_ids"``...), checked, or None if absent."""
        return self._concat(f"arrays/{name}")

    @property
    def sample_keys(self) -> list[str]:
        keys = self._concat(SAMPLE_KEY)
        return [] if keys is None else [k.decode("ascii") for k in keys]

    @property
    def tokens(self) -> np.ndarray | None:
        """Token ids ``[n, P_max + R_max]`` (prompt then response, -1 where none), for
        stores that keep them."""
        prompt, response = self._concat(TOKEN_IDS["prompt"]), self._concat(TOKEN_IDS["response"])
        if prompt is None or response is None:
            return None
        return np.concatenate([prompt, response], axis=1)

    def token_ids(self, i: int, part: str = "prompt") -> np.ndarray | None:
        """Stored token ids of sample ``i``'s ``part`` (its real tokens), or None."""
        k, local = self.locate(i)
        ids = self.stores[k].array(TOKEN_IDS[part])
        if ids is None:
            return None
        return np.asarray(ids[local][: self.stores[k].lengths[part][local]])

    def text(self, i: int, part: str = "prompt") -> str | None:
        """The prompt or response text of sample ``i`` (from ``text/*.jsonl``), or None."""
        k, local = self.locate(i)
        store = self.stores[k]
        name = TEXT_FILES[part]
        if not store.exists(name):
            return None
        offsets = self._text_index.get((k, part))
        if offsets is None:
            data = (
                store.checks.read_bytes(name)
                if store.checks.enabled
                else store.files.read_bytes(name)
            )
            offsets = _line_offsets_of(data)
            if len(offsets) != store.n_samples:
                raise CorruptStoreError(
                    f"{store.url_of(name)} has {len(offsets)} lines for {store.n_samples} samples"
                )
            self._text_index[(k, part)] = offsets
            self.__dict__.setdefault("_texts", {})[(k, part)] = data
        data = self.__dict__.get("_texts", {}).get((k, part))
        if data is None:  # a worker process: the text is read (and checked) again
            data = (
                store.checks.read_bytes(name)
                if store.checks.enabled
                else store.files.read_bytes(name)
            )
            self.__dict__.setdefault("_texts", {})[(k, part)] = data
        start = int(offsets[local])
        line = bytes(data[start:]).split(b"\n", 1)[0]
        try:
            text = load_json(line)[part]
        except (ValueError, KeyError, TypeError) as err:
            raise CorruptStoreError(
                f"{store.url_of(name)}: the record of sample {local} is malformed ({err!r}); "
                "restore the file or re-create the store"
            ) from None
        if not isinstance(text, str):
            raise CorruptStoreError(
                f"{store.url_of(name)}: the {part} of sample {local} is not a string; restore "
                "the file or re-create the store"
            )
        return text

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_texts": {}}

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


# ---------------------------------------------------------------------------- helpers


def _line_offsets_of(data: bytes | memoryview) -> np.ndarray:
    """Start of each non-empty line of ``data`` (a text file read whole)."""
    offsets, pos = [], 0
    for line in bytes(data).split(b"\n"):
        if line.strip():
            offsets.append(pos)
        pos += len(line) + 1
    return np.asarray(offsets, dtype=np.int64)
