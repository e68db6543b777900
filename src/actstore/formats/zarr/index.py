"""Opening a zarr store or a sharded run: each store's metadata, digests and lengths
checked, a run's ``manifest.json`` against its shards (:class:`ZarrIndex`, the first
layer of :class:`~.reader.ZarrReader`), and what they say: layout, sites, lengths, and
which store holds a sample."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import ConfigError, CorruptStoreError, IndexOutOfRangeError, StoreNotFoundError
from ...sites import Site
from ...stats import RunningStats
from ...storage.integrity import Integrity
from ..base import ReaderBase
from ..metacheck import Fields
from ..report import summary_of
from .layout import ACT_DTYPE, CONFIG_FILE, PARTS, RUN_FORMAT_TAG, STORE_NAME
from .meta import StoreMeta

MANIFEST = "manifest.json"


class ZarrIndex(ReaderBase):
    """The stores of a zarr store or run, opened and checked, and their layout."""

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
