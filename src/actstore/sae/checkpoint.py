"""Save and load SAE checkpoints: tensors as safetensors, everything else as JSON.

A run's ``checkpoint/`` holds:

``sae.pt``
    a **safetensors** file (not a torch pickle: loading it never runs code) with tensors
    ``W_enc [d_model, d_sae]``, ``b_enc [d_sae]``, ``W_dec [d_sae, d_model]``,
    ``b_dec [d_model]``, ``input_mean [d_model]``, ``input_scale []`` (float32), and the
    architecture as JSON under the header metadata key ``actstore.sae``. It keeps saev's
    file name so runs resolve ``checkpoint/sae.pt`` as the layout says;
    ``safetensors.torch.load_file("sae.pt")`` reads it in any tool.
``config.json``
    the architecture, the training configuration, the data it saw and its metrics.

Both are written atomically (temporary file + fsync + rename).

Example:
    >>> import tempfile
    >>> out = tempfile.TemporaryDirectory()
    >>> sae = SparseAutoencoder(SAEConfig(d_model=8, d_sae=32, k=4))
    >>> save_sae(sae, f"{out.name}/sae.pt")
    >>> load_sae(f"{out.name}/sae.pt").config
    SAEConfig(d_model=8, d_sae=32, kind='topk', k=4)
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from ..errors import CorruptStoreError, StoreNotFoundError
from ..storage import atomic_write_bytes
from ..storage.local import load_json
from .model import SAEConfig, SparseAutoencoder

#: safetensors header metadata key holding the architecture JSON.
CONFIG_KEY = "actstore.sae"
TENSORS = ("W_enc", "b_enc", "W_dec", "b_dec", "input_mean", "input_scale")


def save_sae(sae: SparseAutoencoder, path: str | os.PathLike) -> None:
    """Write ``sae`` to ``path`` as safetensors, atomically."""
    from safetensors.torch import save

    tensors = {
        name: t.detach().to("cpu", torch.float32).contiguous()
        for name, t in sae.state_dict().items()
    }
    data = save(tensors, metadata={CONFIG_KEY: json.dumps(sae.config.to_dict())})
    atomic_write_bytes(path, data)


def load_sae(path: str | os.PathLike, *, device: str | torch.device = "cpu") -> SparseAutoencoder:
    """Read a checkpoint written by :func:`save_sae` (errors name the file and the fault)."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise StoreNotFoundError(f"SAE checkpoint {path} does not exist") from None
    header = _header(data, path)
    config_text = header.get("__metadata__", {}).get(CONFIG_KEY)
    if config_text is None:
        raise CorruptStoreError(
            f"{path} is a safetensors file without the {CONFIG_KEY!r} metadata entry, so it "
            "was not written by actstore; its architecture is unknown"
        )
    try:
        config = SAEConfig.from_dict(load_json(config_text))
        tensors = load(data)
    except (ValueError, TypeError, SafetensorError) as err:
        raise CorruptStoreError(f"{path} is damaged: {err}") from err
    missing = [t for t in TENSORS if t not in tensors]
    if missing:
        raise CorruptStoreError(f"{path} lacks tensors {missing}")
    sae = SparseAutoencoder(config)
    try:
        sae.load_state_dict({t: tensors[t] for t in TENSORS})
    except RuntimeError as err:  # shape mismatch between header config and tensors
        raise CorruptStoreError(f"{path}: tensors do not match its config: {err}") from err
    return sae.to(device).eval()


def _header(data: bytes, path: Path) -> dict:
    """The JSON header of a safetensors file, or an error saying what the file is instead.

    The length prefix is tried first: a valid header's first byte can be anything (0x80 when
    its length is 128 mod 256), so magic bytes only explain a file that does not parse.
    """
    header = None
    if len(data) >= 8:
        (n,) = struct.unpack("<Q", data[:8])
        if n <= len(data) - 8:
            try:
                header = load_json(data[8 : 8 + n])
            except ValueError as err:
                damage = f"a damaged safetensors header: {err}"
            else:
                damage = "a damaged safetensors header"
        else:
            damage = f"truncated (header of {n} bytes, file {len(data)})"
    else:
        damage = f"truncated ({len(data)} bytes)"
    if isinstance(header, dict):
        return header
    if data[:2] == b"PK" or data[:1] == b"\x80" or data[:1] == b"{":
        raise CorruptStoreError(
            f"{path} is not a safetensors file (it looks like a torch.save pickle or saev's "
            "JSON-header checkpoint); actstore never unpickles checkpoints: retrain with "
            "`actstore train`, or convert it with safetensors.torch.save_file"
        )
    raise CorruptStoreError(f"{path} is {damage}")
