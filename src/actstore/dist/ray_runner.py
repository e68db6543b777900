"""Run a distributed capture as Ray tasks: one slice per worker, then the merge.

Each task loads its own model copy (on its own GPU when the cluster has enough: Ray sets
``CUDA_VISIBLE_DEVICES`` per task, so ``--device cuda`` means that GPU; with a device map,
on the GPUs of one machine, see :func:`_gpus_per_machine`) and writes its
slice as a part with :func:`~actstore.dist.run.capture_part`. A task that dies (a killed
worker, a lost node) or fails with an I/O error is retried by Ray, and the retry resumes
the part from its last finished shard. Slices still failing after the retries are reported
by machine and example range, and the merge is not attempted, so no store with a hole is
published; rerunning the same call redoes only those slices.

``address="local"`` starts a private single-machine Ray cluster whose every listener is
bound to 127.0.0.1 and stops it afterwards; any other address (``"auto"``, ``"host:6379"``,
``"ray://host:10001"``) joins an existing cluster. A driver that already called
``ray.init`` is used as it is.

Example:
    >>> capture_on_ray(cfg, "saev", "/shared/acts", SaevOptions(), workers=8,
    ...                address="auto")  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from ..capture import CaptureConfig
from ..capture.placement import gpus_per_worker
from ..errors import CaptureError, ConfigError, require
from ..progress import bar_switch
from .parts import MissingPartsError, merge_store
from .run import PartResult, capture_part

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RayCaptureResult:
    """The published store and what each worker did."""

    location: Path | str
    parts: list[PartResult]


def _run_part(
    config: CaptureConfig, fmt: str, out: str, options: Any, machine_id: int, n_machines: int
) -> PartResult:
    logging.basicConfig(level=os.environ.get("ACTSTORE_LOG", "INFO").upper())
    return capture_part(config, fmt, out, options, machine_id=machine_id, n_machines=n_machines)


def init_local_ray(num_cpus: int | None = None, **kwargs: Any) -> None:
    """Start a private local Ray cluster whose every listener is on 127.0.0.1 (no dashboard).

    Ray binds its servers to all interfaces unless its "local only" mode is on; that mode
    is read from ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` when ray is imported, so it is set
    both in the environment (for Ray's own processes) and, if ray was already imported, in
    its constants.
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray = require("ray", "ray")
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        configure_logging=False,
        **kwargs,
    )


def capture_on_ray(
    config: CaptureConfig,
    fmt: str,
    out: str,
    options: Any,
    *,
    workers: int,
    address: str = "local",
    retries: int = 2,
) -> RayCaptureResult:
    """Capture ``config`` with ``workers`` Ray tasks into format ``fmt`` at ``out``, merge
    the parts and return the published store (see the module docstring)."""
    ray = require("ray", "ray")
    if workers < 1:
        raise ConfigError(f"--workers must be >= 1, not {workers}")
    own = not ray.is_initialized()
    if own:
        if address == "local":
            init_local_ray(num_cpus=max(workers, os.cpu_count() or 1))
        else:
            ray.init(address=address, configure_logging=False)
    try:
        n_gpus = ray.cluster_resources().get("GPU", 0)
        if config.device.startswith("cuda") and not n_gpus:
            raise ConfigError("--device cuda, but the Ray cluster has no GPUs")
        gpus = (1 if n_gpus >= workers else n_gpus / workers) if config.device != "cpu" else 0
        if config.placement.spread:
            gpus = _gpus_per_machine(ray, config)
        task = ray.remote(_run_part).options(
            num_cpus=1,
            num_gpus=gpus,
            max_retries=retries,
            retry_exceptions=[OSError, CaptureError],
            name="actstore-capture",
        )
        quiet = dataclasses.replace(config, progress=False)  # one bar here, not one per worker
        refs = {task.remote(quiet, fmt, out, options, i, workers): i for i in range(workers)}
        results: dict[int, PartResult] = {}
        failures: dict[int, BaseException] = {}
        pending = list(refs)
        with tqdm(
            total=workers, desc="ray capture", unit="slice", **bar_switch(config.progress)
        ) as bar:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                for ref in done:
                    try:
                        results[refs[ref]] = ray.get(ref)
                    except Exception as err:  # noqa: BLE001 - reported per slice below
                        failures[refs[ref]] = err
                    bar.update(1)
        if failures:
            raise MissingPartsError(_failure_report(failures, results, workers, retries))
        final = next(iter(results.values())).final
        location = merge_store(final, fmt)
        log.info("ray capture: %d workers, published %s", workers, location)
        return RayCaptureResult(location=location, parts=[results[i] for i in sorted(results)])
    finally:
        if own:
            ray.shutdown()


def _gpus_per_machine(ray: Any, config: CaptureConfig) -> int:
    """GPUs each worker holds with a device map: those the map or --max-memory names, else
    every GPU of the largest node (one multi-GPU machine per worker; Ray sets
    ``CUDA_VISIBLE_DEVICES`` to them, so GPU indices in the map count from 0 there)."""
    per_node = [
        int(node["Resources"].get("GPU", 0)) for node in ray.nodes() if node.get("Alive", True)
    ]
    largest = max(per_node, default=0)
    wanted = gpus_per_worker(config.placement)
    if wanted is None:
        return largest
    if wanted > largest:
        raise ConfigError(
            f"the device map uses {wanted} GPUs per worker, but the largest Ray node has {largest}"
        )
    return wanted


def _failure_report(
    failures: dict[int, BaseException], results: dict[int, PartResult], workers: int, retries: int
) -> str:
    known = next(iter(results.values()), None)
    lines = []
    for machine, err in sorted(failures.items()):
        span = ""
        if known is not None and machine < len(known.slices):  # the format's own split
            sl = known.slices[machine]
            span = f" (examples [{sl.start}, {sl.stop}))"
        text = str(err).strip()
        cause = text.splitlines()[-1] if text else type(err).__name__
        lines.append(
            f"machine {machine} of {workers}{span} failed after {retries + 1} attempts: {cause}"
        )
    return (
        "the capture is incomplete, so nothing was published:\n  "
        + "\n  ".join(lines)
        + "\nFinished slices are kept; run the same command again to redo only the failed "
        "ones."
    )
