"""Typed reads of metadata fields: a field of the wrong type or out of range is one
:class:`~actstore.errors.CorruptStoreError` naming the file and the field, never a
``TypeError`` or a huge allocation further on.

Readers take what they trust from a metadata document through :class:`Fields` (and a
capture plan through :func:`plan_from_dict`), so a hostile value (a string for a count, a
negative or 30-digit size, a list for a flag) stops at the parse. What the values say is
then checked against the data by each format (``verify_metadata``).

Example:
    >>> f = Fields({"n": 3, "name": "x", "flags": [True]}, "meta.json")
    >>> f.count("n"), f.text("name")
    (3, 'x')
    >>> f.count("name")
    Traceback (most recent call last):
    ...
    actstore.errors.CorruptStoreError: meta.json: name must be a whole number in 0..281474976710656, not 'x'; the metadata was edited or damaged: restore it or re-create the store
"""

from __future__ import annotations

from typing import Any

from ..batch import CapturePlan
from ..errors import CorruptStoreError
from ..sites import Site

#: Largest count a metadata field may hold (rows, examples, bytes): 2**48.
MAX_COUNT = 1 << 48
#: Largest tokens per example, width or layer count a plan may declare.
MAX_DIM = 1 << 24

_MISSING = object()


class Fields:
    """The fields of one metadata object (``doc``, from ``where``), read by type."""

    def __init__(self, doc: Any, where: str) -> None:
        if not isinstance(doc, dict):
            raise CorruptStoreError(
                f"{where} must be a JSON object, not {type(doc).__name__}; the metadata was "
                "edited or damaged: restore it or re-create the store"
            )
        self.doc, self.where = doc, where

    def fault(self, key: str, want: str, value: Any) -> CorruptStoreError:
        shown = repr(value)
        if len(shown) > 60:
            shown = shown[:57] + "..."
        return CorruptStoreError(
            f"{self.where}: {key} must be {want}, not {shown}; the metadata was edited or "
            "damaged: restore it or re-create the store"
        )

    def _get(self, key: str, optional: bool) -> Any:
        value = self.doc.get(key, _MISSING)
        if value is _MISSING:
            if optional:
                return None
            raise CorruptStoreError(
                f"{self.where} lacks {key!r}; the metadata was edited or damaged: restore it or "
                "re-create the store"
            )
        return value

    def count(self, key: str, *, lo: int = 0, hi: int = MAX_COUNT, optional: bool = False) -> Any:
        """An int in ``lo..hi`` (None when ``optional`` and absent or null)."""
        value = self._get(key, optional)
        if value is None and optional:
            return None
        if not is_int(value) or not lo <= value <= hi:
            raise self.fault(key, f"a whole number in {lo}..{hi}", value)
        return value

    def flag(self, key: str, *, optional: bool = False) -> Any:
        value = self._get(key, optional)
        if value is None and optional:
            return None
        if not isinstance(value, bool):
            raise self.fault(key, "true or false", value)
        return value

    def text(self, key: str, *, optional: bool = False) -> Any:
        value = self._get(key, optional)
        if value is None and optional:
            return None
        if not isinstance(value, str):
            raise self.fault(key, "a string", value)
        return value

    def obj(self, key: str, *, optional: bool = False) -> Any:
        value = self._get(key, optional)
        if value is None and optional:
            return None
        if not isinstance(value, dict):
            raise self.fault(key, "an object", value)
        return value

    def obj_list(self, key: str, *, optional: bool = False) -> Any:
        """A list of objects."""
        value = self._get(key, optional)
        if value is None and optional:
            return None
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            raise self.fault(key, "a list of objects", value)
        return value

    def counts(self, key: str, *, hi: int = MAX_COUNT, optional: bool = False) -> Any:
        """A list of ints in ``0..hi``."""
        value = self._get(key, optional)
        if value is None and optional:
            return None
        if not isinstance(value, list) or not all(is_int(v) and 0 <= v <= hi for v in value):
            raise self.fault(key, f"a list of whole numbers in 0..{hi}", value)
        return value

    def texts(self, key: str, *, optional: bool = False) -> Any:
        value = self._get(key, optional)
        if value is None and optional:
            return None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.fault(key, "a list of strings", value)
        return value


def is_int(value: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def plan_from_dict(doc: Any, where: str) -> CapturePlan:
    """The capture plan a store records (:meth:`CapturePlan.to_json_dict`), each field of
    the type a plan holds (sizes bounded), as a :class:`CapturePlan`.

    Example:
        >>> from actstore.testing import make_plan
        >>> plan = make_plan()
        >>> plan_from_dict(plan.to_json_dict(), "cfg.json") == plan
        True
        >>> plan_from_dict({**plan.to_json_dict(), "classes": 1}, "cfg.json")
        Traceback (most recent call last):
        ...
        actstore.errors.CorruptStoreError: cfg.json: classes must be a list of strings, not 1; the metadata was edited or damaged: restore it or re-create the store
    """
    f = Fields(doc, where)
    for key in ("ckpt", "family", "modality", "dataset_root"):
        f.text(key)
    for key in ("n_model_layers", "d_model", "tokens_per_example"):
        f.count(key, lo=1, hi=MAX_DIM)
    f.count("n_examples")
    f.count("batch_size", lo=1, hi=MAX_COUNT)
    for key in ("has_cls", "has_labels", "has_tokens"):
        f.flag(key)
    f.obj("data")
    f.texts("classes", optional=True)
    f.obj("extras", optional=True)
    sites = f.texts("sites")
    try:
        parsed = tuple(Site.parse(s) for s in sites)
    except (ValueError, KeyError) as err:
        raise f.fault("sites", "a list of site names", sites) from err
    if not parsed or len(set(parsed)) != len(parsed):
        raise f.fault("sites", "a list of distinct site names", sites)
    try:
        return CapturePlan.from_json_dict(doc)
    except (TypeError, ValueError, KeyError) as err:
        raise CorruptStoreError(
            f"{where}: the capture plan is malformed ({err}); the metadata was edited or "
            "damaged: restore it or re-create the store"
        ) from err
