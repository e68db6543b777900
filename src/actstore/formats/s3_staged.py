"""Any format's local writer, published to ``s3://`` when it closes.

:class:`StagedS3Writer` runs the format's own writer (crash protocol unchanged) in a
staging directory (:func:`~actstore.formats.saev.remote.staging_root`) and, at ``close()``,
copies the published store to the destination with
:func:`~actstore.storage.copy.copy_store`: parallel multipart uploads, ``metadata.json``
last (readers refuse a prefix without it), verified. A rerun after ``kill -9`` resumes the
staged writer where it stopped and skips the files already uploaded. Used for pkl.gz;
saev has :class:`~actstore.formats.saev.remote.SaevS3Writer`, which also uploads each shard
in the background while the capture runs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..batch import Batch
from ..errors import ConfigError
from ..storage.copy import copy_store
from ..storage.object import S3Config, S3Store, join_key, open_location
from .base import WriterBase
from .saev.remote import _remove_tree, staging_root

log = logging.getLogger(__name__)


class StagedS3Writer(WriterBase):
    """``make_local(staging_dir)`` builds the local writer; the store it publishes under
    ``staging_dir`` is uploaded to the same relative place under ``url``."""

    def __init__(
        self,
        url: str,
        make_local: Callable[[Path], Any],
        *,
        s3: S3Config | None = None,
        staging: str | os.PathLike | None = None,
        keep_local: bool = False,
        manifest: str = "metadata.json",
    ) -> None:
        self.url, self.s3, self.keep_local = url.rstrip("/"), s3, keep_local
        store, prefix = open_location(url, s3)
        if not isinstance(store, S3Store):
            raise ConfigError(f"{url} is not an s3:// location")
        store.check_bucket()
        self.staging = Path(staging or staging_root(url)).expanduser().resolve()
        self.staging.parent.mkdir(parents=True, exist_ok=True)
        self.inner = make_local(self.staging)
        self.wants_texts: bool = self.inner.wants_texts
        self.example_range: tuple[int, int] = self.inner.example_range
        self._published = store.size(join_key(prefix, manifest)) is not None
        self.complete: bool = self._published or self.inner.complete
        self.resume_from: int = self.example_range[1] if self._published else self.inner.resume_from

    def write(self, batch: Batch) -> None:
        self.inner.write(batch)

    def close(self) -> str:
        """Publish locally, upload (``metadata.json`` last, verified), drop the staged copy."""
        if self._published:
            return self.url
        local = Path(self.inner.close())
        rel = local.relative_to(self.staging).as_posix()
        url = self.url if rel == "." else f"{self.url}/{rel}"
        copy_store(local, url, s3=self.s3)
        if not self.keep_local:
            _remove_tree(local)
        log.info("published %s", url)
        self._published = True
        return url

    def abort(self) -> None:
        self.inner.abort()
