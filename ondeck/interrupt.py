"""Ctrl-C while the ``ondeck`` command starts (torch's import takes seconds): the one
line and status 130 of any other moment, not a traceback through the import.

Only the command's own process is affected; a program that imports ondeck gets its
``KeyboardInterrupt`` as usual.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

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
        raise SystemExit(130) from None
