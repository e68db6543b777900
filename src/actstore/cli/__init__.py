"""The ``actstore`` command. Each sub-module registers one group of commands on :data:`app`.

Example:
    $ actstore capture --layers 3,5 --out actstore-data
    $ actstore inspect actstore-data/<hash>
    $ actstore verify actstore-data/<hash>
"""

from __future__ import annotations

import logging
import os
import sys

import typer

from ..errors import ActstoreError

app = typer.Typer(
    name="actstore",
    help=(
        "Capture transformer activations into the formats SAE tools read, verify them, and "
        "stream them back for training. Run `actstore COMMAND --help` for each command."
    ),
    invoke_without_command=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _show_version(value: bool) -> None:
    if value:
        from .._version import __version__

        typer.echo(f"actstore {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    version: bool = typer.Option(
        False,
        "--version",
        help="Print the version and exit.",
        callback=_show_version,
        is_eager=True,
    ),
) -> None:
    """Capture transformer activations into the formats SAE tools read, verify them, and
    stream them back for training. Run `actstore COMMAND --help` for each command."""
    if ctx.invoked_subcommand is None:
        typer.echo(ctx.get_help())
        raise typer.Exit()


# Command modules register themselves on `app` when imported.
from . import (
    capture_cmd,  # noqa: F401
    convert_cmd,  # noqa: F401
    cp_cmd,  # noqa: F401
    dist_cmd,  # noqa: F401
    inspect_cmd,  # noqa: F401
    runs_cmd,  # noqa: F401
    s3_cmd,  # noqa: F401
    serve_cmd,  # noqa: F401
    status_cmd,  # noqa: F401
)


def _configure_logging() -> None:
    level = os.environ.get("ACTSTORE_LOG", "INFO").upper()
    logging.basicConfig(
        level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    for noisy in ("httpx", "urllib3", "botocore", "filelock", "datasets"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # huggingface_hub prints through its own handler; passing records on to ours too would
    # print every hub warning twice.
    logging.getLogger("huggingface_hub").propagate = False


def main() -> None:
    """Entry point of the console script; actstore errors print as one clear line."""
    _configure_logging()
    try:
        app()
    except ActstoreError as err:
        typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        typer.secho("interrupted", fg=typer.colors.YELLOW, err=True)
        sys.exit(130)
