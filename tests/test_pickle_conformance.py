"""The pkl.gz format keeps the storage rules (actstore.testing), gzipped and plain."""

from __future__ import annotations

from actstore.formats.pickle import PickleOptions
from actstore.testing import ConformanceSuite, FormatCase

RESIDUAL_ONLY = "pkl.gz shards (spec 1.0) store the residual stream only (layer_{idx} keys)"
CANNOT_HOLD = {"attn_out": RESIDUAL_ONLY, "mlp_out": RESIDUAL_ONLY}


class TestPickleConformance(ConformanceSuite):
    case = FormatCase(
        "pickle", PickleOptions(compress=True, samples_per_shard=5), cannot_hold=CANNOT_HOLD
    )


class TestPlainPickleConformance(ConformanceSuite):
    case = FormatCase(
        "pickle",
        PickleOptions(compress=False, samples_per_shard=5),
        cannot_hold=CANNOT_HOLD,
        check_crashes="crash and resume are checked on TestPickleConformance (gzipped shards)",
    )
