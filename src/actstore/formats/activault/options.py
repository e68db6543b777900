"""Writer options of the activault format (``--opt key=value`` on the command line)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ...errors import ConfigError
from ...storage.object import StorageOptions, backend, split_location
from .layout import DTYPES


@dataclass(frozen=True, kw_only=True)
class ActivaultOptions:
    """How a capture is cut into megabatch files and uploaded.

    Example:
        >>> ActivaultOptions(rows_per_file=64, dtype="float16").dtype
        'float16'
    """

    dtype: str = field(
        default="bfloat16",
        metadata={"help": "stored activation dtype: bfloat16, float16 or float32"},
    )
    rows_per_file: int = field(
        default=0,
        metadata={
            "help": "rows (sequences) per megabatch file; 0: 8 x the capture batch size, at "
            "most 256 MiB per file and 1/16 of the capture"
        },
    )
    sequence_length: int = field(
        default=0, metadata={"help": "tokens per stored row; 0: the capture's tokens per example"}
    )
    upload_threads: int = field(
        default=2, metadata={"help": "upload threads per hook (each hook has its own client)"}
    )
    queue_files: int = field(
        default=2, metadata={"help": "megabatches queued per hook before the capture waits"}
    )
    max_attempts: int = field(
        default=8, metadata={"help": "tries per object storage request before the capture fails"}
    )
    part_size_mb: int = field(
        default=32,
        metadata={"help": "multipart part size in MiB (files above 2 parts use multipart uploads)"},
    )

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        for name in ("rows_per_file", "sequence_length"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, not {getattr(self, name)}")
        for name in ("upload_threads", "queue_files", "max_attempts"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, not {getattr(self, name)}")
        if self.part_size_mb < 5:
            raise ConfigError("part_size_mb must be >= 5 (an S3 limit)")

    def storage_options(self, location: str, base: StorageOptions | None = None) -> StorageOptions:
        """The settings of ``location``'s backend: ``base`` where it is that backend's
        (endpoint, credentials), else its defaults from the environment, with these options'
        retry and multipart settings. The endpoint is deliberately not an option: set the
        backend's variable (``S3_ENDPOINT_URL``...) so that writing and every later read
        reach the same one.

        Example:
            >>> ActivaultOptions(part_size_mb=8).storage_options("gs://b/run").part_size >> 20
            8
        """
        scheme = split_location(location)[0]
        if scheme == "file":
            return StorageOptions()
        entry = backend(scheme)
        part = self.part_size_mb << 20
        return dataclasses.replace(
            entry.options(base),
            max_attempts=self.max_attempts,
            part_size=part,
            multipart_threshold=2 * part,
        )
