"""Zarr stores on object storage: detecting one at ``s3://bucket/prefix`` and capturing
straight to it.

:class:`ZarrS3Writer` is the generic :class:`~actstore.formats.s3_staged.StagedS3Writer`
around a local :class:`~.writer.ZarrWriter` (crash protocol unchanged, in a staging
directory), with one rule added for zarr: the consolidated metadata ``.zmetadata``, which
the reader needs first, is uploaded after every other file of the store, so a prefix that
has it holds the whole store. A rerun after ``kill -9`` resumes the staged store from its
last checkpoint and sends only the files not yet on S3.

``out`` is placed as a local ``--out`` is: ``s3://b/x`` gets ``s3://b/x/activations.zarr``,
``s3://b/x.zarr`` is the store itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ...batch import CapturePlan
from ...errors import CorruptStoreError
from ...storage.copy import DEFAULT_PART_BYTES, FileCopier
from ...storage.files import open_files
from ...storage.object import S3Config, join_key, open_location
from ..s3_staged import StagedS3Writer
from ..saev.remote import staging_root
from .layout import FORMAT_TAG, RUN_FORMAT_TAG, STORE_NAME
from .options import ZarrOptions
from .reader import MANIFEST
from .writer import ZarrWriter

#: Uploaded last: a reader refuses a prefix without it.
PUBLISHED_BY = ".zmetadata"


def detect_remote(location: str) -> bool:
    """Whether ``s3://bucket/prefix`` holds an actstore zarr store or run (a few HEADs and
    one small GET). A store whose ``.zattrs`` is ours but whose upload is unfinished counts
    as ours, so its reader says what is missing."""
    store, prefix = open_location(location)
    candidates = (
        (MANIFEST, RUN_FORMAT_TAG),
        (".zattrs", FORMAT_TAG),
        (f"{STORE_NAME}/.zattrs", FORMAT_TAG),
    )
    for name, tag in candidates:
        key = join_key(prefix, name)
        if store.size(key) is None:
            continue
        try:
            doc = store.get_json(key)
        except CorruptStoreError:
            return True  # ours by location but damaged: let the reader say what is wrong
        return isinstance(doc, dict) and doc.get("format") == tag
    return False


def default_staging(url: str) -> Path:
    """The staging directory of a capture to ``url``; it ends in ``.zarr`` (the store is the
    directory itself) when ``url`` does, as a local ``--out`` would."""
    staging = staging_root(url)
    return (
        staging.with_name(staging.name + ".zarr") if url.rstrip("/").endswith(".zarr") else staging
    )


class ZarrS3Writer(StagedS3Writer):
    """A zarr store captured in a staging directory and published below ``url``.

    ``make_local(staging)`` builds the local writer of the store at
    ``store_path(staging)``. ``close()`` uploads every file but ``.zmetadata``, then hands
    over to :meth:`StagedS3Writer.close`, which sends ``.zmetadata`` and verifies the
    upload; it returns the store's URL (:attr:`store_url`)."""

    def __init__(
        self,
        url: str,
        make_local: Callable[[Path], Any],
        *,
        s3: S3Config | None = None,
        staging: str | os.PathLike | None = None,
        keep_local: bool = False,
        threads: int = 8,
    ) -> None:
        self.threads = threads
        staging = Path(staging or default_staging(url)).expanduser().resolve()
        rel = "" if staging.suffix == ".zarr" else f"{STORE_NAME}/"
        self.store_url = url.rstrip("/") + ("/" + rel.rstrip("/") if rel else "")
        super().__init__(
            url,
            make_local,
            s3=s3,
            staging=staging,
            keep_local=keep_local,
            manifest=rel + PUBLISHED_BY,
        )

    @classmethod
    def for_plan(
        cls, plan: CapturePlan, url: str, options: ZarrOptions, **kwargs: Any
    ) -> ZarrS3Writer:
        """The writer ``actstore capture --format zarr --out s3://...`` uses."""
        return cls(url, lambda d: ZarrWriter.from_plan(plan, d, options), **kwargs)

    def close(self) -> str:
        if not _published(self.store_url, self.s3):
            local = Path(self.inner.close())
            self._upload_all_but_manifest(local, self.store_url)
        super().close()
        return self.store_url

    def _upload_all_but_manifest(self, local: Path, url: str) -> None:
        """Send the files of the staged store not yet at ``url`` (same size), except
        ``.zmetadata``."""
        source = open_files(local, cache=False)
        store, prefix = open_location(url, self.s3)
        base = prefix.rstrip("/") + "/" if prefix else ""
        present = {o.key[len(base) :]: o.size for o in store.list(base)}
        listing = source.list()
        todo = [n for n, size in listing.items() if n != PUBLISHED_BY and present.get(n) != size]
        copier = FileCopier(source, store, prefix, DEFAULT_PART_BYTES, None, etags=False)
        with ThreadPoolExecutor(self.threads, thread_name_prefix="actstore-zarr-up") as pool:
            copier.run(pool, todo, listing)


def _published(url: str, s3: S3Config | None) -> bool:
    store, prefix = open_location(url, s3)
    return store.size(join_key(prefix, PUBLISHED_BY)) is not None
