"""The saev format keeps the storage rules (actstore.testing), in both dialects."""

from __future__ import annotations

from actstore.formats.saev import SaevOptions
from actstore.testing import N_TOKENS, SITES, ConformanceSuite, FormatCase

PER_SHARD = 5 * N_TOKENS * len(SITES)  # 5 examples per shard: 5 shards
RESIDUAL_ONLY = "the saev protocol stores the residual stream only (its 'layers')"
CANNOT_HOLD = {"attn_out": RESIDUAL_ONLY, "mlp_out": RESIDUAL_ONLY}


class TestSaevConformance(ConformanceSuite):
    case = FormatCase("saev", SaevOptions(patches_per_shard=PER_SHARD), cannot_hold=CANNOT_HOLD)


class TestSaevDialectConformance(ConformanceSuite):
    case = FormatCase(
        "saev",
        SaevOptions(dialect="saev", patches_per_shard=PER_SHARD),
        plan_overrides={"family": "clip"},
        cannot_hold=CANNOT_HOLD,
        check_crashes="crash and resume are checked on TestSaevConformance (the same writer)",
    )
