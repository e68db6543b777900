"""Read an Activault run (or one hook of it) from S3 or a local directory.

Opening lists each hook's folder once and checks what Activault's reader silently assumes:
``metadata.json`` is complete, every data file is exactly ``bytes_per_file`` bytes, no hook
folder name is a prefix of a sibling's, and (for runs actstore wrote) every committed file
is present, the capture is complete and the run matches its root manifest. Files are
downloaded with concurrent ranged GETs, checked against their keyed digests (a file moved
to another hook or group, or copied from another run, fails) and loaded with
``torch.load(weights_only=True)`` only. Runs Activault itself wrote have no manifest: they
read unverified, after one warning.

Blocks are whole megabatch files (one file = ``rows x seq`` rows of one hook); block ``i``
of every hook holds the same tokens (the same group uuid).

Example:
    >>> import tempfile
    >>> from actstore.formats.activault import ActivaultOptions
    >>> from actstore.testing import FormatCase, make_acts, make_batches, make_plan
    >>> plan, out = make_plan(n_examples=24), tempfile.TemporaryDirectory()  # 6 tokens each
    >>> case = FormatCase("activault", ActivaultOptions(rows_per_file=4))  # 24-token files
    >>> run = case.write(f"{out.name}/run", plan, make_batches(plan, make_acts(plan)))
    >>> r = ActivaultReader(run)  # a local run here; s3://bucket/run alike
    >>> r.sites, r.hooks  # doctest: +NORMALIZE_WHITESPACE
    ((Site(kind='resid', layer=1), Site(kind='resid', layer=3)),
     ['models.layers.1.post', 'models.layers.3.post'])
    >>> r.read_block(r.blocks("resid.1")[0]).shape  # [rows*seq, d] float32
    (24, 8)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ...batch import Batch, CapturePlan
from ...errors import ConfigError, CorruptStoreError, StoreNotFoundError
from ...forksafe import ForkSafeLock
from ...hub import local_tokenizer
from ...sites import Site
from ...stats import RunningStats
from ...storage.integrity import Integrity
from ...storage.location import Location
from ...storage.manifest import MANIFEST
from ...storage.object import MiB, base_name, join_key, open_location, parent_key
from ..arrays import LazyRows
from ..base import Block, ReaderBase, VerifyReport, summary_of
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
    load_megabatch,
    numpy_dtype,
    parse_data_file,
    parse_dtype,
)
from .metadata import (
    DIGESTS_SINCE,
    POSITIONS_SINCE,
    RUN_RECORD_VERSION,
    HookMetadata,
    RunRecord,
    statistics_from_dict,
)
from .positions import POSITIONS, Positions, decode
from .verify import (
    check_statistics,
    file_statistics,
    merged_statistics,
    one_process_run_id,
    record_faults,
)

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


def detect(files) -> bool:
    """A hook folder (metadata.json with Activault's keys) or a run (cfg.json, or hook
    folders beneath holding one)."""
    if files.exists(CFG):
        return True
    names = [n for n in files.list() if n == METADATA or n.endswith("/" + METADATA)]
    for name in names[:8]:
        if name.count("/") > 1:
            continue
        try:
            doc = files.read_json(name)
        except CorruptStoreError:
            continue
        if isinstance(doc, dict) and {"shape", "dtype", "bytes_per_file"} <= set(doc):
            return True
    return False


class ActivaultReader(ReaderBase):
    """Read access to an Activault run or hook folder; picklable (clients reopen lazily).

    ``allow_incomplete`` reads the committed files of an unfinished capture; ``s3`` sets the
    endpoint, credentials and retries (default: the environment); each file is fetched with
    ``concurrency`` parallel ranged GETs of ``chunk_size`` bytes (default: the file split
    over the threads, 1-16 MiB per range).
    """

    format_name = "activault"

    def __init__(
        self,
        location: str | os.PathLike | Location,
        *,
        allow_incomplete: bool = False,
        chunk_size: int | None = None,
        concurrency: int = 8,
        **kwargs: Any,
    ) -> None:
        """``kwargs``: every reader's (``verify_reads``, ``cache_dir``, ``cache_bytes``,
        ``s3``)."""
        self.allow_incomplete = allow_incomplete
        self.chunk_size, self.concurrency = chunk_size, concurrency
        super().__init__(location, **kwargs)

    def open_index(self) -> None:
        """cfg.json (its commit record), each hook's metadata.json and listing, checked."""
        self.store, prefix = open_location(self.location.url, self.s3)
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

    def trusted_summary(self) -> dict[str, Any]:
        """What the run's root manifest records; a reader of one hook folder of a run checks
        it against the run's summary, every hook included."""
        hooks = list(self.listings)
        if self.record is not None and set(hooks) <= set(self.record.hooks):
            hooks = list(self.record.hooks)
        return summary_of(
            sites=[self._hook_site(h) for h in hooks],
            d_model=self.d_model,
            dtype=self.stored_dtype(),
            rows=self.n_rows(self.sites[0]),
        )

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
            >>> reader = ActivaultReader(case.write(out.name, plan, batches))
            >>> reader.aligned_on(["resid.1", "resid.3"])
            True
        """
        hooks = [self.hook_of(s) for s in sites]
        first = [f.name.uuid for f in self.listings[hooks[0]].files]
        return all([f.name.uuid for f in self.listings[h].files] == first for h in hooks[1:])

    # ------------------------------------------------------------------ properties

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

    def example_axis_error(self, site: Site, rows: int) -> str:
        plan = self.capture_plan()
        return (
            f"{self.url} holds {rows} tokens per hook, not {plan.n_examples} examples x "
            f"{plan.tokens_per_example}: token cleaning dropped some (or the last file was "
            f"partial), and the run has no {POSITIONS} (it was captured by an actstore that "
            "did not keep token positions), so reader[example, site, token] cannot place "
            "them; read blocks(site), or capture the run again"
        )

    @property
    def positions(self) -> Positions | None:
        """Where each example's tokens lie (:mod:`.positions`), for runs actstore wrote
        since it keeps them; None for older runs and Activault's own. Read (and checked)
        once, when first needed."""
        if self.record is None:
            return None
        found = self.__dict__.get("_positions", False)
        if found is not False:
            return found  # type: ignore[no-any-return]
        key = join_key(self.run_prefix, POSITIONS)
        found = None
        if self.store.size(key) is None and self.record.version >= POSITIONS_SINCE:
            raise CorruptStoreError(
                f"{self.store.url(key)} is missing: the run's token positions (where each "
                "example's tokens lie) are lost; restore it or capture again"
            )
        if self.store.size(key) is not None:
            plan = self.capture_plan_of_record()
            source = self.store.url(key)
            data = (
                self.checks.read_bytes(POSITIONS)
                if self.checks.enabled
                else bytes(self.store.get(key))
            )
            found = Positions(
                decode(data, plan.tokens_per_example, source, plan.n_examples),
                plan.tokens_per_example,
            )
            faults = found.faults(self.n_rows(self.sites[0]), source)
            if faults:
                raise CorruptStoreError(faults[0])
        self.__dict__["_positions"] = found
        return found

    def read_examples(
        self, examples: np.ndarray, sites: Sequence[Site], tokens: slice | np.ndarray
    ) -> np.ndarray:
        """``reader[...]``: each (example, position) read from the row the positions file
        places it at (checked like any block), NaN where nothing is stored (a token the
        cleaning dropped, or one in the tail past the last file). Runs without a positions
        file read by the base's layout (whole examples only)."""
        positions = self.positions
        if positions is None:
            return super().read_examples(examples, sites, tokens)
        picked = np.arange(positions.tokens)[tokens] if isinstance(tokens, slice) else tokens
        rows = positions.rows(examples, picked)
        out = np.full((len(examples), len(sites), len(picked), self.d_model), np.nan, self.dtype)
        stored = rows >= 0
        for j, site in enumerate(sites):
            blocks = self.site_blocks(site)
            per = blocks[0].n_rows if blocks else 1
            which = rows // per
            dest = out[:, j]
            for k in np.unique(which[stored]).tolist():
                mine = stored & (which == k)
                dest[mine] = self._read_into_scratch(blocks[k])[rows[mine] - k * per]
        return out

    @property
    def token_mask(self) -> LazyRows | None:
        """Bool ``[n_examples, T]``: the positions whose values the run stores (False where
        token cleaning dropped the token, or in the dropped tail), for runs with a positions
        file; ``reader[...]`` is NaN where it is False."""
        positions = self.positions
        return None if positions is None else _StoredMask(positions)

    @property
    def tokens(self) -> LazyRows | None:
        """Token ids ``[n_examples, T]`` (int64), from the ``input_ids`` of the first hook's
        files (each file read, checked and decoded when a row of it is indexed), for runs
        of whole examples; None when the capture kept no token ids or token positions were
        lost (token cleaning)."""
        if not self.capture_plan().has_tokens:
            return None
        positions = self.positions
        if positions is not None:
            return _PositionIds(positions)
        return _InputIds(self)

    def file_input_ids(self, index: int) -> np.ndarray:
        """The ``input_ids`` of file ``index`` of the first hook, flat (the last two files
        decoded are kept)."""
        ids = self._ids.get(index)
        if ids is None:
            first = self.hooks[0]
            got = self.megabatch(first, index)["input_ids"]
            if got is None:
                raise CorruptStoreError(
                    f"{self.store.url(self.listings[first].files[index].key)} holds no "
                    "input_ids (a very old Activault file): its token ids are not stored"
                )
            ids = got.reshape(-1).numpy()
            while len(self._ids) >= 2:
                self._ids.pop(next(iter(self._ids)))
            self._ids[index] = ids
        return ids

    def capture_plan(self) -> CapturePlan:
        """The capture this run came from: actstore's record of it in ``cfg.json`` (as
        planned, also when token cleaning or the dropped tail left fewer tokens stored;
        :meth:`example_batches` refuses to convert such a run), or, for a run Activault
        wrote, what its metadata says (one example per sequence)."""
        first = next(iter(self.listings.values()))
        rows = len(first.files) * first.metadata.tokens_per_file
        if self.record is not None:
            plan = self.capture_plan_of_record()
            # token ids are the positions file's, or the files' input_ids placed by example
            # (in whole examples only)
            whole = self.positions is not None or rows == plan.n_examples * plan.tokens_per_example
            return dataclasses.replace(plan, has_tokens=plan.has_tokens and whole, has_labels=False)
        md = first.metadata
        sites = self.sites
        return CapturePlan(
            ckpt=str(self.model_name or "unknown"),
            family="unknown",
            modality="text",
            sites=sites,
            n_model_layers=max(s.layer for s in sites) + 1,
            d_model=md.d_in,
            tokens_per_example=md.sequence_length,
            has_cls=False,
            n_examples=rows // md.sequence_length,
            dataset_root=str((self.cfg.get("data_config") or {}).get("data_key") or ""),
            data={},
            classes=None,
            has_labels=False,
            has_tokens=True,  # Activault keeps each row's input_ids
            batch_size=md.batch_size,
        )

    def example_batches(self, batch_size: int, start: int = 0) -> Iterator[Batch] | None:
        """With a positions file: the examples as capture batches, each position's value
        where the run stores one and NaN elsewhere, ``token_mask`` True where it stores
        one (so an Activault target stores exactly these tokens again), token ids from the
        positions file. Without one, None: conversion rebuilds examples from blocks, which
        holds only for a run that stores exactly its plan's examples (:class:`ConfigError`
        for one that does not)."""
        plan = self.capture_plan()
        positions = self.positions
        if positions is not None:
            return self._position_batches(positions, plan, batch_size, start)
        rows = self.n_rows(self.sites[0])
        if rows != plan.n_examples * plan.tokens_per_example:
            raise ConfigError(
                f"{self.url} holds {rows} tokens per hook, not {plan.n_examples} examples x "
                f"{plan.tokens_per_example} (token cleaning dropped some, or the last file was "
                "partial): only runs of whole examples convert; capture with --no-clean and "
                "a rows_per_file that divides the examples to convert it"
            )
        return None

    def _position_batches(
        self, positions: Positions, plan: CapturePlan, batch_size: int, start: int
    ) -> Iterator[Batch]:
        every = np.arange(positions.tokens)
        for lo in range(start, plan.n_examples, batch_size):
            ids = np.arange(lo, min(lo + batch_size, plan.n_examples))
            values = self.read_examples(ids, list(self.sites), every)
            yield Batch(
                acts={
                    str(site): torch.from_numpy(np.ascontiguousarray(values[:, j]))
                    for j, site in enumerate(self.sites)
                },
                example_ids=ids,
                token_ids=positions.ids(ids) if plan.has_tokens else None,
                token_mask=positions.stored(ids),
            )

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

    def __repr__(self) -> str:
        md = next(iter(self.listings.values())).metadata
        return (
            f"ActivaultReader({self.url!r}, hooks={self.hooks}, files={self.n_files}, "
            f"shape={list(md.shape)}, dtype={md.dtype})"
        )

    # ------------------------------------------------------------------ reading

    def _thread_pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:  # read_block may be called from several loader threads
            if self._pool is None or self._pid != os.getpid():
                self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="actstore-get")
                self._pid = os.getpid()
            return self._pool

    def fetch(self, site: Any, index: int) -> bytearray:
        """The raw bytes of file ``index`` of ``site`` (concurrent ranged GETs), checked."""
        listing = self.listings[self.hook_of(site)]
        f = listing.files[index]
        size = listing.metadata.file_bytes
        out = bytearray(size)
        self.store.get_into(
            f.key,
            out,
            chunk_size=self.chunk_size or auto_chunk(size, self.concurrency),
            pool=self._thread_pool(),
        )
        self.checks.check(f"{listing.hook}/{base_name(f.key)}", 0, out)
        return out

    def decode(self, site: Any, index: int, data: bytes | bytearray) -> dict[str, torch.Tensor]:
        """Load fetched bytes and check them against ``metadata.json``."""
        listing = self.listings[self.hook_of(site)]
        return check_megabatch(
            load_megabatch(data, source=self.store.url(listing.files[index].key)),
            listing.metadata,
            self.store.url(listing.files[index].key),
        )

    def megabatch(self, site: Any, index: int) -> dict[str, torch.Tensor]:
        """File ``index`` of ``site``: ``{"states": [rows, seq, d], "input_ids": [rows, seq]}``
        in the stored dtypes."""
        return self.decode(site, index, self.fetch(site, index))

    def site_blocks(self, site: Site) -> list[Block]:
        """One block per megabatch file; ``loc = (file index,)``."""
        listing = self.listings[self._site_hooks[site]]
        n = listing.metadata.tokens_per_file
        return [Block(site=site, n_rows=n, loc=(i,)) for i in range(len(listing.files))]

    def n_rows(self, site: Any) -> int:
        listing = self.listings[self.hook_of(site)]
        return len(listing.files) * listing.metadata.tokens_per_file

    def read_block(self, block: Block, out: np.ndarray | None = None) -> np.ndarray:
        """Rows of ``block`` as ``[rows*seq, d]`` (float32 for bfloat16 stores)."""
        states = self.megabatch(block.site, block.loc[0])["states"]
        flat = states.reshape(-1, states.shape[-1])
        if out is None:
            out = np.empty(flat.shape, dtype=self.dtype)
        if out.shape != tuple(flat.shape):
            raise ConfigError(f"out has shape {out.shape}, the block is {tuple(flat.shape)}")
        torch.from_numpy(out).copy_(flat)
        return out

    def site_statistics(self, site: Site) -> RunningStats | None:
        """Exact statistics from statistics.json; None if absent or written by Activault
        (its file has no count, and its std leaves out within-batch variance)."""
        listing = self.listings[self._site_hooks[site]]
        key = join_key(listing.prefix, STATISTICS)
        exact = self.record is not None and self.checks.manifest is not None
        if self.store.size(key) is None:
            if exact:
                raise CorruptStoreError(
                    f"{self.store.url(key)} is missing, where actstore's writer stored the "
                    "hook's exact statistics: restore it or capture again"
                )
            return None
        return statistics_from_dict(
            self._json(f"{listing.hook}/{STATISTICS}"), source=self.store.url(key), exact=exact
        )

    # ------------------------------------------------------------------ summaries

    def describe_format(self) -> dict[str, Any]:
        """The format's part of ``describe()`` (no data is downloaded except for ``text``)."""
        first = next(iter(self.listings.values()))
        md = first.metadata
        n_files = len(first.files)
        out: dict[str, Any] = {
            "format": "activault (torch.save megabatches, one folder per hook)",
            "shape": (
                f"{n_files} files x [{md.batch_size} rows, {md.sequence_length} tokens, "
                f"{md.d_in} dims] per hook ({n_files * md.tokens_per_file} tokens)"
            ),
            "run": self.store.url(self.run_prefix),
            "hooks": {h: str(self._hook_site(h)) for h in self.listings},
            "bytes_per_file": md.bytes_per_file,
        }
        if self.hook_folder is not None:  # the folder's files, not the whole run's
            mine = [s for n, s in self.files.list().items() if n.startswith(self.hook_folder + "/")]
            out["files"], out["bytes"] = len(mine), sum(mine)
        if self.record is not None:
            out["complete"] = self.record.complete
            out["written_by"] = "actstore"
            if self.record.dropped_tokens:
                out["dropped_tail_tokens"] = self.record.dropped_tokens
        else:
            out["written_by"] = "Activault (no actstore record in cfg.json)"
        text = self.sample_text()
        if text:
            out["text"] = text
        if self.tokens is not None:  # a file is downloaded for them: only a small one
            out["token_ids[0][:16]"] = (
                self.tokens[0][:16].tolist()
                if md.file_bytes <= 64 * MiB
                else f"(in the files' input_ids; files of {md.file_bytes} bytes not downloaded)"
            )
        if self.notes:
            out["notes"] = list(self.notes)
        return out

    def sample_text(
        self, n_rows: int = 2, n_tokens: int = 32, max_bytes: int = 64 * MiB
    ) -> list[str] | None:
        """Decoded tokens of the first rows of the first file, when the model's tokenizer is
        available locally and the file is at most ``max_bytes``."""
        first = next(iter(self.listings.values()))
        if not first.files or first.metadata.file_bytes > max_bytes:
            return None
        tokenizer = local_tokenizer(self.model_name)
        if tokenizer is None:
            return None
        ids = self.megabatch(first.hook, 0)["input_ids"]
        if ids is None:
            return None
        rows = ids[:n_rows, :n_tokens].tolist()
        return [tokenizer.decode([t for t in row if t >= 0]) for row in rows]

    def verify(self, *, progress: Callable[[int], None] | None = None) -> VerifyReport:
        """Every file of the run against its root manifest (one download each), then each
        megabatch decoded: shapes, dtypes, NaN/Inf, each hook's statistics recomputed from
        its files the writer's way (bit for bit), stray objects, group alignment across
        hooks, and cfg.json against its commit record and its files
        (:mod:`.verify`). A run without a manifest (Activault's own) is decoded file by
        file and reported as unverifiable."""
        report = VerifyReport(self.url)
        report.notes.extend(self.notes)
        self._scan: dict[str, Any] = {
            h: {
                "stats": {},
                "non_finite": 0,
                "bufs": {},
                "index": {base_name(f.key): i for i, f in enumerate(lst.files)},
            }
            for h, lst in self.listings.items()
        }
        try:
            positions = self.positions
        except CorruptStoreError as err:
            report.faults.append(str(err))
            positions = None
        for scan in self._scan.values():
            scan["positions"] = positions
        n_files, n_bytes = self.checks.verify(
            report.faults, progress=progress, on_chunk=self.scan_chunk
        )
        report.files_checked, report.bytes_checked = n_files, n_bytes
        if self.checks.manifest is None:  # decode what there is, unverified
            for hook, listing in self.listings.items():
                for i, f in enumerate(listing.files):
                    data = self.fetch(hook, i)
                    self._decoded(hook, i, bytes(data))
                    report.files_checked += 1
                    report.bytes_checked += f.size
                    if progress is not None:
                        progress(f.size)
        self.verify_content(report)
        return report

    def scan_chunk(self, name: str, offset: int, data: memoryview) -> None:
        """Gather each megabatch file as verify reads it (files are read several at a
        time: one buffer each); decode it when whole."""
        hook, _, base = name.rpartition("/")
        scan = getattr(self, "_scan", {}).get(hook)
        if scan is None or parse_data_file(base) is None:
            return
        index = scan["index"].get(base)
        if index is None:
            return
        buf = scan["bufs"].setdefault(base, bytearray())
        buf += data
        if len(buf) == self.listings[hook].metadata.bytes_per_file:
            del scan["bufs"][base]
            self._decoded(hook, index, bytes(buf))

    def _decoded(self, hook: str, index: int, data: bytes) -> None:
        scan = self._scan[hook]
        listing = self.listings[hook]
        try:
            mb = check_megabatch(load_megabatch(data, source=hook), listing.metadata, hook)
        except CorruptStoreError as err:
            scan.setdefault("faults", []).append(str(err))
            return
        positions = scan.get("positions")
        if positions is not None and mb["input_ids"] is not None:
            per = listing.metadata.tokens_per_file
            want = positions.ids_of_rows(index * per, (index + 1) * per)
            if not np.array_equal(mb["input_ids"].reshape(-1).numpy(), want):
                scan.setdefault("faults", []).append(
                    f"{hook}/{base_name(listing.files[index].key)}: its tokens are not the ones "
                    f"{POSITIONS} places there: the positions "
                    "were edited; restore them or capture again"
                )
        states = mb["states"]
        scan["non_finite"] += int((~torch.isfinite(states.to(torch.float32))).sum())
        scan["stats"][index] = file_statistics(states)

    def verify_content(self, report: VerifyReport) -> None:
        merged = (
            self.record is not None
            and self.checks.manifest is not None
            and (self.record.run_id != one_process_run_id(self.checks.manifest.store_id))
        )
        for hook, listing in self.listings.items():
            scan = self._scan[hook]
            report.faults.extend(scan.get("faults", []))
            for name in listing.strays:
                report.faults.append(
                    f"{hook}/{name} is not a megabatch file; Activault's reader would read it "
                    "as one: remove it"
                )
            for name in listing.uncommitted:
                report.faults.append(
                    f"{hook}/{name} belongs to no committed group (left by an interrupted "
                    "capture); rerun that capture to clean it up, or delete it"
                )
            if scan["non_finite"]:
                report.notes.append(
                    f"{hook}: {scan['non_finite']} activation values are NaN or infinite"
                )
            try:
                stored = self.site_statistics(self._hook_site(hook))
            except CorruptStoreError as err:  # reported with the rest, not raised
                report.faults.append(str(err))
                continue
            if stored is None:
                report.notes.append(f"{hook}: no exact statistics.json (count missing) to check")
                continue
            recomputed = merged_statistics(scan["stats"], len(listing.files))
            if recomputed is not None:
                check_statistics(
                    report.faults,
                    f"{hook}/{STATISTICS}",
                    hook,
                    stored,
                    recomputed,
                    merged=merged,
                    record=self._json(f"{hook}/{STATISTICS}"),
                )
        if self.record is not None and self.checks.manifest is not None:
            found = record_faults(self.cfg, self.record, self.checks.manifest, self.hooks)
            positions = self.__dict__.get("_positions")
            if positions is not None:
                rec = self.record
                found += [
                    f"cfg.json's {fault} ({POSITIONS} says otherwise): cfg.json or the positions "
                    "were edited; restore them or capture again"
                    for fault in positions.record_faults(
                        rec.groups * rec.tokens_per_file,
                        rec.next_example,
                        rec.next_skip,
                        rec.dropped_tokens,
                        rec.token_mask,
                        merged=merged,
                    )
                ]
            for fault in found:
                if fault not in report.faults:
                    report.faults.append(fault)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        if self._pool is not None and self._pid == os.getpid():
            self._pool.shutdown(wait=False)
        self._pool = None
        self.files.close()

    def __getstate__(self) -> dict[str, Any]:
        state = {**self.__dict__, "_pool": None, "_ids": {}}
        del state["_pool_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pool_lock = ForkSafeLock()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.close()


class _PositionIds(LazyRows):
    """``reader.tokens`` of a run with a positions file: every example's ``T`` token ids."""

    def __init__(self, positions: Positions) -> None:
        super().__init__(np.int64, (len(positions), positions.tokens))
        self.positions = positions

    def rows(self, index: np.ndarray) -> np.ndarray:
        return self.positions.ids(index)


class _StoredMask(LazyRows):
    """``reader.token_mask``: the positions of each example the run stores values of."""

    def __init__(self, positions: Positions) -> None:
        super().__init__(np.bool_, (len(positions), positions.tokens))
        self.positions = positions

    def rows(self, index: np.ndarray) -> np.ndarray:
        return self.positions.stored(index)


class _InputIds(LazyRows):
    """``reader.tokens`` of an Activault run of whole examples: row ``i`` is example ``i``'s
    ``T`` token ids, from the files holding them."""

    def __init__(self, reader: ActivaultReader) -> None:
        plan = reader.capture_plan()
        super().__init__(np.int64, (plan.n_examples, plan.tokens_per_example))
        self.reader = reader
        self.per_file = next(iter(reader.listings.values())).metadata.tokens_per_file

    def rows(self, index: np.ndarray) -> np.ndarray:
        t = self.row_shape[0]
        flat = index[:, None] * t + np.arange(t)[None, :]
        out = np.empty(flat.shape, dtype=self.dtype)
        which = flat // self.per_file
        for k in np.unique(which).tolist():
            mine = which == k
            out[mine] = self.reader.file_input_ids(k)[flat[mine] - k * self.per_file]
        return out


def auto_chunk(size: int, concurrency: int) -> int:
    """Range size that splits one file over every download thread, within 1-16 MiB.

    Example:
        >>> auto_chunk(64 << 20, 8) >> 20, auto_chunk(4 << 30, 100) >> 20
        (8, 16)
    """
    return int(min(16 * MiB, max(MiB, -(-size // concurrency))))


def check_megabatch(
    mb: dict[str, torch.Tensor], md: HookMetadata, source: str
) -> dict[str, torch.Tensor]:
    """Raise :class:`CorruptStoreError` unless ``mb`` matches ``md``'s shape and dtype."""
    states, ids = mb["states"], mb["input_ids"]
    if tuple(states.shape) != md.shape or states.dtype != parse_dtype(md.dtype):
        raise CorruptStoreError(
            f"{source} holds states {tuple(states.shape)} {states.dtype}, metadata.json says "
            f"{list(md.shape)} {md.dtype}"
        )
    if ids is not None and (tuple(ids.shape) != md.input_ids_shape or ids.dtype != torch.int64):
        raise CorruptStoreError(
            f"{source} holds input_ids {tuple(ids.shape)} {ids.dtype}, expected "
            f"{list(md.input_ids_shape)} torch.int64"
        )
    return mb
