"""The format's own conformance suite, as its project would run it: every rule of
actstore's kit (``actstore.testing``), the S3 round trip included (the kit's pytest plugin,
enabled in ``conftest.py``, serves S3 on 127.0.0.1)."""

from actstore.testing import ConformanceSuite, FormatCase


class TestNpyShards(ConformanceSuite):
    # options by field name: the case needs nothing imported from the format
    case = FormatCase("npyshards", {"examples_per_shard": 5})
