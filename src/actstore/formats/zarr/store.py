"""Creating and consolidating one Zarr v2 store directory with zarr-python (the writer's
arrays and ``.zmetadata``); publication is :class:`~actstore.formats.writer.ShardedWriter`'s.

Example:
    >>> import tempfile
    >>> from actstore.formats.zarr import ZarrOptions
    >>> from actstore.formats.zarr.plan import plan_store
    >>> from actstore.testing import make_plan
    >>> layout = plan_store(make_plan(), ZarrOptions())[0]
    >>> tmp = tempfile.TemporaryDirectory()
    >>> root = create_arrays(Path(tmp.name), layout, token_ids=True, sample_rows=1024)
    >>> consolidate(Path(tmp.name))
    >>> "prompt_activations" in root["arrays"], (Path(tmp.name) / ".zmetadata").is_file()
    (True, True)
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import ConfigError, require
from .layout import (
    ACT_DTYPE,
    ACTIVATIONS,
    DIGEST,
    DIGEST_DTYPE,
    FULL_LENGTHS,
    HALLU_LABEL,
    LENGTHS,
    PARTS,
    SAMPLE_KEY,
    SAMPLE_KEY_DTYPE,
    SPLIT,
    TOKEN_IDS,
    ZarrLayout,
)

#: Per-sample arrays a store may hold besides the required ones, with their dtype.
OPTIONAL_ARRAYS = {"hallu_label": (HALLU_LABEL, np.dtype("i1")), "split": (SPLIT, np.dtype("i1"))}


def byte_view(array: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, without a copy (also for zero-size arrays)."""
    if not array.flags.c_contiguous:
        raise ConfigError("the output array must be C-contiguous")
    return array.reshape(-1).view(np.uint8).data


def zarr_module():
    """zarr-python, or a clear error naming the extra to install."""
    return require("zarr", "zarr")


def sample_arrays(
    layout: ZarrLayout, *, token_ids: bool, optional: Iterable[str] = ()
) -> dict[str, tuple[tuple[int, ...], np.dtype, Any]]:
    """Per-sample arrays of a store: path -> (row shape, dtype, fill value)."""
    out: dict[str, tuple[tuple[int, ...], np.dtype, Any]] = {}
    for part in PARTS:
        out[LENGTHS[part]] = ((), np.dtype("<i4"), 0)
        out[FULL_LENGTHS[part]] = ((), np.dtype("<i4"), 0)
        if token_ids:
            out[TOKEN_IDS[part]] = ((layout.max_len(part),), np.dtype("<i4"), -1)
    out[SAMPLE_KEY] = ((), SAMPLE_KEY_DTYPE, b"")
    out[DIGEST] = ((), DIGEST_DTYPE, b"")
    for name in optional:
        path, dtype = OPTIONAL_ARRAYS[name]
        out[path] = ((), dtype, -1)
    return out


def create_arrays(
    directory: Path,
    layout: ZarrLayout,
    *,
    token_ids: bool,
    optional: Iterable[str] = (),
    sample_rows: int,
) -> Any:
    """Create the group and every array (metadata only; no chunk is written yet). The
    per-sample arrays are chunked ``sample_rows`` samples at a time: one writer shard."""
    zarr = zarr_module()
    root = zarr.open_group(str(directory), mode="w", zarr_format=2)
    arrays = root.require_group("arrays")
    for part in PARTS:
        arrays.create_array(
            ACTIVATIONS[part].split("/", 1)[1],
            shape=layout.shape(part),
            chunks=layout.chunk_shape(part),
            dtype=ACT_DTYPE,
            compressors=None,
            filters=None,
            fill_value=0,
            order="C",
        )
    for path, (row_shape, dtype, fill) in sample_arrays(
        layout, token_ids=token_ids, optional=optional
    ).items():
        shape = (layout.n_samples, *row_shape)
        chunks = (max(1, min(sample_rows, layout.n_samples)), *row_shape)
        arrays.create_array(
            path.split("/", 1)[1],
            shape=shape,
            chunks=chunks,
            dtype=dtype,
            compressors=None,
            filters=None,
            fill_value=fill,
            order="C",
        )
    return root


def consolidate(directory: Path) -> None:
    """Write ``.zmetadata``. The plain ``text/`` and ``meta/`` folders are not Zarr nodes;
    zarr-python warns about them while listing, which is expected here."""
    zarr = zarr_module()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not recognized as a component.*")
        zarr.consolidate_metadata(str(directory), zarr_format=2)
