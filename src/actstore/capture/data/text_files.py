"""Text files read directly, line by line and only as far as packing needs: ``.txt`` (one
document per non-blank line), ``.jsonl`` (one record per line: a text field, or a list of
token ids), and the embedded corpus (the Python language reference shipped with CPython).

Example:
    >>> import json, tempfile
    >>> tmp = tempfile.TemporaryDirectory(); path = Path(tmp.name) / "corpus.jsonl"
    >>> _ = path.write_text(json.dumps({"id": 1, "text": "The assert statement is..."}))
    >>> rows = jsonl_rows(path, text_field=None, token_field=None)  # the field: found
    >>> rows.kind, next(rows.items)[:20]
    ('text', 'The assert statement')
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import ConfigError, CorruptStoreError
from ...storage.local import load_json
from .columns import DEFAULT_TEXT_FIELD, pick_field, value_kind
from .packing import Rows

#: Alias for the embedded text corpus: the Python language reference shipped with CPython.
EMBEDDED_DATASET = "embedded"


def embedded_documents() -> tuple[list[str], str]:
    """The embedded corpus: each topic of the Python language reference is one document."""
    from pydoc_data import topics

    return [topics.topics[k] for k in sorted(topics.topics)], str(Path(topics.__file__).resolve())


def embedded_rows() -> tuple[Rows, str]:
    """The embedded corpus as rows to pack, and its root (the topics module's file)."""
    docs, root = embedded_documents()
    description = {"kind": "embedded", "name": "python-language-reference"}
    return Rows(kind="text", items=iter(docs), description=description, total=len(docs)), root


class _Lines:
    """The non-blank lines of a file, as read, with how many bytes have been read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.size = path.stat().st_size
        self.pos = 0

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        with self.path.open("rb") as f:
            for lineno, line in enumerate(f, 1):
                self.pos += len(line)
                if line.strip():
                    yield lineno, line

    def unread(self, _read: int) -> str:
        left = max(self.size - self.pos, 0)
        share = f"{left / self.size:.1%}" if self.size else "0%"
        if share == "100.0%" and left < self.size:
            share = ">99.9%"
        return f"{_bytes(left)} of {self.path.name} ({share}) left unread"


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


def txt_rows(path: Path, text_field: str | None, token_field: str | None) -> Rows:
    """A .txt file: each non-blank line is a document."""
    if token_field is not None:
        raise ConfigError(
            f"{path} is plain text, one document per line; --token-field applies to .jsonl, "
            ".npy/.bin token files and datasets with a column of token ids"
        )
    lines = _Lines(path)
    description = {
        "kind": "text_file",
        "path": str(path),
        "text_field": text_field or DEFAULT_TEXT_FIELD,
    }
    return Rows(kind="text", items=_documents(lines), description=description, unread=lines.unread)


def _documents(lines: _Lines) -> Iterator[str]:
    """The file's non-blank lines as ``str.splitlines`` cuts the whole text."""
    for lineno, raw in lines:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise CorruptStoreError(f"{lines.path}:{lineno} is not UTF-8 text ({err.reason})")
        yield from (line for line in text.splitlines() if line.strip())


def jsonl_rows(path: Path, text_field: str | None, token_field: str | None) -> Rows:
    """A .jsonl file: the text or token-id field of each record (chosen from the first
    record's field types; see :func:`~.columns.pick_field`)."""
    lines = _Lines(path)
    records = _records(lines)
    first = next(records, None)
    if first is None:
        raise ConfigError(f"{path} holds no records")
    lineno, record = first
    where = f"{path}:{lineno}"
    if not isinstance(record, dict):
        raise ConfigError(f"{where} is a JSON {type(record).__name__}, not an object")
    kinds = {name: value_kind(value) for name, value in record.items()}
    name, kind = pick_field(
        kinds, where=where, text_field=text_field, token_field=token_field, noun="field"
    )
    field_key = "token_field" if kind == "tokens" else "text_field"
    description = {"kind": "text_file", "path": str(path), field_key: name}
    items = _values(_chain(first, records), path, name, kind)
    return Rows(kind=kind, items=items, description=description, unread=lines.unread)


def _chain(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    yield first
    yield from rest


def _records(lines: _Lines) -> Iterator[tuple[int, Any]]:
    for lineno, line in lines:
        yield lineno, json_record(line, f"{lines.path}:{lineno}")


def json_record(line: bytes, where: str) -> Any:
    """One line of a JSONL file, parsed by actstore's bounded parser
    (:func:`~actstore.storage.local.load_json`): bytes that are not UTF-8, not JSON, or JSON
    past its bounds are one :class:`CorruptStoreError` line naming the file and line (the
    same as a .txt line that is not UTF-8).

    Example:
        >>> json_record(b'{"text": "hi"}', "c.jsonl:1")
        {'text': 'hi'}
        >>> json_record(bytes([34, 255, 34]), "c.jsonl:2")
        Traceback (most recent call last):
        ...
        actstore.errors.CorruptStoreError: c.jsonl:2 is not UTF-8 text (invalid start byte); fix or remove the line
    """
    try:
        return load_json(line)
    except UnicodeDecodeError as err:
        raise CorruptStoreError(
            f"{where} is not UTF-8 text ({err.reason}); fix or remove the line"
        ) from None
    except ValueError as err:
        msg = err.msg if isinstance(err, json.JSONDecodeError) else str(err)
        raise CorruptStoreError(f"{where} is not valid JSON: {msg}") from None


def _values(records: Iterator[tuple[int, Any]], path: Path, name: str, kind: str) -> Iterator[Any]:
    """Each record's ``name`` value: a ``str`` (text) or an int64 array (tokens)."""
    option = "--token-field" if kind == "tokens" else "--text-field"
    for lineno, record in records:
        if not isinstance(record, dict) or name not in record:
            raise ConfigError(f"{path}:{lineno} has no {name!r} field; choose one with {option}")
        value = record[name]
        found = value_kind(value)
        if found != kind:
            raise ConfigError(
                f"{path}:{lineno}: field {name!r} holds {found}, where earlier records hold "
                f"{'token ids' if kind == 'tokens' else 'text'}"
            )
        yield _token_ids(value, f"{path}:{lineno}", name) if kind == "tokens" else value


def _token_ids(value: list[Any], where: str, name: str) -> np.ndarray:
    """A list of token ids (ints, checked by :func:`~.columns.value_kind`), or of such
    lists of any lengths, as one int64 array: nested lists end to end, as for an Arrow
    column of nested lists."""
    if any(isinstance(v, list) for v in value):
        value = list(_leaves(value))
    try:
        return np.asarray(value, dtype=np.int64)
    except OverflowError:
        raise ConfigError(
            f"{where}: field {name!r} holds a token id that does not fit 64 bits; token ids "
            "are below the model's vocabulary size"
        ) from None


def _leaves(values: list[Any]) -> Iterator[Any]:
    for v in values:
        if isinstance(v, list):
            yield from _leaves(v)
        else:
            yield v
