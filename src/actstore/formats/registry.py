"""The format registry: how ``open_store``, ``capture --format`` and ``convert`` find formats.

Each format package ``actstore.formats.<name>`` exposes ``FORMAT: FormatSpec``. The registry
imports the packages listed in :data:`FORMAT_NAMES` lazily, so a format whose optional
dependency is missing simply reports itself unavailable.

Format options are a frozen dataclass whose fields carry ``metadata={"help": ...}``; the
CLI fills them from ``--opt key=value`` pairs with :func:`parse_options`.

Example:
    >>> spec = get_format("saev")
    >>> spec.name, [f.name for f in dataclasses.fields(spec.options)][:2]
    ('saev', ['dialect', 'patches_per_shard'])
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, MissingDependencyError, StoreNotFoundError

if TYPE_CHECKING:
    from .parts import PartFormat

#: Detection order: the first format whose ``detect`` accepts a location opens it.
FORMAT_NAMES = ("saev", "zarr", "pickle", "activault", "saelens")


@dataclass(frozen=True, kw_only=True)
class FormatSpec:
    """What the rest of actstore needs to know about one storage format."""

    name: str
    summary: str
    """One line for ``--help``."""
    options: type
    """Frozen dataclass of writer options (fields with ``metadata={"help": ...}``)."""
    detect: Callable[[str], bool]
    """True if the location (path or URL) holds a store of this format."""
    open_reader: Callable[..., Any]
    """``open_reader(location, **kwargs) -> Reader``."""
    writer_for_plan: Callable[[Any, str, Any], Any]
    """``writer_for_plan(plan, out, options) -> Writer`` (used by capture)."""
    stored_dtype: str = "float32"
    """dtype name of stored activations (for help texts; conversion asks the reader)."""
    parts: Callable[[], PartFormat] | None = None
    """How the format captures in parts and merges (see :mod:`actstore.formats.parts`);
    None: no distributed capture."""
    clean_tokens: bool = False
    """Capture drops special and chat-template tokens by default (``--clean/--no-clean``)."""
    manifests: tuple[str, ...] = ("metadata.json",)
    """Names of the files readers open first and refuse a location without: copies and
    uploads write them last, so a store is openable only once it is whole."""


def get_format(name: str) -> FormatSpec:
    """The :class:`FormatSpec` of format ``name``."""
    if name not in FORMAT_NAMES:
        raise ConfigError(f"unknown format {name!r}; choose one of {', '.join(FORMAT_NAMES)}")
    if importlib.util.find_spec(f"{__package__}.{name}") is None:
        raise ConfigError(f"format {name!r} is not implemented yet")
    try:
        module = importlib.import_module(f"{__package__}.{name}")
    except MissingDependencyError:
        raise
    except ImportError as err:
        raise MissingDependencyError(
            f"format {name!r} needs an optional dependency ({err.name}); install it with "
            f"`pip install 'actstore[all]'`"
        ) from err
    return module.FORMAT


def available_formats() -> list[FormatSpec]:
    """Formats whose code and dependencies are importable here."""
    out = []
    for name in FORMAT_NAMES:
        try:
            out.append(get_format(name))
        except (MissingDependencyError, ConfigError):
            continue
    return out


def detect_format(location: str) -> FormatSpec:
    """The format of the store at ``location``."""
    for spec in available_formats():
        if spec.detect(str(location)):
            return spec
    raise StoreNotFoundError(
        f"{location} is not an actstore-readable store (formats tried: "
        f"{', '.join(s.name for s in available_formats())}); give a store directory or URL"
    )


def parse_options(spec: FormatSpec, pairs: list[str] | tuple[str, ...], **given: Any) -> Any:
    """Build ``spec.options`` from ``key=value`` strings plus keyword values.

    Example:
        >>> parse_options(get_format("saev"), ["dialect=saev"]).dialect
        'saev'
    """
    fields = {f.name: f for f in dataclasses.fields(spec.options)}
    for key, value in given.items():
        if value is not None and key not in fields:
            raise ConfigError(
                f"--{key.replace('_', '-')} does not apply to format {spec.name!r} "
                f"(its options: {', '.join(fields)})"
            )
    values: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in fields:
            raise ConfigError(
                f"--opt {pair!r}: format {spec.name!r} takes "
                + ", ".join(f"{k}=..." for k in fields)
            )
        values[key] = _convert(text.strip(), fields[key], spec.name)
    values.update({k: v for k, v in given.items() if v is not None})
    try:
        return spec.options(**values)
    except TypeError as err:
        raise ConfigError(f"bad options for format {spec.name!r}: {err}") from err


def _convert(text: str, field: dataclasses.Field, fmt: str) -> Any:
    annotation = str(
        field.type
    )  # annotations are strings under `from __future__ import annotations`
    try:
        if "bool" in annotation:
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if annotation.startswith(("tuple", "list")):
            inner = int if "int" in annotation else float if "float" in annotation else str
            return tuple(inner(x) for x in text.split(",") if x.strip())
        if "int" in annotation and "float" not in annotation:
            return None if text.lower() == "none" and "None" in annotation else int(text)
        if "float" in annotation:
            return None if text.lower() == "none" and "None" in annotation else float(text)
    except ValueError:
        raise ConfigError(f"--opt {field.name}={text!r} for format {fmt!r}: expected {annotation}")
    return None if text.lower() == "none" and "None" in annotation else text


def describe_options(spec: FormatSpec) -> list[tuple[str, str, str]]:
    """(name, default, help) of each option of ``spec``, for help texts."""
    out = []
    for f in dataclasses.fields(spec.options):
        default = f.default if f.default is not dataclasses.MISSING else "required"
        out.append((f.name, repr(default), f.metadata.get("help", "")))
    return out
