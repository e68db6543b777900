"""Golden tests pinning saev protocol 2.1: hashes, shard sizing (section 3), offsets (4.2)."""

from __future__ import annotations

import base64
import hashlib
import json
import pickle
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

from actstore.errors import (
    ConfigError,
    CorruptStoreError,
    IndexOutOfRangeError,
    LayerNotStoredError,
    ProtocolVersionError,
)
from actstore.formats.saev.layout import (
    PROTOCOL_KEYS,
    SAEV_KEYS,
    SaevMetadata,
    encode_saev_img_folder,
    shard_name,
)

DOC = {
    "family": "clip",
    "ckpt": "ViT-B-32/openai",
    "layers": [10, 11],
    "patches_per_ex": 49,
    "cls_token": True,
    "d_model": 768,
    "n_examples": 1000,
    "patches_per_shard": 2_400_000,
    "data": "",
    "dataset": "/data/x",
    "dtype": "float32",
    "protocol": "2.1",
}


def test_protocol_hash_is_sha256_of_sorted_compact_json():
    md = SaevMetadata.from_json_dict(DOC)
    want = hashlib.sha256(
        json.dumps(DOC, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()
    assert md.content_hash() == want
    assert list(md.to_json_dict()) == list(PROTOCOL_KEYS)


def test_protocol_hash_golden_value():
    # Pinned: changing how metadata is serialised would silently orphan every store.
    assert (
        SaevMetadata.from_json_dict(DOC).content_hash()
        == hashlib.sha256(
            b'{"ckpt":"ViT-B-32/openai","cls_token":true,"d_model":768,"data":"","dataset":"/data/x",'
            b'"dtype":"float32","family":"clip","layers":[10,11],"n_examples":1000,"patches_per_ex":49,'
            b'"patches_per_shard":2400000,"protocol":"2.1"}'
        ).hexdigest()
    )


def test_saev_dialect_hash_golden_value():
    md = SaevMetadata.from_json_dict(DOC).with_(dialect="saev")
    assert list(md.to_json_dict()) == list(SAEV_KEYS)
    assert md.to_json_dict()["content_tokens_per_example"] == 49
    assert md.to_json_dict()["max_tokens_per_shard"] == 2_400_000
    assert md.to_json_dict()["pixel_agg"] == "majority"
    # The test vector computed from saev's own code (orjson, dataclass field order, 8 hex).
    assert md.content_hash() == "91bf70dd"


def test_shard_sizing_section_3():
    md = SaevMetadata.from_json_dict(DOC)
    assert md.tokens_per_ex == 50
    assert md.examples_per_shard == 2_400_000 // (50 * 2) == 24000
    small = md.with_(patches_per_shard=50 * 2 * 300)  # 300 examples per shard
    assert small.n_shards == 4
    assert [small.shard_examples(i) for i in range(4)] == [300, 300, 300, 100]  # last smaller
    assert small.shard_nbytes(3) == 100 * 2 * 50 * 768 * 4
    saev = small.with_(dialect="saev")
    assert saev.shard_nbytes(3) == 300 * 2 * 50 * 768 * 4  # saev: every file full size
    assert shard_name(3) == "acts000003.bin"


def test_offsets_section_4_2():
    md = SaevMetadata.from_json_dict(DOC).with_(patches_per_shard=50 * 2 * 300)
    # example 301 -> shard 1, ex_in_shard 1; layer 11 -> index 1; token 7
    shard, offset = md.locate(301, 11, 7)
    assert shard == 1
    assert offset == (1 * 2 * 50 + 1 * 50 + 7) * 768 * 4
    assert md.locate(0, 10, 0) == (0, 0)
    with pytest.raises(LayerNotStoredError, match="stored layers: \\[10, 11\\]"):
        md.locate(0, 9, 0)
    with pytest.raises(IndexOutOfRangeError):
        md.locate(1000, 10, 0)
    with pytest.raises(IndexOutOfRangeError):
        md.locate(0, 10, 50)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"layers": None}, CorruptStoreError, "layers"),
        ({"d_model": "768"}, CorruptStoreError, "d_model must be int"),
        ({"cls_token": 1}, CorruptStoreError, "cls_token must be bool"),
        ({"protocol": "3.0"}, ProtocolVersionError, "major"),
        ({"dtype": "float16"}, CorruptStoreError, "float32"),
        ({"patches_per_shard": 10}, CorruptStoreError, "cannot hold one example"),
    ],
)
def test_bad_metadata_is_rejected(change, error, match):
    doc = {**DOC, **change}
    doc = {k: v for k, v in doc.items() if v is not None}
    with pytest.raises(error, match=match):
        SaevMetadata.from_json_dict(doc)


def test_unknown_minor_version_warns_and_missing_key_errors():
    with pytest.warns(UserWarning, match="2.7"):
        SaevMetadata.from_json_dict({**DOC, "protocol": "2.7"})
    with pytest.raises(CorruptStoreError, match="lacks required keys"):
        SaevMetadata.from_json_dict({k: v for k, v in DOC.items() if k != "n_examples"})


def test_saev_dialect_rules():
    with pytest.raises(ConfigError, match="family"):
        SaevMetadata.from_json_dict(DOC).with_(dialect="saev", family="gpt2")
    saev_doc = SaevMetadata.from_json_dict(DOC).with_(dialect="saev").to_json_dict()
    with pytest.raises(CorruptStoreError, match="unknown keys"):
        SaevMetadata.from_json_dict({**saev_doc, "seed": 1})
    # unknown keys in the document dialect are kept and hashed (a minor addition)
    extra = SaevMetadata.from_json_dict({**DOC, "note": "x"})
    assert extra.to_json_dict()["note"] == "x"


def test_saev_data_field_unpickles_to_saev_img_folder(monkeypatch):
    """saev's Metadata.make_data_cfg() unpickles `data` into saev.data.datasets.ImgFolder."""

    @dataclass(frozen=True)
    class ImgFolder:  # the shape of saev's own class
        root: Path = Path("./data/split")

    module = types.ModuleType("saev.data.datasets")
    ImgFolder.__module__ = "saev.data.datasets"
    module.ImgFolder = ImgFolder
    for name, mod in (
        ("saev", types.ModuleType("saev")),
        ("saev.data", types.ModuleType("saev.data")),
        ("saev.data.datasets", module),
    ):
        monkeypatch.setitem(sys.modules, name, mod)
    cfg = pickle.loads(base64.b64decode(encode_saev_img_folder("/data/imagenet/val")))
    assert cfg == ImgFolder(root=Path("/data/imagenet/val"))
