"""Deterministic, contiguous split of a dataset's examples across machines.

Machine ``i`` of ``n`` captures examples ``[i * per, min((i + 1) * per, N))`` where
``per = align * ceil(N / (align * n))``: every machine but the last gets the same number of
examples, a multiple of ``align`` (a format's shard size, so parts are whole shards), and
the last takes the rest (possibly nothing, for tiny datasets). Because every slice starts at
``machine_id * per``, the pkl.gz spec's global sample id ``machine_id * samples_per_machine
+ local_idx`` is exactly the example's index in the dataset.

Capture computes batches at multiples of ``batch_size`` whatever the slice, so a slice
whose edges fall inside a batch recomputes that batch and keeps only its own rows: the
activations are bitwise those of a single-process capture.

Example:
    >>> [(s.start, s.stop) for s in split_examples(10, 3)]
    [(0, 4), (4, 8), (8, 10)]
    >>> [(s.start, s.stop) for s in split_examples(10, 3, align=4)]
    [(0, 4), (4, 8), (8, 10)]
    >>> [(s.start, s.stop) for s in split_examples(10, 4, align=4)]
    [(0, 4), (4, 8), (8, 10), (10, 10)]
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class Slice:
    """The examples ``[start, stop)`` machine ``machine_id`` of ``n_machines`` captures."""

    machine_id: int
    n_machines: int
    start: int
    stop: int
    per_machine: int
    """The stride: examples per machine (all but the last hold exactly this many)."""

    @property
    def n_examples(self) -> int:
        return self.stop - self.start

    @property
    def empty(self) -> bool:
        return self.stop <= self.start

    def batches(self, batch_size: int) -> tuple[int, int]:
        """(first batch index, number of batches) this slice runs: the blog's "exact batch
        distribution" (a batch straddling an edge is run by both neighbours)."""
        if self.empty:
            return (self.start // batch_size, 0)
        first = self.start // batch_size
        return (first, math.ceil(self.stop / batch_size) - first)

    def __str__(self) -> str:
        return (
            f"machine {self.machine_id} of {self.n_machines}: examples [{self.start}, {self.stop})"
        )


def split_examples(n_examples: int, n_machines: int, *, align: int = 1) -> list[Slice]:
    """Split ``n_examples`` into ``n_machines`` contiguous slices (see the module docstring)."""
    if n_machines < 1:
        raise ConfigError(f"the number of machines must be >= 1, not {n_machines}")
    if align < 1:
        raise ConfigError(f"align must be >= 1, not {align}")
    if n_examples < 0:
        raise ConfigError(f"n_examples must be >= 0, not {n_examples}")
    per = align * max(1, math.ceil(n_examples / (align * n_machines)))
    return [
        Slice(
            machine_id=i,
            n_machines=n_machines,
            start=min(i * per, n_examples),
            stop=min((i + 1) * per, n_examples),
            per_machine=per,
        )
        for i in range(n_machines)
    ]


def slurm_machine(
    environ: Mapping[str, str] | None = None, *, n_machines: int | None = None
) -> tuple[int, int] | None:
    """``(machine_id, n_machines)`` of a Slurm array task; None outside array jobs.

    The array index is the machine id (``actstore slurm-script`` submits ``--array=0-{N-1}``,
    and a failed task is rerun alone with its own index: ``sbatch --array=3``).
    ``n_machines`` is the number of slices when known (``--num-machines``, which the script
    always passes), else ``SLURM_ARRAY_TASK_COUNT`` (right only for the whole array).

    Example:
        >>> slurm_machine({"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_COUNT": "4"})
        (2, 4)
        >>> slurm_machine({"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "1",
        ...                "SLURM_ARRAY_TASK_MIN": "3"}, n_machines=4)  # a rerun of task 3
        (3, 4)
    """
    env = os.environ if environ is None else environ
    if "SLURM_ARRAY_TASK_ID" not in env or "SLURM_ARRAY_TASK_COUNT" not in env:
        return None
    try:
        task = int(env["SLURM_ARRAY_TASK_ID"])
        count = int(env["SLURM_ARRAY_TASK_COUNT"]) if n_machines is None else n_machines
    except ValueError as err:
        raise ConfigError(f"cannot read the Slurm array task from the environment: {err}") from err
    if not 0 <= task < count:
        raise ConfigError(
            f"Slurm array task {task} is outside 0..{count - 1}: the array index is the machine "
            "id, so submit the array as --array=0-{N-1} (actstore slurm-script does) and pass "
            "--num-machines N (needed when rerunning some tasks alone), or pass --machine-id"
        )
    return task, count
