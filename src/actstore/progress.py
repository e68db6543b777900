"""Progress-bar switches shared by every long-running command, and the one way sizes are
printed for people (:func:`human_bytes`)."""

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


def human_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``.

    Example:
        >>> human_bytes(3 * 2**30)
        '3.0 GiB'
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError
