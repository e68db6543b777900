"""The saev run layout: roots from ``$SAEV_SCRATCH``/``$SAEV_NFS`` and run directories.

Example:
    >>> from actstore.runs import Run
    >>> run = Run("/nfs/me/saev/runs/k3x9q2ab")  # doctest: +SKIP
    >>> run.shards("val"), run.require_checkpoint()  # doctest: +SKIP
"""

from .layout import LINKS, SPLITS, Run, new_run_id, nfs_root, runs_root, scratch_root, shards_root

__all__ = [
    "LINKS",
    "SPLITS",
    "Run",
    "new_run_id",
    "nfs_root",
    "runs_root",
    "scratch_root",
    "shards_root",
]
