"""Every wrong argument is one line and status 2, found before anything is built or loaded."""

from __future__ import annotations

import os

import pytest
import torch

from ondeck import cli
from ondeck.cli import commands
from ondeck.loading import HostCache

from .helpers import FAST, error_lines, listing, run


@pytest.fixture
def nothing_may_load(monkeypatch):
    """Building the embedded default or a pipeline fails the test: checks come first."""

    def forbidden(*_, **__):
        raise AssertionError("loaded before the arguments were checked")

    monkeypatch.setattr(commands, "model_dir", forbidden)
    monkeypatch.setattr(commands, "build_pipeline", forbidden)


BAD_ARGUMENTS = [
    (["--budget", "abc"], "--budget: cannot read 'abc' as a size"),
    (["--budget", "-1GiB"], "--budget: a size cannot be negative"),
    (["--budget", "0"], "--budget: must be more than 0"),
    (["--budget", "1.5"], "--budget: cannot read '1.5' as a size"),
    (["--budget", "inf"], "--budget: cannot read 'inf' as a size"),
    (["--host-cache", "abc"], "--host-cache: cannot read 'abc' as a size"),
    (["--host-cache", "-5"], "--host-cache: a size cannot be negative"),
    (["--height", "-64"], "--height: must be at least 1, got -64"),
    (["--height", "0"], "--height: must be at least 1, got 0"),
    (["--width", "0"], "--width: must be at least 1, got 0"),
    (["--width", "wide"], "--width: expected a whole number, got 'wide'"),
    (["--frames", "-5"], "--frames: must be at least 1, got -5"),
    (["--frames", "0"], "--frames: must be at least 1, got 0"),
    (["--steps", "-1"], "--steps: must be at least 1, got -1"),
    (["--steps", "0"], "--steps: must be at least 1, got 0"),
    (["--runs", "0"], "--runs: must be at least 1, got 0"),
    (["--seed", "1e23"], "--seed: expected a whole number, got '1e23'"),
    (["--seed", "-1"], "--seed: must be from 0 to 18446744073709551615"),
    (["--seed", str(2**64)], "--seed: must be from 0 to 18446744073709551615"),
    (["--guidance", "nan"], "--guidance: must be a finite number"),
    (["--policy", "fastest"], "--policy: invalid choice: 'fastest'"),
    (["--device", "tpu9"], "--device: 'tpu9' is not a device"),
    (["--device", "meta"], "--device: 'meta': ondeck runs on cpu, cuda or mps"),
    (["--prompt", "caf\udce9"], "--prompt: not valid UTF-8 text"),
    (["--negative-prompt", "\udcff"], "--negative-prompt: not valid UTF-8 text"),
    (["--shard", "unet"], "--shard: cannot shard ['unet']"),
]


@pytest.mark.parametrize(("argv", "message"), BAD_ARGUMENTS, ids=lambda v: str(v))
def test_a_wrong_generate_argument_is_one_line_and_status_2(
    argv, message, capsys, nothing_may_load, tmp_path
):
    code, out, err = run(capsys, "generate", *argv, "--output", tmp_path / "out")
    assert code == 2
    assert error_lines(err) == [error_lines(err)[0]]
    assert err.startswith("ondeck: error: argument ") or err.startswith("ondeck: error: --")
    assert message in err
    assert "Traceback" not in err + out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "--budget", "abc", "m"], "--budget: cannot read 'abc'"),
        (["plan", "m", "--height", "0"], "--height: must be at least 1"),
        (["plan", "m", "--device", "tpu9"], "'tpu9' is not a device"),
        (["bench", "--runs", "0"], "--runs: must be at least 1"),
        (["bench", "--device", "tpu9"], "'tpu9' is not a device"),
        (["inspect"], "the following arguments are required: model_dir"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        ([], "the following arguments are required: COMMAND (see `ondeck --help`)"),
        (["plan", "m", "--stpes", "4"], "--stpes 4 (see `ondeck plan --help`)"),
    ],
    ids=lambda v: str(v),
)
def test_other_commands_check_their_arguments_the_same_way(argv, message, capsys, nothing_may_load):
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert len(error_lines(err)) == 1 and err.startswith("ondeck: error: ")
    assert message in err


def test_sizes_accept_units_and_plain_bytes_as_the_message_suggests():
    parse = cli.build_parser().parse_args
    assert parse(["generate", "--budget", "24GiB"]).budget == 24 * 2**30
    assert parse(["generate", "--budget", "1e9"]).budget == 10**9
    assert parse(["generate", "--budget", "500MB"]).budget == 500 * 10**6
    assert parse(["generate", "--host-cache", "0"]).host_cache == 0
    assert parse(["generate", "--seed", str(2**64 - 1)]).seed == 2**64 - 1


def test_no_shape_option_means_the_models_default_and_zero_is_never_a_default():
    args = cli.build_parser().parse_args(["generate"])
    assert args.height is None and args.steps is None and args.frames is None


def test_cuda_without_cuda_is_one_line(capsys, monkeypatch, nothing_may_load, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, _, err = run(capsys, "generate", "--device", "cuda", "--output", tmp_path)
    assert code == 2
    assert error_lines(err) == [
        f"ondeck: error: argument --device: cuda asked for, but CUDA is not available here "
        f"(torch {torch.__version__}); use --device cpu"
    ]


def test_an_output_that_is_a_file_is_refused_before_generating(capsys, nothing_may_load, tmp_path):
    existing = tmp_path / "results"
    existing.write_text("keep me")
    code, _, err = run(capsys, "generate", "--output", existing)
    assert code == 2  # a wrong argument
    assert error_lines(err) == [
        f"ondeck: error: argument --output: {existing} is a file; give a folder"
    ]
    assert existing.read_text() == "keep me"


def test_an_output_under_a_file_is_refused_as_an_argument(capsys, nothing_may_load, tmp_path):
    existing = tmp_path / "notes.txt"
    existing.write_text("keep me")
    code, _, err = run(capsys, "generate", "--output", existing / "run1")
    assert code == 2
    assert error_lines(err) == [
        f"ondeck: error: argument --output: {existing} is a file; {existing / 'run1'} cannot "
        "be a folder"
    ]


def test_an_empty_output_is_refused_not_the_current_folder(
    capsys, nothing_may_load, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # `--output "$OUT"` with OUT unset
    code, _, err = run(capsys, "generate", "--output", "")
    assert code == 2
    assert "argument --output: an empty folder name (an unset shell variable?)" in err
    assert list(tmp_path.iterdir()) == []


def test_an_output_that_cannot_be_created_is_refused_before_generating(capsys, nothing_may_load):
    # /proc refuses new folders even to root, unlike a chmod'ed folder.
    code, _, err = run(capsys, "generate", "--output", "/proc/ondeck-out")
    assert code == 1
    assert len(error_lines(err)) == 1
    assert err.startswith("ondeck: error: cannot write to /proc/ondeck-out: ")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_output_folder_is_refused_before_generating(capsys, nothing_may_load, tmp_path):
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        code, _, err = run(capsys, "generate", "--output", folder)
    finally:
        folder.chmod(0o755)
    assert code == 1
    assert err.startswith(f"ondeck: error: cannot write to {folder}: Permission denied")


def test_an_output_name_taken_by_a_folder_is_refused_before_generating(
    capsys, nothing_may_load, tmp_path
):
    (tmp_path / "video.mp4").mkdir()
    code, _, err = run(capsys, "generate", "--output", tmp_path)
    assert code == 1
    assert error_lines(err) == [
        f"ondeck: error: {tmp_path / 'video.mp4'} is a folder; the run writes a file there"
    ]
    assert listing(tmp_path) == {"video.mp4"}  # the write check left nothing


def pairs(argv: list[str]) -> dict[str, str]:
    return dict(zip(argv[::2], argv[1::2], strict=True))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--height", "8"], "--height: must be a multiple of 16 for this model, got 8 (try 16)"),
        (
            ["--width", "40"],
            "--width: must be a multiple of 16 for this model, got 40 (try 32 or 48)",
        ),
        (
            ["--frames", "6"],
            "--frames: must be 4k+1 for this model (1, 5, 9, ...), got 6 (try 5 or 9)",
        ),
        (  # the tiny transformer's rope_max_seq_len is 32: 32 patches of 16 pixels
            ["--width", "528"],
            "--width: 528 is too large for this model: 33 patches along it, more than the "
            "transformer's 32 rotary positions (its rope_max_seq_len); at most 512",
        ),
        (
            ["--frames", "129"],
            "--frames: 129 is too large for this model: 33 patches along it, more than the "
            "transformer's 32 rotary positions (its rope_max_seq_len); at most 125",
        ),
    ],
    ids=lambda v: str(v),
)
def test_a_shape_the_model_cannot_take_is_refused_before_loading(
    argv, message, capsys, tiny_model, tmp_path, monkeypatch
):
    built = []
    real_pipeline = commands.build_pipeline

    def keep(*args):
        built.append(real_pipeline(*args))
        return built[-1]

    monkeypatch.setattr(commands, "build_pipeline", keep)
    options = {**pairs(FAST), **pairs(argv)}
    flat = [item for pair in options.items() for item in pair]
    code, _, err = run(capsys, "generate", tiny_model, *flat, "--output", tmp_path)
    assert code == 2
    assert error_lines(err) == [f"ondeck: error: argument {message}"]
    assert built and built[0].tracker.bytes_loaded == 0
    code, _, err = run(capsys, "plan", tiny_model, *flat)  # the same flags, the same check
    assert code == 2 and message in err


def test_a_missing_model_folder_is_a_load_error_with_status_1(capsys, tmp_path):
    code, out, err = run(capsys, "generate", tmp_path / "nowhere", *FAST, "--output", tmp_path)
    assert code == 1
    assert error_lines(err) == [
        f"ondeck: error: LoadError: model folder {tmp_path / 'nowhere'} does not exist or is not "
        "a folder"
    ]


def test_an_unexpected_exception_is_one_line_with_a_hint(capsys, monkeypatch, tmp_path):
    def broken(*_):
        raise RuntimeError("something inside broke\nsecond line of detail")

    monkeypatch.setattr(commands, "model_dir", broken)
    code, out, err = run(capsys, "generate", "--output", tmp_path)
    assert code == 1
    assert error_lines(err) == [
        "ondeck: error: RuntimeError: something inside broke (run with --debug "
        "(or ONDECK_DEBUG=1) to see the traceback)"
    ]


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_debug_shows_the_traceback(how, capsys, monkeypatch, tmp_path):
    def broken(*_):
        raise RuntimeError("something inside broke")

    monkeypatch.setattr(commands, "model_dir", broken)
    argv = ["generate", "--output", str(tmp_path)]
    if how == "flag":
        argv.append("--debug")
    else:
        monkeypatch.setenv("ONDECK_DEBUG", "1")
    with pytest.raises(RuntimeError, match="something inside broke"):
        cli.main(argv)


def test_ctrl_c_is_one_line_and_status_130(capsys, monkeypatch, tmp_path):
    def interrupted(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "model_dir", interrupted)
    code, _, err = run(capsys, "generate", "--output", tmp_path)
    assert code == 130
    assert error_lines(err) == ["ondeck: interrupted"]


def test_host_cache_auto_asks_for_an_elastic_cache_on_both_command_lines():
    parse = cli.build_parser().parse_args
    for command in (["generate"], ["serve"]):
        assert HostCache.from_setting(parse([*command, "--host-cache", "auto"]).host_cache).elastic
        fixed = HostCache.from_setting(parse([*command, "--host-cache", "40GiB"]).host_cache)
        assert not fixed.elastic and fixed.budget_bytes == 40 * 2**30
        assert HostCache.from_setting(parse([*command, "--host-cache", "0"]).host_cache) is None


def test_every_bench_option_says_what_it_does(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    for option, said in (
        ("model_dir", "diffusers-format folder or Hub repo id"),
        ("--runs RUNS", "runs per policy, back to back, each with the same seed (default 2)"),
        ("--device DEVICE", "cuda, cuda:1, cpu, mps"),
        ("--image PATH", "the input image of an image-to-video"),
        ("--height HEIGHT", "pixels (default 128)"),
        ("--width WIDTH", "pixels (default 128)"),
        ("--steps STEPS", "denoising steps (default 2)"),
    ):
        assert f"{option} {said}" in text, option


def test_the_version_is_one_line(capsys):
    from ondeck import __version__

    with pytest.raises(SystemExit) as exit:
        cli.main(["--version"])
    assert exit.value.code == 0
    assert capsys.readouterr().out == f"ondeck {__version__}\n"
