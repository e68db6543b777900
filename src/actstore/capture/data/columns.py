"""Which field of a record (or column of a table) holds the text or the token ids.

A field holds ``text`` (strings) or ``tokens`` (integer lists or arrays); the choice is made
from the field's type, so a list of ids is never turned into text and re-tokenised:

- ``--token-field F``: ``F`` must hold token ids;
- ``--text-field F``: ``F`` must hold text (a list-typed ``F`` is refused, naming
  ``--token-field``);
- neither: ``text`` when it holds text, else the first of ``input_ids``, ``tokens`` that
  holds token ids.

Example:
    >>> pick_field({"input_ids": "tokens", "n": "int64"}, where="x.jsonl")
    ('input_ids', 'tokens')
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from ...errors import ConfigError

#: Fields taken as pre-tokenized input when no field is named and ``text`` holds no text.
TOKEN_COLUMNS = ("input_ids", "tokens")
#: The field read as text when none is named.
DEFAULT_TEXT_FIELD = "text"

Kind = Literal["text", "tokens"]


def pick_field(
    kinds: Mapping[str, str],
    *,
    where: str,
    text_field: str | None = None,
    token_field: str | None = None,
    noun: str = "column",
) -> tuple[str, Kind]:
    """The field to read and whether it is text or token ids. ``kinds`` maps each field to
    ``"text"``, ``"tokens"`` or a description of what else it holds."""
    listed = f"{noun}s: {list(kinds)}"
    if token_field is not None:
        return token_field, _expect(kinds, token_field, "tokens", where, noun, listed)
    if text_field is not None:
        return text_field, _expect(kinds, text_field, "text", where, noun, listed)
    if kinds.get(DEFAULT_TEXT_FIELD) == "text":
        return DEFAULT_TEXT_FIELD, "text"
    for name in TOKEN_COLUMNS:
        if kinds.get(name) == "tokens":
            return name, "tokens"
    if kinds.get(DEFAULT_TEXT_FIELD) == "tokens":
        raise ConfigError(
            f"{where}'s {DEFAULT_TEXT_FIELD!r} {noun} holds token ids, not text; pass "
            f"--token-field {DEFAULT_TEXT_FIELD} to capture them as they are"
        )
    for name in TOKEN_COLUMNS:  # ids that are not all ints (a list of words is not ids)
        if _numbers(kinds.get(name, "")):
            raise ConfigError(
                f"{where}'s {name!r} {noun} holds {kinds[name]}, not token ids: every id "
                "must be an integer"
            )
    raise ConfigError(
        f"{where} has no {DEFAULT_TEXT_FIELD!r} {noun} and no token-id {noun} "
        f"({', '.join(TOKEN_COLUMNS)}); {listed}; name one with --text-field or --token-field"
    )


def _numbers(kind: str) -> bool:
    """Whether ``kind`` (of :func:`value_kind`) is a list of numbers not all ints."""
    prefix = "a list of "
    return kind.startswith(prefix) and set(kind[len(prefix) :].split(", ")) <= {
        "bool",
        "float",
        "int",
        "list",
    }


def _expect(
    kinds: Mapping[str, str], name: str, want: Kind, where: str, noun: str, listed: str
) -> Kind:
    option = "--token-field" if want == "tokens" else "--text-field"
    have = kinds.get(name)
    if have is None:
        raise ConfigError(f"{where} has no {name!r} {noun} ({option} {name}); {listed}")
    if have == want:
        return want
    if have == "tokens":
        raise ConfigError(
            f"--text-field {name}: {where}'s {name!r} {noun} holds token ids, not text; "
            f"pass --token-field {name} to capture them as they are"
        )
    what = "text" if have == "text" else have
    raise ConfigError(f"{option} {name}: {where}'s {name!r} {noun} holds {what}, not {want}")


def value_kind(value: Any) -> str:
    """``"text"``, ``"tokens"`` (a list of ints, or of lists of ints, of any lengths: every
    element is checked) or what else a JSON value is."""
    if isinstance(value, str):
        return "text"
    if isinstance(value, list):
        leaves = _leaf_types(value)
        if leaves <= {"int"}:
            return "tokens"
        return "a list of " + ", ".join(sorted(leaves))
    return "null" if value is None else type(value).__name__


def _leaf_types(values: list[Any]) -> set[str]:
    """The type names of a (nested) list's elements: ``{"int"}`` for token ids; a list
    mixing lists and values counts ``list`` among them."""
    if values and all(isinstance(v, list) for v in values):
        return set().union(*(_leaf_types(v) for v in values))
    return {type(v).__name__ for v in values}


def arrow_kind(dtype: Any) -> str:
    """``"text"``, ``"tokens"`` (lists, nested lists or fixed-size arrays of integers) or
    the Arrow type of a column."""
    import pyarrow as pa

    if isinstance(dtype, pa.ExtensionType):  # datasets' Array2D and friends
        dtype = dtype.storage_type
    if pa.types.is_string(dtype) or pa.types.is_large_string(dtype):
        return "text"
    inner = dtype
    while pa.types.is_list(inner) or pa.types.is_large_list(inner) or _fixed(inner):
        inner = inner.value_type
    if inner is not dtype and pa.types.is_integer(inner):
        return "tokens"
    return str(dtype)


def _fixed(dtype: Any) -> bool:
    import pyarrow as pa

    return pa.types.is_fixed_size_list(dtype)
