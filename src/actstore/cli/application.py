"""The ``actstore`` Typer app: the root command (``--version``, ``--help``) and the group
every command module registers on.

Nothing heavy is imported here or by the command modules at import time (torch,
transformers and the formats load inside the commands that need them), so ``--help`` and
``--version`` answer at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup


class Interrupted(Exception):
    """Ctrl-C inside a command, carried out of Typer (which would turn a KeyboardInterrupt
    into a silent exit 130) to :func:`actstore.cli.main`, which says so in one line."""


class _Group(TyperGroup):
    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise Interrupted from None


def lazy_epilog(make: Callable[[], str]) -> type[TyperCommand]:
    """A command class whose epilog is ``make()``, built only when help is shown (the
    format list imports the formats, which need torch)."""

    class LazyEpilogCommand(TyperCommand):
        def format_epilog(self, ctx: Any, formatter: Any) -> None:
            self.epilog = make()
            super().format_epilog(ctx, formatter)

    return LazyEpilogCommand


app = typer.Typer(
    name="actstore",
    cls=_Group,
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
