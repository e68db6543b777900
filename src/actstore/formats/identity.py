"""Saying what differs when an output holds another capture.

A writer that finds a published store of another record where its store goes (local
directory or ``s3://``) refuses with :class:`~actstore.errors.OtherCaptureError` naming the
location; :func:`explain_other_capture` reads that store's capture plan back and says, in
the same one line, what differs from the capture asked for (the data changed, the model's
weights, the compute dtype, the model, the sites...), so the user knows why it is not
"Already captured".

Example:
    >>> try:  # doctest: +SKIP
    ...     writer = spec.open_writer(plan, out, options)
    ... except OtherCaptureError as err:
    ...     raise explain_other_capture(err, plan) from None
"""

from __future__ import annotations

from ..batch import CapturePlan, plan_differences
from ..errors import ActstoreError, OtherCaptureError


def explain_other_capture(err: OtherCaptureError, plan: CapturePlan) -> OtherCaptureError:
    """``err`` restated with what differs between the store at ``err.location`` and
    ``plan`` (``err`` itself when that store cannot be read back)."""
    from .registry import format_of

    try:
        spec = format_of(err.location)
        if spec is None:
            return err
        with spec.open_reader(err.location) as reader:
            held = reader.capture_plan()
    except (ActstoreError, OSError, ValueError, KeyError, TypeError):
        return err
    differs = plan_differences(held, plan) or ["other format options (--opt) or layout"]
    return OtherCaptureError(
        f"{err.location} holds another {spec.name} capture: {'; '.join(differs)}; it is not "
        "this capture and is left as it is: choose another output, or move it away to "
        "capture anew",
        location=err.location,
    )
