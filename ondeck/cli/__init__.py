"""ondeck generate | plan | inspect | profiles | bench.

A command is a name in :data:`COMMANDS`: the function that adds its arguments to its
parser, and the function that runs it. Adding one is two lines::

    from ondeck import cli
    cli.COMMANDS["serve"] = cli.Command("run a resident server", add_serve, serve)

This module imports little at its top: Ctrl-C while the heavy modules load is still
the one line and status 130 of any other moment.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import OndeckError
from ..interrupt import (
    INTERRUPTED,
    debugging,
    end_command,
    exit_interrupted,
    exits_on_interrupt,
    interrupted,
    is_the_command,
    raise_interrupts,
)
from .options import Parser, UsageError, add_debug

DEBUG_HINT = "run with --debug (or ONDECK_DEBUG=1) to see the traceback"

__all__ = ["COMMANDS", "Command", "UsageError", "build_parser", "console", "main"]


@dataclass(frozen=True)
class Command:
    """One subcommand: its help line, what adds its arguments, what runs it (an exit
    status from the parsed arguments)."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _lazy(module: str, name: str) -> Callable[..., Any]:
    """``module.name``, imported when first called: the command modules import torch."""

    def call(*args: Any) -> Any:
        import importlib

        with exits_on_interrupt():  # Ctrl-C while diffusers is imported: after it
            found = importlib.import_module(f"{__name__}.{module}")
        return getattr(found, name)(*args)

    call.__name__ = name
    return call


COMMANDS: dict[str, Command] = {
    "generate": Command(
        "generate a video or images from a model folder",
        _lazy("options", "add_generate"),
        _lazy("generate", "generate"),
    ),
    "plan": Command(
        "predict memory per stage without loading weights",
        _lazy("options", "add_plan"),
        _lazy("commands", "plan"),
    ),
    "inspect": Command(
        "list components, classes, dtypes and bytes",
        _lazy("options", "add_inspect"),
        _lazy("commands", "inspect"),
    ),
    "profiles": Command(
        "show where measured activation peaks are stored, or clear them",
        _lazy("options", "add_profiles"),
        _lazy("commands", "profiles"),
    ),
    "bench": Command(
        "compare policies on a model folder",
        _lazy("options", "add_bench"),
        _lazy("commands", "bench"),
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="ondeck",
        description="Run multi-stage generative pipelines in the memory of their largest stage.",
    )
    add_debug(parser)  # before the command too: `ondeck --debug generate`
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"ondeck {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        sub = commands.add_parser(name, help=command.help)
        command.add_arguments(sub)
        add_debug(sub)
    from ..serve import cli as serve_cli

    serve_cli.add_parser(commands)  # `serve`, and `generate --server URL`
    return parser


def _runner(name: str) -> Callable[[argparse.Namespace], int]:
    from ..serve import cli as serve_cli

    if name == "serve":
        return serve_cli.serve
    if name == "generate":  # to a running server with --server, else here
        return serve_cli.remote_or(COMMANDS["generate"].run)
    return COMMANDS[name].run


# What the command's own process sets before CUDA starts, unless the user set it: with
# expandable segments, memory freed between stages is reused whole rather than left in
# fragments, which the budgets planned close to a card's size need.
PROCESS_DEFAULTS = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def console() -> int:
    """The ``ondeck`` command: ``main`` in a process of its own, which it ends (see
    ``end_command``); called from a program that is not the command, it returns the
    status."""
    debug = debugging(sys.argv[1:])
    try:
        raise_interrupts()
        for name, value in PROCESS_DEFAULTS.items():
            os.environ.setdefault(name, value)
        if not debug:  # read as transformers is imported, which comes later
            os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        code = main()
        if interrupted() and code != 130:  # a library swallowed the KeyboardInterrupt
            print(INTERRUPTED, file=sys.stderr)
            code = 130
        from .. import distributed

        if distributed.joined():  # a torchrun worker: see end_process for why it ends so
            distributed.end_process(code)
    except KeyboardInterrupt:
        if debug:
            raise
        print(INTERRUPTED, file=sys.stderr)
        code = 130
    if code == 130:
        exit_interrupted()  # status 130 as said, whatever the interrupt passed through
    if is_the_command() and not debug:
        end_command(code)
    return code


def _no_progress_monitor() -> None:
    """No tqdm monitor thread: a command's bars do not need it, and a Ctrl-C that lands
    while it starts makes tqdm print a warning beside the interrupt's one line."""
    from tqdm import std

    std.tqdm.monitor_interval = 0


def main(argv: list[str] | None = None) -> int:
    """Run one command. Errors are one line on stderr: status 2 for a wrong argument,
    1 for any other failure, 130 for Ctrl-C; ``--debug`` or ``ONDECK_DEBUG=1`` shows
    the traceback instead."""
    arguments = sys.argv[1:] if argv is None else list(argv)
    debug = debugging(arguments)
    finished = False
    try:
        args = build_parser().parse_args(arguments)
        _no_progress_monitor()
        with _warnings_as_lines(debug):
            code = _runner(args.command)(args)
        finished = True
        return code
    except KeyboardInterrupt:
        if debug:
            raise
        print(INTERRUPTED, file=sys.stderr)
        return 130
    except OndeckError as error:
        if debug:
            raise
        print(f"ondeck: error: {_describe(error)}", file=sys.stderr)
        return 2 if isinstance(error, UsageError) else 1
    except Exception as error:
        if debug:
            raise
        first = _first_line(error)
        print(f"ondeck: error: {type(error).__name__}: {first} ({DEBUG_HINT})", file=sys.stderr)
        return 1
    finally:
        # Every rank leaves together after a command that finished; after a failure the
        # others may never arrive, so this rank leaves alone.
        if "ondeck.distributed" in sys.modules:
            sys.modules["ondeck.distributed"].shutdown(wait=finished)


@contextlib.contextmanager
def _warnings_as_lines(debug: bool):
    """ondeck's warnings as ``ondeck: warning: ...`` lines, not Python's two-line form
    with a line of ondeck's source; ``--debug`` keeps Python's form."""
    if debug:
        yield
        return
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        print(f"ondeck: warning: {message}", file=sys.stderr, flush=True)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


def _describe(error: OndeckError) -> str:
    """One line for the error; what follows its first line (a plan table) comes after."""
    text = str(error).strip() or type(error).__name__
    if type(error).__name__ not in ("UsageError", "OutputError", "OndeckError", "FolderInUse"):
        text = f"{type(error).__name__}: {text}"
    return text


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else "(no message)"


if __name__ == "__main__":
    sys.exit(main())
