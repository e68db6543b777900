"""Opening an Activault run: ``cfg.json`` (its commit record), each hook folder's
``metadata.json`` and listing, checked (:class:`ActivaultListing`, the first layer of
:class:`~.reader.ActivaultReader`), and what the listing says of the run: its hooks and
sites, shapes and dtypes."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ...batch import CapturePlan
from ...errors import ConfigError, CorruptStoreError, StoreNotFoundError
from ...forksafe import ForkSafeLock
from ...sites import Site
from ...storage.integrity import Integrity
from ...storage.manifest import MANIFEST
from ...storage.object import base_name, join_key, open_location, parent_key
from ..base import ReaderBase
from ..metacheck import plan_from_dict
from .layout import (
    CFG,
    METADATA,
    STATISTICS,
    DataFile,
    data_file_name,
    dtype_name,
    group_uuid,
    hook_site,
    numpy_dtype,
    parse_data_file,
    parse_dtype,
)
from .metadata import DIGESTS_SINCE, RUN_RECORD_VERSION, HookMetadata, RunRecord

if TYPE_CHECKING:
    import torch
else:
    from ..._lazy import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoredFile:
    """One megabatch file of a hook."""

    key: str
    size: int
    name: DataFile


@dataclass(frozen=True)
class HookListing:
    """What one hook folder holds."""

    hook: str
    prefix: str
    metadata: HookMetadata
    files: tuple[StoredFile, ...]
    strays: tuple[str, ...]
    """Other objects under the folder (Activault's reader would read them as data)."""
    uncommitted: tuple[str, ...]
    """Data files of groups the commit record does not list (a crashed capture's)."""


class ActivaultListing(ReaderBase):
    """A run's index: its commit record, hook folders and files, checked when opened."""

    allow_incomplete: bool
    chunk_size: int | None
    concurrency: int

    def open_index(self) -> None:
        """cfg.json (its commit record), each hook's metadata.json and listing, checked."""
        self.store, prefix = open_location(self.location.url, self.storage)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = ForkSafeLock()
        self._pid = os.getpid()
        self.store.check_bucket()
        #: The hook folder this reader was opened on (None: the whole run).
        self.hook_folder: str | None = None
        if self.store.size(join_key(prefix, METADATA)) is not None:
            self.run_prefix, self.hook_folder = parent_key(prefix), base_name(prefix)
            self.files = self.location.parent.files(**self.cache_options)
        else:
            self.run_prefix = prefix
        whole_run = self.hook_folder is None
        self.cfg: dict[str, Any] = {}
        self.record: RunRecord | None = None
        cfg_key = join_key(self.run_prefix, CFG)
        if self.store.size(cfg_key) is not None:  # unchecked: only to tell what to check
            doc = self.store.get_json(cfg_key)
            self.cfg = doc if isinstance(doc, dict) else {}
            if "actstore" in self.cfg:
                self.record = RunRecord.from_dict(
                    self.cfg["actstore"], source=self.store.url(cfg_key)
                )
        siblings = self.store.list_dirs(self.run_prefix)
        if self.hook_folder is not None:
            hook_names = [self.hook_folder]
        elif self.record is not None:
            hook_names = list(self.record.hooks)
        else:
            hook_names = [
                h
                for h in siblings
                if self.store.size(join_key(self.run_prefix, h, METADATA)) is not None
            ]
        for hook in hook_names:  # before the manifest: the more useful message
            clash = [s for s in siblings if s != hook and s.startswith(hook)]
            if clash:
                raise CorruptStoreError(
                    f"hook folder {hook!r} in {self.store.url(self.run_prefix)} is a prefix of "
                    f"{clash[0]!r}: Activault's reader would mix their files; rename or move "
                    f"{clash[0]!r}"
                )
        if self.record is not None and not self.record.complete and not self.files.exists(MANIFEST):
            if not self.allow_incomplete:
                raise CorruptStoreError(
                    f"{self.store.url(self.run_prefix)} is an unfinished capture "
                    f"({self.record.groups} files per hook committed so far): rerun the same "
                    "capture command to resume and complete it, or pass allow_incomplete=True "
                    "to read the committed files (unverified)"
                )
            # unverified, but never through a symlink out of the run
            self.checks = Integrity.open(
                self.files, ours=True, verify_reads=False, format=self.format_name
            )
        else:  # a run with a root manifest is checked, whatever its cfg.json claims
            version = RUN_RECORD_VERSION if self.record is None else self.record.version
            if version < DIGESTS_SINCE and self.verify_reads and not self.files.exists(MANIFEST):
                raise CorruptStoreError(
                    f"{self.store.url(self.run_prefix)} was written by an older actstore (run "
                    f"record version {version}, before root manifests), so its files cannot be "
                    "checked; re-capture it, or open it with verify_reads=False"
                )
            self.open_checks(ours=self.record is not None)
            if self.checks.enabled:  # cfg.json as published, before anything is trusted
                doc = self.checks.read_json(CFG)
                self.cfg = doc if isinstance(doc, dict) else {}
                self.record = (
                    RunRecord.from_dict(self.cfg["actstore"], source=self.store.url(cfg_key))
                    if "actstore" in self.cfg
                    else None
                )
        if whole_run and self.record is not None:
            hook_names = list(self.record.hooks)  # from the checked record
        if not hook_names:
            raise StoreNotFoundError(
                f"{self.location} holds no Activault hook folders ({{hook}}/metadata.json); give "
                "a run (s3://bucket/run) or one of its hook folders"
            )
        self.listings = {h: self._list_hook(h) for h in hook_names}
        self._site_hooks = {self._hook_site(h): h for h in hook_names}
        self.notes: list[str] = []
        self._check_alignment()
        self._ids: dict[int, np.ndarray] = {}  # input_ids of the last files decoded

    def _hook_site(self, hook: str) -> Site:
        site = hook_site(hook)
        if site is None and self.record is not None:
            site = Site.parse(self.record.hooks.get(hook, hook))
        if site is None:
            raise ConfigError(
                f"hook {hook!r} does not follow Activault's naming (models.layers.L.post, "
                "...mlp.post, ...self_attn.pre): actstore cannot tell which site it stores"
            )
        return site

    def _json(self, rel: str) -> Any:
        """A JSON file of the run (``hook/metadata.json``...), checked when it can be."""
        if self.checks.enabled:
            return self.checks.read_json(rel)
        return self.store.get_json(join_key(self.run_prefix, rel))

    # ------------------------------------------------------------------ listing

    def _list_hook(self, hook: str) -> HookListing:
        prefix = join_key(self.run_prefix, hook)
        md_key = join_key(prefix, METADATA)
        if self.store.size(md_key) is None:
            if self.record is not None and self.record.groups == 0:
                raise CorruptStoreError(f"{self.store.url(prefix)} has no file committed yet")
            raise StoreNotFoundError(f"{self.store.url(md_key)} does not exist")
        md = HookMetadata.from_dict(
            self._json(f"{hook}/{METADATA}"),
            source=self.store.url(md_key),
            exact=self.record is not None,
        )
        if self.record is not None:
            self._check_hook_metadata(md, self.store.url(md_key))
        found: dict[str, StoredFile] = {}
        strays = []
        for obj in self.store.list(prefix + "/"):
            name = obj.key[len(prefix) + 1 :]
            if name in (METADATA, STATISTICS) or name.endswith(CFG):
                continue
            parsed = parse_data_file(name)
            if parsed is None or "/" in name:
                strays.append(name)
                continue
            found[name] = StoredFile(obj.key, obj.size, parsed)
        uncommitted: list[str] = []
        if self.record is not None:
            rec = self.record
            names = [data_file_name(group_uuid(rec.run_id, g), g + 1) for g in range(rec.groups)]
            missing = [n for n in names if n not in found]
            if missing:
                raise CorruptStoreError(
                    f"{self.store.url(prefix)} lacks {len(missing)} committed files (first: "
                    f"{missing[0]}); the run is damaged: capture it again"
                )
            uncommitted = sorted(set(found) - set(names))
            if rec.complete and uncommitted:
                raise CorruptStoreError(
                    f"{self.store.url(prefix)} holds {len(uncommitted)} files beyond the "
                    f"{rec.groups} its complete cfg.json commits (first: {uncommitted[0]}): "
                    "cfg.json was edited or damaged; restore it or capture again"
                )
            files = [found[n] for n in names]
        else:
            files = sorted(found.values(), key=lambda f: f.name.sort_key)
        for f in files:
            if f.size != md.bytes_per_file:
                raise CorruptStoreError(
                    f"{self.store.url(f.key)} is {f.size} bytes but metadata.json says every file "
                    f"is {md.bytes_per_file} (bytes_per_file): the file is truncated or foreign; "
                    "delete or re-create it"
                )
        if strays:
            log.warning(
                "%s holds %d objects that are not megabatch files (e.g. %s); Activault's "
                "reader would read them as data",
                self.store.url(prefix),
                len(strays),
                strays[0],
            )
        return HookListing(hook, prefix, md, tuple(files), tuple(strays), tuple(uncommitted))

    def _check_hook_metadata(self, md: HookMetadata, source: str) -> None:
        """A hook's ``metadata.json`` against the run's commit record: the shape and dtype
        of every file, and the batches per file, are the record's."""
        rec = self.record
        if rec is None:
            return
        plan = self.capture_plan_of_record()
        want = HookMetadata.for_shape(
            rows=rec.rows_per_file,
            seq=rec.sequence_length,
            d=plan.d_model,
            dtype=dtype_name(parse_dtype(rec.dtype)),
            batches_per_file=max(1, rec.rows_per_file // plan.batch_size),
        ).with_bytes(md.file_bytes)
        if md != want:
            raise CorruptStoreError(
                f"{source} says files of {list(md.shape)} {md.dtype} ({md.batches_per_file} "
                f"batches each), but cfg.json's commit record {list(want.shape)} {want.dtype} "
                f"({want.batches_per_file}): it was edited; restore it or capture again"
            )

    def capture_plan_of_record(self) -> CapturePlan:
        """The capture plan cfg.json's commit record holds, typed and checked."""
        cached = self.__dict__.get("_record_plan")
        if cached is None:
            plan = self.record.plan if self.record is not None else None
            cached = plan_from_dict(plan, f"{self.store.url(self.run_prefix)}/{CFG}")
            self.__dict__["_record_plan"] = cached
        return cached

    def _check_alignment(self) -> None:
        """Record whether block i of every hook is the same group of tokens."""
        self.aligned = self.aligned_on(self.sites)
        if not self.aligned:
            self.notes.append(
                "hooks hold different groups of files; block i of one hook is not the same "
                "tokens as block i of another"
            )

    def aligned_on(self, sites: Sequence[Any]) -> bool:
        """Whether block ``i`` of every one of ``sites`` holds the same tokens (the same
        group uuid). Always true for runs actstore wrote; an Activault run whose hooks
        drifted apart (a hook that rejected a batch) is not.

        Example:
            >>> import tempfile
            >>> from actstore.formats.activault import ActivaultOptions
            >>> from actstore.testing import FormatCase, make_acts, make_batches, make_plan
            >>> plan, out = make_plan(n_examples=24), tempfile.TemporaryDirectory()
            >>> case = FormatCase("activault", ActivaultOptions(rows_per_file=4))
            >>> batches = make_batches(plan, make_acts(plan))
            >>> from actstore.formats.activault.reader import ActivaultReader
            >>> reader = ActivaultReader(case.write(out.name, plan, batches))
            >>> reader.aligned_on(["resid.1", "resid.3"])
            True
        """
        hooks = [self.hook_of(s) for s in sites]
        first = [f.name.uuid for f in self.listings[hooks[0]].files]
        return all([f.name.uuid for f in self.listings[h].files] == first for h in hooks[1:])

    @property
    def sites(self) -> tuple[Site, ...]:
        """The stored sites, in capture order (:attr:`hooks` are their folders)."""
        return tuple(self._site_hooks)

    @property
    def hooks(self) -> list[str]:
        """Stored hook folder names (``models.layers.{L}.{...}``), in capture order."""
        return list(self.listings)

    def hook_of(self, site: Any) -> str:
        """The hook folder of ``site`` (any spelling, or a hook name)."""
        return self._site_hooks[self.site(site)]

    def native_site(self, name: Any) -> Site | None:
        if isinstance(name, str) and name in self.listings:
            return self._hook_site(name)
        return None

    def native_name(self, site: Site) -> str:
        return self._site_hooks[site]

    @property
    def family(self) -> str:
        return str(self.record.plan.get("family")) if self.record is not None else "unknown"

    @property
    def n_model_layers(self) -> int:
        if self.record is not None and self.record.plan.get("n_model_layers"):
            return int(self.record.plan["n_model_layers"])
        return max(s.layer for s in self.sites) + 1

    @property
    def n_files(self) -> int:
        """Megabatch files per hook."""
        return len(next(iter(self.listings.values())).files)

    def metadata(self, site: Any) -> HookMetadata:
        return self.listings[self.hook_of(site)].metadata

    @property
    def d_model(self) -> int:
        return next(iter(self.listings.values())).metadata.d_in

    @property
    def torch_dtype(self) -> torch.dtype:
        """Dtype of the stored states."""
        return parse_dtype(next(iter(self.listings.values())).metadata.dtype)

    @property
    def dtype(self) -> np.dtype:
        """numpy dtype of rows from :meth:`read_block` (bfloat16 widens exactly to float32)."""
        return numpy_dtype(self.torch_dtype)

    def stored_dtype(self) -> str:
        return str(self.torch_dtype).removeprefix("torch.")

    @property
    def model_name(self) -> str | None:
        return (self.cfg.get("transformer_config") or {}).get("model_name")

    def data_files(self, site: Any) -> tuple[StoredFile, ...]:
        return self.listings[self.hook_of(site)].files
