"""Small helpers shared by the CLI commands."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError


def parse_int_list(text: str, option: str) -> list[int]:
    """Parse ``"3,5,-1"`` into ``[3, 5, -1]``; spaces around entries are fine, empty
    entries (``"3,,5"``, a trailing comma) are refused.

    Example:
        >>> parse_int_list("3, -1", "--layers")
        [3, -1]
    """
    parts = [part.strip() for part in text.split(",")]
    if not any(parts):
        raise ConfigError(f"{option} needs at least one value, like 3,5,-1")
    if not all(parts):
        raise ConfigError(f"{option} {text!r} has an empty entry; write it like 3,5,-1")
    try:
        return [int(part) for part in parts]
    except ValueError:
        raise ConfigError(
            f"{option} takes comma-separated integers like 3,5,-1, not {text!r}"
        ) from None


def s3_options(endpoint_url: str | None, *locations: str) -> Any:
    """The ``S3Config`` of ``--endpoint-url``; a one-line :class:`ConfigError` when it is
    given for a ``gs://`` or ``az://`` location (their endpoints come from
    ``STORAGE_EMULATOR_HOST`` / ``AZURE_STORAGE_CONNECTION_STRING``).

    Example:
        >>> s3_options("http://127.0.0.1:9000", "s3://b/x", "/tmp/y").endpoint_url
        'http://127.0.0.1:9000'
    """
    from ..storage.object import S3Config, split_location

    if endpoint_url:
        for location in locations:
            scheme, bucket, _ = split_location(location)
            if bucket is not None and scheme != "s3":
                raise ConfigError(
                    f"--endpoint-url is for s3:// locations, not {location}: set "
                    f"{'STORAGE_EMULATOR_HOST' if scheme == 'gs' else 'AZURE_STORAGE_CONNECTION_STRING'} "
                    "instead"
                )
    return S3Config(endpoint_url=endpoint_url)
