"""Which machine captures which examples: the split itself is the formats' parts contract
(:func:`actstore.formats.parts.split_examples`, re-exported here); this module adds how a
Slurm array task finds its machine id.

Example:
    >>> [(s.start, s.stop) for s in split_examples(10, 3)]
    [(0, 4), (4, 8), (8, 10)]
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ..errors import ConfigError
from ..formats.parts import Slice, split_examples

__all__ = ["Slice", "slurm_machine", "split_examples"]


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
