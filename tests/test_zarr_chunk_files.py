"""The writer puts the activation chunk files itself (not through zarr-python): they must be
exactly the files zarr-python writes for the same values, which chunks are stored included
(none of only +0.0, the fill value; every one holding a -0.0)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_zarr_store import SITES, N, SyntheticBatches, make_writer

from actstore.formats.zarr import ZarrReader

zarr = pytest.importorskip("zarr")


def _chunk_files(folder: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir()) if not f.name.startswith(".")}


@pytest.mark.parametrize("options", [{}, {"prompt_keep": "last", "t_chunk_response": 4}])
def test_chunk_files_are_the_ones_zarr_python_writes(tmp_path, options):
    writer = make_writer(tmp_path / "activations.zarr", **options)
    for batch in SyntheticBatches()(0, N):
        for site in SITES:
            acts = batch.acts[site].numpy()
            for b, i in enumerate(batch.example_ids.tolist()):
                if i == 1:
                    acts[b] = 0.0  # no chunk stored
                elif i == 2:
                    acts[b] = -0.0  # every chunk with a token stored
                elif i == 4:
                    acts[b, ::2] = 0.0  # +0.0 and -0.0 mixed
                    acts[b, 1::2] = -0.0
                elif i == 6:
                    acts[b, :3] = 0.0  # the first prompt chunk only padding-like zeros
        writer.write(batch)
    store = writer.close()
    assert ZarrReader(store).verify().ok
    for part in ("prompt", "response"):
        ours = store / "arrays" / f"{part}_activations"
        meta = json.loads((ours / ".zarray").read_text())
        values = zarr.open_array(str(ours), mode="r", zarr_format=2)[:]
        again = zarr.create_array(
            store=str(tmp_path / f"again_{part}"),
            shape=values.shape,
            chunks=tuple(meta["chunks"]),
            dtype=meta["dtype"],
            compressors=None,
            filters=None,
            fill_value=0,
            order="C",
            zarr_format=2,
        )
        again[:] = values
        theirs = _chunk_files(tmp_path / f"again_{part}")
        assert _chunk_files(ours) == theirs
        assert any(np.frombuffer(b, "<u2").max() == 0x8000 for b in theirs.values())  # -0.0
