"""Distributed capture from the command line: ``capture --ray`` / ``--machine-id`` (the
helper below), ``actstore slurm-script`` and ``actstore merge``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from .application import app


def run_distributed_capture(
    config: Any,
    fmt: str,
    out: str,
    options: Any,
    *,
    ray: str | None,
    workers: int,
    retries: int,
    machine_id: int | None,
    num_machines: int | None,
) -> Path | str | None:
    """What ``actstore capture`` does with --ray or a machine id; prints the outcome."""
    from ..dist import capture_distributed, capture_on_ray, slurm_machine
    from ..errors import ConfigError

    if ray is not None:
        if machine_id is not None or num_machines is not None:
            raise ConfigError(
                "give either --ray (Ray runs every slice) or --machine-id/"
                "--num-machines (this process runs one), not both"
            )
        result = capture_on_ray(
            config, fmt, out, options, workers=workers, address=ray, retries=retries
        )
        ran = sum(p.n_examples_run for p in result.parts)
        typer.echo(
            f"Captured {ran} examples with {workers} Ray workers; published\n  {result.location}"
        )
        _echo_next_steps(result.location)
        return result.location
    if machine_id is None or num_machines is None:
        from_env = slurm_machine(n_machines=num_machines)  # array index = machine id
        if from_env is None:
            raise ConfigError(
                "give both --machine-id and --num-machines (or run inside a Slurm "
                "job array, which sets them)"
            )
        machine_id = from_env[0] if machine_id is None else machine_id
        num_machines = from_env[1]
    done = capture_distributed(
        config, fmt, out, options, machine_id=machine_id, n_machines=num_machines
    )
    part = done.part
    if part.part is not None:
        typer.echo(
            f"Captured {part.slice} ({part.n_examples_run} examples run in "
            f"{part.seconds:.1f}s) into\n  {part.part}"
        )
    elif part.slice.empty:
        typer.echo(f"Nothing to capture for {part.slice}: the other slices cover the dataset")
    if done.published is None:
        spans = ", ".join(f"[{a}, {b})" for a, b in done.waiting_for) or "the other slices"
        typer.echo(
            f"Waiting for examples {spans} (other machines): the last machine to finish "
            f"publishes the store; if one failed, rerun it, then `actstore merge {out}`"
        )
        return None
    typer.echo(f"All slices are done; published\n  {done.published}")
    _echo_next_steps(done.published)
    return done.published


def _echo_next_steps(location: Path | str) -> None:
    typer.echo(f"\nRead it back:\n  actstore inspect {location}\n  actstore verify {location}")


_SLURM_EXAMPLE = """\b
Example:
  actstore slurm-script --num-machines 8 --gpus-per-task 1 --time 12:00:00 \\
      --setup 'source ~/actstore/.venv/bin/activate' -- \\
      --model gpt2 --dataset /shared/corpus.jsonl --layers 6 --out /shared/acts --device cuda \\
      > capture.sbatch
  sbatch capture.sbatch
"""


@app.command(
    "slurm-script",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    epilog=_SLURM_EXAMPLE,
)
def slurm_script(
    ctx: typer.Context,
    num_machines: int = typer.Option(
        ..., help="Array tasks: the dataset is split into this many contiguous slices."
    ),
    partition: str = typer.Option(None, help="#SBATCH --partition."),
    account: str = typer.Option(None, help="#SBATCH --account."),
    time: str = typer.Option(None, help="#SBATCH --time per task, e.g. 12:00:00."),
    gpus_per_task: int = typer.Option(None, help="#SBATCH --gpus-per-task."),
    cpus_per_task: int = typer.Option(None, help="#SBATCH --cpus-per-task."),
    mem: str = typer.Option(None, help="#SBATCH --mem per task, e.g. 64G."),
    max_parallel: int = typer.Option(None, help="Run at most this many tasks at once."),
    job_name: str = typer.Option("actstore-capture", help="#SBATCH --job-name."),
    setup: list[str] = typer.Option(
        [], help="Shell line run first in each task (repeatable), e.g. 'source .venv/bin/activate'."
    ),
    output: Path = typer.Option(
        None, "--output", "-o", help="Write the script here instead of printing it."
    ),
) -> None:
    """Print an sbatch script that runs a capture as a Slurm job array.

    Everything after `--` is passed to `actstore capture` (checked here). Task i captures
    slice i of the dataset; the last task to finish merges the slices into one store.
    Dataset and --out must be on a file system every node sees.
    """
    from ..dist import sbatch_script

    capture_args = list(ctx.args)
    _check_capture_args(capture_args)
    text = sbatch_script(
        capture_args,
        num_machines=num_machines,
        partition=partition,
        account=account,
        time=time,
        gpus_per_task=gpus_per_task,
        cpus_per_task=cpus_per_task,
        mem=mem,
        max_parallel=max_parallel,
        job_name=job_name,
        setup=tuple(setup),
    )
    if output is None:
        typer.echo(text, nl=False)
    else:
        output.write_text(text)
        typer.echo(f"wrote {output}; submit it with: sbatch {output}", err=True)


def _check_capture_args(args: list[str]) -> None:
    """Parse ``args`` as `actstore capture` would, so a typo fails now, not on the cluster."""
    from ..errors import ConfigError

    command = typer.main.get_command(app).commands["capture"]  # type: ignore[attr-defined]
    try:
        ctx = command.make_context("capture", list(args))
    except Exception as err:  # click's usage errors (typer may vendor its own click)
        if not hasattr(err, "format_message"):
            raise
        raise ConfigError(
            f"the capture arguments after `--` are invalid: {err.format_message()}"
        ) from None
    from ..capture.placement import parse_placement

    # the device map's syntax (its modules and devices are checked on the nodes)
    params = ctx.params
    parse_placement(params.get("device_map"), params.get("max_memory"))


@app.command()
def merge(
    locations: list[str] = typer.Argument(
        ...,
        help="Output directories of distributed "
        "captures (--out; an s3:// run for activault), or "
        "with --into: pkl.gz stores written by several "
        "machines.",
    ),
    into: Path = typer.Option(
        None,
        help="Merge the pkl.gz stores LOCATIONS (one per machine, "
        "unique sample ids) into this new directory.",
    ),
) -> None:
    """Publish a distributed capture from its slices, or merge machines' pkl.gz stores.

    Without --into: finds every capture under each location whose slices are waiting and
    merges it (the last machine normally does this itself; use this after rerunning a
    failed one). A missing slice is named and nothing is published (exit 1).

    Example: actstore merge /shared/acts
    """
    from ..dist import MissingPartsError, find_unmerged, merge_store
    from ..formats.pickle import merge_stores

    if into is not None:
        typer.echo(f"merged into {merge_stores(locations, into)}")
        return
    failed = False
    for location in locations:
        if "://" not in location and not Path(location).expanduser().exists():
            typer.secho(f"error: {location} does not exist", fg=typer.colors.RED, err=True)
            failed = True
            continue
        finals = find_unmerged(location)
        if not finals:
            typer.echo(f"{location}: no distributed capture waiting to be merged")
        for final, fmt in finals:
            try:
                typer.echo(f"published {merge_store(final, fmt)}")
            except MissingPartsError as err:
                typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
                failed = True
    if failed:
        raise typer.Exit(1)
