"""Opening a saev directory: ``metadata.json`` and ``shards.json`` read through the root
manifest and checked against each other and every shard's size (:class:`SaevIndex`, the
first layer of :class:`~.reader.SaevReader`), and what the metadata says of the store."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import CorruptStoreError, StoreNotFoundError
from ...sites import Site
from ..base import ReaderBase
from .layout import SaevMetadata, shard_name

#: Files only actstore writes into a saev directory (a store holding one is ours).
OWN_MARKERS = ("statistics.json", "tokens.bin", "actstore-manifest.json")
#: The checksum file of actstore before the root manifest (such stores are refused by name).
OLD_CHECKSUMS = "checksums.xxh128"


class SaevIndex(ReaderBase):
    """A saev directory's metadata and shard list, checked."""

    def open_index(self) -> None:
        """metadata.json and shards.json read and checked, every shard's size too."""
        if not self.files.exists("metadata.json"):
            raise StoreNotFoundError(
                f"{self.url} holds no saev store (no metadata.json): a wrong path, or an "
                "unfinished copy (finish it with actstore cp)"
            )
        if (
            self.verify_reads
            and self.files.exists(OLD_CHECKSUMS)
            and not self.files.exists("actstore-manifest.json")
        ):
            raise CorruptStoreError(
                f"{self.url} was written by an older actstore (it has {OLD_CHECKSUMS}, not a "
                "root manifest): re-capture it, or open it with verify_reads=False"
            )
        self.open_checks(ours=any(self.files.exists(n) for n in OWN_MARKERS))
        self.metadata = SaevMetadata.from_json_dict(
            self.checks.read_json("metadata.json"), source=self.files.url_of("metadata.json")
        )
        self.shard_counts = self._read_shards_json()
        self._check_sizes()
        self._statistics: dict[str, Any] | None = None

    # ------------------------------------------------------------------ validation

    def _read_shards_json(self) -> list[int]:
        md, source = self.metadata, self.files.url_of("shards.json")
        doc = self.checks.read_json("shards.json")
        if not isinstance(doc, list) or not all(
            isinstance(e, dict)
            and isinstance(e.get("name"), str)
            and isinstance(e.get("n_examples"), int)
            for e in doc
        ):
            raise CorruptStoreError(f"{source} must be a list of {{name, n_examples}} objects")
        if (
            md.dialect == "saev"
            and len(doc) == md.n_shards + 1
            and md.n_shards
            and md.n_examples % md.examples_per_shard == 0
            and doc[-1] == {"name": shard_name(md.n_shards), "n_examples": 0}
        ):
            # saev's own ShardWriter opens one more (all-zero) shard when the last one fills
            # exactly and lists it with 0 examples; its readers ignore it, and so do we.
            doc = doc[:-1]
        if len(doc) != md.n_shards:
            raise CorruptStoreError(
                f"{source} lists {len(doc)} shards; metadata ({md.n_examples} examples, "
                f"{md.examples_per_shard} per shard) implies {md.n_shards}"
            )
        for i, entry in enumerate(doc):
            if entry["name"] != shard_name(i) or entry["n_examples"] != md.shard_examples(i):
                raise CorruptStoreError(
                    f"{source} entry {i} is {entry}; expected name {shard_name(i)} with "
                    f"{md.shard_examples(i)} examples"
                )
        return [e["n_examples"] for e in doc]

    def _check_sizes(self) -> None:
        md = self.metadata
        listed = self.files.list()  # one listing, not a stat per shard
        for i in range(md.n_shards):
            url = self.files.url_of(shard_name(i))
            size, want = listed.get(shard_name(i)), md.shard_nbytes(i)
            if size is None:
                raise StoreNotFoundError(f"shard {url} is missing; restore it or re-capture")
            if size != want:
                raise CorruptStoreError(
                    f"shard {url} has {size} bytes, expected {want} "
                    f"({'truncated' if size < want else 'too long'}); restore it or re-capture"
                )
        for name, row in (("tokens.bin", md.tokens_per_ex * 4), ("labels.bin", md.patches_per_ex)):
            size = listed.get(name)
            if size is not None and size != md.n_examples * row:
                raise CorruptStoreError(
                    f"{self.files.url_of(name)} has {size} bytes, expected {md.n_examples * row}"
                )

    # ------------------------------------------------------------------ properties

    @property
    def dialect(self) -> str:
        """``"protocol"`` (the document) or ``"saev"`` (saev's released code)."""
        return self.metadata.dialect

    @property
    def layers(self) -> tuple[int, ...]:
        return self.metadata.layers

    @property
    def sites(self) -> tuple[Site, ...]:
        """The stored residual-stream layers (saev's "layers") as ``resid.L`` sites."""
        return tuple(Site("resid", layer) for layer in self.metadata.layers)

    def native_name(self, site: Site) -> str:
        return str(site.layer)

    @property
    def family(self) -> str:
        return self.metadata.family

    @property
    def n_model_layers(self) -> int:
        """saev metadata does not record the model's depth: negative layers count from the
        deepest stored layer (``-1`` is it)."""
        return max(self.metadata.layers) + 1

    @property
    def d_model(self) -> int:
        return self.metadata.d_model

    @property
    def dtype(self) -> np.dtype:
        return np.dtype("<f4")

    @property
    def n_examples(self) -> int:
        return self.metadata.n_examples

    @property
    def tokens_per_ex(self) -> int:
        return self.metadata.tokens_per_ex

    @property
    def tokens_per_example(self) -> int:
        return self.metadata.tokens_per_ex

    def n_rows(self, site: Any) -> int:
        self.site(site)
        return self.metadata.n_examples * self.metadata.tokens_per_ex

    def _layer_index(self, site: Site) -> int:
        return self.metadata.layers.index(site.layer)
