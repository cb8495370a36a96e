"""``pipe.<name> = value`` on the diffusers path: the replaced component leaves the
pipeline whole (its decode, its touches), a refused assignment changes nothing, and a
deferred component belongs to one pipeline at a time."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

import ondeck.diffusers
from ondeck.errors import OndeckError

from .breadth_pipelines import ALL_FAMILIES
from .tiny_pipelines import run

FAMILY = ALL_FAMILIES["wan"]


def load(path, policy="release"):
    pipe = ondeck.diffusers.from_pretrained(path, policy=policy)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def deferred_vae(path):
    """The deferred VAE of a pipeline loaded for it, taken out of that pipeline: a
    deferred component belongs to one pipeline at a time."""
    donor = load(path)
    vae = donor.vae
    donor.vae = None
    return vae


def test_a_vae_replaced_by_a_module_is_no_longer_held(folders):
    """After ``pipe.vae = module`` nothing of the pipeline holds the old deferred VAE
    (its fitting decode included), so it and what it loaded can be freed."""
    from diffusers import AutoencoderKLWan

    pipe = load(folders["wan"])
    run(pipe, FAMILY)
    old = weakref.ref(pipe.vae)
    pipe.vae = AutoencoderKLWan.from_pretrained(folders["wan"] / "vae")
    gc.collect()

    holders = [type(r).__name__ for r in gc.get_referrers(old())] if old() else []
    assert old() is None, f"the old VAE is still alive, held by {holders}"
    assert "vae" not in pipe.ondeck.decoders


def test_a_vae_replaced_by_a_deferred_vae_has_its_decoder_at_once(folders, references):
    """The runtime's decoder (which sizes the plan's decode before a call decodes) is
    the new VAE's as soon as it is assigned, and the call decodes with it."""
    pipe = load(folders["wan"])
    run(pipe, FAMILY)
    new_vae = deferred_vae(folders["wan"])
    pipe.vae = new_vae

    assert pipe.ondeck.decoders["vae"].proxy is new_vae
    assert np.array_equal(run(pipe, FAMILY), references["wan"][0])
    assert pipe.ondeck.decoders["vae"].proxy is new_vae


def test_a_replaced_vae_decoding_leaves_the_pipelines_decoder_alone(folders):
    """A decode through the VAE the pipeline no longer holds is that VAE's own: it
    neither replaces the pipeline's decoder nor is sized against its room."""
    pipe = load(folders["wan"])
    old = pipe.vae
    pipe.vae = deferred_vae(folders["wan"])
    latents = run(pipe, FAMILY, output_type="latent")

    old.decode(latents.to(old.dtype), return_dict=False)

    assert pipe.ondeck.decoders["vae"].proxy is pipe.vae
    assert old.ondeck_runtime is None


def test_an_assignment_refused_during_a_call_changes_nothing(folders):
    """``pipe.vae = x`` while a call runs is refused, and the pipeline keeps the VAE it
    plans for and decodes with."""
    pipe = load(folders["wan"])
    old, other = pipe.vae, deferred_vae(folders["wan"])
    refused = []

    def assign(p, step, timestep, tensors):
        try:
            p.vae = other
        except OndeckError as error:
            refused.append(error)
        return {}

    run(pipe, FAMILY, callback_on_step_end=assign)

    assert refused and "while a call runs" in str(refused[0])
    assert pipe.ondeck.components["vae"] is old
    assert pipe.vae is old


def test_a_deferred_component_of_another_pipeline_is_refused_and_both_keep_working(
    folders, references
):
    """``pipe2.vae = pipe1.vae`` is refused, naming the component and how to share it:
    the VAE stays pipe1's, whose calls keep their plan's peak and output."""
    pipe1, pipe2 = load(folders["wan"]), load(folders["wan"])
    own = pipe2.vae

    with pytest.raises(OndeckError, match=r"'vae'.*another ondeck pipeline.*from_pretrained"):
        pipe2.vae = pipe1.vae

    assert pipe2.vae is own and pipe1.vae.ondeck_runtime is pipe1.ondeck
    assert np.array_equal(run(pipe1, FAMILY), references["wan"][0])
    peak, planned = pipe1.ondeck.report()["peak_resident_bytes"], pipe1.ondeck.plan().peak_bytes
    assert peak <= planned, f"peak {peak} above the plan's {planned}"
    assert np.array_equal(run(pipe2, FAMILY), references["wan"][0])


def test_a_deferred_component_of_another_pipeline_is_refused_by_from_pretrained(folders):
    """``from_pretrained(..., vae=pipe1.vae)`` is refused as the assignment is, before
    anything loads: pipe1's runtime frees that VAE, and a new pipeline's never would."""
    pipe1 = load(folders["wan"])
    with pytest.raises(OndeckError, match=r"'vae'.*another ondeck pipeline.*from_pretrained"):
        ondeck.diffusers.from_pretrained(folders["wan"], policy="release", vae=pipe1.vae)
    assert pipe1.vae.ondeck_runtime is pipe1.ondeck
    assert not pipe1.ondeck.tracker.resident


def test_a_replaced_vae_leaves_no_measurement_behind(folders):
    """What the runs measured of the old VAE's turn (its decode's activations, room kept
    after running out of memory) is not planned for the new one, which is sized as a VAE
    not yet measured is."""
    pipe = load(folders["wan"], policy="auto")
    run(pipe, FAMILY)
    runtime = pipe.ondeck
    estimated = runtime.snapshot().measured_activation["vae"]
    # What a GPU run records: the decode's peak, and room kept after it ran out.
    runtime._measured_activation["vae"] = 64 * estimated
    runtime._oom_room["vae"] = 32 * estimated
    assert runtime.snapshot().measured_activation["vae"] == 64 * estimated

    pipe.vae = deferred_vae(folders["wan"])

    assert runtime.snapshot().measured_activation.get("vae", 0) <= estimated


def test_a_replaced_controlnet_leaves_no_room_on_the_turn_that_holds_it(folders):
    """The unet's turn holds the ControlNet (it runs inside each step): replacing the
    ControlNet drops that turn's measured activations and the room kept for it after
    running out of memory, though the turn is named after the unet."""
    family = ALL_FAMILIES["sd_controlnet"]
    pipe = load(folders["sd_controlnet"], policy="auto")
    run(pipe, family)
    runtime = pipe.ondeck
    assert "controlnet" in dict(runtime.report()["turns"])["unet"]
    estimated = runtime.snapshot().measured_activation.get("unet") or 2**20
    runtime._measured_activation["unet"] = 64 * estimated
    runtime._oom_room["unet"] = 32 * estimated

    donor = load(folders["sd_controlnet"])
    controlnet = donor.controlnet
    donor.controlnet = None
    pipe.controlnet = controlnet

    assert runtime.snapshot().measured_activation.get("unet", 0) < 32 * estimated


@pytest.mark.parametrize("policy", ["release", "budget"])
@pytest.mark.parametrize("name", ["vae", "transformer", "text_encoder_3"])
def test_a_component_replaced_after_calls_takes_its_turn_in_the_next(folders, name, policy):
    """After calls have shown when each turn ends, ``pipe.<name> = module`` (or None, as
    SD3's T5 often is) gives later calls what the same assignment before any call gives:
    the turn that would have started early on the old component is not started on the
    new one."""
    family = ALL_FAMILIES["sd3"]
    plain = family.pipeline_type().from_pretrained(folders["sd3"])
    value = None if name == "text_encoder_3" else getattr(plain, name)
    options = {"budget": "1GiB"} if policy == "budget" else {}
    before = ondeck.diffusers.from_pretrained(folders["sd3"], policy=policy, **options)
    setattr(before, name, value)
    after = ondeck.diffusers.from_pretrained(folders["sd3"], policy=policy, **options)
    for pipe in (before, after):
        pipe.set_progress_bar_config(disable=True)
    run(after, family)
    run(after, family, seed=1)
    setattr(after, name, value)

    expected = run(before, family)
    assert np.array_equal(run(after, family), expected)
    assert np.array_equal(run(after, family), expected)
