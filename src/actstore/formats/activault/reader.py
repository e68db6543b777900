"""Read an Activault run (or one hook of it) from S3 or a local directory.

Opening lists each hook's folder once and checks what Activault's reader silently assumes:
``metadata.json`` is complete, every data file is exactly ``bytes_per_file`` bytes, no hook
folder name is a prefix of a sibling's, and (for runs actstore wrote) every committed file
is present, the capture is complete and the run matches its root manifest. Files are
downloaded with concurrent ranged GETs, checked against their keyed digests (a file moved
to another hook or group, or copied from another run, fails) and loaded with
``torch.load(weights_only=True)`` only. Runs Activault itself wrote have no manifest: they
read unverified, after one warning.

:class:`ActivaultReader` is built in layers, one module each: :mod:`.listing` (the commit
record and hook folders, checked when opened), :mod:`.fetch` (files fetched, checked and
decoded), :mod:`.examples` (positions, token ids, the capture plan), :mod:`.verify`
(``verify``); this module adds the constructor, ``describe`` and the lifecycle.

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
import os
from typing import Any

from ...errors import CorruptStoreError
from ...forksafe import ForkSafeLock
from ...hub import local_tokenizer
from ...storage.location import Location
from ...storage.object import MiB
from ..report import summary_of
from .layout import CFG, METADATA
from .verify import ActivaultVerify


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


class ActivaultReader(ActivaultVerify):
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

    def __repr__(self) -> str:
        md = next(iter(self.listings.values())).metadata
        return (
            f"ActivaultReader({self.url!r}, hooks={self.hooks}, files={self.n_files}, "
            f"shape={list(md.shape)}, dtype={md.dtype})"
        )

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
