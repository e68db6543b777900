"""A --dialect saev capture, read the way saev's released code reads it.

The checks restate what saev's reader does (see the research notes): the directory must sit
at .../saev/shards/<name>; metadata.json must build saev's Metadata dataclass (exactly these
keys, pixel_agg present); shards.json entries must build Shard(name, n_examples); every
shard file is memmapped with the FULL shard shape; content token i of example e at layer l
is read at [e % S, layers.index(l), i + cls].
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math

import numpy as np
from typer.testing import CliRunner

from actstore.cli import app
from actstore.formats.saev import SaevReader


@dataclasses.dataclass(frozen=True, kw_only=True)
class SaevMetadata:  # field names, order and defaults of saev's own dataclass
    family: str
    ckpt: str
    layers: tuple
    content_tokens_per_example: int
    cls_token: bool
    d_model: int
    n_examples: int
    max_tokens_per_shard: int
    data: str
    dataset: str
    pixel_agg: str = "majority"
    dtype: str = "float32"
    protocol: str = "2.1"


def saev_load(shards_dir):
    assert shards_dir.is_dir() and shards_dir.parts[-3:-1] == ("saev", "shards")
    doc = json.loads((shards_dir / "metadata.json").read_text())
    doc["layers"] = tuple(doc.pop("layers"))
    assert doc["pixel_agg"] in ("majority", "prefer-fg")
    assert doc["family"] in ("clip", "siglip", "dinov2", "dinov3", "fake-clip")
    md = SaevMetadata(**doc)  # TypeError on unknown or missing keys, as in saev
    shards = json.loads((shards_dir / "shards.json").read_text())
    assert all(set(s) == {"name", "n_examples"} for s in shards)
    for s in shards:
        assert (shards_dir / s["name"]).stat().st_size > 0
    return md, shards


def test_saev_dialect_capture_is_readable_the_saev_way(model_dir, image_folder, tmp_path):
    result = CliRunner().invoke(
        app,
        [
            "capture",
            "--model",
            str(model_dir("clip")),
            "--dataset",
            str(image_folder),
            "--layers",
            "1,-1",
            "--dialect",
            "saev",
            "--patches-per-shard",
            str(17 * 2 * 4),
            "--batch-size",
            "3",
            "--out",
            str(tmp_path),
            "--no-progress",
        ],
    )
    assert result.exit_code == 0, result.output
    (shards_dir,) = (tmp_path / "saev" / "shards").iterdir()
    md, shards = saev_load(shards_dir)

    compact = json.dumps(
        json.loads((shards_dir / "metadata.json").read_text()),
        separators=(",", ":"),
        ensure_ascii=False,
    )
    assert shards_dir.name == hashlib.sha256(compact.encode()).hexdigest()[:8]
    tokens = md.content_tokens_per_example + int(md.cls_token)
    per_shard = md.max_tokens_per_shard // (tokens * len(md.layers))
    assert (per_shard, md.n_examples, md.layers) == (4, 15, (1, 3))
    assert len(shards) == math.ceil(md.n_examples / per_shard) == 4
    assert [s["n_examples"] for s in shards] == [4, 4, 4, 3]

    ours = SaevReader(shards_dir)
    assert ours.dialect == "saev"
    shape = (per_shard, len(md.layers), tokens, md.d_model)
    maps = [
        np.memmap(shards_dir / f"acts{i:06}.bin", mode="r", dtype=np.float32, shape=shape)
        for i in range(len(shards))
    ]  # full shape for every shard, the last included
    labels = np.memmap(
        shards_dir / "labels.bin",
        mode="r",
        dtype=np.uint8,
        shape=(md.n_examples, md.content_tokens_per_example),
    )
    n_rows = md.n_examples * md.content_tokens_per_example
    for i in range(0, n_rows, 7):  # saev's IndexedDataset, tokens="content"
        example, token = divmod(i, md.content_tokens_per_example)
        shard, in_shard = divmod(example, per_shard)
        for layer in md.layers:
            act = maps[shard][in_shard, md.layers.index(layer), token + int(md.cls_token)]
            np.testing.assert_array_equal(act, ours[example, layer, token + 1])
        assert labels[example, token] == example // 5  # class folders: 5 images each


def test_data_claims_imgfolder_only_when_torchvision_lists_the_same_images(
    model_dir, image_folder, tmp_path, caplog
):
    """saev's visuals map example i to image i of torchvision's ImageFolder(root): 'data'
    names ImgFolder only when that listing equals the capture's order."""
    import base64
    import shutil

    from actstore.capture import CaptureConfig, capture
    from actstore.formats.saev import SaevWriter
    from actstore.formats.saev.writer import imagefolder_files

    def run(folder, out):
        cfg = CaptureConfig(
            model=str(model_dir("clip")),
            dataset=str(folder),
            sites=("resid.1",),
            batch_size=8,
            progress=False,
        )
        path = capture(cfg, lambda plan: SaevWriter.from_plan(plan, out, dialect="saev")).output
        return base64.b64decode(SaevReader(path).metadata.data)

    assert b"saev.data.datasets\nImgFolder" in run(image_folder, tmp_path / "a")
    odd = shutil.copytree(image_folder, tmp_path / "odd")
    (odd / "cat" / "sub").mkdir()
    shutil.copy(odd / "dog" / "dog_000.jpg", odd / "cat" / "sub" / "inner.jpg")  # nested folder
    shutil.copy(odd / "dog" / "dog_000.jpg", odd / "cat" / "zz.jpg")
    listing = [p[len(str(odd.resolve())) + 1 :] for p in imagefolder_files(str(odd.resolve()))]
    assert listing[:5] == [f"cat/cat_{i:03d}.{'png' if i % 2 else 'jpg'}" for i in range(5)]
    # a folder's own files before its subfolders (capture sorts paths: sub/ before zz.jpg)
    assert listing[5:7] == ["cat/zz.jpg", "cat/sub/inner.jpg"] and len(listing) == 17
    with caplog.at_level("WARNING"):
        data = run(odd, tmp_path / "b")
    assert b"ImgFolder" not in data and "cannot map examples back to images" in caplog.text
