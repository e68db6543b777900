"""The format registry: how ``open_store``, ``capture --format`` and ``convert`` find formats.

Formats come from three places, in this detection order:

1. the built-in packages ``actstore.formats.<name>`` (:data:`FORMAT_NAMES`), each exposing
   ``FORMAT: FormatSpec``;
2. installed packages that declare an entry point in the group :data:`ENTRY_POINT_GROUP`
   (``actstore.formats``), named after the format and pointing at its ``FormatSpec`` (or at
   a module exposing ``FORMAT``), e.g. in the plugin's ``pyproject.toml``::

       [project.entry-points."actstore.formats"]
       npz = "actstore_npz:FORMAT"

   so ``capture --format npz``, ``convert``, ``verify``, ``inspect`` and ``open_store`` take
   it once the package is installed, with no edit to actstore;
3. :func:`register_format` calls in the running process (tests, notebooks).

Every format is imported lazily, when first needed, so a format whose optional dependency
is missing reports itself unavailable, with the extra (or package) to install.

Format options are a frozen dataclass whose fields carry ``metadata={"help": ...}``; the
CLI fills them from ``--opt key=value`` pairs with :func:`parse_options`, converting each
value to the field's declared type.

Example:
    >>> spec = get_format("saev")
    >>> spec.name, [f.name for f in dataclasses.fields(spec.options)][:2]
    ('saev', ['dialect', 'patches_per_shard'])
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import logging
import os
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, MissingDependencyError, StoreNotFoundError
from ..storage.location import Location, refuse_unwritable
from ..storage.manifest import MANIFEST

if TYPE_CHECKING:
    from ..batch import CapturePlan
    from ..storage.files import StoreFiles
    from .base import ReaderBase
    from .parts import PartFormat
    from .writerbase import FormatWriter, WriterBase

log = logging.getLogger(__name__)

#: The built-in formats, in detection order (the first format whose ``detect`` accepts a
#: location opens it); installed plugins and registered formats are tried after them.
FORMAT_NAMES = ("saev", "zarr", "pickle", "activault", "saelens")

#: The entry-point group an installed package declares its formats in (see above).
ENTRY_POINT_GROUP = "actstore.formats"

#: The last scan of the installed packages' entry points, and the ``sys.path`` it saw.
_SCANNED: tuple[tuple[str, ...], dict[str, importlib.metadata.EntryPoint]] | None = None

#: Plugins that failed to load, each reported once per process.
_BROKEN_WARNED: set[str] = set()

#: Formats registered from outside this package (:func:`register_format`), detected after
#: the built-in ones, in registration order.
_REGISTERED: dict[str, FormatSpec] = {}

#: The optional dependency each format needs beyond the core install, and its extra.
EXTRAS = {"zarr": "zarr", "saelens": "datasets"}


@dataclass(frozen=True, kw_only=True)
class FormatSpec:
    """What the rest of actstore knows about one storage format."""

    name: str
    summary: str
    """One line for ``--help``."""
    options: type
    """Frozen dataclass of writer options (fields with ``metadata={"help": ...}``)."""
    detect: Callable[[StoreFiles], bool]
    """True if the files of a location hold a store of this format (a damaged index the
    format would claim counts as True, so its reader names the fault)."""
    reader: type[ReaderBase]
    """``reader(location, *, verify_reads=True, cache_dir=None, cache_bytes=None, storage=None)``."""
    writer: type[FormatWriter]
    """``writer.from_plan(plan, location, options)``: the writer capture and convert use."""
    stored_dtype: str = "float32"
    """dtype name of stored activations (for help texts; conversion asks the reader)."""
    parts: Callable[[], PartFormat] | None = None
    """How the format captures in parts and merges (see :mod:`actstore.formats.parts`);
    None: no distributed capture."""
    clean_tokens: bool = False
    """Capture drops special and chat-template tokens by default (``--clean/--no-clean``)."""
    manifests: tuple[str, ...] = ("metadata.json",)
    """The format's own index files, which its peers' readers open first: copies and
    uploads write them just before the root manifest, which always goes last."""
    markers: tuple[str, ...] = ()
    """Names at the top of a directory that mark a store of this format as it or its peers
    write it (preflight asks :attr:`detect` only of a directory holding one, since asking
    lists the whole tree); default: :attr:`manifests`."""
    writes_remote: bool = False
    """The writer writes object storage locations (``s3://``, ``gs://``...) itself (else
    they are staged locally and uploaded by :class:`~actstore.formats.staged.StagedWriter`)."""

    def open_reader(self, location: str | os.PathLike | Location, **kwargs: Any) -> ReaderBase:
        make: Callable[..., ReaderBase] = self.reader  # each reader's own signature (above)
        return make(location, **kwargs)

    def open_writer(
        self, plan: CapturePlan, out: str | os.PathLike | Location, options: Any = None
    ) -> WriterBase:
        """The writer of ``plan`` for output ``out`` (local, ``file://`` or object storage)."""
        options = options if options is not None else self.options()
        location = Location.parse(out)
        refuse_unwritable(location)
        if location.is_local or self.writes_remote:
            return self.writer.from_plan(plan, location, options)
        from .staged import StagedWriter, staging_root

        # staged under the destination's own name, so the store lands where it would there
        staging = Location.parse(staging_root(location.url) / (location.name or "store"))
        final = self.writer.store_location(plan, location, options)
        subdir = final.url[len(location.url) :].strip("/")
        return StagedWriter(
            location.url,
            lambda directory: self.writer.from_plan(plan, Location.parse(directory), options),
            staging=staging.url,
            subdir=subdir,
            storage=location.storage,
            last=self.last_files,
        )

    @property
    def store_markers(self) -> tuple[str, ...]:
        """:attr:`markers`, or :attr:`manifests` where the format gives none."""
        return self.markers or self.manifests

    @property
    def last_files(self) -> tuple[str, ...]:
        """Names a copy sends last, in order: the format's index, then the root manifest."""
        return (*self.manifests, MANIFEST)


def register_format(spec: FormatSpec) -> FormatSpec:
    """Make a format defined outside actstore known to ``open_store``, ``capture --format``,
    ``convert`` and the rest, by its ``spec.name`` (the one line a plugin format adds).

    Example:
        >>> register_format(dataclasses.replace(get_format("pickle"), name="pkl-copy")).name
        'pkl-copy'
        >>> unregister_format("pkl-copy")
    """
    if spec.name in FORMAT_NAMES:
        raise ConfigError(f"format {spec.name!r} is built in; give the new format another name")
    _REGISTERED[spec.name] = spec
    return spec


def unregister_format(name: str) -> None:
    """Forget a format :func:`register_format` added (tests)."""
    _REGISTERED.pop(name, None)


def plugin_entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    """The installed plugin formats: name -> entry point of the group
    :data:`ENTRY_POINT_GROUP`, sorted by name (nothing is imported). A plugin may not take
    a built-in format's name (it is left out, with a warning naming its package). The
    installed packages are scanned once per process (a scan reads every package's
    metadata: ~50 ms), again only when ``sys.path`` changes."""
    global _SCANNED
    key = tuple(sys.path)
    if _SCANNED is None or _SCANNED[0] != key:
        _SCANNED = (key, _scan_entry_points())
    return dict(_SCANNED[1])


def _scan_entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    found: dict[str, importlib.metadata.EntryPoint] = {}
    for ep in sorted(
        importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name
    ):
        if ep.name in FORMAT_NAMES:
            _warn_once(
                ep.name,
                f"the plugin format {ep.name!r} ({_package(ep)}) takes a "
                "built-in format's name and is ignored; rename its entry point",
            )
            continue
        found.setdefault(ep.name, ep)  # the first on sys.path wins, as for imports
    return found


def format_names() -> tuple[str, ...]:
    """Every format name: the built-in ones, then installed plugins (entry points, by
    name), then the ones registered in this process."""
    plugins = [n for n in plugin_entry_points() if n not in _REGISTERED]
    return (*FORMAT_NAMES, *plugins, *_REGISTERED)


def get_format(name: str) -> FormatSpec:
    """The :class:`FormatSpec` of format ``name``."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name not in FORMAT_NAMES:
        plugin = plugin_entry_points().get(name)
        if plugin is None:
            raise ConfigError(f"unknown format {name!r}; choose one of {', '.join(format_names())}")
        return _load_plugin(plugin)
    if importlib.util.find_spec(f"{__package__}.{name}") is None:
        raise ConfigError(f"format {name!r} is not implemented yet")
    try:
        module = importlib.import_module(f"{__package__}.{name}")
    except MissingDependencyError:
        raise
    except ImportError as err:
        extra = EXTRAS.get(name, "all")
        raise MissingDependencyError(
            f"format {name!r} needs the optional dependency {err.name!r}; install it with "
            f"`pip install 'actstore[{extra}]'`"
        ) from err
    return module.FORMAT


def _load_plugin(ep: importlib.metadata.EntryPoint) -> FormatSpec:
    """The :class:`FormatSpec` entry point ``ep`` names (a spec, or a module with ``FORMAT``),
    checked to be one and to carry the entry point's name."""
    where = f"the plugin format {ep.name!r} ({_package(ep)}, entry point {ep.value!r})"
    try:
        loaded = ep.load()
    except ImportError as err:
        raise MissingDependencyError(
            f"{where} cannot be imported: {err}; install its dependencies or uninstall it"
        ) from err
    except Exception as err:  # a broken plugin must not break every command
        raise ConfigError(f"{where} fails to import: {type(err).__name__}: {err}") from err
    spec = getattr(loaded, "FORMAT", loaded) if isinstance(loaded, types.ModuleType) else loaded
    if not isinstance(spec, FormatSpec):
        raise ConfigError(
            f"{where} names a {type(spec).__name__}, not an actstore FormatSpec (or a module "
            "exposing FORMAT)"
        )
    if spec.name != ep.name:
        raise ConfigError(f"{where} gives a FormatSpec named {spec.name!r}; the names must agree")
    return spec


def _package(ep: importlib.metadata.EntryPoint) -> str:
    dist = ep.dist
    return f"package {dist.metadata['Name']} {dist.version}" if dist is not None else "a package"


def _warn_once(key: str, message: str) -> None:
    if key not in _BROKEN_WARNED:
        _BROKEN_WARNED.add(key)
        log.warning("%s", message)


def available_formats() -> list[FormatSpec]:
    """Formats whose code and dependencies are importable here (a plugin that fails to
    load is left out, with one warning saying why)."""
    out = []
    for name in format_names():
        try:
            out.append(get_format(name))
        except (MissingDependencyError, ConfigError) as err:
            if name not in FORMAT_NAMES and name not in _REGISTERED:
                _warn_once(name, str(err))
            continue
    return out


def format_of(location: str | os.PathLike | Location) -> FormatSpec | None:
    """The format of the store at ``location``, or None when it holds none."""
    location = Location.parse(location)
    if not location.exists():
        return None
    try:
        return detect_format(location)
    except StoreNotFoundError:
        return None


def detect_format(
    location: str | os.PathLike | Location, files: StoreFiles | None = None
) -> FormatSpec:
    """The format of the store at ``location`` (one listing of its files, shared by every
    format's ``detect``)."""
    location = Location.parse(location)
    files = files or location.files(cache=False)
    for spec in available_formats():
        if spec.detect(files):
            return spec
    raise StoreNotFoundError(
        f"{location} is not an actstore-readable store (formats tried: "
        f"{', '.join(s.name for s in available_formats())}); give a store directory or URL"
    )


def parse_options(spec: FormatSpec, pairs: list[str] | tuple[str, ...], **given: Any) -> Any:
    """Build ``spec.options`` from ``key=value`` strings plus keyword values, each value
    converted to its field's declared type.

    Example:
        >>> parse_options(get_format("saev"), ["dialect=saev"]).dialect
        'saev'
    """
    fields = {f.name: f for f in dataclasses.fields(spec.options)}
    hints = typing.get_type_hints(spec.options)
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
        values[key] = convert_value(text.strip(), hints[key], f"--opt {key}", spec.name)
    values.update({k: v for k, v in given.items() if v is not None})
    try:
        return spec.options(**values)
    except TypeError as err:
        raise ConfigError(f"bad options for format {spec.name!r}: {err}") from err


def convert_value(text: str, hint: Any, what: str, fmt: str) -> Any:
    """``text`` as a value of type ``hint`` (bool, int, float, str, ``X | None``,
    ``tuple[X, ...]``, ``Literal[...]``).

    Example:
        >>> convert_value("1,2", tuple[int, ...], "--opt x", "f"), convert_value("none", int | None, "--opt y", "f")
        ((1, 2), None)
    """
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if text.lower() == "none" and type(None) in args:
            return None
        return convert_value(text, inner[0], what, fmt)
    wrong = ConfigError(f"{what}={text!r} for format {fmt!r}: expected {_type_name(hint)}")
    if hint is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise wrong
    if origin is typing.Literal:
        if text not in [str(a) for a in args]:
            raise wrong
        return text
    try:
        if origin in (tuple, list):
            item = args[0] if args else str
            return tuple(
                convert_value(x.strip(), item, what, fmt) for x in text.split(",") if x.strip()
            )
        if hint in (int, float, str):
            return hint(text)
    except ValueError:  # int("x"), or an item of a tuple (ConfigError)
        raise wrong from None
    return text


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", str(hint))


def describe_options(spec: FormatSpec) -> list[tuple[str, str, str]]:
    """(name, default, help) of each option of ``spec``, for help texts."""
    out = []
    for f in dataclasses.fields(spec.options):
        default = f.default if f.default is not dataclasses.MISSING else "required"
        out.append((f.name, repr(default), f.metadata.get("help", "")))
    return out
