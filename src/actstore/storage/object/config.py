"""Where the S3 endpoint and credentials come from, and how hard to retry."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ...errors import ConfigError

MiB = 1 << 20


def env(*names: str) -> str | None:
    """The first of the environment variables ``names`` that is set and not empty."""
    for name in names:
        value = os.environ.get(name)
        if value:
            return value
    return None


@dataclass(frozen=True, kw_only=True)
class S3Config:
    """How to reach an S3-compatible endpoint and how hard to retry.

    Fields left ``None`` are read from the environment when the client is created.

    Example:
        >>> S3Config(endpoint_url="http://127.0.0.1:9000", max_attempts=4).max_attempts
        4
    """

    endpoint_url: str | None = None
    """e.g. ``https://storage.eu-north1.nebius.cloud``; None: $S3_ENDPOINT_URL,
    $AWS_ENDPOINT_URL_S3 or $AWS_ENDPOINT_URL, else AWS."""
    region: str | None = None
    """None: $AWS_REGION or $AWS_DEFAULT_REGION, else us-east-1."""
    access_key_id: str | None = field(default=None, repr=False)
    secret_access_key: str | None = field(default=None, repr=False)
    max_attempts: int = 8
    """Tries per request (and per multipart part) before giving up."""
    backoff_s: float = 0.1
    """First backoff; doubles per retry up to ``backoff_max_s``, with full jitter."""
    backoff_max_s: float = 10.0
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    max_pool_connections: int = 64
    multipart_threshold: int = 64 * MiB
    """Objects larger than this are uploaded as multipart uploads."""
    part_size: int = 32 * MiB
    """Multipart part size (S3 requires >= 5 MiB except for the last part)."""
    part_concurrency: int = 4
    """Parts of one object uploaded at once."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError(f"max_attempts must be >= 1, not {self.max_attempts}")
        if self.part_size < 5 * MiB:
            raise ConfigError(f"part_size must be >= 5 MiB (an S3 limit), not {self.part_size}")
        if self.multipart_threshold < self.part_size:
            raise ConfigError("multipart_threshold must be >= part_size")

    def resolved_endpoint(self) -> str | None:
        return self.endpoint_url or env(*_ENDPOINT_VARS)

    def endpoint_setting(self) -> str:
        """Where the endpoint comes from, for error messages (what the user should fix).

        Example:
            >>> S3Config(endpoint_url="http://127.0.0.1:9000").endpoint_setting()
            'S3Config.endpoint_url (--endpoint-url)'
        """
        if self.endpoint_url:
            return "S3Config.endpoint_url (--endpoint-url)"
        return next((name for name in _ENDPOINT_VARS if os.environ.get(name)), "S3_ENDPOINT_URL")


#: Environment variables naming the endpoint, first match wins (S3_ENDPOINT_URL: Activault's).
_ENDPOINT_VARS = ("S3_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
