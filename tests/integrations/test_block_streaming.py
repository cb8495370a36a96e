"""Every family under a budget its largest component cannot fit whole: every list of
repeated blocks in it streams (a double- and a single-stream list alike), and the
outputs are plain diffusers' own: equal where the decode has whole frames, equal to
diffusers' own tiled decode at the same tiles where it tiles."""

from __future__ import annotations

import numpy as np
import pytest

import ondeck.diffusers
from ondeck.policy import BudgetPolicy
from ondeck.streaming import BlockStreaming, StreamOptions

from .breadth_pipelines import ALL_FAMILIES
from .tiny_pipelines import expected_output, run

OPTIONS = StreamOptions(unified=False, unmeasured_activation_fraction=0.0)


def candidates(pipe) -> dict:
    """The block sizes of each component that has repeated blocks."""
    return BlockStreaming(OPTIONS).inputs(pipe.ondeck.snapshot()).candidates


def forcing_budget(pipe) -> tuple[int, str]:
    """A budget the largest streamable component fits only streaming nearly every block
    (one resident), that still holds every other component of a stage whole."""
    sizes = candidates(pipe)
    nbytes = pipe.ondeck.component_bytes()
    largest = max(sizes, key=lambda name: nbytes[name])
    least = {
        name: s.other_bytes + 2 * max(s.packed_bytes) + min(s.block_bytes)
        for name, s in sizes.items()
    }
    stages = [use.components for use in pipe.ondeck.stage_uses()] + [(n,) for n in nbytes]
    budget = max(sum(least.get(name, nbytes[name]) for name in held) for held in stages)
    return budget, largest


def load(path, policy):
    pipe = ondeck.diffusers.from_pretrained(path, device="cpu", policy=policy, progress=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("tight_decode", [False, True], ids=["decode-as-planned", "decode-tiles"])
@pytest.mark.parametrize("family", list(ALL_FAMILIES))
def test_every_block_list_streams_with_diffusers_outputs(
    family, folders, references, tight_decode, monkeypatch
):
    probe = load(folders[family], "release")
    run(probe, ALL_FAMILIES[family])  # the turns a call takes, as the budget must hold them
    if not candidates(probe):
        pytest.skip(f"{family}: no component has repeated blocks at this tiny size")
    budget, largest = forcing_budget(probe)
    if budget >= probe.ondeck.component_bytes()[largest]:
        pytest.skip(f"{family}: '{largest}' streams nothing at this tiny size")
    lists = candidates(probe)[largest].groups()
    if tight_decode:  # no room left beside the VAE: its decode tiles where it can
        from ondeck.integrations.diffusers import DiffusersRuntime

        monkeypatch.setattr(DiffusersRuntime, "activation_room", lambda self: 1)
    pipe = load(folders[family], BudgetPolicy(budget, streaming=OPTIONS))
    for call, expected in enumerate(references[family], start=1):
        output = run(pipe, ALL_FAMILIES[family])
        expected = expected_output(pipe, family, folders[family], expected)
        assert np.array_equal(output, expected), f"call {call}"
    stats = pipe.ondeck.policy.streaming.stats()[largest]
    streamed = set(stats["streamed_blocks"])
    # Where one list cannot hold all that must go, blocks of several lists stream.
    sizes = candidates(probe)[largest]
    one_list_at_most = max(sum(sizes.packed_bytes[i] for i in group) for group in lists)
    lists_streaming = [group for group in lists if streamed & set(group)]
    if stats["bytes_per_pass"] > one_list_at_most:
        assert len(lists_streaming) >= 2, f"{family}: {stats['path']}"
    assert streamed, f"{family}: '{largest}' streams nothing"


@pytest.mark.parametrize("family", ["flux", "hunyuan_video", "chroma"])
def test_a_two_list_transformer_is_found_with_both_lists(family, folders):
    sizes = candidates(load(folders[family], "release"))["transformer"]
    assert len(sizes.groups()) == 2, sizes.path


def test_a_budget_short_even_streaming_says_what_streaming_leaves_it_short(folders):
    """Below what streaming every block needs, the BudgetError's first line gives the
    bytes missing then (the plan's note: needs X, Y left), not the whole component's
    overflow."""
    import re

    from ondeck.errors import BudgetError
    from ondeck.memory import parse_bytes

    probe = load(folders["flux"], "release")
    run(probe, ALL_FAMILIES["flux"])
    _, largest = forcing_budget(probe)
    sizes = candidates(probe)[largest]
    below = sizes.other_bytes + max(sizes.packed_bytes)  # one slot's worth, of two
    pipe = load(folders["flux"], BudgetPolicy(below, streaming=OPTIONS))
    with pytest.raises(BudgetError) as caught:
        run(pipe, ALL_FAMILIES["flux"])
    headline, *rest = str(caught.value).splitlines()

    def size(text: str) -> int:
        return parse_bytes(text.replace(" ", ""))

    (note,) = [line for line in rest if "even streaming every block" in line]
    needs, left = re.search(
        r"needs ([\d.]+ \w+) on the device.*only ([\d.]+ \w+) is", note
    ).groups()
    said = size(re.search(r"needs ([\d.]+ \w+) more than the budget", headline).group(1))
    assert abs(said - (size(needs) - size(left))) <= 16, (headline, note)
    assert said < pipe.ondeck.plan().overflow()[1]
