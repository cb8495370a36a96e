"""Ctrl-C while the ``ondeck`` command starts (torch's import takes seconds) or ends
(the libraries' clean-up takes half a second): the one line and status 130 of any other
moment, not a traceback through the import or the exit handlers.

Only the command's own process is affected; a program that imports ondeck gets its
``KeyboardInterrupt`` as usual.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import NoReturn

INTERRUPTED = "\nondeck: interrupted"


def debugging(arguments: list[str]) -> bool:
    """``--debug`` among the arguments, or ``ONDECK_DEBUG`` set: tracebacks wanted."""
    return "--debug" in arguments or os.environ.get("ONDECK_DEBUG", "") not in ("", "0")


def is_the_command() -> bool:
    """This process is ``ondeck …`` or ``python -m ondeck …``."""
    if sys.argv and os.path.basename(sys.argv[0]) in ("ondeck", "ondeck.exe"):
        return True
    original = list(getattr(sys, "orig_argv", ()))
    return any(a == "-m" and b == "ondeck" for a, b in zip(original, original[1:], strict=False))


@contextlib.contextmanager
def exits_on_interrupt() -> Iterator[None]:
    """Around the package's imports: in the command's process, Ctrl-C prints the line
    and exits 130."""
    try:
        yield
    except KeyboardInterrupt:
        if not is_the_command() or debugging(sys.argv[1:]):
            raise
        print(INTERRUPTED, file=sys.stderr)
        exit_interrupted()


def end_command(status: int) -> NoReturn:
    """End the command's process with ``status`` once its work is done, Ctrl-C included.

    What a normal exit does with Python whole is done here: other threads are waited
    for, the exit handlers run, the streams are flushed. The interpreter's teardown after
    them is left out: there the interrupt handler is gone, and a Ctrl-C ended the process
    by SIGINT without a word (or, inside torch's exit handlers, printed a traceback).
    From here on Ctrl-C is the line and status 130; every file is already in place.
    """
    signal.signal(signal.SIGINT, _interrupted_while_ending)
    _end_threads()
    atexit._run_exitfuncs()
    _flush()
    os._exit(status)


def _end_threads() -> None:
    """What the interpreter does with threads before its exit handlers: tell the thread
    pools to finish (their workers wait for that word, so joining them first never ends),
    then wait for every thread that is not a daemon."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None and threading.current_thread() is threading.main_thread():
        shutdown()
        return
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()


def _interrupted_while_ending(signum: int, frame: object) -> None:
    print(INTERRUPTED, file=sys.stderr)
    exit_interrupted()


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def exit_interrupted() -> NoReturn:
    """End the process with status 130, now.

    Not through ``SystemExit``: an interrupt that passed through code the interpreter ran
    for an extension (pybind11's ``exec``, which torch's import uses) marks it as never
    handled, and under ``python -m`` the interpreter then ends itself by SIGINT whatever
    status it was given. Nothing is left to write: every file goes through a temporary
    name, already renamed into place or removed.
    """
    _flush()
    os._exit(130)
