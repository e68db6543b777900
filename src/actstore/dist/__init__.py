"""Distributed capture: split a dataset across machines (Ray tasks or a Slurm job array),
capture each slice as a part, and merge the parts into one store.

The merged store is what a single-machine capture of the same data gives (same rows,
same example order; for saev, byte-identical files), statistics merged exactly, and it is
published only when every slice is there.

Example:
    >>> from actstore.dist import capture_on_ray
    >>> capture_on_ray(cfg, "saev", "/shared/acts", SaevOptions(), workers=4)  # doctest: +SKIP
    >>> split_examples(10, 3)[2]
    Slice(machine_id=2, n_machines=3, start=8, stop=10, per_machine=4)
"""

from .parts import (
    MissingPartsError,
    PartFormat,
    PartInfo,
    find_unmerged,
    merge_store,
    part_format,
    part_formats,
)
from .ray_runner import RayCaptureResult, capture_on_ray, init_local_ray
from .run import DistributedResult, PartResult, capture_distributed, capture_part
from .slurm import SlurmOptions, sbatch_script
from .split import Slice, slurm_machine, split_examples

__all__ = [
    "DistributedResult",
    "MissingPartsError",
    "PartFormat",
    "PartInfo",
    "PartResult",
    "RayCaptureResult",
    "Slice",
    "SlurmOptions",
    "capture_distributed",
    "capture_on_ray",
    "capture_part",
    "find_unmerged",
    "init_local_ray",
    "merge_store",
    "part_format",
    "part_formats",
    "sbatch_script",
    "slurm_machine",
    "split_examples",
]
