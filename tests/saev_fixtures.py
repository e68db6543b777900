"""saev stores for tests: the plan and options whose saev metadata is a given
``SaevMetadata`` (tests written against saev's own metadata build their stores this way)."""

from __future__ import annotations

from pathlib import Path

from actstore.batch import CapturePlan
from actstore.sites import Site


def saev_writer(md, root, *, has_tokens=False, has_labels=False, classes=None, **kw):
    """The :class:`SaevWriter` of a capture whose plan gives saev metadata ``md``."""
    from actstore.formats.saev import SaevWriter

    plan, options = saev_plan(md, has_tokens=has_tokens, has_labels=has_labels, classes=classes)
    return SaevWriter(plan, Path(root), options, **kw)


def saev_plan(md, *, has_tokens=False, has_labels=False, classes=None):
    """``(plan, options)`` of a capture whose saev metadata is ``md``."""
    from actstore.formats.saev import SaevOptions
    from actstore.formats.saev.reader import _decode_data

    plan = CapturePlan(
        ckpt=md.ckpt,
        family=md.family,
        modality="image" if md.family in ("clip", "siglip", "dinov2") else "text",
        sites=tuple(Site("resid", layer) for layer in md.layers),
        n_model_layers=max(md.layers) + 1,
        d_model=md.d_model,
        tokens_per_example=md.tokens_per_ex,
        has_cls=md.cls_token,
        n_examples=md.n_examples,
        dataset_root=md.dataset,
        data=_decode_data(md.data),
        classes=classes,
        has_labels=has_labels,
        has_tokens=has_tokens,
        batch_size=4,
    )
    return plan, SaevOptions(dialect=md.dialect, patches_per_shard=md.patches_per_shard)
