"""The VAE's decode on the diffusers path: whole frames where they fit, diffusers' own
tiles where they do not, and a decode that runs out of memory recovers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ondeck.diffusers
from ondeck.errors import BudgetError
from ondeck.integrations.diffusers import DiffusersRuntime
from ondeck.policy import BudgetPolicy

from .breadth_pipelines import ALL_FAMILIES
from .tiny_pipelines import plain_tiled, run

# Families whose tiny frames leave room for two latent pixels a tile or more.
TILING_FAMILIES = ["wan", "ltx", "flux", "sd3"]


def load(path, policy="release", budget=None):
    pipe = ondeck.diffusers.from_pretrained(
        path, device="cpu", policy=policy, budget=budget, progress=False
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("family", TILING_FAMILIES)
def test_a_decode_without_room_tiles_as_diffusers_tiles(family, folders, monkeypatch):
    monkeypatch.setattr(DiffusersRuntime, "activation_room", lambda self: 1)
    pipe = load(folders[family])
    output = run(pipe, ALL_FAMILIES[family])
    tiles = pipe.ondeck.decoders["vae"].last_tiles
    assert tiles is not None and tiles.count > 1, "one byte of room: the decode tiles"
    assert np.array_equal(output, plain_tiled(family, folders[family], tiles))


@pytest.mark.parametrize("family", ["wan", "flux"])
def test_a_decode_with_room_decodes_whole_frames(family, folders, references):
    pipe = load(folders[family])
    assert np.array_equal(run(pipe, ALL_FAMILIES[family]), references[family][0])
    assert pipe.ondeck.decoders["vae"].last_tiles is None


def _running_out(times: int | None):
    """A transform making the VAE's whole-frame decode run out of memory ``times``
    times (None: always); tiled decodes run."""
    count = {"raised": 0}

    def transform(vae):
        decode = vae.decode

        def failing(*args, **kwargs):
            whole = not getattr(vae, "use_tiling", False)
            if whole and (times is None or count["raised"] < times):
                count["raised"] += 1
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            return decode(*args, **kwargs)

        vae.decode = failing
        return vae

    return transform, count


@pytest.mark.parametrize("family", list(ALL_FAMILIES))
def test_running_out_once_frees_what_the_policy_kept_and_decodes_whole(
    family, folders, references, monkeypatch
):
    if family == "allegro":
        pytest.skip("AutoencoderKLAllegro has no whole-frame decode: it always tiles")
    pipe = load(folders[family], "budget")
    if "vae" not in pipe.ondeck.decoders:
        pytest.skip(f"{family}: its decoder is not a component named 'vae'")
    made_room = []
    original = DiffusersRuntime.make_room
    monkeypatch.setattr(
        DiffusersRuntime,
        "make_room",
        lambda self, keep=(): made_room.append(1) or original(self, keep),
    )
    transform, count = _running_out(1)
    pipe.ondeck.add_transform("vae", transform)
    assert np.array_equal(run(pipe, ALL_FAMILIES[family]), references[family][0])
    assert count["raised"] == 1 and made_room, "room was made before the retry"
    decoder = pipe.ondeck.decoders["vae"]
    assert decoder.last_tiles is None and decoder.last_retries == 1


@pytest.mark.parametrize("family", ["wan", "flux"])
def test_running_out_every_time_whole_decodes_in_diffusers_tiles(family, folders):
    pipe = load(folders[family])
    transform, count = _running_out(None)
    pipe.ondeck.add_transform("vae", transform)
    output = run(pipe, ALL_FAMILIES[family])
    tiles = pipe.ondeck.decoders["vae"].last_tiles
    assert count["raised"] >= 1 and tiles is not None
    assert np.array_equal(output, plain_tiled(family, folders[family], tiles))


def test_a_vae_that_cannot_tile_is_refused_before_it_loads(folders, monkeypatch):
    from ondeck.integrations.diffusers import decode

    pipe = ondeck.diffusers.from_pretrained(
        folders["flux"], device="cpu", policy="budget", budget="1GiB", prefetch=False
    )
    pipe.set_progress_bar_config(disable=True)
    monkeypatch.setattr(decode, "tiling_style", lambda cls: None)
    decoder = pipe.ondeck.decoders["vae"] = decode.FittingDecode(
        pipe.ondeck.deferred["vae"], pipe.ondeck, "vae"
    )
    decoder.bytes_per_element = 2.0**40  # as measured: whole frames cannot fit
    with pytest.raises(BudgetError, match="vae"):
        run(pipe, ALL_FAMILIES["flux"])
    assert not ondeck.is_loaded(pipe.ondeck.deferred["vae"])


def test_the_decode_need_is_in_the_plan_before_the_first_call(folders):
    pipe = load(folders["wan"], "budget", budget="1GiB")
    runtime = pipe.ondeck
    assert "vae" not in runtime.snapshot().measured_activation, "no call, no frame size"
    runtime._call_arguments = {"height": 32, "width": 32, "num_frames": 5}
    need = runtime.snapshot().measured_activation["vae"]
    assert need == runtime.decoders["vae"].expected_need(runtime._call_arguments) > 0
    bigger = runtime.decoders["vae"].expected_need({"height": 64, "width": 64, "num_frames": 5})
    assert bigger == 4 * need, "the need grows with the frame's area"


def test_a_vae_that_decodes_in_chunks_of_frames_is_counted_a_chunk_at_a_time(folders):
    """HunyuanVideo's VAE decodes 16 frames and the one overlapping the next chunk at
    once, whole or tiled; Wan's a latent frame (four frames) at a time. A first decode's
    estimate counts what each holds: counted as Wan's, HunyuanVideo's 33 frames would
    be a quarter of their need and run out of memory before it tiled."""
    sizes = {"height": 32, "width": 32}
    chunked = load(folders["hunyuan_video"], "budget", budget="1GiB").ondeck.decoders["vae"]
    framewise = load(folders["wan"], "budget", budget="1GiB").ondeck.decoders["vae"]
    assert (chunked.in_flight, framewise.in_flight) == (17, 4)
    short, long = (chunked.expected_need({**sizes, "num_frames": n}) for n in (5, 33))
    assert long == short * 17 // 5, "up to a chunk, the need grows with the frames"
    assert chunked.expected_need({**sizes, "num_frames": 65}) == long, "a chunk at most"
    five, many = (framewise.expected_need({**sizes, "num_frames": n}) for n in (5, 33))
    assert five == many, "a frame-by-frame VAE holds four frames however long the video"


def test_entering_a_cache_context_does_not_wait_for_a_pipelined_load(folders, monkeypatch):
    from ondeck.integrations.diffusers import PipelineComponent

    pipe = load(folders["wan"])
    asked = []
    original = PipelineComponent.materialize

    def materialize(self, *, complete=True):
        asked.append(complete)
        return original(self, complete=complete)

    monkeypatch.setattr(PipelineComponent, "materialize", materialize)
    with pipe.transformer.cache_context("cond"):
        pass
    assert asked == [False]


def test_a_call_keeps_only_the_numbers_that_size_its_decode(folders):
    import weakref

    pipe = load(folders["wan"])
    embeds = torch.zeros(1, 16, 32)
    watched = weakref.ref(embeds)
    arguments = dict(ALL_FAMILIES["wan"].call)
    arguments.pop("prompt")
    arguments.pop("negative_prompt", None)
    pipe(
        prompt_embeds=embeds,
        negative_prompt_embeds=torch.zeros(1, 16, 32),
        generator=torch.Generator().manual_seed(0),
        **{k: v for k, v in arguments.items() if k != "max_sequence_length"},
    )
    assert pipe.ondeck._call_arguments == {"height": 32, "width": 32, "num_frames": 5}
    del embeds
    assert watched() is None, "the runtime holds no tensor of the call"


def test_a_measured_need_is_counted_as_the_call_that_follows_counts_it(folders):
    """The pixels a decode is measured over are those the next call's need is worked out
    from: a measured whole-frame need comes back for the same frame size."""
    pipe = load(folders["wan"])
    run(pipe, ALL_FAMILIES["wan"])  # 32x32, 5 frames
    decoder = pipe.ondeck.decoders["vae"]
    decoder.measured(123_456)
    arguments = {"height": 32, "width": 32, "num_frames": 5}
    assert decoder.expected_need(arguments) == 123_456


def test_a_tiled_measurement_beside_a_load_keeps_the_need_within_what_it_bounds(
    folders, monkeypatch
):
    """Weights that arrived beside a decode (the next call's first components, loaded
    ahead) are counted as weights whole, though they may have come after its peak: the
    need lies between the measurement and that plus their bytes. The need the decode was
    sized by stands where it lies within; outside, the nearer bound replaces it."""
    monkeypatch.setattr(DiffusersRuntime, "activation_room", lambda self: 1)
    pipe = load(folders["wan"])
    run(pipe, ALL_FAMILIES["wan"])
    decoder = pipe.ondeck.decoders["vae"]
    tiles, need = decoder.last_tiles, decoder.last_need
    assert tiles is not None and need > 0
    decoder.loaded_beside_bytes = 0
    assert decoder.whole_activations(1) < need, "a tile's few bytes measured alone are believed"
    decoder.loaded_beside_bytes = need  # whole frames: up to need / area more
    assert decoder.whole_activations(1) == need
    assert decoder.whole_activations(10 * need) > need, "a measurement above it raises it"
    decoder.loaded_beside_bytes = 1  # the need is above what the measurement bounds
    assert decoder.whole_activations(1) == int(2 / tiles.area) < need


@pytest.mark.parametrize("leaves", [False, True])
def test_a_decode_counts_the_bytes_of_other_components_that_arrived_beside_it(
    folders, monkeypatch, leaves
):
    """Another turn's component loaded while the VAE decodes (and released again before
    the turn ends, where ``leaves``) counts its bytes beside the decode; none, none."""
    from ondeck.integrations.diffusers.decode import FittingDecode

    pipe = load(folders["wan"])
    decode, beside = FittingDecode._decode, []

    def with_a_load_beside(self, *args, **kwargs):
        if beside:
            with pipe.ondeck._deciding():  # a load of the policy's, not a touch
                pipe.text_encoder.materialize()
                if leaves:
                    pipe.ondeck.executor.release(["text_encoder"])
        return decode(self, *args, **kwargs)

    monkeypatch.setattr(FittingDecode, "_decode", with_a_load_beside)
    run(pipe, ALL_FAMILIES["wan"])
    decoder = pipe.ondeck.decoders["vae"]
    assert decoder.decoded and decoder.loaded_beside_bytes == 0, "nothing loaded beside it"
    beside.append(True)
    run(pipe, ALL_FAMILIES["wan"])
    assert decoder.loaded_beside_bytes == pipe.ondeck.component_bytes()["text_encoder"]


def test_a_vae_turn_that_only_encodes_is_not_counted_as_a_decode(folders, monkeypatch):
    """Image to video: the VAE's own turn encodes the image, and the decode comes in a
    later turn that holds the VAE. What the encoding turn measured is its own, not a
    decode's: the decode does not scale it to whole frames and size itself by it."""
    import dataclasses

    pipe = load(folders["wan_i2v"])
    runtime = pipe.ondeck
    measured = runtime._stage_measured
    monkeypatch.setattr(
        runtime,
        "_stage_measured",
        lambda index, record: measured(index, dataclasses.replace(record, activation_bytes=1000)),
    )
    run(pipe, ALL_FAMILIES["wan_i2v"])  # learns the turns: its own decoded in the VAE's
    assert dict(runtime._turns)["transformer"] == ("transformer", "vae"), "it decodes there"
    decoder = runtime.decoders["vae"]
    decoder.bytes_per_element = None
    run(pipe, ALL_FAMILIES["wan_i2v"])
    assert decoder.bytes_per_element is None, "no decode measured in the turn"
    # Nor does the peak stored for the VAE's turn, an encode's, size a decode.
    assert runtime.activation_profile()[0]["vae"] == 1000
    assert decoder.last_need > 1000


def test_each_turn_is_measured_from_the_weights_its_step_left(folders):
    """A turn's activations are measured from once its step released the last turn's
    components and loaded its own ahead (``compute_started``): counted as weights, the
    released ones would hide as much of the turn's peak (a decode after a 5 GiB streamed
    transformer measured 42 MB). Under a budget each turn's step releases the last."""
    pipe = load(folders["wan"], "budget", budget="400KiB")
    tracker, seen = pipe.ondeck.tracker, []
    started = tracker.compute_started

    def noting():
        seen.append(
            (pipe.ondeck.stages[pipe.ondeck._current_index].name, set(pipe.ondeck.resident()))
        )
        started()

    tracker.compute_started = noting
    run(pipe, ALL_FAMILIES["wan"])
    turns = [name for name, _ in seen]
    assert turns == pipe.ondeck.order, "each turn's compute starts once"
    for (name, resident), earlier in zip(seen[1:], turns, strict=False):
        assert earlier not in resident, f"{earlier} is released before {name} computes"


def test_what_running_out_proved_is_not_forgotten_by_a_later_measurement(folders, monkeypatch):
    """A decode that ran out of memory in a room proved whole frames need more than that
    room; a later tiled decode's measurement, which understates whole frames, must not
    bring the next call back to the tiles that ran out."""
    room = 10**6
    monkeypatch.setattr(DiffusersRuntime, "activation_room", lambda self: room)
    pipe = load(folders["wan"])
    transform, count = _running_out(1)
    pipe.ondeck.add_transform("vae", transform)
    run(pipe, ALL_FAMILIES["wan"])
    decoder = pipe.ondeck.decoders["vae"]
    assert count["raised"] == 1
    proven = decoder.bytes_per_element
    assert proven and proven * decoder.last_elements > room
    decoder.measured(1)  # a measurement far below what running out proved
    arguments = {"height": 32, "width": 32, "num_frames": 5}
    assert decoder.expected_need(arguments) >= int(proven * decoder.last_elements)
    # Nor does what a later run stores for later processes (its decode did not retry).
    decoder.last_retries = 0
    assert decoder.whole_activations(1) >= int(proven * decoder.last_elements)


def test_a_batch_that_does_not_fit_at_once_decodes_an_image_at_a_time(folders, monkeypatch):
    from references import in_fresh_tensors

    family = ALL_FAMILIES["flux"]
    pipe = load(folders["flux"], "budget")  # the VAE stays: its settings can be read
    decoder = pipe.ondeck.decoders["vae"]
    arguments = {**family.call, "num_images_per_prompt": 2}
    need = decoder.expected_need(arguments)
    # Room for one image's decode, not for both at once.
    monkeypatch.setattr(DiffusersRuntime, "activation_room", lambda self: need * 3 // 4)
    output = run(pipe, family, num_images_per_prompt=2)
    assert decoder.last_slices == 2 and decoder.last_tiles is None
    plain = family.pipeline_type().from_pretrained(folders["flux"])
    plain.set_progress_bar_config(disable=True)
    in_fresh_tensors(plain)
    plain.vae.enable_slicing()
    assert np.array_equal(output, run(plain, family, num_images_per_prompt=2))
    assert not pipe.vae.use_slicing, "the VAE's own setting is put back"

    monkeypatch.setattr(DiffusersRuntime, "activation_room", lambda self: need * 2)
    run(pipe, family, num_images_per_prompt=2)
    assert decoder.last_slices == 1, "a batch that fits decodes at once"


@pytest.mark.parametrize("family", ["wan", "flux"])
@pytest.mark.parametrize("retries", [1, 3])
def test_a_decode_that_fitted_only_by_the_allocator_retrying_tiles_the_next_time(
    family, retries, folders, references, monkeypatch
):
    """Whole frames that fitted their room only by the allocator giving back its cache
    and retrying again and again (slow on a large card) took all the room: the next
    call of that size decodes in diffusers' own tiles, within its room, freeing nothing
    the policy keeps. One retry is not crowding."""
    from itertools import chain, repeat

    from ondeck.integrations.diffusers import decode

    pipe = load(folders[family])
    decoder = pipe.ondeck.decoders["vae"]
    room = 2 * decoder.expected_need(ALL_FAMILIES[family].call)
    monkeypatch.setattr(DiffusersRuntime, "activation_room", lambda self: room)
    counts = chain([0, retries], repeat(retries))  # the first decode's before and after
    monkeypatch.setattr(decode, "allocator_counts", lambda device: (next(counts), 0))
    assert np.array_equal(run(pipe, ALL_FAMILIES[family]), references[family][0])
    assert decoder.last_tiles is None, "whole frames fitted, as far as the room says"
    made_room = []
    original = DiffusersRuntime.make_room
    monkeypatch.setattr(
        DiffusersRuntime,
        "make_room",
        lambda self, keep=(): made_room.append(1) or original(self, keep),
    )
    second = run(pipe, ALL_FAMILIES[family])
    tiles = decoder.last_tiles
    if retries < decode.CROWDED_RETRIES:
        assert tiles is None
        assert np.array_equal(second, references[family][1])
        return
    assert tiles is not None and tiles.count > 1
    assert made_room == [], "what the policy keeps stays; the decode tiles instead"
    assert np.array_equal(second, plain_tiled(family, folders[family], tiles))


def _crowded(pipe, family, monkeypatch):
    """A first decode that fitted its room only by the allocator retrying: the decoder
    counts as crowded. Returns the decoder and the room its decodes are told of."""
    from itertools import chain, repeat

    from ondeck.integrations.diffusers import decode

    decoder = pipe.ondeck.decoders["vae"]
    room = 2 * decoder.expected_need(ALL_FAMILIES[family].call)
    monkeypatch.setattr(DiffusersRuntime, "activation_room", lambda self: room)
    counts = chain([0, decode.CROWDED_RETRIES], repeat(decode.CROWDED_RETRIES))
    monkeypatch.setattr(decode, "allocator_counts", lambda device: (next(counts), 0))
    run(pipe, ALL_FAMILIES[family])
    assert decoder.crowded
    return decoder


@pytest.mark.parametrize(("reload_seconds", "frees"), [(1e-9, True), (1e9, False)])
def test_a_crowded_decode_frees_what_is_kept_where_its_tiles_cost_more_than_a_reload(
    reload_seconds, frees, folders, monkeypatch
):
    """The tiles within the room cover more frame area than whole frames in the room a
    release would make: at the seconds per area decodes took, that costs more or less
    than loading the freed components again. The cheaper is done."""
    pipe = load(folders["wan"], policy=BudgetPolicy(2**40))
    decoder = _crowded(pipe, "wan", monkeypatch)
    decoder.seconds_per_pixel = 1e-3
    decoder._timing = None
    monkeypatch.setattr(
        DiffusersRuntime, "room_to_make", lambda self, keep=(): (2**40, reload_seconds)
    )
    made_room = []
    original = DiffusersRuntime.make_room
    monkeypatch.setattr(
        DiffusersRuntime,
        "make_room",
        lambda self, keep=(): made_room.append(1) or original(self, keep),
    )
    run(pipe, ALL_FAMILIES["wan"])
    assert made_room == ([1] if frees else [])


def test_without_a_timed_decode_or_a_known_reload_a_crowded_decode_tiles_within(
    folders, monkeypatch
):
    pipe = load(folders["wan"], policy=BudgetPolicy(2**40))
    decoder = _crowded(pipe, "wan", monkeypatch)
    assert decoder._seconds_per_pixel() is None, "a crowded decode's time is not kept"
    monkeypatch.setattr(DiffusersRuntime, "room_to_make", lambda self, keep=(): (2**40, 0.0))
    made_room = []
    monkeypatch.setattr(DiffusersRuntime, "make_room", lambda self, keep=(): made_room.append(1))
    run(pipe, ALL_FAMILIES["wan"])
    assert made_room == []
    assert decoder.last_tiles is not None


def test_tiles_that_are_crowded_all_the_same_do_not_tile_finer_run_after_run(folders, monkeypatch):
    """Each decode makes the allocator retry: the first, in whole frames, raises the
    need and the second tiles; the second, in finer tiles, was crowded by something
    other than its size, so the third tiles as the second did."""
    from ondeck.integrations.diffusers import decode

    pipe = load(folders["wan"])
    decoder = pipe.ondeck.decoders["vae"]
    room = 2 * decoder.expected_need(ALL_FAMILIES["wan"].call)
    monkeypatch.setattr(DiffusersRuntime, "activation_room", lambda self: room)
    calls = []  # each decode reads the counts before and after: every one retried

    def counts(device):
        calls.append(1)
        return (len(calls) // 2 * decode.CROWDED_RETRIES, 0)

    monkeypatch.setattr(decode, "allocator_counts", counts)
    run(pipe, ALL_FAMILIES["wan"])
    assert decoder.crowded and decoder.last_tiles is None
    run(pipe, ALL_FAMILIES["wan"])
    second, need = decoder.last_tiles, decoder.bytes_per_element
    assert second is not None and second.count > 1
    run(pipe, ALL_FAMILIES["wan"])
    assert decoder.last_retries == 0 and len(calls) == 6, "each decode was crowded"
    assert decoder.last_tiles == second
    assert decoder.bytes_per_element == need


def test_a_crowded_decode_of_another_size_raises_the_need_again(folders):
    """Finer tiles than a crowded decode's are compared at the same size only: a
    decode of another size, crowded in smaller tiles, still raises its need."""
    from ondeck.integrations.diffusers import decode
    from ondeck.tiles import Tiles

    decoder = load(folders["wan"]).ondeck.decoders["vae"]
    crowded = (0, 0), (decode.CROWDED_RETRIES, 0)
    assert decoder._crowded(*crowded, None, 1 << 30, 1000)  # whole frames, 1000 elements
    raised = decoder.bytes_per_element
    quarter = Tiles(16, 16, 16, 16, 4, 0.25)
    assert decoder._crowded(*crowded, quarter, 1 << 30, 1000)
    assert decoder.bytes_per_element == raised, "the same size in finer tiles"
    assert decoder._crowded(*crowded, quarter, 1 << 30, 500)
    assert decoder.bytes_per_element > raised, "another size"


def test_a_decode_that_fitted_without_retries_is_timed_per_pixel(folders):
    pipe = load(folders["wan"])
    decoder = pipe.ondeck.decoders["vae"]
    assert decoder._seconds_per_pixel() is None
    run(pipe, ALL_FAMILIES["wan"])
    assert decoder.last_tiles is None and decoder._seconds_per_pixel() > 0


def _inside_a_second_decode(folder, look):
    """A budget that keeps every component runs once (the loads' rates), then again with
    the VAE released: ``look(runtime)`` inside that run's decode. Returns the runtime and
    what each look returned."""
    pipe = load(folder, policy=BudgetPolicy(2**40))
    run(pipe, ALL_FAMILIES["wan"])
    runtime, seen = pipe.ondeck, []

    def watch(vae):
        decode = vae.decode

        def watching(*args, **kwargs):
            seen.append(look(runtime))
            return decode(*args, **kwargs)

        vae.decode = watching
        return vae

    pipe.vae.add_transform(watch)
    pipe.vae.release()
    run(pipe, ALL_FAMILIES["wan"])
    return runtime, seen


def test_the_room_a_release_would_make_counts_the_kept_components_at_their_load_rates(
    folders,
):
    """Inside the decode of a budget that keeps every component: a release would free
    all but the VAE, and loading them again takes their bytes at the rates their last
    loads reached."""
    rates = {}

    def look(runtime):
        rates.update(runtime.tracker.reload_bytes_per_second)
        return dict(runtime.tracker.resident), runtime.room_to_make()

    runtime, ((resident, (freed, seconds)),) = _inside_a_second_decode(folders["wan"], look)
    kept = {name: n for name, n in resident.items() if name != "vae"}
    assert kept and freed == sum(kept.values())
    assert seconds == pytest.approx(sum(n / rates[name] for name, n in kept.items()))
    assert runtime.room_to_make() is None, "between runs no stage is running"


class _Runtime:
    def __init__(self, made):
        self.made = made

    def room_to_make(self, keep=()):
        return self.made


class _Proxy:
    def __init__(self):
        from types import SimpleNamespace

        self._ondeck_spec = SimpleNamespace(cls=None, config={"block_out_channels": [8]})


class _SlicingVae:
    use_slicing = False

    def enable_slicing(self):
        self.use_slicing = True


def _deciding(made, per_pixel):
    from ondeck.integrations.diffusers.decode import FittingDecode

    decoder = FittingDecode(_Proxy(), _Runtime(made), "vae")
    decoder.seconds_per_pixel = per_pixel
    return decoder


def test_the_tiles_extra_cost_scales_with_the_pixels_of_the_decode_at_hand():
    from ondeck.integrations.diffusers.decode import covered_area
    from ondeck.tiles import tiles_for

    need, room, freed = 1000, 400, 10_000
    small, large = torch.zeros(1, 4, 8, 8), torch.zeros(1, 4, 16, 16)
    for latents in (small, large):
        side = latents.shape[-1] * 8
        extra = covered_area(tiles_for(side, side, need, room)) - 1.0
        assert extra > 0
        cost = 1e-6 * side * side * extra  # the seconds the tiles' extra pixels take
        assert _deciding((freed, 0.99 * cost), 1e-6)._room_pays(None, latents, need, room, 8)
        assert not _deciding((freed, 1.01 * cost), 1e-6)._room_pays(None, latents, need, room, 8)


def test_a_batch_that_would_decode_an_image_at_a_time_counts_no_tiles():
    """Two images whose need is twice the room each decode whole, one at a time, in the
    room as it is: freeing anything gains no pixels."""
    latents = torch.zeros(2, 4, 8, 8)
    decoder = _deciding((10_000, 1e-12), 1.0)
    assert not decoder._room_pays(_SlicingVae(), latents, 800, 500, 8)
    assert decoder._room_pays(object(), latents, 800, 500, 8), "no slicing: tiles"


def test_no_room_is_priced_while_a_load_is_under_way(folders, monkeypatch):
    def look(runtime):
        idle = runtime.room_to_make()
        monkeypatch.setattr(DiffusersRuntime, "_loading_bytes", lambda self: 1)
        loading = runtime.room_to_make()
        monkeypatch.undo()
        return idle, loading

    _, ((idle, loading),) = _inside_a_second_decode(folders["wan"], look)
    assert idle is not None and loading is None


def test_a_call_naming_no_size_sizes_its_decode_at_the_size_the_call_makes(folders):
    """``pipe(prompt)``, as diffusers' own examples call it: the decode and the output's
    host memory are sized at what the call makes (here the tiny SD3's sample size times
    its VAE's scale), not left unknown until a decode has been measured."""
    from ondeck.host_pool import output_host_bytes

    family = ALL_FAMILIES["sd3"]
    pipe = load(folders["sd3"])
    run(pipe, family, height=None, width=None)
    own = pipe.default_sample_size * pipe.vae_scale_factor
    assert {"height": own, "width": own}.items() <= pipe.ondeck._call_arguments.items()
    assert pipe.ondeck.output_host_bytes() == output_host_bytes(own, own)


@pytest.mark.parametrize(
    "name, sizes",
    [
        ("wan", {"height": 480, "width": 832, "num_frames": 81}),  # its call's defaults
        ("ltx", {"height": 512, "width": 704, "num_frames": 161}),
        ("flux", {"height": 128, "width": 128}),  # computed: sample size x VAE scale
    ],
)
def test_the_size_a_call_makes_when_given_none_is_read_without_loading(name, sizes, folders):
    from ondeck.arguments import own_call_sizes
    from ondeck.lazy import is_loaded

    pipe = load(folders[name])
    assert own_call_sizes(pipe) == sizes
    assert not any(is_loaded(proxy) for proxy in pipe.ondeck.deferred.values())


def test_a_first_decode_tiles_from_the_need_an_earlier_process_stored(
    folders, monkeypatch, tmp_path
):
    """A process's first decode, before it measures anything, tiles from the whole-frame
    need stored for the call's shape, where the config's estimate decodes whole frames
    (and on a card, would run out of memory first)."""
    from ondeck.profiles import ActivationProfiles

    store = ActivationProfiles(tmp_path / "profiles.json")
    monkeypatch.setattr("ondeck.profiles._default", store)
    room = 1 << 20
    monkeypatch.setattr(DiffusersRuntime, "activation_room", lambda self: room)
    estimated = load(folders["flux"])
    run(estimated, ALL_FAMILIES["flux"])
    assert estimated.ondeck.decoders["vae"].last_tiles is None, "the estimate fits the room"

    store.record(estimated.ondeck.profile_model, estimated.ondeck.run_shape, "vae", 8 * room)
    later = load(folders["flux"])
    output = run(later, ALL_FAMILIES["flux"])

    decoder = later.ondeck.decoders["vae"]
    assert decoder.last_tiles is not None and decoder.last_tiles.count > 1
    assert decoder.last_retries == 0
    assert np.array_equal(output, plain_tiled("flux", folders["flux"], decoder.last_tiles))
    # A tile's measurement understates whole frames: what this process stores in place of
    # the stored need, and what its next call plans from, stay at least that need.
    decoder.measured(decoder.whole_activations(1))
    assert decoder.bytes_per_element * decoder.last_elements >= 8 * room
    assert decoder.expected_need(later.ondeck._call_arguments) >= 8 * room
    # A whole-frame measurement is exact: it replaces a stored need, smaller or not.
    decoder.last_tiles = None
    assert decoder.whole_activations(1) == 1
    decoder.measured(1)
    assert decoder.expected_need(later.ondeck._call_arguments) < room
    # A need scaled from another shape is no floor: it only sizes a first decode.
    scaled = load(folders["flux"])
    run(scaled, ALL_FAMILIES["flux"], height=16)
    assert scaled.ondeck.activation_profile()[0].get("vae")  # scaled from the stored one
    assert scaled.ondeck.decoders["vae"].stored_bytes_per_element == 0.0


def test_a_load_that_fails_during_the_decode_is_raised_not_retried_in_tiles(folders):
    """A LoadError caused by running out of memory is the policy's to handle: the
    decode does not take it for its own, free room and retry in tiles."""
    from ondeck.errors import LoadError

    attempts = []

    def transform(vae):
        decode = vae.decode

        def failing(*args, **kwargs):
            attempts.append(getattr(vae, "use_tiling", False))
            if not attempts[-1]:
                try:
                    raise torch.OutOfMemoryError("CUDA out of memory (injected)")
                except torch.OutOfMemoryError as error:
                    raise LoadError("component 'vae': out of memory while loading") from error
            return decode(*args, **kwargs)

        vae.decode = failing
        return vae

    pipe = load(folders["wan"])
    pipe.ondeck.add_transform("vae", transform)
    with pytest.raises(LoadError, match="vae"):
        run(pipe, ALL_FAMILIES["wan"])
    assert attempts == [False]
    assert pipe.ondeck.decoders["vae"].last_retries == 0


def _latents_needing_more_than_the_room(pipe):
    """Latents for the VAE, and its measured need set to half its weights below the budget:
    the decode fits the budget alone, not beside the VAE's weights. Called outside a
    pipeline call, whose plan would refuse it first."""
    from ondeck.tiles import spatial_scale

    decoder = pipe.ondeck.decoders["vae"]
    weights = object.__getattribute__(pipe.ondeck.deferred["vae"], "_ondeck_spec").nbytes
    assert weights > 0
    latents = torch.zeros(1, decoder.config["latent_channels"], 8, 8)
    elements = (8 * spatial_scale(decoder.config)) ** 2
    decoder.bytes_per_element = (pipe.ondeck.policy.budget_bytes - weights // 2) / elements
    return latents


def test_a_vae_that_cannot_tile_is_refused_when_its_weights_and_need_exceed_the_budget(
    folders, monkeypatch
):
    from ondeck.integrations.diffusers import decode

    pipe = load(folders["flux"], "budget", budget="1GiB")
    monkeypatch.setattr(decode, "tiling_style", lambda cls: None)
    decoder = pipe.ondeck.decoders["vae"] = decode.FittingDecode(
        pipe.ondeck.deferred["vae"], pipe.ondeck, "vae"
    )
    latents = _latents_needing_more_than_the_room(pipe)
    with pytest.raises(BudgetError, match="cannot decode in tiles"):
        decoder(latents, return_dict=False)
    assert not ondeck.is_loaded(pipe.ondeck.deferred["vae"])


def test_a_vae_that_can_tile_is_not_refused_at_the_same_sizes_and_tiles(folders):
    from ondeck.tiles import spatial_scale

    pipe = load(folders["flux"], "budget", budget="1GiB")
    latents = _latents_needing_more_than_the_room(pipe)
    decoder = pipe.ondeck.decoders["vae"]
    (image,) = decoder(latents, return_dict=False)
    assert decoder.last_tiles is not None and decoder.last_tiles.count > 1
    assert decoder.last_retries == 0
    scale = spatial_scale(decoder.config)
    assert image.shape[-2:] == (latents.shape[-2] * scale, latents.shape[-1] * scale)


class _OverlapVae:
    """A VAE taking overlap factors whose whole-frame decode runs out of memory."""

    use_tiling = False
    tile_sample_min_height = tile_sample_min_width = 0
    tile_overlap_factor_height = tile_overlap_factor_width = 0.0

    def __init__(self):
        self.attempts = []

    def enable_tiling(
        self,
        tile_sample_min_height=None,
        tile_sample_min_width=None,
        tile_overlap_factor_height=None,
        tile_overlap_factor_width=None,
    ):
        self.use_tiling = True
        self.tile_sample_min_height = tile_sample_min_height

    def decode(self, latents, return_dict=True):
        self.attempts.append(self.tile_sample_min_height if self.use_tiling else None)
        if not self.use_tiling:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return (torch.zeros(1, 3, 64, 112),)


def test_planned_tiles_the_vae_cannot_use_start_at_the_finest_it_can(monkeypatch):
    """At 64x112 with 16x latents, the tiles planned for a need 5% above the room cannot be
    cut in quarters' overlap; the first decode is already in the finest tiles the VAE
    decodes, not whole frames that run out of memory first."""
    from types import SimpleNamespace

    from ondeck.integrations.diffusers.decode import FittingDecode
    from ondeck.tiles import estimated_need, smallest_tiles, tiles_for

    vae, config = _OverlapVae(), {"spatial_compression_ratio": 16, "block_out_channels": [8]}
    latents = torch.zeros(1, 4, 4, 7)
    need = estimated_need(config, tuple(latents.shape), latents.element_size())
    runtime = SimpleNamespace(
        activation_room=lambda: int(need / 1.05),
        make_room=lambda keep=(): False,
        held_by_another_turn=lambda name: False,
        activation_profile=lambda: ({}, None),
    )
    spec = SimpleNamespace(cls=_OverlapVae, config=config, nbytes=0, dtype=None)
    proxy = SimpleNamespace(_ondeck_spec=spec, materialize=lambda: vae)
    decoder = FittingDecode(proxy, runtime, "vae")
    planned = tiles_for(64, 112, need, int(need / 1.05), scale=16)
    assert planned is not None and decoder.style.usable(planned, 64, 112, 16) is None
    finest = decoder.style.usable(smallest_tiles(64, 112, scale=16), 64, 112, 16)
    decoder(latents, return_dict=False)
    assert vae.attempts == [finest.height] and decoder.last_retries == 0
    assert decoder.last_tiles == finest
