"""ondeck.diffusers.from_pretrained: the genuine pipeline, same outputs, components on demand."""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from references import assert_close_to_plain, in_fresh_tensors

import ondeck
import ondeck.diffusers
from ondeck.errors import OndeckError

from .tiny_pipelines import FAMILIES, expected_output, run

FAMILY_NAMES = list(FAMILIES)


def load(path, **options):
    pipe = ondeck.diffusers.from_pretrained(path, **options)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def loads(pipe) -> dict[str, int]:
    return {name: proxy.load_count for name, proxy in pipe.ondeck.deferred.items()}


def resident(pipe) -> set[str]:
    return {name for name, proxy in pipe.ondeck.deferred.items() if ondeck.is_loaded(proxy)}


def plain_pipeline(folder):
    """Plain diffusers with its weights in fresh tensors (see tests/references.py)."""
    from diffusers import WanPipeline

    plain = in_fresh_tensors(WanPipeline.from_pretrained(folder))
    plain.set_progress_bar_config(disable=True)
    return plain


@pytest.mark.parametrize("policy", ["release", "budget"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_outputs_equal_diffusers_across_two_calls(family, policy, folders, references):
    pipe = load(folders[family], policy=policy)

    for call, expected in enumerate(references[family]):
        output = run(pipe, FAMILIES[family])
        assert np.array_equal(output, expected), f"{family} call {call + 1} under {policy}"
        if policy == "release":
            assert resident(pipe) == set(), "release leaves nothing resident after a call"
        else:
            assert resident(pipe) == set(pipe.ondeck.deferred), "everything fits the budget"


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_outputs_are_close_to_plain_diffusers_as_it_loads(family, folders, references):
    """Against plain diffusers' own memory-mapped weights: equal up to rounding."""
    pipe = load(folders[family], policy="release")
    assert_close_to_plain(run(pipe, FAMILIES[family]), references.plain(family), family)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_pipeline_is_the_diffusers_class_with_its_config(family, folders):
    import diffusers

    pipe = load(folders[family], policy="release")
    cls = FAMILIES[family].pipeline_type()
    plain_config = diffusers.DiffusionPipeline.load_config(folders[family])

    assert isinstance(pipe, cls)
    assert type(pipe).__name__ == cls.__name__
    assert pipe.ondeck.deferred, "heavy components are deferred"
    for name in pipe.ondeck.deferred:
        assert tuple(pipe.config[name]) == tuple(plain_config[name])
        assert isinstance(getattr(pipe, name), torch.nn.Module)
        assert ondeck.is_lazy(getattr(pipe, name))


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_reading_configs_dtypes_and_devices_loads_nothing(family, folders):
    pipe = load(folders[family], policy="release")

    pipe.components
    assert pipe.device == torch.device("cpu")
    assert pipe._execution_device == torch.device("cpu")
    assert pipe.dtype == torch.float32
    for name in pipe.ondeck.deferred:
        component = getattr(pipe, name)
        component.config
        assert component.dtype == torch.float32
        assert component.device == torch.device("cpu")
        assert not hasattr(component, "_hf_hook")
        repr(component)
    pipe.ondeck.plan()
    pipe.ondeck.schedule

    assert set(loads(pipe).values()) == {0}
    assert pipe.ondeck.tracker.bytes_loaded == 0


def test_a_release_call_leaves_the_transformer_unloaded(folders):
    pipe = load(folders["wan"], policy="release")
    run(pipe, FAMILIES["wan"])

    assert not ondeck.is_loaded(pipe.transformer)
    assert loads(pipe) == {"text_encoder": 1, "transformer": 1, "vae": 1}
    releases = [e["name"] for e in pipe.ondeck.report()["events"] if e["kind"] == "release"]
    assert releases == ["text_encoder", "transformer", "vae"], "each goes when the next starts"


def test_a_component_passed_in_is_used_as_given_and_stays_resident(folders, references):
    from diffusers import AutoencoderKLWan

    vae = in_fresh_tensors(AutoencoderKLWan.from_pretrained(folders["wan"] / "vae"))
    pipe = load(folders["wan"], policy="release", vae=vae)

    assert pipe.vae is vae
    assert "vae" not in pipe.ondeck.deferred
    for expected in references["wan"]:
        assert np.array_equal(run(pipe, FAMILIES["wan"]), expected)
    assert pipe.vae is vae
    assert vae.decoder.conv_in.weight.untyped_storage().nbytes() > 0


def test_a_transform_survives_release_and_reload(folders):
    def double_output_projection(module):
        with torch.no_grad():
            module.proj_out.weight.mul_(2.0)
        return module

    plain = plain_pipeline(folders["wan"])
    double_output_projection(plain.transformer)
    expected = run(plain, FAMILIES["wan"])

    pipe = load(folders["wan"], policy="release")
    pipe.ondeck.add_transform("transformer", double_output_projection)
    first, second = run(pipe, FAMILIES["wan"]), run(pipe, FAMILIES["wan"])

    assert np.array_equal(first, expected)
    assert np.array_equal(second, expected)
    assert pipe.transformer.load_count == 2


def test_a_transform_that_fails_its_first_load_is_not_kept(folders):
    """Given to a component not loaded yet, a transform that fails where it is first
    applied fails that call alone; one that applied once stays through a later failure."""
    pipe = load(folders["wan"], policy="release")
    expected = run(pipe, FAMILIES["wan"])

    def broken(module):
        raise RuntimeError("a broken transform")

    pipe.ondeck.add_transform("transformer", broken)
    with pytest.raises(OndeckError, match="a broken transform"):
        run(pipe, FAMILIES["wan"])
    assert np.array_equal(run(pipe, FAMILIES["wan"]), expected)  # loads without it

    calls = {"n": 0}

    def fails_on_its_second_load(module):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("out of room, once")
        return module

    pipe.ondeck.add_transform("transformer", fails_on_its_second_load)
    assert np.array_equal(run(pipe, FAMILIES["wan"]), expected)
    with pytest.raises(OndeckError, match="out of room, once"):
        run(pipe, FAMILIES["wan"])
    assert np.array_equal(run(pipe, FAMILIES["wan"]), expected)
    assert calls["n"] == 3, "applied once it stays"


@pytest.mark.parametrize("loaded", [False, True], ids=["at its load", "loaded"])
def test_a_transform_that_changes_the_module_in_place_and_returns_none_is_kept(folders, loaded):
    policy = "eager" if loaded else "release"
    pipe = load(folders["wan"], policy=policy)
    expected = run(pipe, FAMILIES["wan"])

    def silence(module):  # in place, returning nothing, as list.sort does
        with torch.no_grad():
            module.proj_out.weight.zero_()
            module.proj_out.bias.zero_()

    pipe.ondeck.add_transform("transformer", silence)
    first, second = run(pipe, FAMILIES["wan"]), run(pipe, FAMILIES["wan"])
    assert not np.array_equal(first, expected), "the change took"
    assert np.array_equal(second, first), "and stays through a reload"
    assert pipe.transformer.materialize() is not None


def test_a_transform_that_fails_in_a_load_ahead_fails_the_call(folders):
    """Under a budget the VAE is loaded ahead, on the prefetch thread, where a failing
    transform is only a warning: the call's own load meets it again and fails, rather
    than decoding with the transform silently gone; the call after runs without it."""
    sizes = load(folders["wan"], policy="release").ondeck.component_bytes()
    pipe = load(folders["wan"], device="cpu", policy="budget", budget=sum(sizes.values()) - 1)
    expected = run(pipe, FAMILIES["wan"])
    pipe.ondeck.release_all()

    def broken(module):
        raise RuntimeError("a broken transform")

    pipe.ondeck.add_transform("vae", broken)
    with pytest.raises(OndeckError, match="a broken transform"):
        run(pipe, FAMILIES["wan"])
    assert np.array_equal(run(pipe, FAMILIES["wan"]), expected)


@pytest.fixture(scope="module")
def wan_lora(folders, tmp_path_factory):
    pytest.importorskip("peft")
    from diffusers import WanPipeline, WanTransformer3DModel
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    transformer = WanTransformer3DModel.from_pretrained(folders["wan"] / "transformer")
    torch.manual_seed(5)
    transformer.add_adapter(
        LoraConfig(
            r=4,
            lora_alpha=4,
            target_modules=["to_q", "to_k", "to_v", "to_out.0"],
            init_lora_weights=False,
        )
    )
    path = tmp_path_factory.mktemp("lora")
    WanPipeline.save_lora_weights(
        path, transformer_lora_layers=get_peft_model_state_dict(transformer)
    )
    return path


def test_lora_loaded_through_the_pipeline_survives_release(folders, references, wan_lora):
    plain = plain_pipeline(folders["wan"])
    plain.load_lora_weights(wan_lora, adapter_name="style")
    expected = run(plain, FAMILIES["wan"])
    assert not np.array_equal(expected, references["wan"][0]), "the LoRA changes the output"

    pipe = load(folders["wan"], policy="release")
    pipe.load_lora_weights(wan_lora, adapter_name="style")
    assert loads(pipe)["transformer"] == 0, "loading a LoRA loads nothing"

    assert np.array_equal(run(pipe, FAMILIES["wan"]), expected)
    assert np.array_equal(run(pipe, FAMILIES["wan"]), expected)
    assert pipe.transformer.load_count == 2


def test_adapter_weights_set_through_the_pipeline_survive_release(folders, wan_lora):
    plain = plain_pipeline(folders["wan"])
    plain.load_lora_weights(wan_lora, adapter_name="style")
    plain.set_adapters(["style"], [0.5])
    expected = run(plain, FAMILIES["wan"])

    pipe = load(folders["wan"], policy="release")
    pipe.load_lora_weights(wan_lora, adapter_name="style")
    pipe.set_adapters(["style"], [0.5])
    pipe.ondeck.release_all()

    assert np.array_equal(run(pipe, FAMILIES["wan"]), expected)
    assert np.array_equal(run(pipe, FAMILIES["wan"]), expected)


def test_settings_made_through_a_component_survive_release_without_loading(folders):
    pipe = load(folders["wan"], policy="release")
    pipe.vae.enable_slicing()
    pipe.vae.use_tiling = True
    pipe.transformer.eval()
    assert set(loads(pipe).values()) == {0}

    run(pipe, FAMILIES["wan"], height=16, width=16)
    assert not ondeck.is_loaded(pipe.vae)
    assert pipe.vae.use_slicing is True
    assert pipe.vae.use_tiling is True


def test_a_budget_below_the_sum_evicts_prefetches_and_matches(folders, references):
    sizes = ondeck.plan(folders["wan"], policy="release").component_bytes
    budget = sum(sizes.values()) - min(sizes.values())
    pipe = load(folders["wan"], policy="budget", budget=budget)
    vae_load_threads = []
    pipe.vae.add_transform(
        lambda module: vae_load_threads.append(threading.current_thread().name) or module
    )

    for reference in references["wan"]:
        output = run(pipe, FAMILIES["wan"])
        assert np.array_equal(output, expected_output(pipe, "wan", folders["wan"], reference))
    tracker = pipe.ondeck.tracker
    assert tracker.peak_resident_bytes <= budget
    assert any(e.kind == "release" for e in tracker.events), "something had to go"
    assert pipe.ondeck.plan().peak_bytes <= budget
    # The VAE is loaded on the prefetch thread (during the transformer's turn) once the
    # order of turns is known, so the decoding turn does not wait for it.
    assert any(name.startswith("ondeck-prefetch") for name in vae_load_threads), vae_load_threads


def test_encoders_used_again_stay_until_their_last_use(folders, references):
    """SD3 encodes the prompt and then the negative prompt with all three encoders."""
    pipe = load(folders["sd3"], policy="release")
    run(pipe, FAMILIES["sd3"])
    after_first = loads(pipe)
    second = run(pipe, FAMILIES["sd3"])

    assert np.array_equal(second, references["sd3"][1])
    assert {
        name: count - after_first[name] for name, count in loads(pipe).items()
    } == dict.fromkeys(pipe.ondeck.deferred, 1), (
        "after the first call, each component loads once per call"
    )
    released_after_encoding = set(pipe.ondeck.schedule["text_encoder_3"])
    assert released_after_encoding == {"text_encoder", "text_encoder_2", "text_encoder_3"}


def noise_drawn_with(pipe, monkeypatch) -> list[set[str]]:
    """What is resident each time SD3 draws its noise (on the host, between its encoders
    and its loop), one entry per call."""
    from diffusers import StableDiffusion3Pipeline

    seen: list[set[str]] = []
    original = StableDiffusion3Pipeline.prepare_latents

    def prepare_latents(self, *args, **kwargs):
        if self is pipe:  # not a plain pipeline's call
            seen.append(resident(pipe))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(StableDiffusion3Pipeline, "prepare_latents", prepare_latents)
    return seen


def test_the_next_turn_starts_when_the_turn_before_made_its_last_call(
    folders, references, monkeypatch
):
    """Once a call has shown how often each encoder is called, the transformer's turn
    starts as the last encoder call returns: loaded before the pipeline draws its noise
    (which waits for the device), the encoders already gone."""
    pipe = load(folders["sd3"], policy="release")
    seen = noise_drawn_with(pipe, monkeypatch)
    counts = []
    for call in range(3):
        before = loads(pipe)
        output = run(pipe, FAMILIES["sd3"])
        counts.append({name: n - before[name] for name, n in loads(pipe).items()})
        assert np.array_equal(output, references["sd3"][min(call, 1)]), f"call {call + 1}"
    assert "transformer" not in seen[0]
    assert seen[1] == seen[2] == {"transformer"}
    assert counts[1] == counts[2] == dict.fromkeys(pipe.ondeck.deferred, 1)


def test_a_turn_used_between_its_calls_still_ends_with_its_last_call(folders, references):
    """Wan enters the transformer's ``cache_context`` before each call: uses between calls
    leave the turn to end with the last call, so the VAE is in by the last step's
    scheduler update."""
    pipe = load(folders["wan"], policy="release")
    seen: list[set[str]] = []
    step = pipe.scheduler.step

    def stepping(*args, **kwargs):
        seen.append(resident(pipe))
        return step(*args, **kwargs)

    pipe.scheduler.step = stepping
    outputs, last = [], []
    for _ in range(2):
        seen.clear()
        outputs.append(run(pipe, FAMILIES["wan"]))
        last.append(seen[-1])
    assert "vae" not in last[0], "the first call learns: its turns start at first touch"
    assert last[1] == {"vae"}, "the last call returned: the decode's turn has begun"
    assert all(np.array_equal(o, e) for o, e in zip(outputs, references["wan"], strict=True))


def test_a_call_unlike_the_last_ends_no_turn_early(folders, monkeypatch):
    """Guidance switched on calls each encoder twice where the last call called it once,
    and more steps call the transformer more often: a call whose settings differ from the
    last one's starts each turn at its first touch, so nothing loads twice, and the next
    call of its kind ends its turns early again."""
    from diffusers import StableDiffusion3Pipeline

    plain = in_fresh_tensors(StableDiffusion3Pipeline.from_pretrained(folders["sd3"]))
    plain.set_progress_bar_config(disable=True)
    settings = [
        dict(guidance_scale=1.0),
        dict(guidance_scale=1.0),
        dict(guidance_scale=5.0),
        dict(guidance_scale=5.0),
        dict(guidance_scale=5.0, num_inference_steps=3),
    ]
    pipe = load(folders["sd3"], policy="release")
    seen = noise_drawn_with(pipe, monkeypatch)
    for call, setting in enumerate(settings):
        before = loads(pipe)
        output = run(pipe, FAMILIES["sd3"], **setting)
        assert np.array_equal(output, run(plain, FAMILIES["sd3"], **setting)), f"call {call + 1}"
        counts = {name: n - before[name] for name, n in loads(pipe).items()}
        # (A call with guidance after one without loads the CLIP encoders twice: the
        # turns it learned from did not hold them for the negative prompt.)
        assert counts["text_encoder_3"] == counts["transformer"] == counts["vae"] == 1, (
            f"call {call + 1}: {counts}"
        )
    assert [("transformer" in resident) for resident in seen] == [False, True, False, True, False]


def test_a_turn_the_last_call_did_not_reach_is_not_started_early(folders):
    """Calls returning latents never touch the VAE: the transformer's last call starts
    no decode's turn for them."""
    pipe = load(folders["sd3"], policy="release")
    run(pipe, FAMILIES["sd3"])
    for _ in range(2):
        run(pipe, FAMILIES["sd3"], output_type="latent")
    assert loads(pipe)["vae"] == 1


def test_plan_report_and_policy_reason(folders):
    pipe = load(folders["wan"], policy="release")
    plan = pipe.ondeck.plan()
    run(pipe, FAMILIES["wan"])
    report = pipe.ondeck.report()

    assert [stage for stage, _, _ in plan.stages] == ["text_encoder", "transformer", "vae"]
    assert plan.peak_bytes == max(plan.component_bytes.values())
    assert report["pipeline"] == "WanPipeline"
    assert report["peak_resident_bytes"] == plan.peak_bytes
    assert pipe.ondeck.policy.name == "release"
    assert "release" in pipe.ondeck.policy.reason
    assert pipe.ondeck.plan(budget="1GiB").policy == "budget"


def test_eager_loads_everything_up_front_and_matches(folders, references):
    pipe = load(folders["wan"], policy="eager")
    assert resident(pipe) == set(pipe.ondeck.deferred)

    for expected in references["wan"]:
        assert np.array_equal(run(pipe, FAMILIES["wan"]), expected)
    assert set(loads(pipe).values()) == {1}


def test_auto_names_the_policy_it_chose_and_matches_diffusers(folders, references):
    pipe = load(folders["wan"])

    policy = pipe.ondeck.policy
    assert policy.reason.startswith(f"auto chose '{policy.name}'"), policy.reason
    assert np.array_equal(run(pipe, FAMILIES["wan"]), references["wan"][0])


def test_generate_seeds_on_the_cpu_and_returns_frames(folders, references):
    pipe = load(folders["wan"], policy="release")
    call = FAMILIES["wan"].call
    frames = pipe.ondeck.generate(
        call["prompt"],
        height=call["height"],
        width=call["width"],
        num_frames=call["num_frames"],
        num_inference_steps=call["num_inference_steps"],
        guidance_scale=call["guidance_scale"],
        negative_prompt=call["negative_prompt"],
        seed=0,
        max_sequence_length=call["max_sequence_length"],
    )
    assert np.array_equal(frames, references["wan"][0])


def test_generate_returns_images_as_one_frame_videos(folders, references):
    pipe = load(folders["flux"], policy="release")
    call = FAMILIES["flux"].call
    frames = pipe.ondeck.generate(
        call["prompt"],
        height=call["height"],
        width=call["width"],
        num_frames=33,
        num_inference_steps=call["num_inference_steps"],
        guidance_scale=call["guidance_scale"],
        seed=0,
        max_sequence_length=call["max_sequence_length"],
        negative_prompt="",
    )
    assert np.array_equal(frames, references["flux"][0][:, None])


def test_progress_advances_once_per_step(folders):
    class Bar:
        count = 0

        def update(self, n):
            self.count += n

    pipe = load(folders["wan"], policy="release")
    bar = Bar()
    pipe.ondeck.generate(
        "a fox", height=16, width=16, num_frames=5, num_inference_steps=3, seed=0, progress=bar
    )
    assert bar.count == 3


def test_folders_of_other_families_plan_and_generate_through_the_integration(folders):
    from ondeck.folder_pipelines import pipeline_for_folder
    from ondeck.integrations.diffusers import DiffusersRuntime

    runtime = pipeline_for_folder(folders["ltx"], policy="release")
    plan = ondeck.plan(folders["ltx"], policy="release")

    assert isinstance(runtime, DiffusersRuntime)
    assert [stage for stage, _, _ in plan.stages] == ["text_encoder", "transformer", "vae"]
    assert set(loads(runtime.pipe).values()) == {0}, (
        "the VAE's compression ratio came from its config"
    )
    frames = runtime.generate(
        "a fox", height=32, width=32, num_frames=9, num_inference_steps=1, seed=0
    )
    assert frames.shape == (1, 9, 32, 32, 3)


def test_pipe_to_redirects_future_loads_without_loading(folders):
    pipe = load(folders["wan"], policy="release")
    pipe.to("cpu")
    pipe.to(torch.bfloat16)

    assert set(loads(pipe).values()) == {0}
    assert pipe.transformer.dtype == torch.bfloat16
    assert pipe.transformer.materialize().proj_out.weight.dtype == torch.bfloat16


def test_a_failed_call_releases_everything_and_the_next_call_works(folders, references):
    def fail(pipe, step, timestep, tensors):
        raise RuntimeError("stop")

    pipe = load(folders["wan"], policy="budget")
    with pytest.raises(RuntimeError, match="stop"):
        run(pipe, FAMILIES["wan"], callback_on_step_end=fail)

    assert resident(pipe) == set()
    assert np.array_equal(run(pipe, FAMILIES["wan"]), references["wan"][0])


@pytest.mark.parametrize("policy", ["eager", "budget"])
@pytest.mark.parametrize(
    "wrong", [{"num_inference_step": 2}, {"height": 15}], ids=["misspelt", "refused"]
)
def test_a_call_refused_before_it_uses_a_component_keeps_what_is_loaded(
    folders, references, policy, wrong
):
    pipe = load(folders["wan"], policy=policy)
    assert np.array_equal(run(pipe, FAMILIES["wan"]), references["wan"][0])
    kept, before = resident(pipe), loads(pipe)
    assert kept, "the policy keeps components between calls"

    with pytest.raises((TypeError, ValueError)):
        run(pipe, FAMILIES["wan"], **wrong)

    assert resident(pipe) == kept
    assert np.array_equal(run(pipe, FAMILIES["wan"]), references["wan"][1])
    assert loads(pipe) == before, "nothing loaded again"


def test_offload_hooks_are_refused_with_a_reason(folders):
    pipe = load(folders["wan"], policy="release")
    with pytest.raises(
        OndeckError, match=r"freed by its ondeck policy \(it runs under 'release'\); offload"
    ):
        pipe.enable_model_cpu_offload()


def test_importing_ondeck_does_not_import_diffusers():
    code = "import sys, ondeck; assert 'diffusers' not in sys.modules, 'diffusers imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_replacing_a_component_stops_deferring_it(folders, references):
    from diffusers import AutoencoderKLWan

    pipe = load(folders["wan"], policy="release")
    vae = in_fresh_tensors(AutoencoderKLWan.from_pretrained(folders["wan"] / "vae"))
    pipe.vae = vae

    assert "vae" not in pipe.ondeck.deferred
    assert tuple(pipe.config["vae"]) == ("diffusers", "AutoencoderKLWan")
    assert np.array_equal(run(pipe, FAMILIES["wan"]), references["wan"][0])
    assert pipe.vae is vae


def test_released_modules_leave_no_reference_behind(folders, wan_lora):
    import gc
    import weakref

    pipe = load(folders["wan"], policy="release")
    pipe.load_lora_weights(wan_lora, adapter_name="style")
    pipe.vae.enable_slicing()
    seen = []

    def capture(pipeline, step, timestep, tensors):
        seen.append(weakref.ref(pipeline.transformer.materialize()))
        return {}

    run(pipe, FAMILIES["wan"], callback_on_step_end=capture)
    seen.append(weakref.ref(pipe.vae.materialize()))
    pipe.ondeck.release_all()
    gc.collect()

    assert seen and all(ref() is None for ref in seen)


def test_compile_survives_release(folders, references):
    pipe = load(folders["wan"], policy="release")
    pipe.transformer.compile(backend="eager")
    assert pipe.transformer.load_count == 0, "recorded, not applied to a loaded module"

    for expected in references["wan"]:
        assert np.array_equal(run(pipe, FAMILIES["wan"]), expected)
    assert pipe.transformer.materialize()._compiled_call_impl is not None
    assert pipe.transformer.load_count == 3


def test_a_budget_too_small_for_one_component_fails_before_loading(folders):
    pipe = load(folders["wan"], policy="budget", budget=1000)

    with pytest.raises(ondeck.BudgetError):
        run(pipe, FAMILIES["wan"])
    assert set(loads(pipe).values()) == {0}


def test_a_call_stopped_by_its_callback_teaches_no_turn_ends(folders):
    """A callback that sets the pipeline's ``_interrupt`` stops the loop after one of its
    two transformer calls: the next full call ends the transformer's turn after its last
    call, not after one, so under a budget that holds one of the transformer and the VAE
    it loads each component once and never holds the two together."""

    def go_on(pipe, step, timestep, values):
        return values

    def stop(pipe, step, timestep, values):
        pipe._interrupt = True
        return values

    sizes = load(folders["wan"], policy="release").ondeck.component_bytes()
    budget = max(sizes.values()) + 1024
    assert sizes["transformer"] + sizes["vae"] > budget
    pipe = load(folders["wan"], device="cpu", policy="budget", budget=budget)
    first = run(pipe, FAMILIES["wan"], callback_on_step_end=go_on)  # calls alike but for
    run(pipe, FAMILIES["wan"], callback_on_step_end=stop)  # what their callbacks do
    before, seen = loads(pipe), len(pipe.ondeck.tracker.events)
    assert np.array_equal(run(pipe, FAMILIES["wan"], callback_on_step_end=go_on), first)
    counts = {name: n - before[name] for name, n in loads(pipe).items()}
    assert counts == dict.fromkeys(pipe.ondeck.deferred, 1), counts
    held = [event.resident_bytes for event in pipe.ondeck.tracker.events[seen:]]
    assert max(held) <= budget


def test_budget_loads_no_vae_ahead_for_calls_returning_latents(folders):
    """Under a budget that holds the encoder and the transformer but not the VAE beside
    them, calls returning latents load the VAE ahead only until a call has shown they do
    not decode: the later ones keep the rest and load nothing."""
    sizes = load(folders["wan"], policy="release").ondeck.component_bytes()
    budget = sum(sizes.values()) - 1
    pipe = load(folders["wan"], device="cpu", policy="budget", budget=budget)
    counts = []
    for _ in range(3):
        before = loads(pipe)
        run(pipe, FAMILIES["wan"], output_type="latent")
        counts.append({name: n - before[name] for name, n in loads(pipe).items()})
    assert counts[2] == dict.fromkeys(pipe.ondeck.deferred, 0), counts
    assert sum(count["vae"] for count in counts) <= 1, counts


def test_a_recorded_call_failing_in_a_load_ahead_fails_the_call(folders):
    """A call recorded on an unloaded VAE that fails when it is applied: the prefetch
    that loads the VAE ahead meets it first, and the call fails naming it, rather than
    decoding with a VAE loaded again without it. The call after loads without it."""
    sizes = load(folders["wan"], policy="release").ondeck.component_bytes()
    pipe = load(folders["wan"], device="cpu", policy="budget", budget=sum(sizes.values()) - 1)
    expected = run(pipe, FAMILIES["wan"])
    pipe.ondeck.release_all()
    pipe.vae.enable_tiling(no_such_setting=1)
    with pytest.raises(OndeckError, match="no_such_setting"):
        run(pipe, FAMILIES["wan"])
    assert np.array_equal(run(pipe, FAMILIES["wan"]), expected)
