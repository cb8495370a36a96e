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


# Ctrl-Cs the command's process received, and how deep it is in deferring them.
_interrupts = 0
_deferring = 0
_after_deferring: object = None
# Signals ``interrupts_held`` delivers again once its block ends: each one a signal the
# process received already, not a second interrupt.
_raised_again: list[int] = []
# The last interrupting signal: the status is 128 + its number (130 for Ctrl-C, 143 for
# SIGTERM, what ``timeout``, ``docker stop`` and systemd send).
_signal_number = int(signal.SIGINT)


@contextlib.contextmanager
def exits_on_interrupt() -> Iterator[None]:
    """Around the package's imports: in the command's process, Ctrl-C prints the line
    and exits 130, once the imports are done.

    The interrupt is noted, not raised, until then: raised inside an extension's
    initialisation (numpy's, torch's), it aborted the process ("terminate called after
    throwing … KeyboardInterrupt"), failed a second import of the module with a
    traceback, or was swallowed and broke a later import. From the end of the outermost
    of these imports, and once the command's handler is in place (``raise_interrupts``),
    Ctrl-C raises ``KeyboardInterrupt`` as usual and is noted too (see ``interrupted``).
    """
    global _deferring, _after_deferring
    watching = _watching()
    if watching:
        if _deferring == 0:
            _after_deferring = signal.signal(signal.SIGINT, _note_interrupt)
        _deferring += 1
    try:
        yield
    except BaseException as error:
        # An interrupt raised anyway (through an extension's code), or whatever a noted
        # one made of the import.
        if _interrupts or isinstance(error, KeyboardInterrupt):
            if is_the_command() and not debugging(sys.argv[1:]):
                _exit_with_the_line()
        raise
    finally:
        if watching:
            _deferring -= 1
            if _deferring == 0 and _after_deferring is _note_and_raise_interrupt:
                signal.signal(signal.SIGINT, _note_and_raise_interrupt)
    if watching and _deferring == 0 and _interrupts:
        _exit_with_the_line()


def raise_interrupts() -> None:
    """From here on Ctrl-C raises ``KeyboardInterrupt`` (noted too): called first in the
    command's handler, so that no interrupt lands between the imports and that handler.
    SIGTERM, where nothing else handles it, does the same: a run it stops removes its
    temporary files as one Ctrl-C stops does, and ends with status 143."""
    if signal.getsignal(signal.SIGINT) is _note_interrupt and _deferring == 0:
        signal.signal(signal.SIGINT, _note_and_raise_interrupt)
        if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _note_and_raise_interrupt)
        if _interrupts:
            raise KeyboardInterrupt
    elif _terminated_only() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        # A background job (``cmd &`` in a script, nohup) ignores Ctrl-C; SIGTERM still
        # stops its runs cleanly.
        signal.signal(signal.SIGTERM, _note_and_raise_interrupt)


def stop_at_once_when_asked_again() -> None:
    """In the command's process: a second Ctrl-C or SIGTERM ends it at once (status 130
    or 143), even while the main thread is inside one long operation (a CPU attention
    call can last minutes) that the first interrupt waits for. A thread reads the
    signals' numbers as they arrive (``signal.set_wakeup_fd``), where the main thread's
    handlers only run between operations. The first interrupt stops the run as before,
    removing its temporary files; what a second one leaves is what it interrupts."""
    if not (_watching() or _terminated_only()):  # the main thread, as set_wakeup_fd needs
        return
    reader, writer = os.pipe()
    os.set_blocking(writer, False)
    try:
        signal.set_wakeup_fd(writer, warn_on_full_buffer=False)
    except ValueError:  # not the main thread of the main interpreter
        os.close(reader)
        os.close(writer)
        return
    stops = (int(signal.SIGINT), int(signal.SIGTERM))

    def watch() -> None:
        seen = 0
        while received := os.read(reader, 64):
            for number in (n for n in received if n in stops):
                if number in _raised_again:
                    _raised_again.remove(number)
                    continue
                seen += 1
                if seen >= 2:
                    print("\nondeck: interrupted again: stopping now", file=sys.stderr)
                    _flush()
                    os._exit(128 + number)

    threading.Thread(target=watch, name="ondeck-interrupts", daemon=True).start()


def interrupted() -> bool:
    """The command's process received Ctrl-C: a library that swallowed the
    ``KeyboardInterrupt`` (a bare ``except``) cannot make the command end otherwise."""
    return _interrupts > 0


def _the_commands_main_thread() -> bool:
    """The command's own process, not ``--debug``, its main thread."""
    return (
        is_the_command()
        and not debugging(sys.argv[1:])
        and threading.current_thread() is threading.main_thread()
    )


def _terminated_only() -> bool:
    """The command's main thread, with SIGINT ignored (``nohup``, a background job)."""
    return _the_commands_main_thread() and signal.getsignal(signal.SIGINT) == signal.SIG_IGN


def _watching() -> bool:
    """Interrupts are the command's to handle: its own process, not ``--debug``, the
    main thread, and SIGINT not ignored (``nohup``, a background job)."""
    ignored = (signal.SIG_IGN, None)
    return _the_commands_main_thread() and signal.getsignal(signal.SIGINT) not in ignored


def _note_interrupt(signum: int, frame: object) -> None:
    global _interrupts, _signal_number
    _interrupts += 1
    _signal_number = int(signum)


def _note_and_raise_interrupt(signum: int, frame: object) -> None:
    _note_interrupt(signum, frame)
    raise KeyboardInterrupt


def _exit_with_the_line() -> NoReturn:
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
    """End the process with status 130 (143 after SIGTERM), now.

    Not through ``SystemExit``: an interrupt that passed through code the interpreter ran
    for an extension (pybind11's ``exec``, which torch's import uses) marks it as never
    handled, and under ``python -m`` the interpreter then ends itself by SIGINT whatever
    status it was given. Nothing is left to write: every file goes through a temporary
    name, already renamed into place or removed.
    """
    _flush()
    os._exit(128 + _signal_number)


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM wait for the end of the block (renames that replace a set of
    files together), then are delivered to the handlers they would have met. Only the
    main thread receives signals; elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    held = {}
    for number in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(number)
        if handler not in (signal.SIG_IGN, None):
            held[number] = handler
            signal.signal(number, lambda received, _: caught.append(received))
    try:
        yield
    finally:
        for number, handler in held.items():
            signal.signal(number, handler)
        for number in caught:
            _raised_again.append(number)  # the same interrupt: not a second one
            signal.raise_signal(number)
