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
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# Command modules register themselves on `app` when imported.
from . import capture_cmd, convert_cmd, dist_cmd, inspect_cmd, runs_cmd, s3_cmd, serve_cmd  # noqa: F401


def _configure_logging() -> None:
    level = os.environ.get("ACTSTORE_LOG", "INFO").upper()
    logging.basicConfig(
        level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    for noisy in ("httpx", "urllib3", "botocore", "filelock", "datasets"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def main() -> None:
    """Entry point of the console script; actstore errors print as one clear line."""
    _configure_logging()
    try:
        app()
    except ActstoreError as err:
        typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
        sys.exit(2)
