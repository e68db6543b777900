"""Zarr stores on object storage: detecting one at ``s3://bucket/prefix`` and capturing
straight to it.

:class:`ZarrS3Writer` is the generic :class:`~actstore.formats.s3_staged.StagedS3Writer`
around a local :class:`~.writer.ZarrWriter` (crash protocol unchanged, in a staging
directory): its finished chunk files upload while the capture runs, and the consolidated
metadata ``.zmetadata``, which the reader needs first, is uploaded after every other file
of the store, so a prefix that has it holds the whole store. A rerun after ``kill -9`` resumes the staged store from its
last checkpoint and sends only the files not yet on S3.

``out`` is placed as a local ``--out`` is: ``s3://b/x`` gets ``s3://b/x/activations.zarr``,
``s3://b/x.zarr`` is the store itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...batch import CapturePlan
from ...errors import CorruptStoreError
from ...storage.object import S3Config, join_key, open_location
from ..s3_staged import StagedS3Writer, staging_root
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
    """A zarr store captured in a staging directory and published below ``url`` (at
    ``url/activations.zarr``, or ``url`` itself when it ends in ``.zarr``), with
    ``.zmetadata`` sent last."""

    def __init__(
        self,
        url: str,
        make_local: Callable[[Path], Any],
        *,
        s3: S3Config | None = None,
        staging: str | os.PathLike | None = None,
        keep_local: bool = False,
        threads: int = 8,
        break_lock: bool = False,
    ) -> None:
        staging = Path(staging or default_staging(url)).expanduser().resolve()
        super().__init__(
            url,
            make_local,
            s3=s3,
            staging=staging,
            keep_local=keep_local,
            manifest=PUBLISHED_BY,
            subdir="" if staging.suffix == ".zarr" else STORE_NAME,
            threads=threads,
            break_lock=break_lock,
        )

    @property
    def store_url(self) -> str:
        """Where the store is published (as :attr:`url`)."""
        return self.url

    @classmethod
    def for_plan(
        cls, plan: CapturePlan, url: str, options: ZarrOptions, **kwargs: Any
    ) -> ZarrS3Writer:
        """The writer ``actstore capture --format zarr --out s3://...`` uses."""
        return cls(url, lambda d: ZarrWriter.from_plan(plan, d, options), **kwargs)
