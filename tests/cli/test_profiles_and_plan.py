"""`ondeck profiles`, `ondeck plan`'s account of auto, and `--library`."""

from __future__ import annotations

import json

import pytest
from integrations.breadth_pipelines import ALL_FAMILIES

from ondeck.memory import parse_bytes
from ondeck.profiles import ActivationProfiles

from .helpers import FAST, run


def test_profiles_shows_where_they_live_and_clear_deletes_them(cache, capsys):
    path = cache / "activation-profiles.json"
    ActivationProfiles(path).record("wan", {"height": 32}, "Decode", 2048)
    code, out, _ = run(capsys, "profiles")
    assert code == 0
    assert str(path) in out and "Decode 2.00 KiB" in out
    code, out, _ = run(capsys, "profiles", "--clear")
    assert code == 0 and "deleted" in out
    assert not path.exists()
    code, out, _ = run(capsys, "profiles")
    assert "(none yet)" in out


def test_profiles_says_what_is_wrong_with_a_damaged_file_and_clear_deletes_it_quietly(
    cache, capsys
):
    path = cache / "activation-profiles.json"
    cache.mkdir()
    path.write_text('{"garbage":\n')
    code, out, err = run(capsys, "profiles")
    assert (code, out) == (0, f"ondeck: activation profiles in {path}\n")
    assert err.splitlines() == [
        f"ondeck: warning: activation profiles {path}: ignored (Expecting value: line 2 "
        "column 1 (char 12)); `ondeck profiles --clear` removes the file"
    ]
    code, out, err = run(capsys, "profiles", "--clear")
    assert (code, out, err) == (0, f"ondeck: deleted {path}\n", "")
    assert not path.exists()


def test_clear_where_the_file_cannot_be_deleted_is_one_line(cache, capsys):
    # A folder in the file's place (an IsADirectoryError with --debug's hint before).
    path = cache / "activation-profiles.json"
    path.mkdir(parents=True)
    code, out, err = run(capsys, "profiles", "--clear")
    assert (code, out, err.splitlines()) == (
        1,
        "",
        [f"ondeck: error: cannot delete {path}: Is a directory; nothing was deleted"],
    )
    assert path.is_dir()


def test_a_generate_then_profiles_lists_what_it_measured_or_nothing(cache, tiny_model, capsys):
    # On the CPU there is no device peak to measure: the command still runs and says so.
    code, _, _ = run(capsys, "generate", tiny_model, *FAST, "--output", cache.parent / "out")
    assert code == 0
    code, out, _ = run(capsys, "profiles")
    assert code == 0 and "activation profiles in" in out


def test_profiles_lists_the_allocators_evidence_and_the_turns_beside_the_peaks(cache, capsys):
    store = ActivationProfiles(cache / "activation-profiles.json")
    store.record("m", {"width": 8}, "denoise", 3 << 20)
    store.record_allocator("m", {"width": 8}, "denoise", retried=True, limit=True)
    store.record_allocator("m", {"width": 16}, "decode", retried=False, limit=True)
    alone = [("encode", ("encode",)), ("denoise", ("denoise",))]
    store.record_turns("m", {"width": 16}, alone)  # nothing to say
    store.record_turns("m", {"width": 8}, [("encode", ("encode",)), ("t5", ("t5", "encode"))])
    code, out, _ = run(capsys, "profiles")
    assert code == 0
    lines = [line.strip() for line in out.splitlines()[1:]]
    assert lines == [
        "m  width=8: denoise 3.00 MiB",
        "m  width=8: allocator: denoise kept retrying in 1 run(s), denoise reached the "
        "device's limit",
        "m  width=16: allocator: decode reached the device's limit",
        "m  width=8: turns: t5's turn holds encode",
    ]


def test_plan_says_what_auto_chose_and_why(cache, tiny_model, capsys):
    code, out, _ = run(capsys, "plan", tiny_model, "--device", "cpu")
    assert code == 0
    assert out.splitlines()[0].startswith("ondeck: auto chose 'budget'")
    assert "the host has free" in out.splitlines()[0]  # the CPU is the host


def test_a_plan_on_the_cpu_does_not_promise_a_measurement(cache, family, capsys):
    """Nothing measures activations on the CPU: the plan of a folder with no profile
    stored says so, instead of asking for a run that would measure nothing."""
    code, out, _ = run(capsys, "plan", family("flux"), "--device", "cpu")
    assert code == 0
    assert "activations: unknown (not measured on cpu)" in out and "run once" not in out


def test_library_trusts_an_installed_package(cache, tiny_model, tmp_path, capsys):
    import shutil

    folder = shutil.copytree(tiny_model, tmp_path / "custom")
    index = json.loads((folder / "model_index.json").read_text())
    index["scheduler"] = ["torch.nn", "Identity"]
    (folder / "model_index.json").write_text(json.dumps(index))
    code, _, err = run(capsys, "plan", folder, "--device", "cpu")
    assert code == 1 and "ondeck imports classes only from" in err and "--library torch" in err
    # Trusted, the class is imported, and found to be no scheduler ondeck can load.
    code, _, err = run(capsys, "plan", folder, "--device", "cpu", "--library", "torch")
    assert code == 1 and "Identity has no from_pretrained" in err


def test_sizes_in_scientific_notation_are_bytes():
    assert parse_bytes("1e9") == 10**9
    assert parse_bytes("2.5e3MB") == 2_500_000_000


def _built_pipeline(monkeypatch, capsys, tiny_model):
    import ondeck.pipelines

    built = []
    real = ondeck.folder_pipelines.pipeline_for_folder

    def recording(*args, **kwargs):
        built.append(real(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(ondeck.folder_pipelines, "pipeline_for_folder", recording)
    assert run(capsys, "plan", tiny_model, "--device", "cpu")[0] == 0
    return built[0]


def test_the_command_measures_every_stage_exactly(monkeypatch, cache, tiny_model, capsys):
    # The command owns its process, so it may reset torch's peak statistics per stage.
    monkeypatch.delenv("ONDECK_RESET_PEAKS", raising=False)
    assert _built_pipeline(monkeypatch, capsys, tiny_model).tracker.reset_peaks is True


def test_ondeck_reset_peaks_0_keeps_them(monkeypatch, cache, tiny_model, capsys):
    monkeypatch.setenv("ONDECK_RESET_PEAKS", "0")
    assert _built_pipeline(monkeypatch, capsys, tiny_model).tracker.reset_peaks is False


def test_warnings_are_one_line_each(cache, tiny_model, capsys):
    path = cache / "activation-profiles.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("[]")
    code, _, err = run(capsys, "plan", tiny_model, "--device", "cpu")
    assert code == 0
    lines = [line for line in err.splitlines() if "activation profiles" in line]
    assert lines and all(line.startswith("ondeck: warning: ") for line in lines)
    assert "UserWarning" not in err and "ActivationProfiles(" not in err


def test_plan_shows_the_host_pool_against_host_memory(cache, tiny_model, capsys):
    code, out, _ = run(capsys, "plan", tiny_model, "--device", "cpu", "--host-memory", "64GiB")
    assert code == 0
    assert "of a budget of 64.00 GiB (given)" in out
    code, out, _ = run(capsys, "plan", tiny_model, "--device", "cpu")
    assert code == 0 and "host:" in out and "(given)" not in out


@pytest.mark.parametrize("command", ["generate", "plan"])
def test_a_host_memory_below_the_process_is_a_wrong_argument(cache, tiny_model, capsys, command):
    extra = [*FAST, "--output", str(cache / "out")] if command == "generate" else []
    code, out, err = run(
        capsys, command, tiny_model, "--device", "cpu", "--host-memory", "1MiB", *extra
    )
    assert code == 2 and out == ""
    assert "argument --host-memory: 1.00 MiB is no more than the " in err
    assert "this process holds before reading a weight; give more" in err
    assert not (cache / "out").exists()


def test_a_host_memory_below_the_process_says_so_beside_its_budget(tiny_model):
    """On the CPU the device's budget is the host's given, less what the process holds:
    below that, the error says where its one byte comes from."""
    import ondeck.diffusers
    from ondeck.errors import BudgetError

    pipe = ondeck.diffusers.from_pretrained(tiny_model, device="cpu", host_memory=2**20)
    with pytest.raises(BudgetError) as refused:
        pipe("a fox", num_inference_steps=1, height=64, width=64, num_frames=5)
    assert "budget of 1 B (the host memory given, 1.00 MiB, less the " in str(refused.value)
    assert "this process holds) even streaming" in str(refused.value)


def test_plan_on_a_diffusers_folder_scales_a_stored_call(cache, family, capsys):
    """`ondeck plan` on a folder the diffusers path runs: the activations of the nearest
    call stored for that model, scaled to the size asked for."""
    import torch

    from ondeck import folder_pipelines

    folder = family("flux")
    runtime = folder_pipelines.pipeline_for_folder(folder, device="cpu", dtype=torch.float32)
    stored = {"height": 8, "width": 8, "batch": 1, "call": "0", "device": "cpu"}
    ActivationProfiles(cache / "activation-profiles.json").record(
        runtime.profile_model, stored, "transformer", 1 << 20
    )
    code, out, _ = run(capsys, "plan", folder, "--device", "cpu", "--height", "16", "--width", "16")
    assert code == 0
    assert "activations: extrapolated from batch=1,call=0,device=cpu,height=8,width=8 (x4.00" in out


def test_the_plan_generate_shows_is_at_the_calls_size(capsys, tmp_path):
    """`generate` prints the plan of the call it makes: the VAE's decode need and the
    decoded output's host bytes at the size asked for, not unknown."""
    folder = tmp_path / "flux"
    ALL_FAMILIES["flux"].build(folder)
    size = ["--height", "64", "--width", "64", "--steps", "2"]
    code, out, err = run(capsys, "generate", folder, "--device", "cpu", *size, "--output", tmp_path)
    assert code == 0, err
    rows = [line.split() for line in out.splitlines() if line.startswith("  vae ")]
    stage = next(row for row in rows if len(row) > 3)  # the stages table's, not the sizes'
    assert stage[3] != "unknown", stage
    assert "the decoded output 0 B" not in out and "the decoded output" in out


def test_plan_shows_the_plan_generate_would_print_with_the_same_flags(cache, family, capsys):
    """`ondeck plan` plans the call `generate` makes with the same flags, so it finds what
    an earlier `generate` stored for that call: SD3's T5 turn holding both CLIP encoders,
    as the next `generate` plans it, where a plan at the size alone shows one turn each."""
    folder = family("sd3")
    call = ["--device", "cpu", "--height", "32", "--width", "32", "--policy", "release"]

    def stages(out: str) -> list[str]:
        lines = out.splitlines()
        start = lines.index("stages:") + 2
        return [line.split(None, 1)[0] + " " + line.rsplit("  ", 1)[-1] for line in lines[start:]
                if line.startswith("  ")]  # fmt: skip

    steps = ["--steps", "2", "--output", cache.parent / "out"]
    assert run(capsys, "generate", folder, *call, *steps)[0] == 0
    code, planned, _ = run(capsys, "plan", folder, *call, "--prompt", "a heron")
    assert code == 0
    assert "text_encoder_3 text_encoder, text_encoder_2, text_encoder_3" in stages(planned)
    code, generated, _ = run(capsys, "generate", folder, *call, *steps)
    assert code == 0
    assert stages(planned) == stages(generated)
    # Another call (a guidance that changes what the pipeline calls) stored nothing.
    code, other, _ = run(capsys, "plan", folder, *call, "--guidance", "1")
    assert "text_encoder_3 text_encoder_3" in stages(other)


def test_bench_runs_an_image_family_at_a_size_it_takes_and_names_the_flag_otherwise(
    cache, family, capsys
):
    """The tiny SD3 takes at most 96 pixels a side: bench's default 128 is refused
    naming --height before anything loads (status 2); --height/--width it takes run."""
    folder = family("sd3")
    capsys.readouterr()
    code, _, err = run(capsys, "bench", folder, "--device", "cpu", "--runs", "1")
    assert code == 2
    [line] = err.splitlines()
    assert line.startswith(
        "ondeck: error: argument --height: 128 (bench's default) is too large for this model"
    )
    assert line.endswith("; give a smaller --height")
    code, out, err = run(
        capsys, "bench", folder, "--device", "cpu", "--runs", "1", "--height", "32", "--width", "32"
    )
    assert code == 0, err
    assert [line.split()[0] for line in out.splitlines()[-3:]] == ["eager", "release", "budget"]
    code, _, err = run(capsys, "bench", folder, "--device", "cpu", "--frames", "5")
    assert code == 2 and "argument --frames: " in err and "makes images, not a video" in err


def test_bench_takes_the_input_image_a_pipeline_needs_and_refuses_to_start_without_it(
    cache, family, capsys, input_image, monkeypatch
):
    """The tiny SD3 ControlNet needs an input image: without --image one line names the
    flag before anything is built (status 2), as `generate` says it; with it every policy
    runs, and under ONDECK_PROGRESS=0 no step bar is drawn, the pipeline's own neither."""
    monkeypatch.setenv("ONDECK_PROGRESS", "0")
    folder = family("sd3_controlnet")
    capsys.readouterr()
    bench = ["bench", folder, "--device", "cpu", "--runs", "1", "--height", "32", "--width", "32"]
    code, out, err = run(capsys, *bench)
    assert (code, out, err.splitlines()) == (
        2,
        "",
        [
            "ondeck: error: StableDiffusion3ControlNetPipeline needs an input image: "
            "give it with --image PATH"
        ],
    )
    code, out, err = run(capsys, *bench, "--image", input_image)
    assert (code, err) == (0, "")
    assert [line.split()[0] for line in out.splitlines()[-3:]] == ["eager", "release", "budget"]
    code, _, err = run(capsys, "bench", family("sd3"), "--device", "cpu", "--image", input_image)
    assert code == 2 and "argument --image: StableDiffusion3Pipeline takes no input image" in err


def test_bench_shows_its_own_step_bars_unless_told_not_to(cache, family, capsys, monkeypatch):
    monkeypatch.setenv("ONDECK_PROGRESS", "1")
    argv = ["bench", family("sd3"), "--device", "cpu", "--runs", "1", "--height", "32"]
    code, _, err = run(capsys, *argv, "--width", "32")
    assert code == 0, err
    # Each policy's bar, as tqdm redraws it, ends at its 2 steps; diffusers' own is off.
    lines = err.replace("\r", "\n").splitlines()
    assert [line for line in lines if "%|" in line and "denoising" not in line] == []
    done = {line.split(" denoising")[0] for line in lines if "denoising" in line and "2/2" in line}
    assert done == {"eager run 1/1", "release run 1/1", "budget run 1/1"}


def test_a_budget_with_the_default_policy_says_auto_chose_budget(
    cache, tiny_model, capsys, tmp_path
):
    argv = [*FAST, "--budget", "1GiB", "--output", tmp_path / "out"]
    code, out, err = run(capsys, "generate", tiny_model, *argv)
    assert code == 0, err
    assert "ondeck: auto chose 'budget': a budget was given" in out.splitlines()
