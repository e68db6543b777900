"""Writer options of the saelens format (``--opt key=value`` on the command line)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...errors import ConfigError
from .layout import DTYPES


@dataclass(frozen=True, kw_only=True)
class SaelensOptions:
    """How a capture is laid out as a SAELens activation cache."""

    dtype: str = field(
        default="float32",
        metadata={"help": "stored dtype of the activation columns: float32 (exact) or float16"},
    )
    shard_mb: float = field(
        default=1000.0,
        metadata={
            "help": "target MB per Arrow file (at most 2000: sae_lens keeps files under 2 GB); "
            "a killed capture resumes at the last finished file"
        },
    )
    examples_per_shard: int | None = field(
        default=None, metadata={"help": "examples per Arrow file, overriding shard_mb"}
    )
    block_kb: int | None = field(
        default=None,
        metadata={"help": "KiB per block (Arrow record batch) of one column; default 2048"},
    )

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        if not 0 < self.shard_mb <= 2000:
            raise ConfigError(f"shard_mb must be in (0, 2000], not {self.shard_mb}")
        if self.examples_per_shard is not None and self.examples_per_shard < 1:
            raise ConfigError(f"examples_per_shard must be >= 1, not {self.examples_per_shard}")
        if self.block_kb is not None and self.block_kb < 1:
            raise ConfigError(f"block_kb must be >= 1, not {self.block_kb}")
