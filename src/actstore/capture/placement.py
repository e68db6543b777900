"""Where a model's weights go: ``--device-map``, ``--max-memory``, ``--offload-folder``.

:func:`parse_placement` turns the command-line strings into a :class:`Placement` (syntax
only: no torch, no devices), so a typo fails before anything else runs. The map itself is
worked out on a weightless (meta device) copy of the truncated model by
:func:`resolve_device_map`: a strategy (``auto``, ``balanced``, ``balanced_low_0``,
``sequential``) goes through accelerate's ``infer_auto_device_map``, the same planner
``transformers``' ``from_pretrained(device_map=...)`` uses; an explicit map is checked
(every name a module of the model, every weight given a device) and its entries for blocks
after the last one needed are dropped. The resolved map is what loading uses, so the
memory plan :func:`memory_plan` prints is the one the load follows.

Example:
    >>> parse_placement('{"embed_tokens": 0, "layers": "cuda:1", "norm": 1}').device_map
    {'embed_tokens': 0, 'layers': 1, 'norm': 1}
    >>> parse_placement("auto", "0=70GiB,cpu=1TB").max_memory
    {0: 75161927680, 'cpu': 1000000000000}
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..storage.local import load_json

#: Device map strategies (accelerate's planners).
STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")

Device = int | str
"""A GPU index (CUDA device N), ``"cpu"``, ``"disk"`` or ``"mps"``."""

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_DEVICE_HELP = "a GPU index (0, 1, ...), cuda:N, cpu, disk or mps"


@dataclass(frozen=True)
class Placement:
    """How to spread a model over one machine's devices (all None: one device)."""

    device_map: str | dict[str, Device] | None = None
    """A strategy from :data:`STRATEGIES`, or module name -> device."""
    max_memory: dict[Device, int] | None = None
    """Bytes each device may hold (strategies only)."""
    offload_folder: str | None = None
    """Where weights mapped to ``"disk"`` are kept while the capture runs."""

    @property
    def spread(self) -> bool:
        """True when a device map places the model (else it loads onto ``--device``)."""
        return self.device_map is not None


def parse_device(value: Any, what: str) -> Device:
    """A device-map value or max-memory key in canonical form (GPU index or name)."""
    if isinstance(value, bool):
        raise ConfigError(f"{what}: {value!r} is not a device; give {_DEVICE_HELP}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{what}: {value} is not a device; give {_DEVICE_HELP}")
        return value
    text = str(value).strip().lower()
    if text.isdigit():
        return int(text)
    if text == "cuda":
        return 0
    if m := re.fullmatch(r"cuda:(\d+)", text):
        return int(m.group(1))
    if text in ("cpu", "disk", "mps"):
        return text
    raise ConfigError(f"{what}: {value!r} is not a device; give {_DEVICE_HELP}")


def parse_size(value: Any, what: str) -> int:
    """Bytes from ``70GiB``, ``80GB``, ``1.5TB`` or a number (GB = 10**9, GiB = 2**30)."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    m = _SIZE_RE.match(str(value))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS or float(m.group(1)) <= 0:
        raise ConfigError(f"{what}: {value!r} is not a size; write it like 70GiB, 80GB or 500MiB")
    return int(float(m.group(1)) * _UNITS[unit])


def _parse_json_object(text: str, option: str) -> dict[str, Any]:
    try:
        value = load_json(text)
    except ValueError as err:
        why = f"{err.msg} at character {err.pos}" if isinstance(err, json.JSONDecodeError) else err
        raise ConfigError(
            f"{option}: not valid JSON ({why}); give a JSON object "
            'such as \'{"embed_tokens": 0, "layers.0": 0, "layers.1": 1, "norm": 1}\''
        ) from None
    if not isinstance(value, dict) or not value:
        raise ConfigError(f"{option}: give a non-empty JSON object of module name -> device")
    return value


def parse_device_map(text: str) -> str | dict[str, Device]:
    """``auto``/``balanced``/``balanced_low_0``/``sequential``, a JSON object of module
    name -> device, or a path to a .json file holding one."""
    text = text.strip()
    if text in STRATEGIES:
        return text
    if not text.startswith(("{", "[")):
        path = Path(text).expanduser()
        if path.suffix != ".json":
            raise ConfigError(
                f"--device-map {text!r}: give one of {', '.join(STRATEGIES)}, a JSON object "
                "of module name -> device, or a .json file holding one"
            )
        try:
            text = path.read_text()
        except OSError as err:
            raise ConfigError(
                f"--device-map {path}: cannot read it ({err.strerror or err})"
            ) from None
    raw = _parse_json_object(text, "--device-map")
    return {
        str(name): parse_device(dev, f"--device-map entry {name!r}") for name, dev in raw.items()
    }


def parse_max_memory(text: str) -> dict[Device, int]:
    """``0=70GiB,1=70GiB,cpu=200GiB`` or the same as a JSON object."""
    text = text.strip()
    if text.startswith("{"):
        pairs = list(_parse_json_object(text, "--max-memory").items())
    else:
        pairs = []
        for item in filter(None, (s.strip() for s in text.split(","))):
            key, sep, value = item.partition("=")
            if not sep:
                raise ConfigError(
                    f"--max-memory: {item!r} is not DEVICE=SIZE; write it like "
                    "0=70GiB,1=70GiB,cpu=200GiB"
                )
            pairs.append((key, value))
        if not pairs:
            raise ConfigError("--max-memory: give DEVICE=SIZE pairs, e.g. 0=70GiB,cpu=200GiB")
    out: dict[Device, int] = {}
    for key, value in pairs:
        device = parse_device(key, f"--max-memory key {key!r}")
        out[device] = parse_size(value, f"--max-memory {key}")
    return out


def parse_placement(
    device_map: str | None, max_memory: str | None = None, offload_folder: str | None = None
) -> Placement:
    """Check the command-line strings' syntax (no devices are looked at)."""
    if max_memory is not None and device_map is None:
        raise ConfigError(
            "--max-memory limits what --device-map places on each device; give "
            "--device-map auto (or balanced, sequential) with it"
        )
    parsed_map = None if device_map is None else parse_device_map(device_map)
    memory = None if max_memory is None else parse_max_memory(max_memory)
    if memory is not None and isinstance(parsed_map, dict):
        raise ConfigError(
            "--max-memory applies to --device-map auto/balanced/sequential; an explicit map "
            "already says where every module goes"
        )
    return Placement(device_map=parsed_map, max_memory=memory, offload_folder=offload_folder)


def _named_devices(placement: Placement) -> set[Device]:
    named: set[Device] = set()
    if isinstance(placement.device_map, dict):
        named |= set(placement.device_map.values())
    if placement.max_memory:
        named |= set(placement.max_memory)
    return named


def check_devices(placement: Placement) -> None:
    """Every device ``placement`` names exists on this machine (one line if not)."""
    import torch

    n_gpus = torch.cuda.device_count()
    named = [("--device-map", d) for d in _named_devices(Placement(placement.device_map))]
    named += [("--max-memory", d) for d in placement.max_memory or ()]
    for option, device in sorted(named, key=str):
        if isinstance(device, int) and device >= n_gpus:
            have = f"{n_gpus} CUDA devices (0..{n_gpus - 1})" if n_gpus else "no CUDA devices"
            raise ConfigError(f"{option} names cuda:{device}, but this machine has {have}")
        if device == "mps" and not torch.backends.mps.is_available():
            raise ConfigError(f"{option} names mps, which this machine lacks")


def gpus_per_worker(placement: Placement) -> int | None:
    """GPUs one capture of ``placement`` uses when it names them, else None (a strategy
    without GPU limits uses every GPU it sees)."""
    gpus = {d for d in _named_devices(placement) if isinstance(d, int)}
    return max(gpus) + 1 if gpus else None


def _owner(name: str, device_map: Mapping[str, Device]) -> Device | None:
    """The device of tensor ``name``: its longest module prefix in the map."""
    parts = name.split(".")
    for end in range(len(parts), -1, -1):
        prefix = ".".join(parts[:end])
        if prefix in device_map:
            return device_map[prefix]
    return None


def check_explicit_map(
    device_map: Mapping[str, Device],
    model: Any,
    *,
    blocks_path: str,
    n_layers: int,
    last_block: int,
) -> dict[str, Device]:
    """``device_map`` checked against ``model`` (the truncated model on the meta device):
    entries for blocks after ``last_block`` are dropped; every other name must be a module
    or weight of the model, and every weight must get a device."""
    modules = dict(model.named_modules())
    tensors = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    later = re.compile(re.escape(blocks_path) + r"\.(\d+)(?:\.(.+))?$")
    kept: dict[str, Device] = {}
    for name, device in device_map.items():
        m = later.match(name)
        if m and int(m.group(1)) > last_block:
            if int(m.group(1)) >= n_layers:
                raise ConfigError(
                    f"--device-map names {name!r}, but the model has {n_layers} blocks "
                    f"({blocks_path}.0 .. {blocks_path}.{n_layers - 1})"
                )
            rest = m.group(2)
            if rest and not any(f"{blocks_path}.0.{rest}" in x for x in (modules, tensors)):
                raise ConfigError(f"--device-map names {name!r}, which the model does not have")
            continue  # a block after the last one needed: never loaded
        if name and name not in modules and name not in tensors:
            top = ", ".join(n for n, _ in model.named_children())
            raise ConfigError(
                f"--device-map names {name!r}, which is not a module of "
                f"{type(model).__name__} (its top-level modules: {top}; blocks are "
                f"{blocks_path}.N)"
            )
        kept[name] = device
    uncovered = [t for t in tensors if _owner(t, kept) is None]
    if uncovered:
        raise ConfigError(
            f"--device-map gives no device for {uncovered[0]!r}"
            + (f" (and {len(uncovered) - 1} more weights)" if len(uncovered) > 1 else "")
            + '; name its module, or add "": DEVICE as the default'
        )
    return kept


def resolve_device_map(
    placement: Placement,
    model: Any,
    *,
    dtype: Any,
    blocks_path: str,
    n_layers: int,
    last_block: int,
) -> dict[str, Device] | None:
    """The module -> device map loading will use for ``model`` (the truncated model on the
    meta device), or None when ``placement`` spreads nothing."""
    if placement.device_map is None:
        return None
    if isinstance(placement.device_map, dict):
        resolved = check_explicit_map(
            placement.device_map,
            model,
            blocks_path=blocks_path,
            n_layers=n_layers,
            last_block=last_block,
        )
    else:
        from accelerate import utils

        no_split = list(model._no_split_modules or [])
        if placement.device_map == "sequential":
            memory = utils.get_max_memory(placement.max_memory)
        else:
            memory = utils.get_balanced_memory(
                model,
                max_memory=placement.max_memory,
                no_split_module_classes=no_split,
                dtype=dtype,
                low_zero=placement.device_map == "balanced_low_0",
            )
        resolved = dict(
            utils.infer_auto_device_map(
                model, max_memory=memory, no_split_module_classes=no_split, dtype=dtype
            )
        )
    if "disk" in resolved.values() and not placement.offload_folder:
        where = next(name for name, dev in resolved.items() if dev == "disk")
        raise ConfigError(
            f"--device-map puts {where or 'the model'!r} on disk: give --offload-folder DIR "
            "(a local directory for the offloaded weights)"
        )
    return resolved


def main_device(device_map: Mapping[str, Device] | None, default: str) -> str:
    """Where inputs go: the first GPU the map uses, else the CPU (accelerate's rule)."""
    if device_map is None:
        return default
    for device in device_map.values():
        if isinstance(device, int):
            return f"cuda:{device}"
        if device == "mps":
            return "mps"
    return "cpu"


def device_label(device: Device) -> str:
    return f"cuda:{device}" if isinstance(device, int) else str(device)


@dataclass(frozen=True)
class DeviceMemory:
    """What one device holds during a capture."""

    device: str
    weights: int
    """Bytes of parameters and buffers placed there (exact, from the model's shapes)."""
    blocks: tuple[int, ...]
    """Indices of the transformer blocks placed there."""
    sites: int
    """Bytes of captured site tensors held there until copied out (one batch)."""
    working: int
    """Estimated forward working memory of one block's pass (0 on disk)."""

    @property
    def total(self) -> int:
        return self.weights + self.sites + self.working


def tensor_bytes(model: Any, dtype: Any) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes of every parameter and buffer of ``model`` once loaded: floating-point
    parameters in ``dtype``, everything else in its own dtype."""
    params = {
        name: p.numel() * (dtype.itemsize if p.is_floating_point() else p.element_size())
        for name, p in model.named_parameters()
    }
    buffers = {name: b.numel() * b.element_size() for name, b in model.named_buffers()}
    return params, buffers


def memory_plan(
    sizes: tuple[Mapping[str, int], Mapping[str, int]],
    device_map: Mapping[str, Device] | None,
    *,
    device: str,
    blocks_path: str,
    site_blocks: Iterable[int],
    batch_tokens: int,
    d_model: int,
    intermediate: int,
    itemsize: int,
) -> list[DeviceMemory]:
    """What each device holds: the weights placed there, the captured site tensors of the
    blocks there (``batch_tokens x d_model`` each), and one block's forward working set,
    estimated as ``batch_tokens x (4 d_model + 2 intermediate)`` values. ``sizes`` is
    (parameters, buffers) as :func:`tensor_bytes` gives them; buffers of offloaded modules
    stay on the device they run on (accelerate's default)."""
    block_re = re.compile(re.escape(blocks_path) + r"\.(\d+)(?:\.|$)")
    main = main_device(device_map, device)
    weights: dict[str, int] = {}
    blocks: dict[str, set[int]] = {}
    first_block = None
    params, buffers = sizes
    for name, nbytes in [*params.items(), *buffers.items()]:
        owner = None if device_map is None else _owner(name, device_map)  # maps cover all
        dev = device if owner is None else device_label(owner)
        if name in buffers and dev in ("disk", "cpu"):
            dev = main
        weights[dev] = weights.get(dev, 0) + nbytes
        if m := block_re.match(name):
            blocks.setdefault(dev, set()).add(int(m.group(1)))
            if int(m.group(1)) == 0:
                first_block = dev
    runs_on = {}  # offloaded blocks (cpu next to a GPU, or disk) run on the main device
    for dev, idx in blocks.items():
        for i in idx:
            runs_on[i] = main if dev in ("disk", "cpu") else dev
    site_bytes: dict[str, int] = {}
    for layer in site_blocks:
        dev = runs_on.get(layer, first_block or device)
        site_bytes[dev] = site_bytes.get(dev, 0) + batch_tokens * d_model * itemsize
    working = batch_tokens * (4 * d_model + 2 * intermediate) * itemsize
    computing = set(runs_on.values())
    devices = sorted(set(weights) | set(site_bytes), key=_device_order)
    return [
        DeviceMemory(
            device=dev,
            weights=weights.get(dev, 0),
            blocks=tuple(sorted(blocks.get(dev, ()))),
            sites=site_bytes.get(dev, 0),
            working=working if dev in computing else 0,
        )
        for dev in devices
    ]


def _device_order(label: str) -> tuple[int, int, str]:
    if label.startswith("cuda:"):
        return (0, int(label[5:]), label)
    return (1 if label != "disk" else 2, 0, label)
