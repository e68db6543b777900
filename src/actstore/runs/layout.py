"""The saev run layout: where shards and runs live, and what a run directory holds.

Two roots, as saev defines them:

- shards: ``$SAEV_SCRATCH/saev/shards/<shard_hash>/`` (activations, read-only once published);
- runs:   ``$SAEV_NFS/saev/runs/<run_id>/`` with ``checkpoint/{sae.pt, config.json}``,
  ``links/{train-shards, train-dataset, val-shards, val-dataset}`` (symlinks) and
  ``inference/<shard_hash>/{config.json, patch_acts.npz, visuals/}``.

When the variables are unset, scratch defaults to ``~/.cache/actstore`` (activations can
be recomputed) and NFS to ``~/.local/share/actstore`` (checkpoints are results).

A :class:`Run` is opened from its directory alone and resolves every other path from it;
a missing directory, link or file raises an error naming it and saying how to create it.

Example:
    >>> import tempfile
    >>> from actstore.testing import FormatCase, make_acts, make_batches, make_plan
    >>> plan, tmp = make_plan(), tempfile.TemporaryDirectory()
    >>> batches = make_batches(plan, make_acts(plan))
    >>> shards = Path(FormatCase("saev").write(f"{tmp.name}/shards", plan, batches))
    >>> run = Run.create(train_shards=shards, val_shards=shards, train_dataset=tmp.name,
    ...                  val_dataset=tmp.name, run_id="k3x9q2ab", root=f"{tmp.name}/runs")
    >>> run = Run(f"{tmp.name}/runs/k3x9q2ab")  # later: from its directory alone
    >>> run.shards("train") == shards, run.sae_path.relative_to(run.path).as_posix()
    (True, 'checkpoint/sae.pt')
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import string
from pathlib import Path

from ..errors import ConfigError, StoreExistsError, StoreNotFoundError

log = logging.getLogger(__name__)

#: The two data splits a run links to.
SPLITS = ("train", "val")
#: Names of the symlinks under ``links/``.
LINKS = ("train-shards", "train-dataset", "val-shards", "val-dataset")
#: Single-split link names of saev's older layout, read as the train links when present.
_LEGACY = {"train-shards": "shards", "train-dataset": "dataset"}
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def scratch_root() -> Path:
    """``$SAEV_SCRATCH`` (default ``~/.cache/actstore``): where ``saev/shards`` lives.

    Example:
        >>> from unittest import mock
        >>> with mock.patch.dict(os.environ, {"SAEV_SCRATCH": "/scratch/me"}):
        ...     scratch_root()
        PosixPath('/scratch/me')
    """
    value = os.environ.get("SAEV_SCRATCH")
    return Path(value).expanduser() if value else Path.home() / ".cache" / "actstore"


def nfs_root() -> Path:
    """``$SAEV_NFS`` (default ``~/.local/share/actstore``): where ``saev/runs`` lives.

    Example:
        >>> from unittest import mock
        >>> with mock.patch.dict(os.environ, {"SAEV_NFS": "/nfs/me"}):
        ...     nfs_root()
        PosixPath('/nfs/me')
    """
    value = os.environ.get("SAEV_NFS")
    return Path(value).expanduser() if value else Path.home() / ".local" / "share" / "actstore"


def shards_root() -> Path:
    """``<scratch>/saev/shards``: pass it to ``actstore capture --dialect saev --out``.

    Example:
        >>> shards_root().parts[-2:]
        ('saev', 'shards')
    """
    return scratch_root() / "saev" / "shards"


def runs_root() -> Path:
    """``<nfs>/saev/runs``: new runs are created here unless told otherwise.

    Example:
        >>> runs_root().parts[-2:]
        ('saev', 'runs')
    """
    return nfs_root() / "saev" / "runs"


def new_run_id() -> str:
    """A fresh 8-character run id (lower-case letters and digits, like wandb's).

    Example:
        >>> len(new_run_id())
        8
    """
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


class Run:
    """One run directory. Opening checks it exists; everything else is resolved lazily,
    so each entry point fails only on what it really needs, with the path named."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path).expanduser().absolute()
        if not self.path.is_dir():
            raise StoreNotFoundError(
                f"run directory {self.path} does not exist; create a run with "
                "`actstore new-run --train-shards DIR --val-shards DIR`"
            )
        if not (self.path / "links").is_dir():
            raise StoreNotFoundError(
                f"{self.path} is not a run: it has no links/ directory (a run holds "
                "checkpoint/, links/ and inference/; create one with `actstore new-run`)"
            )

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r})"

    @property
    def run_id(self) -> str:
        return self.path.name

    # ------------------------------------------------------------------ create

    @classmethod
    def create(
        cls,
        *,
        train_shards: str | os.PathLike,
        val_shards: str | os.PathLike,
        train_dataset: str | os.PathLike | None = None,
        val_dataset: str | os.PathLike | None = None,
        run_id: str | None = None,
        root: str | os.PathLike | None = None,
    ) -> Run:
        """Create ``<root>/<run_id>/`` with its subdirectories and the four links.

        ``root`` defaults to :func:`runs_root`, ``run_id`` to :func:`new_run_id`. A dataset
        left out is taken from the shards' metadata (its ``dataset`` field). The run is
        built under a temporary name and renamed into place, so it appears complete or
        not at all.
        """
        root = Path(root).expanduser() if root is not None else runs_root()
        run_id = run_id or new_run_id()
        if not _RUN_ID.match(run_id):
            raise ConfigError(
                f"run id {run_id!r} must be letters, digits, '.', '_' or '-' (no slashes)"
            )
        final = root.absolute() / run_id
        if final.exists():
            raise StoreExistsError(f"run {final} already exists; choose another --run-id")
        targets: dict[str, Path] = {}
        for split, shards, dataset in (
            ("train", train_shards, train_dataset),
            ("val", val_shards, val_dataset),
        ):
            shard_dir = _existing(shards, f"{split} shards")
            if not (shard_dir / "metadata.json").is_file():
                raise StoreNotFoundError(
                    f"{shard_dir} holds no metadata.json: give the directory of one capture "
                    "(…/saev/shards/<hash>), not its parent"
                )
            targets[f"{split}-shards"] = shard_dir
            if dataset is None:
                dataset = _dataset_of(shard_dir)
            targets[f"{split}-dataset"] = _existing(dataset, f"{split} dataset")
        root.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{run_id}.partial"
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp)
        for sub in ("checkpoint", "links", "inference"):
            (tmp / sub).mkdir(parents=True)
        for name, target in targets.items():
            (tmp / "links" / name).symlink_to(target)
        os.rename(tmp, final)
        log.info("created run %s", final)
        return cls(final)

    # ------------------------------------------------------------------ links

    def link(self, name: str) -> Path:
        """The resolved target of ``links/<name>``; an error names a missing or dangling link."""
        if name not in LINKS:
            raise ConfigError(f"unknown link {name!r}; runs link {', '.join(LINKS)}")
        link = self.path / "links" / name
        if not link.is_symlink() and not link.exists() and name in _LEGACY:
            legacy = self.path / "links" / _LEGACY[name]
            if legacy.is_symlink() or legacy.exists():
                link = legacy
        if not link.is_symlink() and not link.exists():
            raise StoreNotFoundError(
                f"run {self.path} has no link links/{name}; create it with "
                f"`ln -s <target> {link}` or make a new run with `actstore new-run`"
            )
        target = link.resolve()
        if not target.exists():
            raise StoreNotFoundError(
                f"link {link} points to {os.readlink(link)}, which does not exist "
                "(moved or deleted?); re-point the link with `ln -sfn <target> "
                f"{link}`"
            )
        return target

    def shards(self, split: str) -> Path:
        """The shard directory of ``split`` (``train`` or ``val``)."""
        return self.link(f"{_split(split)}-shards")

    def dataset(self, split: str) -> Path:
        """The original dataset of ``split`` (image folder, text file, ...)."""
        return self.link(f"{_split(split)}-dataset")

    def resolve_shards(self, which: str | os.PathLike) -> tuple[Path, str | None]:
        """``train``/``val`` (a link) or a shard directory path -> (directory, split or None).

        A path equal to one of the linked directories reports that split, so its dataset
        link is used for visuals.
        """
        if str(which) in SPLITS:
            return self.shards(str(which)), str(which)
        path = Path(which).expanduser().resolve()
        if not path.is_dir():
            raise StoreNotFoundError(
                f"shards {which!r} is neither {' nor '.join(map(repr, SPLITS))} (the run's "
                f"links) nor an existing shard directory ({path})"
            )
        for split in SPLITS:
            try:
                if self.shards(split) == path:
                    return path, split
            except StoreNotFoundError:
                continue
        return path, None

    # ------------------------------------------------------------------ checkpoint

    @property
    def checkpoint_dir(self) -> Path:
        return self.path / "checkpoint"

    @property
    def sae_path(self) -> Path:
        """``checkpoint/sae.pt`` (a safetensors file; see :mod:`actstore.sae.checkpoint`)."""
        return self.checkpoint_dir / "sae.pt"

    @property
    def config_path(self) -> Path:
        return self.checkpoint_dir / "config.json"

    def require_checkpoint(self) -> Path:
        """``checkpoint/sae.pt``, or an error saying to train first."""
        if not self.sae_path.is_file():
            raise StoreNotFoundError(
                f"run {self.path} has no checkpoint/sae.pt; train one first with "
                f"`actstore train --run {self.path}`"
            )
        return self.sae_path

    # ------------------------------------------------------------------ inference

    def inference_dir(self, shard_dir: str | os.PathLike) -> Path:
        """``inference/<shard_hash>/`` for the shards at ``shard_dir`` (not created)."""
        return self.path / "inference" / Path(shard_dir).name


def _split(split: str) -> str:
    if split not in SPLITS:
        raise ConfigError(f"split must be one of {SPLITS}, not {split!r}")
    return split


def _existing(path: str | os.PathLike, what: str) -> Path:
    resolved = Path(path).expanduser().resolve()
    if not resolved.exists():
        raise StoreNotFoundError(f"{what} {path} does not exist")
    return resolved


def _dataset_of(shard_dir: Path) -> str:
    from ..storage import read_json

    dataset = read_json(shard_dir / "metadata.json").get("dataset")
    if not dataset:
        raise ConfigError(
            f"{shard_dir}/metadata.json names no dataset; pass the dataset path explicitly"
        )
    return str(dataset)
