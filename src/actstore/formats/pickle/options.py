"""Writer options of the pkl.gz format (``--opt key=value`` on the command line)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...errors import ConfigError
from .layout import DEFAULT_SHARD_MB


@dataclass(frozen=True, kw_only=True)
class PickleOptions:
    """How a capture is cut into pkl.gz shards."""

    compress: bool = field(
        default=True,
        metadata={
            "help": "gzip shards (.pkl.gz, the spec's default) or write plain .pkl (faster to load)"
        },
    )
    compresslevel: int = field(
        default=1,
        metadata={
            "help": "gzip level 1-9; activations are high-entropy floats, so higher levels cost "
            "much time for little size"
        },
    )
    shard_mb: float = field(
        default=DEFAULT_SHARD_MB,
        metadata={"help": "target MB of float32 activations per shard (spec: 50-500 recommended)"},
    )
    samples_per_shard: int | None = field(
        default=None, metadata={"help": "samples per shard, overriding shard_mb"}
    )

    def __post_init__(self) -> None:
        if not 1 <= self.compresslevel <= 9:
            raise ConfigError(f"compresslevel must be 1..9, not {self.compresslevel}")
        if self.shard_mb <= 0:
            raise ConfigError(f"shard_mb must be positive, not {self.shard_mb}")
        if self.samples_per_shard is not None and self.samples_per_shard < 1:
            raise ConfigError(f"samples_per_shard must be >= 1, not {self.samples_per_shard}")
