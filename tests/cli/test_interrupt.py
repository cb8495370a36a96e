"""A real Ctrl-C (SIGINT) in `python -m ondeck generate`: one line, status 130, nothing lost."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .helpers import listing

ROOT = Path(__file__).resolve().parents[2]


def interruptible(
    command: list[str], environment: dict, sigint: signal.Handlers = signal.SIG_DFL
) -> subprocess.Popen:
    """``command`` started with SIGINT at its default (``sigint``): a shell running tests
    in the background ignores it, and children inherit that."""
    return subprocess.Popen(
        command,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, sigint),
    )


def long_run(tiny_model: Path, tmp_path: Path, out: Path) -> tuple[list[str], dict]:
    """A run of ten thousand steps into ``out``: the command and its environment."""
    command = [sys.executable, "-m", "ondeck", "generate", str(tiny_model), "--device", "cpu"]
    command += ["--height", "32", "--width", "32", "--frames", "5", "--steps", "10000"]
    command += ["--policy", "release", "--output", str(out)]
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    environment["ONDECK_CACHE"] = str(tmp_path / "cache")
    return command, environment


@pytest.mark.parametrize(
    ("stop", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl-c", "sigterm"]
)
def test_ctrl_c_during_a_run_prints_one_line_exits_130_and_keeps_the_previous_results(
    tiny_model, tmp_path, stop, status
):
    """SIGTERM (``timeout``, ``docker stop``, systemd) stops a run as Ctrl-C does: one
    line, the previous results kept, no temporary file or lock left, status 143."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "video.mp4").write_bytes(b"previous complete video")
    (out / "report.json").write_text('{"previous": "run"}')
    process = interruptible(*long_run(tiny_model, tmp_path, out))
    try:
        for line in process.stdout:  # the plan is printed just before the run starts
            if line.startswith("predicted component peak"):
                break
        process.send_signal(stop)
        _, err = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == status
    assert [line for line in err.splitlines() if line.strip()] == ["ondeck: interrupted"]
    assert (out / "video.mp4").read_bytes() == b"previous complete video"
    assert sorted(path.name for path in out.iterdir()) == ["report.json", "video.mp4"]


def test_sigterm_stops_a_background_run_that_ignores_ctrl_c(tiny_model, tmp_path):
    """``cmd &`` in a script starts the command with SIGINT ignored: SIGTERM still stops
    the run with its line and status 143, the previous results kept, no lock left."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "video.mp4").write_bytes(b"previous complete video")
    process = interruptible(*long_run(tiny_model, tmp_path, out), sigint=signal.SIG_IGN)
    try:
        for line in process.stdout:
            if line.startswith("predicted component peak"):
                break
        process.send_signal(signal.SIGINT)  # ignored, as in a background job
        time.sleep(0.5)
        assert process.poll() is None, "SIGINT is ignored there"
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 143
    assert [line for line in err.splitlines() if line.strip()] == ["ondeck: interrupted"]
    assert sorted(path.name for path in out.iterdir()) == ["video.mp4"]
    assert (out / "video.mp4").read_bytes() == b"previous complete video"


# Loaded at start-up (sitecustomize), it sends the process SIGINT as torch starts to be
# imported: Ctrl-C in the seconds that import takes.
INTERRUPT_TORCH_IMPORT = """
import os, signal, sys

class InterruptTorch:
    def find_spec(self, name, path=None, target=None):
        if name == os.environ.get("INTERRUPT_AT", "torch"):
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, InterruptTorch())
"""


@pytest.mark.parametrize(
    "how, module",
    [
        ("python -m ondeck", "torch"),
        ("the ondeck script", "torch"),
        ("python -m ondeck", "diffusers"),  # once the command runs, as it imports diffusers
    ],
)
def test_ctrl_c_while_torch_is_imported_is_one_line_and_130(how, module, tiny_model, tmp_path):
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(INTERRUPT_TORCH_IMPORT)
    if how == "python -m ondeck":
        command = [sys.executable, "-m", "ondeck", "generate", str(tiny_model), "--device"]
        command += ["cpu", "--output", str(tmp_path / "out")]
    else:  # what the installed entry point runs
        script = tmp_path / "bin" / "ondeck"
        script.parent.mkdir()
        script.write_text("import sys\nfrom ondeck.cli import console\nsys.exit(console())\n")
        command = [sys.executable, str(script), "inspect", str(tmp_path)]
    finished = run_interrupted(command, hooks, module)
    assert finished.returncode == 130, finished.stderr
    assert [line for line in finished.stderr.splitlines() if line.strip()] == [
        "ondeck: interrupted"
    ]


# The same interrupt, raised through code the interpreter runs for an extension
# (PyRun_String, as pybind11's exec does in torch's import): the interpreter marks it as
# never handled and, under `python -m`, ended itself by SIGINT (status -2) whatever
# status it was given.
INTERRUPT_THROUGH_AN_EXTENSION = """
import ctypes, os, sys

class InterruptThroughAnExtension:
    def find_spec(self, name, path=None, target=None):
        if name == os.environ["INTERRUPT_AT"]:
            sys.meta_path.remove(self)
            run = ctypes.pythonapi.PyRun_String
            run.restype = ctypes.py_object
            run.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.py_object, ctypes.py_object]
            run(b"raise KeyboardInterrupt", 257, {}, {})
        return None

sys.meta_path.insert(0, InterruptThroughAnExtension())
"""


@pytest.mark.parametrize("module", ["torch", "diffusers"])
def test_ctrl_c_through_an_extensions_code_is_still_status_130(module, tiny_model, tmp_path):
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(INTERRUPT_THROUGH_AN_EXTENSION)
    command = [sys.executable, "-m", "ondeck", "generate", str(tiny_model), "--device", "cpu"]
    command += ["--output", str(tmp_path / "out")]
    environment = {**os.environ, "PYTHONPATH": f"{hooks}{os.pathsep}{ROOT}"}
    environment["INTERRUPT_AT"] = module
    environment.pop("ONDECK_DEBUG", None)
    finished = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 130, finished.stderr
    assert [line for line in finished.stderr.splitlines() if line.strip()] == [
        "ondeck: interrupted"
    ]


def test_ctrl_c_as_the_command_ends_is_one_line_and_130(tmp_path):
    # The interrupt lands after the command's own handler, as the process ends.
    program = (
        "import sys\n"
        "from ondeck import cli, distributed\n"
        "def interrupted():\n"
        "    raise KeyboardInterrupt\n"
        "distributed.joined = interrupted\n"
        "sys.argv = ['ondeck', 'profiles']\n"
        "sys.exit(cli.console())\n"
    )
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "ONDECK_CACHE": str(tmp_path)}
    environment.pop("ONDECK_DEBUG", None)
    finished = subprocess.run(
        [sys.executable, "-c", program],
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert finished.returncode == 130, finished.stderr
    assert [line for line in finished.stderr.splitlines() if line.strip()] == [
        "ondeck: interrupted"
    ]


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.2])
def test_ctrl_c_once_the_command_has_printed_its_result_is_one_line_and_130(
    delay, tiny_model, tmp_path
):
    # The process ends in the half second after its last line: torch's and the other
    # libraries' clean-up, where a Ctrl-C printed a traceback or ended it by SIGINT.
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    environment.pop("ONDECK_DEBUG", None)
    process = interruptible(
        [sys.executable, "-m", "ondeck", "inspect", str(tiny_model)], environment
    )
    try:
        for line in process.stdout:
            if line.lstrip().startswith("sum "):  # the last line it prints
                break
        time.sleep(delay)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    lines = [line for line in err.splitlines() if line.strip()]
    # Either the command had ended (status 0, nothing said) or the interrupt landed.
    assert (process.returncode, lines) in ((0, []), (130, ["ondeck: interrupted"])), err


def test_a_program_importing_ondeck_keeps_its_keyboard_interrupt(tmp_path):
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(INTERRUPT_TORCH_IMPORT)
    program = "try:\n    import ondeck\nexcept KeyboardInterrupt:\n    print('caught')\n"
    finished = subprocess.run(
        [sys.executable, "-c", program],
        env={**os.environ, "PYTHONPATH": f"{hooks}{os.pathsep}{ROOT}"},
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert finished.stdout == "caught\n", finished.stderr


# Sends SIGINT as INTERRUPT_AT starts to be imported and swallows the KeyboardInterrupt,
# as a library's bare `except:` does (one in torch's or numpy's import did: the command
# then ran on, or failed later with "Failed to import diffusers.pipelines...").
SWALLOW_AN_INTERRUPT = """
import os, signal, sys

class SwallowAnInterrupt:
    def find_spec(self, name, path=None, target=None):
        if name == os.environ["INTERRUPT_AT"]:
            sys.meta_path.remove(self)
            try:
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(1000):
                    pass
            except KeyboardInterrupt:
                open(os.environ["SWALLOWED"], "w").close()
        return None

sys.meta_path.insert(0, SwallowAnInterrupt())
"""


@pytest.mark.parametrize(
    "module, raised, written",
    [
        # While the package is imported the interrupt is noted, never raised inside an
        # import; the command ends once the imports are done, before anything is built.
        ("torch", False, set()),
        # As the video is written (an import inside the run): raised, swallowed, noted.
        ("imageio_ffmpeg", True, {"report.json", "timeline.png", "video.mp4"}),
    ],
)
def test_ctrl_c_that_a_library_swallows_still_ends_the_command_with_130(
    module, raised, written, tiny_model, tmp_path
):
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SWALLOW_AN_INTERRUPT)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "ondeck", "generate", str(tiny_model), "--device", "cpu"]
    command += ["--height", "32", "--width", "32", "--frames", "5", "--steps", "2"]
    command += ["--output", str(out)]
    finished = run_interrupted(command, hooks, module, SWALLOWED=str(tmp_path / "swallowed"))
    assert finished.returncode == 130, finished.stderr
    assert (tmp_path / "swallowed").exists() == raised
    lines = [line for line in finished.stderr.splitlines() if line.strip()]
    assert lines[-1] == "ondeck: interrupted" and "Traceback" not in finished.stderr
    assert (listing(out) if out.exists() else set()) == written


def run_interrupted(command: list[str], hooks, module: str, **extra: str):
    """``command`` with ``hooks`` on the path, interrupted as ``module`` starts to import
    (``INTERRUPT_AT``), SIGINT at its default as a terminal leaves it."""
    environment = {**os.environ, "PYTHONPATH": f"{hooks}{os.pathsep}{ROOT}"}
    environment.update(INTERRUPT_AT=module, **extra)
    environment.pop("ONDECK_DEBUG", None)
    return subprocess.run(
        command,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


SECOND_INTERRUPT = """
import os, signal, sys
sys.argv[0] = "ondeck"  # the command's own process
from ondeck import interrupt
interrupt.stop_at_once_when_asked_again()
# What the first interrupt meets inside one long operation: nothing happens until it
# returns (here it never does).
signal.signal(signal.{name}, lambda *_: None)
reader, _ = os.pipe()
print("ready", flush=True)
os.read(reader, 1)
"""


@pytest.mark.parametrize(("stop", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_second_interrupt_stops_the_command_inside_a_long_operation(stop, status):
    """The first Ctrl-C (or SIGTERM) waits for the operation under way to return, which
    on the CPU can take minutes; the second ends the process at once."""
    process = interruptible(
        [sys.executable, "-c", SECOND_INTERRUPT.format(name=stop.name)],
        {**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert process.stdout.readline().strip() == "ready"
    process.send_signal(stop)
    time.sleep(0.5)
    assert process.poll() is None  # the first waits
    process.send_signal(stop)
    try:
        _, errors = process.communicate(timeout=20)
    finally:
        process.kill()
    assert process.returncode == status, errors
    assert "ondeck: interrupted again: stopping now" in errors


HELD_THEN_SECOND = """
import os, signal, sys, time
sys.argv[0] = "ondeck"
from ondeck import interrupt
interrupt.stop_at_once_when_asked_again()
signal.signal(signal.SIGINT, lambda *_: print("handled", flush=True))
with interrupt.interrupts_held():
    print("holding", flush=True)
    time.sleep(1.5)
print("released", flush=True)
reader, _ = os.pipe()
os.read(reader, 1)
"""


def test_an_interrupt_held_over_a_rename_and_delivered_after_is_still_the_first():
    """``interrupts_held`` delivers a Ctrl-C once its renames are done: that is the same
    interrupt, not a second one, so the process goes on to handle it; another Ctrl-C
    then ends it at once."""
    process = interruptible(
        [sys.executable, "-c", HELD_THEN_SECOND], {**os.environ, "PYTHONPATH": str(ROOT)}
    )
    try:
        assert process.stdout.readline().strip() == "holding"
        process.send_signal(signal.SIGINT)
        assert process.stdout.readline().strip() == "handled"  # delivered after the block
        assert process.stdout.readline().strip() == "released"
        time.sleep(0.5)
        assert process.poll() is None
        process.send_signal(signal.SIGINT)
        _, errors = process.communicate(timeout=20)
    finally:
        process.kill()
    assert process.returncode == 130, errors
