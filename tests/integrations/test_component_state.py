"""What a component keeps across releases and calls on the diffusers path: casts, the
turns of components a first call skipped, configuring calls and settings in order, and
the bytes a cast changes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from references import in_fresh_tensors

import ondeck
import ondeck.diffusers
from ondeck.lazy import loaded_module, module_nbytes

from .breadth_pipelines import ALL_FAMILIES
from .tiny_pipelines import run


def load(path, **options):
    pipe = ondeck.diffusers.from_pretrained(path, **options)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def plain(family, folder, **options):
    pipe = in_fresh_tensors(ALL_FAMILIES[family].pipeline_type().from_pretrained(folder, **options))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def dtypes(module):
    return {name: p.dtype for name, p in module.named_parameters()}


# -- casts ------------------------------------------------------------------------------


def test_pipe_to_half_reloads_the_module_diffusers_cast_gives(folders):
    """diffusers' ``pipe.to(torch.float16)`` casts every weight, the layers a load in
    float16 keeps in float32 (``_keep_in_fp32_modules``: Wan's norms and time embedder,
    T5's ``wo``) included; each reload is that module again."""
    folder = folders["wan"]
    reference = plain("wan", folder)
    reference.to(torch.float16)
    expected = run(reference, ALL_FAMILIES["wan"], output_type="latent")

    pipe = load(folder, policy="release")
    pipe.to(torch.float16)
    latents = run(pipe, ALL_FAMILIES["wan"], output_type="latent")

    for name in ("transformer", "text_encoder"):
        assert dtypes(getattr(pipe, name).materialize()) == dtypes(getattr(reference, name)), (
            f"{name} after pipe.to(float16) is not what diffusers' cast makes"
        )
    assert torch.equal(latents, expected)


def test_half_on_a_loaded_component_survives_a_reload_unchanged(folders):
    """The same through a component: ``half()`` casts it all, and the module a release
    brings back is all float16 too, so the second call computes with the first's."""
    pipe = load(folders["wan"], policy="release")
    pipe.transformer.materialize()
    pipe.transformer.half()
    before = dtypes(pipe.transformer.materialize())
    assert set(before.values()) == {torch.float16}
    pipe.ondeck.release_all()

    assert dtypes(pipe.transformer.materialize()) == before


# -- a component a first call did not touch ----------------------------------------


@pytest.mark.parametrize(
    ("family", "first_call"),
    [("wan22", {"num_inference_steps": 1}), ("wan", {"output_type": "latent"})],
    ids=["wan22-one-step-first", "latent-first"],
)
def test_a_component_first_used_in_the_second_call_keeps_release_peak(folders, family, first_call):
    """A first call that does not touch a component (Wan 2.2 with one step never reaches
    ``transformer_2``; ``output_type='latent'`` never reaches the VAE) leaves it a turn
    where the pipeline's order puts it: the next call that touches it starts that turn,
    and under ``release`` never holds it beside the component before it."""
    pipe = load(folders[family], policy="release")
    run(pipe, ALL_FAMILIES[family], **first_call)
    plan_peak = pipe.ondeck.plan().peak_bytes
    largest = max(pipe.ondeck.plan().component_bytes.values())
    assert plan_peak == largest

    run(pipe, ALL_FAMILIES[family])

    assert pipe.ondeck.report()["peak_resident_bytes"] <= plan_peak, pipe.ondeck.report()["turns"]


# -- configuring calls and settings ---------------------------------------------------


def test_freeu_survives_release(folders):
    """``pipe.enable_freeu(...)`` calls ``unet.enable_freeu``: recorded, so the UNet a
    release brings back has FreeU too."""
    folder = folders["sdxl"]
    freeu = dict(s1=0.6, s2=0.4, b1=1.1, b2=1.2)
    reference = plain("sdxl", folder)
    reference.enable_freeu(**freeu)
    expected = run(reference, ALL_FAMILIES["sdxl"])

    pipe = load(folder, policy="release")
    pipe.enable_freeu(**freeu)
    first = run(pipe, ALL_FAMILIES["sdxl"])
    second = run(pipe, ALL_FAMILIES["sdxl"])

    assert np.array_equal(first, expected)
    assert np.array_equal(second, expected), "the reloaded UNet lost FreeU"


def test_a_setting_made_after_a_recorded_call_wins_after_load(folders):
    """Plain settings replay in their place among the recorded calls: the last word
    wins after a load, as it did on the module."""
    pipe = load(folders["wan"], policy="release")
    pipe.vae.use_slicing = True
    pipe.vae.disable_slicing()
    pipe.vae.use_slicing = True  # the user's last word

    assert pipe.vae.materialize().use_slicing is True


def test_settings_after_a_failed_setting_are_still_kept(folders):
    """A setting the module refuses (a read-only property) is not kept, and the settings
    after it are."""
    pipe = load(folders["wan"], policy="release")
    pipe.vae.materialize()
    with pytest.raises(AttributeError):
        pipe.vae.dtype = torch.float16

    pipe.vae.use_slicing = True

    assert pipe.vae.materialize().use_slicing is True


# -- the bytes a cast changes -------------------------------------------------------


def test_pipe_to_float32_between_calls_keeps_the_budget(folders):
    """Under ``budget``, ``pipe.to(torch.float32)`` doubles the components kept resident
    across calls: they go, and load again in float32 where the plan has room, never
    above the budget."""
    budget = 400_000
    pipe = load(folders["wan"], policy="budget", budget=budget, dtype=torch.bfloat16)
    held = []

    def measure(pipeline, step, timestep, tensors):
        held.append(
            sum(
                module_nbytes(loaded_module(proxy))
                for proxy in pipe.ondeck.deferred.values()
                if ondeck.is_loaded(proxy)
            )
        )
        return {}

    run(pipe, ALL_FAMILIES["wan"], callback_on_step_end=measure)
    assert max(held) <= budget
    pipe.to(torch.float32)
    held.clear()
    run(pipe, ALL_FAMILIES["wan"], callback_on_step_end=measure)

    assert max(held) <= budget, (
        f"{max(held)} bytes resident, budget {budget}; the tracker counted "
        f"{pipe.ondeck.report()['peak_resident_bytes']}"
    )


def test_attention_slicing_survives_release_and_loads_nothing(folders):
    """``pipe.enable_attention_slicing()`` probes every component with
    ``hasattr(m, "set_attention_slice")``, answered without loading, and calls
    ``unet.set_attention_slice``, recorded: the UNet a release brings back slices."""
    pipe = load(folders["sdxl"], policy="release")
    pipe.enable_attention_slicing(1)
    loaded = {name: proxy.load_count for name, proxy in pipe.ondeck.deferred.items()}
    pipe.ondeck.release_all()

    processors = {type(p).__name__ for p in pipe.unet.materialize().attn_processors.values()}
    assert processors == {"SlicedAttnProcessor"}, processors
    assert set(loaded.values()) == {0}, f"configuring loaded components: {loaded}"


def test_a_deleted_setting_is_not_set_again_at_the_next_load(folders):
    pipe = load(folders["wan"], policy="release")
    pipe.vae.ondeck_check_flag = 3
    assert pipe.vae.materialize().ondeck_check_flag == 3
    del pipe.vae.ondeck_check_flag
    pipe.ondeck.release_all()

    assert not hasattr(pipe.vae.materialize(), "ondeck_check_flag")


def test_generate_advances_its_progress_and_calls_the_callback_given(folders):
    """``generate(progress=bar, callback_on_step_end=f)``: the bar advances each step and
    ``f`` is called each step too; neither replaces the other."""
    pipe = load(folders["wan"], policy="release")
    steps, seen = 2, []

    class Bar:
        n = 0

        def update(self, count):
            self.n += count

    def callback(pipeline, step, timestep, tensors):
        seen.append(step)
        return {}

    bar = Bar()
    call = ALL_FAMILIES["wan"].call
    pipe.ondeck.generate(
        "a fox",
        height=call["height"],
        width=call["width"],
        num_frames=call["num_frames"],
        num_inference_steps=steps,
        seed=0,
        progress=bar,
        callback_on_step_end=callback,
    )
    assert (bar.n, seen) == (steps, [0, 1])
