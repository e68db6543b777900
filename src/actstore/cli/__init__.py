"""The ``actstore`` command. Each sub-module registers one group of commands on :data:`app`
(:mod:`.application`); ``main`` is the console script.

Importing this package imports nothing else: ``main`` loads the app inside its error
handling, so Ctrl-C at any moment (even during imports) prints one line and exits 130.

Example:
    $ actstore capture --layers 3,5 --out actstore-data
    $ actstore inspect actstore-data/<hash>
    $ actstore verify actstore-data/<hash>
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

#: The command modules, each registering its commands on the app when imported.
COMMAND_MODULES = (
    "capture_cmd",
    "convert_cmd",
    "cp_cmd",
    "dist_cmd",
    "inspect_cmd",
    "runs_cmd",
    "s3_cmd",
    "serve_cmd",
    "status_cmd",
)


def load_app() -> Any:
    """The Typer app with every command registered."""
    import importlib

    from .application import app

    for name in COMMAND_MODULES:
        importlib.import_module(f"{__name__}.{name}")
    return app


def __getattr__(name: str) -> Any:
    if name == "app":
        return load_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


def _say(line: str, code: int) -> None:
    """Print ``line`` on stderr (red for errors, yellow for interrupts, on a terminal) and
    exit with ``code``."""
    typer = sys.modules.get("typer")
    if typer is None:  # interrupted before typer was imported
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    else:
        color = typer.colors.RED if code == 2 else typer.colors.YELLOW
        typer.secho(line, fg=color, err=True)
    sys.exit(code)


def main() -> None:
    """Entry point of the console script: actstore errors and missing optional
    dependencies print as one ``error:`` line (exit 2), Ctrl-C as one line (exit 130)."""
    try:
        _run()
    except KeyboardInterrupt:
        _say("interrupted", 130)


def _run() -> None:
    from ..errors import ActstoreError, missing_extra
    from .application import Interrupted

    _configure_logging()
    try:
        load_app()()
    except ActstoreError as err:
        _say(f"error: {err}", 2)
    except ModuleNotFoundError as err:
        extra = missing_extra(err)
        if extra is None:
            raise
        _say(f"error: {extra}", 2)
    except Interrupted:
        _say("interrupted", 130)
