"""Writer options of the zarr format (``--opt key=value`` on the command line).

Example:
    >>> ZarrOptions(r_max=64).quantile
    0.99
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...errors import ConfigError
from .layout import DEFAULT_QUANTILE, PROMPT_KEEP


@dataclass(frozen=True, kw_only=True)
class ZarrOptions:
    """How prompt/response activations are padded, truncated and chunked."""

    p_max: int | None = field(
        default=None,
        metadata={
            "help": ("stored prompt tokens per sample (pad/truncate); None: the length quantile")
        },
    )
    r_max: int | None = field(
        default=None,
        metadata={
            "help": (
                "stored response tokens per sample (pad/truncate); None: the length quantile "
                "(the spec's QA default is 64); 0 stores prompts only"
            )
        },
    )
    quantile: float = field(
        default=DEFAULT_QUANTILE,
        metadata={"help": ("length quantile that sets P_max/R_max when they are not given")},
    )
    t_chunk_prompt: int | None = field(
        default=None,
        metadata={"help": ("prompt tokens per chunk; None: fewest equal chunks of <= 1 MiB")},
    )
    t_chunk_response: int | None = field(
        default=None,
        metadata={"help": ("response tokens per chunk; None: R_max (one chunk per query)")},
    )
    prompt_keep: str = field(
        default="first",
        metadata={
            "help": ("which tokens of a prompt longer than P_max are kept: 'first' or 'last'")
        },
    )
    samples_per_shard: int | None = field(
        default=None,
        metadata={
            "help": (
                "samples per writer shard (a killed capture resumes at the last finished one; "
                "per-sample arrays are chunked this many rows at a time); None: about 256 MiB"
            )
        },
    )
    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": ("dataset name recorded in the attributes; None: the dataset's file name")
        },
    )

    def __post_init__(self) -> None:
        if self.prompt_keep not in PROMPT_KEEP:
            raise ConfigError(f"prompt_keep must be one of {PROMPT_KEEP}, not {self.prompt_keep!r}")
        if not 0.0 < self.quantile <= 1.0:
            raise ConfigError(f"quantile must lie in (0, 1], not {self.quantile}")
        for name, least in (
            ("p_max", 0),
            ("r_max", 0),
            ("t_chunk_prompt", 1),
            ("t_chunk_response", 1),
            ("samples_per_shard", 1),
        ):
            value = getattr(self, name)
            if value is not None and value < least:
                raise ConfigError(f"{name} must be >= {least} (or None), not {value}")
