"""The layout arithmetic, from sizes alone: which blocks stay, what streams, what it costs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ondeck.memory import format_bytes
from ondeck.planning import StageUse, build_plan, bytes_loaded_per_run, moved_per_run
from ondeck.streaming import (
    BlockSizes,
    BlockStreaming,
    StreamingInputs,
    StreamOptions,
    evenly_spaced,
    plan_streaming,
    stream_layout,
)
from ondeck.streaming.host import HostCopies
from ondeck.streaming.layout import (
    PAGE_LOCK_BYTES_PER_SECOND,
    plan_resident_streaming,
    streamed_blocks,
    switch_cost,
)

GiB = 2**30

# Wan 2.1 14B's transformer, in round numbers: 40 blocks of 0.66 GiB, 0.4 GiB outside.
BLOCK = int(0.66 * GiB)
WAN14B = BlockSizes("blocks", (BLOCK,) * 40, (BLOCK + 4096,) * 40, int(0.4 * GiB))
USES = [
    StageUse("EncodePrompt", ("text_encoder",)),
    StageUse("PrepareLatents", ()),
    StageUse("Denoise", ("transformer",)),
    StageUse("Decode", ("vae",)),
]
SIZES = {"text_encoder": int(10.6 * GiB), "transformer": WAN14B.total_bytes, "vae": GiB // 2}
INPUTS = StreamingInputs({"transformer": WAN14B}, unmeasured_activation_fraction=0.0)


def test_evenly_spaced_indices_leave_gaps_of_one_or_two():
    resident = evenly_spaced(40, 28)
    assert len(resident) == len(set(resident)) == 28
    streamed = [i for i in range(40) if i not in resident]
    assert max(b - a for a, b in zip(streamed, streamed[1:], strict=False)) <= 4
    assert evenly_spaced(6, 3) == (1, 3, 5)
    assert evenly_spaced(6, 1) == (3,)
    assert evenly_spaced(5, 5) == (0, 1, 2, 3, 4)
    assert evenly_spaced(5, 0) == ()


def test_layout_keeps_as_many_blocks_as_fit_beside_the_slots():
    sizes = BlockSizes("blocks", (100,) * 10, (128,) * 10, 50)
    available = 50 + 2 * 128 + 5 * 100
    layout = stream_layout(sizes, available, slots=2)
    assert layout.resident == evenly_spaced(10, 5)
    assert len(layout.streamed) == 5
    assert layout.slot_count == 2 and layout.slot_bytes == 128
    assert layout.device_bytes == available
    assert stream_layout(sizes, available - 1, slots=2).resident == evenly_spaced(10, 4)


def test_bytes_per_pass_are_the_streamed_blocks_packed():
    layout = stream_layout(WAN14B, 20 * GiB)
    assert layout.bytes_per_pass == len(layout.streamed) * (BLOCK + 4096)
    assert set(layout.resident) | set(layout.streamed) == set(range(40))
    assert layout.transfer_seconds(55e9) == pytest.approx(layout.bytes_per_pass / 55e9)


def test_a_component_that_fits_keeps_every_block():
    layout = stream_layout(WAN14B, WAN14B.total_bytes)
    assert layout.streamed == () and layout.slot_count == 0
    assert layout.device_bytes == WAN14B.total_bytes


def test_no_layout_when_even_streaming_every_block_does_not_fit():
    smallest = WAN14B.other_bytes + 2 * (BLOCK + 4096)
    assert stream_layout(WAN14B, smallest - 1) is None
    assert stream_layout(WAN14B, smallest).resident == ()


def test_a_24_gib_card_streams_the_transformer_and_keeps_most_blocks():
    choice = plan_streaming(
        USES, SIZES, budget=22 * GiB, activation={"Denoise": 2 * GiB}, inputs=INPUTS
    )
    layout = choice.layouts["transformer"]
    assert set(choice.layouts) == {"transformer"} and choice.notes == []
    assert choice.reserved == {}
    # 22 GiB - 2 GiB activations - 0.4 GiB other - 2 slots of 0.66 GiB: 27 blocks.
    assert len(layout.resident) == 27
    assert layout.device_bytes <= 20 * GiB


def test_unmeasured_activations_get_a_share_of_the_budget():
    inputs = StreamingInputs({"transformer": WAN14B}, unmeasured_activation_fraction=0.1)
    choice = plan_streaming(USES, SIZES, budget=20 * GiB, activation={}, inputs=inputs)
    assert choice.layouts["transformer"].device_bytes <= 18 * GiB
    assert choice.reserved == {"Denoise": 2 * GiB}
    assert any("not measured yet" in note and "'Denoise'" in note for note in choice.notes)


def test_unified_memory_streams_nothing_and_says_why():
    inputs = StreamingInputs(unavailable="cpu is unified memory: nothing to free")
    choice = plan_streaming(USES, SIZES, budget=20 * GiB, activation={}, inputs=inputs)
    assert choice.layouts == {}
    assert choice.notes == ["streaming blocks cannot help: cpu is unified memory: nothing to free"]


def test_a_stage_without_blocks_is_named():
    choice = plan_streaming(USES, SIZES, budget=8 * GiB, activation={}, inputs=INPUTS)
    assert "transformer" in choice.layouts
    assert any("'EncodePrompt'" in n and "repeated blocks" in n for n in choice.notes)


def test_plan_text_shows_resident_blocks_bytes_per_pass_and_transfer_time():
    plan = build_plan(
        USES,
        SIZES,
        policy="budget",
        budget=22 * GiB,
        activation={"Denoise": 2 * GiB},
        streaming=INPUTS,
    )
    layout = plan.streamed["transformer"]
    text = str(plan)
    assert plan.fits()
    assert plan.component_bytes["transformer"] == WAN14B.total_bytes
    assert plan.device_bytes["transformer"] == layout.device_bytes
    assert "transformer.blocks: 27 of 40 blocks resident" in text
    assert "13 streamed through 2 slots" in text
    assert f"{layout.bytes_per_pass / GiB:.2f} GiB host to device per forward pass" in text
    assert f"{layout.bytes_per_pass / 55e9 * 1000:.1f} ms per pass at 55.0 GB/s" in text
    assert dict((name, nbytes) for name, _, nbytes in plan.stages)["Denoise"] == (
        layout.device_bytes
    )


def test_without_streaming_inputs_the_plan_is_unchanged():
    plan = build_plan(USES, SIZES, policy="budget", budget=22 * GiB, activation={})
    assert plan.streamed == {} and not plan.fits()


def test_host_copies_hold_each_streamed_block_once_and_free_a_block_that_stops_streaming():
    import weakref

    copies = HostCopies(pinned=False)
    copies.keep_only({0: 1000, 1: 3000, 2: 500})
    regions = {block: copies.region(block) for block in (0, 1, 2)}
    assert {b: r.numel() for b, r in regions.items()} == {0: 1000, 1: 3000, 2: 500}
    assert copies.nbytes == 4500
    copies.filled.update({0, 1, 2})
    regions[1].fill_(7)
    gone = weakref.ref(regions.pop(1))
    # A re-plan keeps block 1 on the device and streams block 3 instead.
    copies.keep_only({0: 1000, 2: 500, 3: 200})
    assert gone() is None  # block 1's host bytes are freed, not kept beside the others
    assert copies.nbytes == 1500 and copies.filled == {0, 2}
    assert copies.region(0) is regions[0]  # held blocks keep their contents
    assert copies.region(3).numel() == 200 and copies.nbytes == 1700
    copies.drop_unfilled()  # block 3 was never filled
    assert copies.nbytes == 1500
    assert copies.clear() == 1500 and copies.nbytes == 0


def test_activations_not_measured_yet_stay_free_in_every_decision():
    inputs = StreamingInputs({"transformer": WAN14B}, unmeasured_activation_fraction=0.1)
    budget = 22 * GiB
    plan = build_plan(USES, SIZES, policy="budget", budget=budget, activation={}, streaming=inputs)
    reserve = plan.reserved_activation_bytes["Denoise"]
    assert reserve == int(budget * 0.1)
    denoise = next(stage for stage in plan.stages if stage[0] == "Denoise")
    assert denoise[2] + reserve <= budget
    assert "vae" not in denoise[1]  # not prefetched into the room kept for activations
    assert f"~{reserve / GiB:.2f} GiB" in str(plan)


def test_without_previous_blocks_the_streamed_ones_are_the_evenly_spaced_residents_gaps():
    for count, streamed in ((40, 12), (40, 10), (6, 3), (24, 13)):
        resident = set(evenly_spaced(count, count - streamed))
        assert streamed_blocks(count, streamed) == tuple(
            i for i in range(count) if i not in resident
        )


def test_a_new_layout_keeps_to_the_blocks_whose_host_copies_are_held():
    held = streamed_blocks(40, 12)
    fewer = streamed_blocks(40, 10, held)
    assert len(fewer) == 10 and set(fewer) <= set(held)
    more = streamed_blocks(40, 14, held)
    assert len(more) == 14 and set(held) <= set(more)
    assert streamed_blocks(40, 12, held) == held
    # Without them, 10 of 40 would share only two blocks with the 12 streamed now.
    assert len(set(streamed_blocks(40, 10)) & set(held)) == 2


def test_stream_layout_shrinks_within_what_streams_now():
    sizes = BlockSizes("blocks", (BLOCK,) * 40, (BLOCK,) * 40, 0)
    budget = 31 * BLOCK  # 29 resident and 2 slots
    first = stream_layout(sizes, budget - 2 * BLOCK)  # 27 resident, 13 streamed
    second = stream_layout(sizes, budget, previous=first.streamed)
    assert len(second.streamed) == 11 and set(second.streamed) <= set(first.streamed)
    assert second.device_bytes <= budget
    assert stream_layout(sizes, budget).device_bytes == second.device_bytes


# A transformer with two lists of blocks: 4 large double-stream blocks, then 8 single-stream
# blocks a quarter of their size (a Flux or HunyuanVideo in miniature).
TWO_LISTS = BlockSizes(
    "transformer_blocks+single_transformer_blocks",
    (400,) * 4 + (100,) * 8,
    (400,) * 4 + (100,) * 8,
    50,
    (4, 8),
)


def test_two_lists_stream_the_small_blocks_first_when_that_moves_fewer_bytes():
    # 300 bytes must leave the device; streaming small blocks needs slots of 100, large
    # ones slots of 400: the small blocks move fewer bytes per pass.
    available = TWO_LISTS.total_bytes - 300
    layout = stream_layout(TWO_LISTS, available, slots=2)
    assert layout.device_bytes <= available
    assert set(layout.streamed) <= set(range(4, 12)), "only single-stream blocks stream"
    assert layout.slot_bytes == 100
    assert layout.bytes_per_pass == 100 * len(layout.streamed)


def test_two_lists_both_stream_when_one_is_not_enough():
    # Almost everything must go: the single-stream list alone holds only 800 bytes.
    available = 50 + 2 * 400 + 400
    layout = stream_layout(TWO_LISTS, available, slots=2)
    assert layout.device_bytes <= available
    groups = TWO_LISTS.groups()
    assert any(block in groups[0] for block in layout.streamed)
    assert any(block in groups[1] for block in layout.streamed)
    # No other choice of streamed blocks that fits moves fewer bytes.
    import itertools

    best = min(
        sum(TWO_LISTS.packed_bytes[i] for i in streamed)
        for count in range(1, 13)
        for streamed in itertools.combinations(range(12), count)
        if 50
        + sum(TWO_LISTS.block_bytes[i] for i in range(12) if i not in streamed)
        + min(2, count) * max(TWO_LISTS.packed_bytes[i] for i in streamed)
        <= available
    )
    assert layout.bytes_per_pass == best


def test_a_stage_with_two_large_components_streams_both():
    uses = [StageUse("Denoise", ("transformer", "transformer_2"))]
    sizes = {"transformer": WAN14B.total_bytes, "transformer_2": WAN14B.total_bytes}
    inputs = StreamingInputs(
        {"transformer": WAN14B, "transformer_2": WAN14B}, unmeasured_activation_fraction=0.0
    )
    budget = 20 * GiB
    choice = plan_streaming(uses, sizes, budget=budget, activation={}, inputs=inputs)
    assert set(choice.layouts) == {"transformer", "transformer_2"}
    assert sum(layout.device_bytes for layout in choice.layouts.values()) <= budget


# SD3.5 Large's shapes in round numbers: a T5-XXL of 24 blocks beside CLIPs, an 8B MMDiT
# of 38 blocks. Each stage fits 22 GiB alone; together they do not.
T5 = BlockSizes("encoder.block", (int(0.35 * GiB),) * 24, (int(0.35 * GiB),) * 24, GiB // 2)
MMDIT = BlockSizes("transformer_blocks", (int(0.39 * GiB),) * 38, (int(0.39 * GiB),) * 38, GiB)
IMAGE_USES = [
    StageUse("encode", ("text_encoder", "text_encoder_3")),
    StageUse("denoise", ("transformer",)),
    StageUse("decode", ("vae",)),
]
IMAGE_SIZES = {
    "text_encoder": int(1.5 * GiB),
    "text_encoder_3": T5.total_bytes,
    "transformer": MMDIT.total_bytes,
    "vae": GiB // 4,
}
IMAGE_ACTIVATION = {"encode": GiB // 4, "denoise": int(1.5 * GiB), "decode": 2 * GiB}


def _image_plan(calls, budget=22 * GiB, **timing):
    inputs = StreamingInputs(
        {"text_encoder_3": T5, "transformer": MMDIT},
        unmeasured_activation_fraction=0.0,
        calls=calls,
        **timing,
    )
    return build_plan(
        IMAGE_USES,
        IMAGE_SIZES,
        policy="budget",
        budget=budget,
        activation=IMAGE_ACTIVATION,
        streaming=inputs,
    )


def test_before_a_run_tells_the_calls_a_plan_reloads_what_does_not_fit_together():
    plan = _image_plan({})
    assert not plan.streamed
    assert bytes_loaded_per_run(plan) > 20 * GiB  # the encoder and the transformer, each run


def test_a_text_encoder_called_twice_streams_so_the_transformer_stays_resident():
    plan = _image_plan({"text_encoder": 2, "text_encoder_3": 2, "transformer": 16})
    assert set(plan.streamed) == {"text_encoder_3"}
    assert plan.overflow() is None
    assert bytes_loaded_per_run(plan) == 0
    # Every component stays on the device in every stage of the steady run.
    held = set(IMAGE_SIZES)
    assert all(set(resident) == held for _, resident, _ in plan.stages)
    streamed = plan.streamed["text_encoder_3"].bytes_per_pass * 2
    assert moved_per_run(plan, {"text_encoder_3": 2}) == streamed < 20 * GiB
    assert "keeps every component on the device" in str(plan)


def test_the_component_called_least_streams_whatever_its_size():
    # Here the encoder is called more often than the transformer: the transformer streams.
    plan = _image_plan({"text_encoder": 2, "text_encoder_3": 20, "transformer": 2})
    assert set(plan.streamed) == {"transformer"}
    assert bytes_loaded_per_run(plan) == 0


def test_resident_streaming_loses_to_reloading_when_it_would_move_more():
    # At 16 GiB the transformer itself must stream as well: fifty calls of it cost more
    # than reloading the encoder once a run.
    inputs = StreamingInputs(
        {"text_encoder_3": T5, "transformer": MMDIT},
        unmeasured_activation_fraction=0.0,
        calls={"text_encoder": 2, "text_encoder_3": 2, "transformer": 50},
    )
    plan = build_plan(
        IMAGE_USES,
        IMAGE_SIZES,
        policy="budget",
        budget=16 * GiB,
        activation=IMAGE_ACTIVATION,
        streaming=inputs,
    )
    kept = plan_resident_streaming(
        IMAGE_USES, IMAGE_SIZES, budget=16 * GiB, activation=IMAGE_ACTIVATION, inputs=inputs
    )
    assert kept is not None and "transformer" in kept.layouts
    assert bytes_loaded_per_run(plan) > 0  # the reloading plan won
    assert "keeps every component on the device" not in str(plan)


def _timed_plan_at_16(seconds_per_call, load_bytes_per_second=None, declined_seconds=60.0):
    # ``declined_seconds``: by default the runs so far lost more than any switch costs.
    return _image_plan(
        {"text_encoder": 2, "text_encoder_3": 2, "transformer": 16},
        16 * GiB,
        bytes_per_second=55e9,
        seconds_per_call=seconds_per_call,
        load_bytes_per_second=load_bytes_per_second or {},
        declined_seconds=declined_seconds,
    )


def test_timed_calls_weigh_the_copies_their_compute_does_not_hide():
    """By bytes, streaming the transformer as well moves more than reloading at 16 GiB.
    Timed, what counts is the copies compute does not hide: a transformer call long
    enough to hide its streamed blocks leaves only the encoder's copies, less than the
    reloads (read at the rate they reached, less one call each); a short call does not."""
    untimed = _timed_plan_at_16({})
    assert bytes_loaded_per_run(untimed) > 0  # by bytes, reloading
    # The VAE's decode is not a call of the component: its reload counts whole.
    calls = {"text_encoder": 0.01, "text_encoder_3": 0.03, "transformer": 0.2}
    slow_reads = dict.fromkeys(IMAGE_SIZES, 30e9)
    staying = _timed_plan_at_16(calls, slow_reads)
    assert set(staying.streamed) >= {"text_encoder_3", "transformer"}
    assert bytes_loaded_per_run(staying) == 0
    assert "s a run of copies that compute does not hide" in str(staying)
    # A transformer call shorter than its streamed blocks' copies: reloading again.
    short = _timed_plan_at_16({**calls, "transformer": 0.01}, slow_reads)
    assert bytes_loaded_per_run(short) > 0
    # Reloads at the streaming rate, the transformer's hidden behind its first call:
    # streaming the encoder twice costs more than loading it once.
    fast = _timed_plan_at_16({**calls, "transformer": 0.5})
    assert bytes_loaded_per_run(fast) > 0


def test_keeping_every_component_resident_waits_until_the_runs_have_lost_its_one_time_cost():
    """The switch to the plan that keeps every component resident costs once: the pinned
    host copies only it makes, page-locked, then read. It is taken when the runs on the
    reloading plan have lost that much, counting the run about to start; not before."""
    calls = {"text_encoder": 0.01, "text_encoder_3": 0.03, "transformer": 0.2}
    slow_reads = dict.fromkeys(IMAGE_SIZES, 30e9)
    staying = _timed_plan_at_16(calls, slow_reads)
    waiting = _timed_plan_at_16(calls, slow_reads, declined_seconds=0.0)
    assert bytes_loaded_per_run(waiting) > 0 == bytes_loaded_per_run(staying)
    sizes = {"text_encoder_3": T5, "transformer": MMDIT}
    new = sum(
        sizes[name].packed_bytes[block]
        for name, layout in staying.streamed.items()
        for block in layout.streamed
        if name not in waiting.streamed or block not in waiting.streamed[name].streamed
    )
    cost = new / PAGE_LOCK_BYTES_PER_SECOND + new / 30e9
    gain = waiting.resident_gain
    assert 0 < gain < cost
    assert f"after {format_bytes(new)} of new pinned host copies (about {cost:.2f} s" in str(
        waiting
    )
    short = _timed_plan_at_16(calls, slow_reads, declined_seconds=cost - gain - 0.01)
    assert bytes_loaded_per_run(short) > 0 and short.resident_gain == pytest.approx(gain)
    enough = _timed_plan_at_16(calls, slow_reads, declined_seconds=cost - gain + 0.01)
    assert bytes_loaded_per_run(enough) == 0 and enough.resident_gain is None


def test_runs_already_staying_resident_keep_to_it_when_its_layout_needs_new_copies():
    """A switch costing more than the runs lost waits while the runs reload; once they
    stay resident (the layout since changed, more blocks to copy), the same figures keep
    the resident plan: back to reloading would cost its reloads every run."""
    calls = {"text_encoder": 0.01, "text_encoder_3": 0.03, "transformer": 0.2}
    slow_reads = dict.fromkeys(IMAGE_SIZES, 30e9)
    waiting = _timed_plan_at_16(calls, slow_reads, declined_seconds=0.0)
    assert bytes_loaded_per_run(waiting) > 0 and waiting.resident_gain > 0
    staying = _image_plan(
        {"text_encoder": 2, "text_encoder_3": 2, "transformer": 16},
        16 * GiB,
        bytes_per_second=55e9,
        seconds_per_call=calls,
        load_bytes_per_second=slow_reads,
        declined_seconds=0.0,
        staying=True,
    )
    assert bytes_loaded_per_run(staying) == 0 and staying.resident_gain is None
    assert staying.keeps_resident


def test_host_copies_held_already_make_the_switch_to_staying_resident_free():
    calls = {"text_encoder": 0.01, "text_encoder_3": 0.03, "transformer": 0.2}
    slow_reads = dict.fromkeys(IMAGE_SIZES, 30e9)
    staying = _timed_plan_at_16(calls, slow_reads)
    held = {name: tuple(layout.streamed) for name, layout in staying.streamed.items()}
    plan = _image_plan(
        {"text_encoder": 2, "text_encoder_3": 2, "transformer": 16},
        16 * GiB,
        bytes_per_second=55e9,
        seconds_per_call=calls,
        load_bytes_per_second=slow_reads,
        previous=held,
    )
    assert bytes_loaded_per_run(plan) == 0 and plan.resident_gain is None


def test_the_runs_add_up_what_they_declined_once_each_until_the_switch():
    streaming = BlockStreaming(StreamOptions(unified=False))
    steps = [  # (runs completed before it, resident_gain, keeps_resident, lost so far)
        (0, None, False, 0.0),  # run 1: nothing counted yet
        (1, 0.4, False, 0.4),
        (1, 0.4, False, 0.4),  # the same run again, after running out of memory
        (2, 0.3, False, 0.7),
        (3, None, False, 0.7),  # neither waits nor switches: the count stays
        (4, None, True, 0.0),  # the switch
        (5, 0.2, False, 0.2),
    ]
    for completed, gain, keeps, lost in steps:
        streaming.count_run(SimpleNamespace(resident_gain=gain, keeps_resident=keeps), completed)
        assert streaming.declined_seconds == pytest.approx(lost)
        inputs = streaming.inputs(_no_components())
        assert inputs.declined_seconds == pytest.approx(lost)
        assert streaming.staying is keeps and inputs.staying is keeps


def _no_components() -> SimpleNamespace:
    """A pipeline's snapshot with nothing to stream: what ``BlockStreaming.inputs`` reads."""
    return SimpleNamespace(
        device="cpu",
        streamable_blocks={},
        loaders={},
        calls_per_run={},
        seconds_per_call={},
        load_bytes_per_second={},
        host_room_bytes=None,
    )


def test_the_switch_counts_the_copies_only_the_resident_plan_pins_and_the_loads_it_causes():
    sizes = BlockSizes("blocks", (100,) * 4, (128,) * 4, 50)
    inputs = StreamingInputs({"enc": sizes}, load_bytes_per_second={"enc": 1000.0})

    def plan(streamed, from_files):
        return SimpleNamespace(
            streamed={"enc": SimpleNamespace(streamed=streamed)},
            file_reads={"enc": SimpleNamespace(from_files=from_files)},
        )

    # Block 0 both plans pin; 1 the reloading plan reads from the files each pass, so the
    # resident plan's copy of it is new; 3 the resident plan reads from the files.
    resident, reloading = plan((0, 1, 2, 3), (3,)), plan((0, 1), (1,))
    switch = switch_cost(resident, reloading, inputs, {}, 1.0)
    assert switch.nbytes == 2 * 128  # blocks 1 and 2
    assert switch.seconds == pytest.approx(256 / PAGE_LOCK_BYTES_PER_SECOND + 256 / 1000)
    held = StreamingInputs(
        {"enc": sizes}, load_bytes_per_second={"enc": 1000.0}, previous={"enc": (2,)}
    )
    assert switch_cost(resident, reloading, held, {}, 1.0).nbytes == 128  # 2 is held
    # A component kept loaded between runs now loads again once, to stream.
    again = switch_cost(resident, reloading, inputs, {"enc": 500}, 1.0)
    assert again.seconds == pytest.approx(switch.seconds + 500 / 1000)


def test_a_stage_streams_its_largest_component_first_where_that_alone_is_enough():
    uses = [StageUse("Denoise", ("text_encoder", "transformer"))]
    sizes = {"text_encoder": T5.total_bytes, "transformer": WAN14B.total_bytes}
    inputs = StreamingInputs(
        {"text_encoder": T5, "transformer": WAN14B}, unmeasured_activation_fraction=0.0
    )
    budget = T5.total_bytes + 12 * GiB
    choice = plan_streaming(uses, sizes, budget=budget, activation={"Denoise": 0}, inputs=inputs)
    assert set(choice.layouts) == {"transformer"}, "the encoder stays whole"


def test_a_component_in_two_stages_is_laid_out_for_the_tighter_one():
    uses = [StageUse("alone", ("transformer",)), StageUse("beside", ("transformer", "vae"))]
    sizes = {"transformer": WAN14B.total_bytes, "vae": 4 * GiB}
    budget = 16 * GiB
    choice = plan_streaming(
        uses, sizes, budget=budget, activation={"alone": 0, "beside": 0}, inputs=INPUTS
    )
    assert choice.layouts["transformer"].device_bytes <= budget - 4 * GiB


def test_a_streaming_candidate_is_planned_at_its_blocks_whole_size_whatever_its_load_says():
    """A component loaded streamed counts the bytes of the layout it was loaded in; the
    plan weighs the whole of it, as any other layout would take it from there."""
    loaded_streamed = {**SIZES, "transformer": 8 * GiB}  # its previous layout's bytes
    budget = 22 * GiB
    plan = build_plan(
        USES, loaded_streamed, policy="budget", budget=budget, activation={}, streaming=INPUTS
    )
    assert "transformer" in plan.streamed
    assert plan.streamed["transformer"].device_bytes < WAN14B.total_bytes
    assert plan.overflow() is None


def test_a_component_of_fewer_blocks_than_slots_is_short_by_what_its_blocks_need():
    """Two blocks never fill four slots: what the component lacks, and the note, count the
    two it can use."""
    pair = BlockSizes("blocks", (4 * GiB,) * 2, (4 * GiB,) * 2, GiB)
    inputs = StreamingInputs({"transformer": pair}, slots=4, unmeasured_activation_fraction=0.0)
    uses = [StageUse("denoise", ("transformer",))]
    choice = plan_streaming(
        uses, {"transformer": pair.total_bytes}, budget=4 * GiB, activation={}, inputs=inputs
    )
    assert choice.short == {"denoise": 5 * GiB}
    assert "needs 9.00 GiB on the device (its non-block parts and 2 slots)" in choice.notes[0]
