"""An image that does not decode, met mid-capture in a DataLoader worker: one line naming the
file and what to do, not the worker's traceback."""

from __future__ import annotations

import shutil

import pytest

from actstore.capture import CaptureConfig, capture
from actstore.errors import CorruptStoreError
from actstore.formats.saev import SaevWriter


@pytest.mark.parametrize("workers", [0, 1])
def test_an_image_that_does_not_decode_is_one_line(workers, model_dir, image_folder, tmp_path):
    folder = tmp_path / "images"
    shutil.copytree(image_folder, folder)
    broken = sorted(p for p in folder.rglob("*") if p.is_file())[9]  # past the first batches
    broken.write_bytes(broken.read_bytes()[:40])  # cut short: its header, no pixels
    cfg = CaptureConfig(
        model=str(model_dir("clip")),
        dataset=str(folder),
        sites=("resid.1",),
        batch_size=4,
        num_workers=workers,
        progress=False,
    )
    with pytest.raises(CorruptStoreError) as err:
        capture(cfg, lambda p: SaevWriter.from_plan(p, tmp_path / "out"))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{broken} (")
    assert message.endswith(
        "is not an image that can be decoded; replace or remove it, or give another --dataset"
    )
