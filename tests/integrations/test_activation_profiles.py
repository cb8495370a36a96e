"""Activation peaks on the diffusers path are stored per model and call shape, so the
first call of a later process plans with what an earlier one measured. On the CPU, whose
device has no peak to measure, each finished turn is handed what a CUDA run would
measure (as in ``tests/core/test_profiles.py``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from streaming.conftest import build_six_block_folder

import ondeck.diffusers
from ondeck.integrations.diffusers.call_shape import call_profile_shape, profile_identity
from ondeck.profiles import ActivationProfiles

CALL = dict(prompt="a fox", height=16, width=16, num_frames=5, num_inference_steps=2)
MEASURED = {"text_encoder": 3_000, "transformer": 7_000, "vae": 5_000}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_six_block_folder(tmp_path_factory.mktemp("profiles") / "wan")


@pytest.fixture
def store(monkeypatch, tmp_path):
    """A fresh profile file; ``store.reopen()`` reads it as a new process would."""

    class Store:
        path = tmp_path / "profiles.json"

        def reopen(self) -> ActivationProfiles:
            profiles = ActivationProfiles(self.path)
            monkeypatch.setattr("ondeck.profiles._default", profiles)
            return profiles

    store = Store()
    store.reopen()
    return store


def open_pipe(monkeypatch, folder, **options):
    """The folder through ``from_pretrained``; each finished turn measures ``MEASURED``,
    and the activation needs each call's first plan starts from are kept in ``needs``."""
    pipe = ondeck.diffusers.from_pretrained(
        folder, dtype=torch.float32, device="cpu", progress=False, **options
    )
    pipe.set_progress_bar_config(disable=True)
    runtime = pipe.ondeck
    measured = runtime._stage_measured

    def with_activations(index, record):
        nbytes = MEASURED.get(record.stage)
        measured(index, dataclasses.replace(record, activation_bytes=nbytes))

    monkeypatch.setattr(runtime, "_stage_measured", with_activations)
    runtime.needs = []
    before_run = runtime._before_run

    def noting_needs():
        runtime.needs.append(runtime.policy.activation_needs(runtime.snapshot()))
        before_run()

    monkeypatch.setattr(runtime, "_before_run", noting_needs)
    return pipe


def under_budget(folder, budget: str):
    """The folder through ``from_pretrained`` under the budget policy, no bars."""
    pipe = ondeck.diffusers.from_pretrained(
        folder, device="cpu", policy="budget", budget=budget, progress=False
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run(pipe, seed: int = 0, **overrides):
    arguments = {**CALL, "generator": torch.Generator().manual_seed(seed), **overrides}
    return pipe(**arguments, output_type="np").frames[0]


def test_a_later_process_plans_its_first_call_with_the_peaks_measured(monkeypatch, folder, store):
    first = open_pipe(monkeypatch, folder)
    expected = run(first)
    needs, note = first.ondeck.needs[0]
    assert "unknown" in note and needs["transformer"] is None
    entries = store.reopen().entries()
    assert len(entries) == 1 and entries[0][2] == MEASURED
    model, _, _ = entries[0]
    assert model.startswith("WanPipeline:") and str(folder.resolve()) in model

    later = open_pipe(monkeypatch, folder)  # a new process, the same file
    frames = run(later)
    needs, note = later.ondeck.needs[0]
    assert note == "activations: measured at this shape"
    assert {stage: needs[stage] for stage in MEASURED} == MEASURED
    assert frames.tobytes() == expected.tobytes()


def test_another_frame_size_is_stored_apart_and_scaled_until_measured(monkeypatch, folder, store):
    run(open_pipe(monkeypatch, folder))
    later = open_pipe(monkeypatch, folder)
    run(later, height=32, width=32)
    _, note = later.ondeck.needs[0]
    assert note.startswith("activations: extrapolated from")
    assert len(store.reopen().entries()) == 2


def test_a_replaced_component_neither_uses_nor_stores_peaks(monkeypatch, folder, store):
    run(open_pipe(monkeypatch, folder))
    later = open_pipe(monkeypatch, folder)
    from diffusers import AutoencoderKLWan

    later.vae = AutoencoderKLWan.from_pretrained(folder / "vae")  # passed in ready-made
    run(later)
    needs, note = later.ondeck.needs[0]
    assert "measured at this shape" not in note and needs["transformer"] is None
    assert len(store.reopen().entries()) == 1


def test_the_call_shape_ignores_steps_and_seeds_but_not_sizes_or_settings():
    def shape(**changes):
        arguments = {**CALL, "generator": torch.Generator(), "output_type": "np", **changes}
        sizes = {k: arguments[k] for k in ("height", "width", "num_frames")}
        return call_profile_shape((), arguments, sizes, "cpu")

    base = shape()
    assert base["height"] == 16 and base["frames"] == 5 and base["batch"] == 1
    assert shape(num_inference_steps=50, generator=torch.Generator().manual_seed(3)) == base
    assert shape(prompt="another prompt", output_type="pil") == base
    assert shape(guidance_scale=1.0)["call"] != base["call"]
    assert shape(max_sequence_length=512)["call"] != base["call"]
    assert shape(height=32) != base
    assert call_profile_shape((), CALL, {"height": 10**6}, "cpu") is None  # no plausible side


def test_the_identity_names_what_changes_the_components():
    class Pipe:
        pass

    plain = profile_identity(Pipe, "/m", torch.bfloat16)
    assert plain == profile_identity(Pipe, "/m/../m", torch.bfloat16)
    assert plain != profile_identity(Pipe, "/m", torch.float16)
    assert plain != profile_identity(Pipe, "/m", torch.bfloat16, storage={"transformer": "fp8"})
    assert plain != profile_identity(Pipe, "/m", torch.bfloat16, components={"vae": "/v.st"})
    assert plain != profile_identity(Pipe, "/m", torch.bfloat16, parallel_degree=2)
    by_name = profile_identity(Pipe, "/m", {"vae": torch.float32, "default": torch.bfloat16})
    assert by_name == profile_identity(
        Pipe, "/m", {"default": torch.bfloat16, "vae": torch.float32}
    )


def test_a_plan_before_any_call_scales_the_nearest_stored_call(monkeypatch, folder, store):
    run(open_pipe(monkeypatch, folder))
    later = open_pipe(monkeypatch, folder).ondeck
    assert "activations: unknown" in str(later.plan())
    later.set_plan_shape(height=32, width=32, frames=5)
    note = str(later.plan())
    assert "extrapolated from" in note and "height=16" in note and "(x4.00" in note


def test_a_later_process_plans_its_first_call_with_the_turns_an_earlier_one_showed(
    folders, store, monkeypatch
):
    """SD3's call encodes the negative prompt after the prompt: its CLIP encoders are
    used again in T5's turn, which holds all three. A process's first call has not seen
    that yet; planned as if each encoder were done once its turn passed, a T5 sized for
    the room alone ran out of memory when the CLIP encoders came back beside it (SD3.5
    at 8 GiB). A later process starts with the turns the earlier one stored."""
    from .breadth_pipelines import ALL_FAMILIES
    from .tiny_pipelines import run

    def open_sd3():
        pipe = ondeck.diffusers.from_pretrained(folders["sd3"], device="cpu", progress=False)
        pipe.set_progress_bar_config(disable=True)
        planned = []
        before_run = pipe.ondeck._before_run
        monkeypatch.setattr(
            pipe.ondeck,
            "_before_run",
            lambda: (planned.append(list(pipe.ondeck._turns)), before_run()),
        )
        return pipe, planned

    first, planned_first = open_sd3()
    run(first, ALL_FAMILIES["sd3"])
    shown = list(first.ondeck._turns)
    assert planned_first[0] != shown, "a first call plans each turn alone"
    assert dict(shown)["text_encoder_3"] == ("text_encoder_3", "text_encoder", "text_encoder_2")
    store.reopen()
    later, planned_later = open_sd3()
    run(later, ALL_FAMILIES["sd3"])
    assert planned_later[0] == shown


def test_stored_turns_that_do_not_fit_the_pipeline_are_not_used():
    """Turns stored for a folder whose components changed since, or damaged so that a
    turn holds no component of its own, leave the pipeline's own turns."""
    from ondeck.integrations.diffusers.turns import usable_turns

    components = ("text_encoder", "transformer", "vae")
    good = [
        ("text_encoder", ("text_encoder",)),
        ("transformer", ("transformer",)),
        ("vae", ("vae", "text_encoder")),
    ]
    assert usable_turns(good, components) == good
    assert usable_turns(None, components) is None
    assert usable_turns(good[:2], components) is None, "a component without a turn"
    assert usable_turns([*good, ("controlnet", ("controlnet",))], components) is None
    assert usable_turns([good[0], ("transformer", ("vae",)), good[2]], components) is None
    assert usable_turns([good[0], good[1], ("vae", ("vae", "unet"))], components) is None


def test_stored_turns_that_would_refuse_a_command_that_fits_without_them_are_not_used(
    folders, store, monkeypatch
):
    """Stored turns are a plan's refinement: where planning with them would refuse the
    call (every component held in the transformer's turn, on a budget that fits each
    turn alone), the first call plans each turn alone, as before, and runs."""
    from .breadth_pipelines import ALL_FAMILIES
    from .tiny_pipelines import run

    def open_sd3():
        return under_budget(folders["sd3"], "1450KiB")

    first = open_sd3()
    run(first, ALL_FAMILIES["sd3"])
    runtime = first.ondeck
    everything = tuple(runtime.order)
    crowded = [(n, everything if n == "transformer" else (n,)) for n in runtime.order]
    ActivationProfiles(store.path).record_turns(runtime.profile_model, runtime.run_shape, crowded)
    store.reopen()
    later = open_sd3()
    later.ondeck._turns = crowded
    later.ondeck._rebuild_stages()
    assert later.ondeck.plan().overflow() is not None, "with them the plan would refuse"
    later = open_sd3()
    planned = []
    before_run = later.ondeck._before_run
    monkeypatch.setattr(
        later.ondeck,
        "_before_run",
        lambda: (planned.append(list(later.ondeck._turns)), before_run())[1],
    )
    run(later, ALL_FAMILIES["sd3"])
    assert planned[0] != crowded


def test_the_plan_of_a_call_before_it_runs_has_the_turns_stored_for_a_call_like_it(folders, store):
    """``ondeck generate`` prints the plan of its very call (``plan_call``): a later
    process's shows T5's turn holding both CLIP encoders, as its first run plans, where
    a plan at the call's size alone shows one turn per component."""
    options = dict(negative_prompt="blurry", height=32, width=32, num_inference_steps=2)

    def open_sd3():
        pipe = ondeck.diffusers.from_pretrained(folders["sd3"], device="cpu", progress=False)
        pipe.set_progress_bar_config(disable=True)
        return pipe.ondeck

    first = open_sd3()
    first.generate("a fox", seed=0, **options)
    store.reopen()
    later = open_sd3()
    later.set_plan_shape(height=32, width=32)
    by_size = {use.name: use.components for use in later.plan().uses}
    assert by_size["text_encoder_3"] == ("text_encoder_3",)
    planned = later.plan_call("a heron", seed=1, **options)  # another prompt, another seed
    turns = {use.name: use.components for use in planned.uses}
    assert set(turns["text_encoder_3"]) == {"text_encoder_3", "text_encoder", "text_encoder_2"}
    later.generate("a heron", seed=1, **options)
    assert {use.name: use.components for use in later.plan().uses} == turns


def test_turns_stored_in_another_order_never_free_the_vae_while_it_decodes(folders, store):
    """Stored turns the call does not follow leave the VAE's call outside its turn; a
    decode that makes room must still keep the VAE it computes with. Freeing it there
    released its storage under the running convolution (a crash, not an error)."""
    from .breadth_pipelines import ALL_FAMILIES
    from .tiny_pipelines import run

    def open_flux():
        return under_budget(folders["flux"], "700KiB")

    first = open_flux()
    size = dict(height=32, width=32)  # a decode that needs more room than is left
    expected = run(first, ALL_FAMILIES["flux"], **size)
    runtime = first.ondeck
    shown = store.reopen().stored_turns(runtime.profile_model, runtime.run_shape)
    assert shown and shown[-1][0] == "vae"
    ActivationProfiles(store.path).record_turns(
        runtime.profile_model, runtime.run_shape, list(reversed(shown))
    )
    store.reopen()
    later = open_flux()
    made_room = []
    make_room = later.ondeck.make_room
    later.ondeck.make_room = lambda keep=(): made_room.append(tuple(keep)) or make_room(keep)
    frames = run(later, ALL_FAMILIES["flux"], **size)
    assert ("vae",) in made_room, "the decode made room with the VAE's turn passed"
    assert frames.tobytes() == expected.tobytes()
