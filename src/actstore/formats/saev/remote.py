"""Write a saev store straight to ``s3://bucket/prefix``.

:class:`SaevS3Writer` is a :class:`~actstore.formats.s3_staged.StagedS3Writer` around the
local :class:`~.writer.SaevWriter`: each finished shard (and its block checksums) goes up
in the background while the capture runs, the destination is locked, and ``close()``
publishes ``s3://bucket/prefix/<HASH>`` (``metadata.json`` last, verified), as on disk.
See :mod:`actstore.formats.s3_staged` for the upload, lock and resume rules.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ...batch import CapturePlan
from ...storage.object import S3Config
from ..s3_staged import StagedS3Writer, staging_root
from .layout import DEFAULT_PATCHES_PER_SHARD, SaevMetadata
from .writer import SaevWriter, plan_arguments, store_dir

__all__ = ["SaevS3Writer", "staging_root"]


class SaevS3Writer(StagedS3Writer):
    """A saev store published at ``dump_to/<HASH>`` on S3 (:attr:`url`); ``close()``
    returns that URL. ``keep_local=True`` keeps the staged copy after the upload;
    ``kwargs`` go to :class:`SaevWriter`."""

    def __init__(
        self,
        metadata: SaevMetadata,
        dump_to: str,
        *,
        s3: S3Config | None = None,
        staging: str | os.PathLike | None = None,
        keep_local: bool = False,
        threads: int = 8,
        break_lock: bool = False,
        **kwargs: Any,
    ) -> None:
        staged = Path(staging or staging_root(dump_to)).expanduser().resolve()
        if kwargs.get("example_range") is not None:
            subdir = ""  # a part is written into the directory itself
        else:
            subdir = store_dir(metadata, staged).relative_to(staged).as_posix()
        self.metadata = metadata
        super().__init__(
            dump_to,
            lambda directory: SaevWriter(metadata, directory, break_lock=break_lock, **kwargs),
            s3=s3,
            staging=staged,
            keep_local=keep_local,
            subdir=subdir,
            threads=threads,
            break_lock=break_lock,
        )

    @classmethod
    def from_plan(
        cls,
        plan: CapturePlan,
        dump_to: str,
        *,
        dialect: str = "protocol",
        patches_per_shard: int = DEFAULT_PATCHES_PER_SHARD,
        break_lock: bool = False,
    ) -> SaevS3Writer:
        """The writer for a capture plan (what ``capture --format saev --out s3://`` uses)."""
        metadata, kwargs = plan_arguments(plan, dialect, patches_per_shard)
        return cls(metadata, dump_to, break_lock=break_lock, **kwargs)
