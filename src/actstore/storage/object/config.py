"""Each backend's settings (endpoint, credentials, how hard to retry): one frozen dataclass
per URL scheme, all :class:`StorageOptions`, each reading its ecosystem's usual variables."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar

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
class StorageOptions:
    """Base of every backend's settings: how hard to retry and how large objects go up,
    shared by all; each backend adds its endpoint and credentials. :mod:`.registry` hands
    a location's backend the options of its own type (:attr:`scheme`), else that type's
    defaults (read from the environment)."""

    scheme: ClassVar[str] = ""
    max_attempts: int = 8
    """Tries per request (and per part) before giving up."""
    backoff_s: float = 0.1
    """First backoff; doubles per retry up to ``backoff_max_s``, with full jitter."""
    backoff_max_s: float = 10.0
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    multipart_threshold: int = 64 * MiB
    """Objects larger than this are uploaded in parts (the object appears only when
    complete)."""
    part_size: int = 16 * MiB
    """Part size (>= 5 MiB, S3's minimum, for every backend)."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigError(f"max_attempts must be >= 1, not {self.max_attempts}")
        if self.part_size < 5 * MiB:
            raise ConfigError(f"part_size must be >= 5 MiB (an S3 limit), not {self.part_size}")
        if self.multipart_threshold < self.part_size:
            raise ConfigError("multipart_threshold must be >= part_size")

    def endpoint_setting(self) -> str:
        """Where the endpoint comes from, for error messages (what the user should fix)."""
        return "the backend's endpoint setting"


@dataclass(frozen=True, kw_only=True)
class S3Config(StorageOptions):
    """How to reach an S3-compatible endpoint and how hard to retry.

    Fields left ``None`` are read from the environment when the client is created.

    Example:
        >>> S3Config(endpoint_url="http://127.0.0.1:9000", max_attempts=4).max_attempts
        4
    """

    scheme: ClassVar[str] = "s3"
    endpoint_url: str | None = None
    """e.g. ``https://storage.eu-north1.nebius.cloud``; None: $S3_ENDPOINT_URL,
    $AWS_ENDPOINT_URL_S3 or $AWS_ENDPOINT_URL, else AWS."""
    region: str | None = None
    """None: $AWS_REGION or $AWS_DEFAULT_REGION, else us-east-1."""
    access_key_id: str | None = field(default=None, repr=False)
    secret_access_key: str | None = field(default=None, repr=False)
    list_page_size: int = 1000
    """Keys per LIST request (S3's maximum; smaller in tests of pagination)."""
    max_pool_connections: int = 64
    part_size: int = 32 * MiB
    """Multipart part size (S3 requires >= 5 MiB except for the last part)."""
    part_concurrency: int = 4
    """Parts of one object uploaded at once."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.list_page_size <= 1000:
            raise ConfigError(f"list_page_size must be 1..1000, not {self.list_page_size}")

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


@dataclass(frozen=True, kw_only=True)
class GCSConfig(StorageOptions):
    """How to reach Google Cloud Storage (``gs://``). Fields left ``None`` are read from the
    environment when the client is created.

    Example:
        >>> GCSConfig(endpoint_url="http://127.0.0.1:4443").resolved_endpoint()
        'http://127.0.0.1:4443'
    """

    scheme: ClassVar[str] = "gs"
    endpoint_url: str | None = None
    """None: $STORAGE_EMULATOR_HOST (an emulator: no credentials, plain HTTP allowed), else
    Google's endpoint."""
    credentials_path: str | None = None
    """A service account key file; None: $GOOGLE_APPLICATION_CREDENTIALS, else the
    machine's default credentials (metadata server)."""
    list_page_size: int = 1000
    """Objects per LIST request (the service's maximum; smaller in tests of pagination)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.part_size % (256 << 10):
            raise ConfigError(
                f"part_size must be a multiple of 256 KiB for gs:// (GCS's chunk unit), not "
                f"{self.part_size}"
            )

    def resolved_endpoint(self) -> str | None:
        """The endpoint with a scheme (the emulator variable is often written without)."""
        endpoint = self.endpoint_url or env("STORAGE_EMULATOR_HOST")
        if endpoint and "://" not in endpoint:
            endpoint = f"http://{endpoint}"
        return endpoint.rstrip("/") if endpoint else None

    def endpoint_setting(self) -> str:
        if self.endpoint_url:
            return "GCSConfig.endpoint_url"
        return "STORAGE_EMULATOR_HOST"


@dataclass(frozen=True, kw_only=True)
class AzureConfig(StorageOptions):
    """How to reach Azure Blob Storage (``az://container/prefix``). Fields left ``None``
    are read from the environment: $AZURE_STORAGE_CONNECTION_STRING first (Azurite's
    included), else $AZURE_STORAGE_ACCOUNT_NAME with $AZURE_STORAGE_ACCOUNT_KEY.

    Example:
        >>> AzureConfig(connection_string="AccountName=a;AccountKey=k;"
        ...             "BlobEndpoint=http://127.0.0.1:10000/a").resolved()["endpoint"]
        'http://127.0.0.1:10000/a'
    """

    scheme: ClassVar[str] = "az"
    connection_string: str | None = field(default=None, repr=False)
    account_name: str | None = None
    account_key: str | None = field(default=None, repr=False)
    endpoint_url: str | None = None
    """None: the connection string's BlobEndpoint, else https://ACCOUNT.blob.core.windows.net."""

    def resolved(self) -> dict[str, str]:
        """``account_name``, ``account_key`` and ``endpoint`` (those known), from the
        fields, then the connection string, then the account variables."""
        parts: dict[str, str] = {}
        text = self.connection_string or env("AZURE_STORAGE_CONNECTION_STRING") or ""
        for item in text.split(";"):
            name, sep, value = item.partition("=")
            if sep:
                parts[name.strip()] = value.strip()
        out = {
            "account_name": self.account_name
            or parts.get("AccountName")
            or env("AZURE_STORAGE_ACCOUNT_NAME"),
            "account_key": self.account_key
            or parts.get("AccountKey")
            or env("AZURE_STORAGE_ACCOUNT_KEY"),
            "endpoint": self.endpoint_url or parts.get("BlobEndpoint"),
        }
        return {k: v.rstrip("/") if k == "endpoint" else v for k, v in out.items() if v}

    def endpoint_setting(self) -> str:
        if self.endpoint_url:
            return "AzureConfig.endpoint_url"
        return "AZURE_STORAGE_CONNECTION_STRING"
