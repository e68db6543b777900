"""Writer options of the saev format (``--opt key=value`` on the command line)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .layout import DEFAULT_PATCHES_PER_SHARD


@dataclass(frozen=True, kw_only=True)
class SaevOptions:
    """How a capture is laid out as saev protocol 2.1 shards."""

    dialect: str = field(
        default="protocol",
        metadata={
            "help": (
                "'protocol': the saev protocol 2.1 document; 'saev': what saev's released code reads "
                "(ViT families only)"
            )
        },
    )
    patches_per_shard: int = field(
        default=DEFAULT_PATCHES_PER_SHARD,
        metadata={"help": "token budget per shard file (~10 GiB at d_model=1024)"},
    )
