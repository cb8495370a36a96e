"""Which streamed blocks are read from the files each pass when their pinned host copies do
not fit the host budget, and what the plan says of it: from sizes alone."""

from __future__ import annotations

import dataclasses

from ondeck.memory import format_bytes
from ondeck.planning import build_plan
from ondeck.streaming.file_reads import (
    DEFAULT_READ_BYTES_PER_SECOND,
    DEFAULT_READ_SOURCE,
    HostRoom,
    plan_file_reads,
    spread_order,
)

from .test_layout import INPUTS, SIZES, USES, WAN14B, GiB

CARD = 8 * GiB  # Wan 14B's transformer on an 8 GiB card: most of its blocks stream
ACTIVATION = {"Denoise": GiB}
COMPONENTS = {**SIZES, "text_encoder": 5 * GiB}  # an encoder that fits the card whole


def plan(room_bytes: int | None, **host):
    inputs = INPUTS
    if room_bytes is not None:
        inputs = dataclasses.replace(INPUTS, host=HostRoom(room_bytes, **host))
    return build_plan(
        USES, COMPONENTS, policy="budget", budget=CARD, activation=ACTIVATION, streaming=inputs
    )


def test_with_room_for_the_pinned_copies_nothing_is_read_from_the_files():
    roomy = plan(64 * GiB)
    assert roomy.streamed["transformer"].streamed
    assert roomy.file_reads == {} and roomy.ring_bytes == 0
    assert roomy.pinned_host_bytes == roomy.streamed["transformer"].bytes_per_pass
    assert "read from the files" not in str(roomy)


def test_a_small_host_budget_reads_the_blocks_that_do_not_fit_from_the_files():
    layout = plan(None).streamed["transformer"]
    room = layout.bytes_per_pass // 2
    squeezed = plan(room)
    reads = squeezed.file_reads["transformer"]
    assert squeezed.streamed["transformer"] == layout  # the device side is unchanged
    assert set(reads.pinned) | set(reads.from_files) == set(layout.streamed)
    assert reads.pinned and reads.from_files and not set(reads.pinned) & set(reads.from_files)
    # The kept pinned copies and the ring fit the room; one more pinned block would not.
    assert reads.pinned_bytes + reads.ring_bytes <= room
    assert reads.pinned_bytes + reads.ring_bytes + max(WAN14B.packed_bytes) > room
    assert reads.file_bytes_per_pass + reads.pinned_bytes == layout.bytes_per_pass
    assert reads.ring_bytes == 3 * layout.slot_bytes
    assert squeezed.pinned_host_bytes == reads.pinned_bytes
    assert squeezed.ring_bytes == reads.ring_bytes


def test_the_plan_says_what_is_read_each_pass_and_how_much_slower_that_is():
    layout = plan(None).streamed["transformer"]
    squeezed = plan(layout.bytes_per_pass // 2)
    reads = squeezed.file_reads["transformer"]
    copy_rate = squeezed.transfer_bytes_per_second
    pinned_seconds = layout.bytes_per_pass / copy_rate
    expected = max(pinned_seconds, reads.file_bytes_per_pass / DEFAULT_READ_BYTES_PER_SECOND)
    text = str(squeezed)
    assert (
        f"read from the files each pass: {len(reads.from_files)} of {len(layout.streamed)} "
        f"streamed blocks, {format_bytes(reads.file_bytes_per_pass)} per pass" in text
    )
    assert f"({DEFAULT_READ_SOURCE})" in text
    assert f"{expected / pinned_seconds:.1f}x the pinned path's" in text
    assert f"pinned host copies {format_bytes(reads.pinned_bytes)}" in text
    assert "read from the files each pass" in squeezed.fit_summary()


def test_a_given_read_rate_sets_the_slowdown_and_a_slow_one_says_what_would_be_faster():
    layout = plan(None).streamed["transformer"]
    room = layout.bytes_per_pass // 2
    copy_rate = plan(room).transfer_bytes_per_second
    fast = plan(room, read_rate=lambda name: (copy_rate * 100, "given"))
    assert fast.file_reads["transformer"].slowdown(layout, copy_rate, copy_rate * 100) == 1.0
    assert "1.0x the pinned path's" in str(fast)
    assert "What would be faster" not in str(fast)
    slow = plan(room, read_rate=lambda name: (copy_rate / 100, "given"))
    text = str(slow)
    assert "What would be faster: fp8 storage (--weights fp8)" in text
    assert "a lower resolution" in text and "a larger host budget (--host-memory)" in text


def test_where_even_the_ring_does_not_fit_every_block_is_read_and_the_plan_says_what_would_fit():
    layout = plan(None).streamed["transformer"]
    tight = plan(3 * layout.slot_bytes - 1)
    reads = tight.file_reads["transformer"]
    assert not tight.file_reads_fit
    assert reads.from_files == layout.streamed and reads.pinned == ()
    text = str(tight)
    assert "do not fit the host budget" in text
    assert "What would fit: fp8 storage (--weights fp8)" in text
    assert "a larger host budget (--host-memory)" in text
    enough = plan(3 * layout.slot_bytes)
    assert enough.file_reads_fit and enough.file_reads["transformer"].pinned == ()


def test_blocks_whose_pinned_copies_are_held_keep_them():
    layout = plan(None).streamed["transformer"]
    held = layout.streamed[-3:]
    room = 3 * layout.slot_bytes + 3 * max(WAN14B.packed_bytes)
    reads, fits = plan_file_reads(
        {"transformer": layout}, {"transformer": WAN14B}, room, held={"transformer": held}
    )
    assert fits and reads["transformer"].pinned == held
    fresh, _ = plan_file_reads({"transformer": layout}, {"transformer": WAN14B}, room)
    assert fresh["transformer"].pinned != held


def longest_gap(count: int, kept: set[int]) -> int:
    longest = run = 0
    for index in range(count):
        run = 0 if index in kept else run + 1
        longest = max(longest, run)
    return longest


def test_the_blocks_read_from_the_files_fall_between_pinned_ones():
    layout = plan(None).streamed["transformer"]
    squeezed = plan(layout.bytes_per_pass // 2).file_reads["transformer"]
    order = list(layout.streamed)
    pinned = {order.index(block) for block in squeezed.pinned}
    files = len(order) - len(pinned)
    assert 0.3 < files / len(order) < 0.7
    # Never more blocks read in a row than twice an even spread would put there; taken in
    # streamed order they would be one run of every block read.
    even = -(-files // (len(pinned) + 1))
    assert longest_gap(len(order), pinned) <= 2 * even < files


def test_every_prefix_of_spread_order_leaves_no_gap_over_twice_an_even_spread():
    for count in range(60):
        order = spread_order(count)
        assert sorted(order) == list(range(count))
        for kept in range(1, count):
            even = -(-(count - kept) // (kept + 1))
            assert longest_gap(count, set(order[:kept])) <= 2 * even
    assert spread_order(34)[:3] == [17, 8, 26]
