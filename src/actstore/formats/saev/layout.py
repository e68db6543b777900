"""saev protocol 2.1: metadata, content hash, shard sizing and offsets (pure functions).

Two dialects share the shard layout (C-order float32 ``(S, L, T, D)`` per shard file):

``protocol`` (default) follows the protocol document: keys ``patches_per_ex`` and
``patches_per_shard``, directory ``<dump_to>/<HASH>`` with HASH the full sha256 hex of
``json.dumps(metadata, sort_keys=True, separators=(',', ':'))``, the last shard smaller.

``saev`` matches saev's released code: keys ``content_tokens_per_example`` and
``max_tokens_per_shard``, a required ``pixel_agg``, no other keys, ``family`` from its closed
list of vision families, directory ``<root>/saev/shards/<h8>`` with h8 the first 8 hex chars
of sha256 of the compact JSON in field order, and every shard file full size (the last
zero-padded; its real example count is in shards.json).

Example:
    >>> md = SaevMetadata(family="clip", ckpt="ViT-B-32/openai", layers=(10, 11),
    ...     patches_per_ex=49, cls_token=True, d_model=768, n_examples=1000,
    ...     patches_per_shard=2_400_000, data="", dataset="/data/x", dialect="saev")
    >>> md.content_hash()
    '91bf70dd'
    >>> md.examples_per_shard, md.n_shards
    (24000, 1)
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
import struct
import warnings
from dataclasses import dataclass, field, fields, replace
from typing import Any

from ...batch import CapturePlan
from ...errors import (
    ConfigError,
    CorruptStoreError,
    IndexOutOfRangeError,
    ProtocolVersionError,
    UnsafeDataError,
)
from ...sites import Site

PROTOCOL = "2.1"
DIALECTS = ("protocol", "saev")
#: saev's closed list of families common to every 2.1 release of its code.
SAEV_FAMILIES = ("clip", "siglip", "dinov2", "dinov3", "fake-clip")
PIXEL_AGG = ("majority", "prefer-fg")
DEFAULT_PATCHES_PER_SHARD = 2_400_000
BYTES_PER_VALUE = 4  # float32

#: Key order of metadata.json in each dialect (saev: its dataclass field order).
PROTOCOL_KEYS = (
    "family",
    "ckpt",
    "layers",
    "patches_per_ex",
    "cls_token",
    "d_model",
    "n_examples",
    "patches_per_shard",
    "data",
    "dataset",
    "dtype",
    "protocol",
)
SAEV_KEYS = (
    "family",
    "ckpt",
    "layers",
    "content_tokens_per_example",
    "cls_token",
    "d_model",
    "n_examples",
    "max_tokens_per_shard",
    "data",
    "dataset",
    "pixel_agg",
    "dtype",
    "protocol",
)
_RENAMES = {
    "content_tokens_per_example": "patches_per_ex",
    "max_tokens_per_shard": "patches_per_shard",
}


def shard_name(index: int) -> str:
    """File name of shard ``index``: ``acts000000.bin``."""
    return f"acts{index:06d}.bin"


@dataclass(frozen=True, kw_only=True)
class SaevMetadata:
    """metadata.json of a saev protocol 2.1 directory, in either dialect."""

    family: str
    ckpt: str
    layers: tuple[int, ...]
    patches_per_ex: int
    """Content tokens per example, excluding CLS (``content_tokens_per_example`` in saev)."""
    cls_token: bool
    d_model: int
    n_examples: int
    patches_per_shard: int = DEFAULT_PATCHES_PER_SHARD
    """Token budget per shard (``max_tokens_per_shard`` in saev)."""
    data: str = ""
    """base64 pickle describing the dataset; never unpickled unless the caller opts in."""
    dataset: str = ""
    dtype: str = "float32"
    protocol: str = PROTOCOL
    dialect: str = "protocol"
    pixel_agg: str = "majority"
    extra: dict[str, Any] = field(default_factory=dict)
    """Unknown keys found in a protocol-dialect file (kept so the hash still matches)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        if self.dialect not in DIALECTS:
            raise ConfigError(f"dialect must be one of {DIALECTS}, not {self.dialect!r}")
        if self.dtype != "float32":
            raise ConfigError(f"saev protocol 2.1 stores float32 only, not {self.dtype!r}")
        if not self.layers:
            raise ConfigError("at least one layer is needed")
        if len(set(self.layers)) != len(self.layers):
            raise ConfigError(f"layers {list(self.layers)} repeat a layer")
        for name in ("patches_per_ex", "d_model", "patches_per_shard"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, not {getattr(self, name)}")
        if self.n_examples < 0:
            raise ConfigError(f"n_examples must be >= 0, not {self.n_examples}")
        if self.examples_per_shard < 1:
            need = self.tokens_per_ex * len(self.layers)
            raise ConfigError(
                f"patches_per_shard={self.patches_per_shard} cannot hold one example "
                f"({self.tokens_per_ex} tokens x {len(self.layers)} layers = {need}); "
                f"raise it to at least {need}"
            )
        if self.dialect == "saev":
            if self.family not in SAEV_FAMILIES:
                raise ConfigError(
                    f"saev's code accepts family in {SAEV_FAMILIES}, not {self.family!r}: "
                    "--dialect saev is for ViT captures (CLIP, SigLIP, DINOv2); use the "
                    "default dialect for language models"
                )
            if self.pixel_agg not in PIXEL_AGG:
                raise ConfigError(f"pixel_agg must be one of {PIXEL_AGG}, not {self.pixel_agg!r}")
            if self.extra:
                raise ConfigError(f"saev's code rejects unknown keys: {sorted(self.extra)}")

    # ------------------------------------------------------------------ sizing (section 3)

    @property
    def tokens_per_ex(self) -> int:
        """T = patches + 1 if a CLS token is stored."""
        return self.patches_per_ex + (1 if self.cls_token else 0)

    @property
    def examples_per_shard(self) -> int:
        """floor(patches_per_shard / (T * L))."""
        return self.patches_per_shard // (self.tokens_per_ex * len(self.layers))

    @property
    def n_shards(self) -> int:
        return math.ceil(self.n_examples / self.examples_per_shard)

    @property
    def example_nbytes(self) -> int:
        """Bytes of one example (all its layers and tokens)."""
        return len(self.layers) * self.tokens_per_ex * self.d_model * BYTES_PER_VALUE

    def shard_examples(self, index: int) -> int:
        """Examples really stored in shard ``index`` (the last may hold fewer)."""
        if not 0 <= index < self.n_shards:
            raise IndexOutOfRangeError(f"shard {index} out of range (0..{self.n_shards - 1})")
        return min(self.examples_per_shard, self.n_examples - index * self.examples_per_shard)

    def shard_file_examples(self, index: int) -> int:
        """Examples the file of shard ``index`` has room for (saev: always full size)."""
        return self.examples_per_shard if self.dialect == "saev" else self.shard_examples(index)

    def shard_nbytes(self, index: int) -> int:
        """Exact size in bytes of the file of shard ``index``."""
        return self.shard_file_examples(index) * self.example_nbytes

    # ------------------------------------------------------------------ offsets (section 4.2)

    def layer_index(self, layer: int) -> int:
        """Position of ``layer`` in ``layers`` (an error if it is not stored)."""
        from ...errors import LayerNotStoredError

        try:
            return self.layers.index(layer)
        except ValueError:
            raise LayerNotStoredError(
                f"layer {layer} is not stored here; stored layers: {list(self.layers)}"
            ) from None

    def locate(self, example: int, layer: int, token: int) -> tuple[int, int]:
        """(shard index, byte offset in that shard) of one activation vector."""
        if not 0 <= example < self.n_examples:
            raise IndexOutOfRangeError(f"example {example} out of range (0..{self.n_examples - 1})")
        if not 0 <= token < self.tokens_per_ex:
            raise IndexOutOfRangeError(f"token {token} out of range (0..{self.tokens_per_ex - 1})")
        shard, ex_in_shard = divmod(example, self.examples_per_shard)
        layer_idx = self.layer_index(layer)
        n_layers, n_tokens = len(self.layers), self.tokens_per_ex
        offset_in_vectors = ex_in_shard * n_layers * n_tokens + layer_idx * n_tokens + token
        return shard, offset_in_vectors * self.d_model * BYTES_PER_VALUE

    # ------------------------------------------------------------------ JSON and hash

    def to_json_dict(self) -> dict[str, Any]:
        """metadata.json content, keys in the dialect's order."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values["layers"] = list(self.layers)
        if self.dialect == "saev":
            return {key: values[_RENAMES.get(key, key)] for key in SAEV_KEYS}
        return {**{key: values[key] for key in PROTOCOL_KEYS}, **self.extra}

    def capture_plan(
        self,
        *,
        has_tokens: bool = False,
        has_labels: bool = False,
        classes: list[str] | None = None,
        batch_size: int = 32,
    ) -> CapturePlan:
        """The capture this metadata describes, as far as it records it (with the side
        files' presence given): what ``SaevWriter.from_plan`` turns back into this
        metadata (same content hash)."""
        return CapturePlan(
            ckpt=self.ckpt,
            family=self.family,
            modality="image" if self.family in SAEV_FAMILIES else "text",
            sites=tuple(Site("resid", layer) for layer in self.layers),
            n_model_layers=max(self.layers) + 1,
            d_model=self.d_model,
            tokens_per_example=self.tokens_per_ex,
            has_cls=self.cls_token,
            n_examples=self.n_examples,
            dataset_root=self.dataset,
            data=decode_data(self.data),
            classes=classes,
            has_labels=has_labels,
            has_tokens=has_tokens,
            batch_size=batch_size,
        )

    def content_hash(self) -> str:
        """The directory name: full sha256 (protocol dialect) or its first 8 hex (saev)."""
        doc = self.to_json_dict()
        if self.dialect == "saev":
            text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False)
            return hashlib.sha256(text.encode("utf-8")).hexdigest()[:8]
        text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    def to_json_text(self) -> str:
        """metadata.json bytes as written: 2-space indented UTF-8 JSON."""
        return json.dumps(self.to_json_dict(), indent=2, ensure_ascii=False)

    @classmethod
    def from_json_dict(cls, doc: Any, *, source: str = "metadata.json") -> SaevMetadata:
        """Parse and validate metadata.json of either dialect (found from its keys)."""
        if not isinstance(doc, dict):
            raise CorruptStoreError(f"{source} must hold a JSON object, not {type(doc).__name__}")
        dialect = "saev" if "content_tokens_per_example" in doc else "protocol"
        keys = SAEV_KEYS if dialect == "saev" else PROTOCOL_KEYS
        _check_protocol(doc.get("protocol"), source)
        required = [k for k in keys if k not in ("dtype", "protocol", "data", "dataset")]
        missing = [k for k in required if k not in doc]
        if missing:
            raise CorruptStoreError(f"{source} lacks required keys {missing}")
        types = {
            "family": str,
            "ckpt": str,
            "layers": list,
            "cls_token": bool,
            "d_model": int,
            "n_examples": int,
            "data": str,
            "dataset": str,
            "dtype": str,
            "pixel_agg": str,
        }
        for key, typ in types.items():
            if key in doc and not _is_type(doc[key], typ):
                raise CorruptStoreError(
                    f"{source}: {key} must be {typ.__name__}, not {type(doc[key]).__name__}"
                )
        if not all(_is_type(x, int) for x in doc["layers"]):
            raise CorruptStoreError(f"{source}: layers must be a list of integers")
        values = {_RENAMES.get(k, k): doc[k] for k in keys if k in doc}
        for key in ("patches_per_ex", "patches_per_shard"):
            if not _is_type(values[key], int):
                raise CorruptStoreError(f"{source}: {key} must be an integer")
        extra = {k: v for k, v in doc.items() if k not in keys}
        if dialect == "saev" and extra:
            raise CorruptStoreError(f"{source}: saev dialect with unknown keys {sorted(extra)}")
        try:
            return cls(**values, dialect=dialect, extra=extra)
        except ConfigError as err:
            raise CorruptStoreError(f"{source}: {err}") from err

    def with_(self, **changes: Any) -> SaevMetadata:
        """A copy with some fields changed."""
        return replace(self, **changes)


def _is_type(value: Any, typ: type) -> bool:
    if typ is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, typ)


def _check_protocol(value: Any, source: str) -> None:
    if value is None:
        return  # saev's code defaults a missing protocol to 2.1
    if not isinstance(value, str) or not re.fullmatch(r"\d+(\.\d+)?", value):
        raise CorruptStoreError(f"{source}: protocol must be a version like '2.1', not {value!r}")
    major, _, minor = value.partition(".")
    want_major, _, want_minor = PROTOCOL.partition(".")
    if major != want_major:
        raise ProtocolVersionError(
            f"{source} says protocol {value!r}; this reader implements {PROTOCOL} and cannot "
            "read another major version (re-capture, or use the matching saev release)"
        )
    if minor != want_minor:
        warnings.warn(
            f"{source} says protocol {value!r}; reading it as {PROTOCOL} (same major version)",
            stacklevel=3,
        )


# ---------------------------------------------------------------------- the `data` field


def encode_data(description: dict[str, Any]) -> str:
    """base64 pickle of a plain dict (protocol 4, deterministic for the same dict)."""
    import pickle

    return base64.b64encode(pickle.dumps(description, protocol=4)).decode("utf8")


def decode_data(data: str) -> dict[str, Any]:
    """The dataset description in metadata's ``data`` (a base64 pickle), decoded with the
    restricted unpickler so a store cannot run code through it; for saev's own ImgFolder
    object, the description pickled after it (see :func:`encode_saev_img_folder`), else {}."""
    if not data:
        return {}
    from ... import safe_pickle

    try:
        raw = base64.b64decode(data)
    except ValueError:
        return {}
    try:
        decoded = safe_pickle.loads(raw)
    except (UnsafeDataError, CorruptStoreError, ValueError):
        decoded = _trailing(raw)
    return decoded if isinstance(decoded, dict) else {}


def _trailing(raw: bytes) -> Any:
    """The object pickled after the first pickle in ``raw`` (found by walking its opcodes,
    never running them), or None."""
    import pickletools

    from ... import safe_pickle

    try:
        stop = next(pos for op, _, pos in pickletools.genops(raw) if op.name == "STOP")
        end = (stop or 0) + 1
        return safe_pickle.loads(raw[end:]) if end < len(raw) else None
    except (UnsafeDataError, CorruptStoreError, ValueError, StopIteration):
        return None


def encode_saev_img_folder(root: str, description: dict[str, Any] | None = None) -> str:
    """base64 pickle of ``saev.data.datasets.ImgFolder(root=PosixPath(root))``, followed
    by the pickled ``description`` when given (what identifies the images:
    ``pickle.loads`` stops at the first pickle's end, so saev reads its ImgFolder as
    before, while the store's content hash covers the images' digest).

    Written opcode by opcode so saev need not be installed here; saev's
    ``Metadata.make_data_cfg()`` unpickles it into its own ``ImgFolder`` dataclass.

    Example:
        >>> data = base64.b64decode(encode_saev_img_folder("/x", {"image_digest": "ab"}))
        >>> decode_data(base64.b64encode(data).decode())
        {'image_digest': 'ab'}
    """
    root_bytes = root.encode("utf-8")
    stream = b"".join(
        [
            b"\x80\x02",  # PROTO 2
            b"csaev.data.datasets\nImgFolder\n",  # GLOBAL saev.data.datasets.ImgFolder
            b")\x81",  # EMPTY_TUPLE, NEWOBJ: cls.__new__(cls)
            b"}",  # EMPTY_DICT: the instance state
            b"X" + struct.pack("<I", 4) + b"root",  # BINUNICODE "root"
            b"cpathlib\nPosixPath\n",  # GLOBAL pathlib.PosixPath
            b"X" + struct.pack("<I", len(root_bytes)) + root_bytes,
            b"\x85R",  # TUPLE1, REDUCE: PosixPath(root)
            b"s",  # SETITEM state["root"] = path
            b"b",  # BUILD: instance.__dict__.update(state)
            b".",  # STOP
        ]
    )
    if description:
        import pickle

        stream += pickle.dumps(description, protocol=4)
    return base64.b64encode(stream).decode("utf8")
