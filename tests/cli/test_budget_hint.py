"""What a run that does not fit its --budget suggests: what fits its pipeline (no fewer
frames for images) and its weights (--weights fp8 where the overflowing stage holds a
model stored as it computes, not a VAE)."""

from __future__ import annotations

from .helpers import FAST, IMAGE_ARGS, error_lines, run

FITS_IN_FP8 = ["--budget", "300KiB"]  # the tiny Flux's transformer overflows it, not in fp8


def _error(capsys, *argv) -> str:
    code, _, err = run(capsys, "generate", *argv)
    [line] = error_lines(err)
    assert code == 1, line
    return line


def test_an_image_pipeline_is_told_fp8_would_shrink_the_stage_and_no_frames(
    capsys, cache, family, tmp_path
):
    folder = family("flux")
    capsys.readouterr()
    line = _error(capsys, folder, *IMAGE_ARGS, *FITS_IN_FP8, "--output", tmp_path / "o")
    assert line.startswith("ondeck: error: BudgetError: stage 'transformer' needs ")
    assert line.endswith(
        "nothing was loaded. Try a lower resolution, a larger budget, or --weights fp8 "
        "(`ondeck plan` with the same flags shows what fits)."
    )
    code, _, err = run(
        capsys, "generate", folder, *IMAGE_ARGS, *FITS_IN_FP8, "--weights", "fp8",
        "--output", tmp_path / "o",
    )  # fmt: skip
    assert code == 0, err


def test_weights_in_fp8_already_are_not_suggested_again(capsys, cache, family, tmp_path):
    folder = family("flux")
    capsys.readouterr()
    argv = [*IMAGE_ARGS, "--budget", "100KiB", "--weights", "fp8", "--output", tmp_path / "o"]
    line = _error(capsys, folder, *argv)
    assert line.endswith("nothing was loaded. Try a lower resolution or a larger budget.")


def test_a_video_pipeline_is_told_fewer_frames_and_a_vae_stage_no_fp8(
    capsys, cache, tiny_model, tmp_path
):
    line = _error(capsys, tiny_model, *FAST, "--budget", "100KiB", "--output", tmp_path / "o")
    assert line.startswith("ondeck: error: BudgetError: stage 'Decode' needs ")
    assert line.endswith(
        "nothing was loaded. Try a lower resolution, fewer frames, or a larger budget."
    )


def test_a_budget_error_without_the_hint_stays_what_it_is():
    from ondeck.cli.budget_hint import fitting_hint
    from ondeck.host_watch import HostMemoryError

    error = HostMemoryError("the process's host memory outgrew its budget of 8.00 GiB")
    assert fitting_hint(error, video=True, fp8=True) is error
