"""Progress-bar switches shared by every long-running command."""

from __future__ import annotations


def bar_switch(progress: bool) -> dict[str, bool]:
    """tqdm keyword arguments that turn a bar off only when ``progress`` is False.

    Passing ``disable=False`` (or ``None``) explicitly would override the ``TQDM_DISABLE``
    environment variable, so nothing is passed when progress is on.

    Example:
        >>> bar_switch(True), bar_switch(False)
        ({}, {'disable': True})
    """
    return {} if progress else {"disable": True}
