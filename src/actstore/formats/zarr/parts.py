"""zarr in parts: the format's own sharded run (``<out>/shards/shard-K.zarr``, one per
machine); the merge writes ``<out>/manifest.json`` over the shards, read in place."""

from __future__ import annotations

from pathlib import Path

from ...errors import CorruptStoreError
from ...storage.integrity import Integrity
from ...storage.location import Location
from ..parts import PartFormat, PartInfo, Slice
from .index import MANIFEST
from .layout import CONFIG_FILE
from .meta import parse_zmetadata
from .shards import SHARDS_DIR, shard_ranges, write_manifest
from .writer import ZarrWriter


def shard_info(path: Path) -> PartInfo:
    """What the merge needs of a published shard: its attributes and ``meta/config.json``,
    checked against its root manifest (not its per-sample arrays or chunk digests)."""
    location = Location.parse(path)
    checks = Integrity.open(location.files(), ours=True, format="zarr")
    _, attrs, _, _ = parse_zmetadata(checks.read_json(".zmetadata"), location.url)
    config = checks.read_json(CONFIG_FILE) if checks.files.exists(CONFIG_FILE) else {}
    try:
        shard = attrs["shard"]
        start, stop = int(shard["start"]), int(shard["stop"])
        total = int(config["layout"]["n_samples"])
    except (KeyError, TypeError, ValueError) as err:
        raise CorruptStoreError(
            f"{path} lacks its shard record ({err!r} in its attributes or meta/config.json): "
            f"it is not a shard of a run; move it out of {path.parent}"
        ) from None
    return PartInfo(
        path=path, start=start, stop=stop, n_examples=total, identity=attrs.get("fingerprint")
    )


def part_format() -> PartFormat:
    """How this format captures in parts and merges them."""

    def slices(plan, options, n_machines):
        # the format's own split (sizes differing by at most one); machines beyond the
        # number of samples get nothing
        used = min(n_machines, plan.n_examples)
        ranges = shard_ranges(plan.n_examples, used) if used else []
        ranges += [(plan.n_examples, plan.n_examples)] * (n_machines - used)
        per = max((b - a for a, b in ranges), default=0)
        return [
            Slice(machine_id=i, n_machines=n_machines, start=a, stop=b, per_machine=per)
            for i, (a, b) in enumerate(ranges)
        ]

    def part_writer(plan, final, options, sl):
        used = min(sl.n_machines, plan.n_examples)
        return ZarrWriter.for_shard(plan, final, sl.machine_id, used, options)

    def info(path):
        return shard_info(Path(path))

    def list_parts(final):
        shards = final / SHARDS_DIR
        if not shards.is_dir():
            return []
        return [info(p) for p in sorted(shards.glob("shard-*.zarr")) if p.is_dir()]

    def merge(parts, final):
        write_manifest(final)
        return final

    def pending(out):
        return [out] if (out / SHARDS_DIR).is_dir() and not (out / MANIFEST).exists() else []

    return PartFormat(
        name="zarr",
        slices=slices,
        final_location=lambda plan, out, options: Path(out).expanduser().resolve(),
        part_writer=part_writer,
        list_parts=list_parts,
        merge=merge,
        pending=pending,
    )
