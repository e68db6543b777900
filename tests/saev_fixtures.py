"""saev stores for tests: the plan and options whose saev metadata is a given
``SaevMetadata`` (tests written against saev's own metadata build their stores this way)."""

from __future__ import annotations

from pathlib import Path


def saev_writer(md, root, *, has_tokens=False, has_labels=False, classes=None, **kw):
    """The :class:`SaevWriter` of a capture whose plan gives saev metadata ``md``."""
    from actstore.formats.saev import SaevWriter

    plan, options = saev_plan(md, has_tokens=has_tokens, has_labels=has_labels, classes=classes)
    return SaevWriter(plan, Path(root), options, **kw)


def saev_plan(md, *, has_tokens=False, has_labels=False, classes=None):
    """``(plan, options)`` of a capture whose saev metadata is ``md``."""
    from actstore.formats.saev import SaevOptions

    plan = md.capture_plan(
        has_tokens=has_tokens, has_labels=has_labels, classes=classes, batch_size=4
    )
    return plan, SaevOptions(dialect=md.dialect, patches_per_shard=md.patches_per_shard)
