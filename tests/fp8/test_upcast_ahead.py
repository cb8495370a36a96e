"""Stored layers upcast one layer ahead: the order is learned, the copies made ahead are
used only by the layer they were made for while it holds the tensors they came from,
and every forward computes what an upcast at the layer itself gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp8.test_streaming import FP8 as FP8_CHOICE
from fp8.test_streaming import generate, six_blocks, streamed, wan  # noqa: F401
from ondeck.loading import fp8
from ondeck.loading.upcast_ahead import UpcastAhead, group_of

FP8 = torch.float8_e4m3fn
LAYERS = ("stem", "blocks.0.a", "blocks.0.b", "blocks.0.c", "blocks.1.a", "blocks.1.b")


@pytest.mark.parametrize(
    ("name", "group"),
    [
        ("blocks.3.attn1.to_q", "blocks.3"),
        ("encoder.block.11.layer.0.SelfAttention.q", "encoder.block.11"),
        ("transformer_blocks.0.ff.net.2", "transformer_blocks.0"),
        ("single_transformer_blocks.37.proj_out", "single_transformer_blocks.37"),
        ("layers.4", "layers.4"),
        ("proj_out", None),
        ("condition_embedder.text_embedder.linear_1", None),
    ],
)
def test_a_layer_belongs_to_its_first_numbered_step(name, group):
    assert group_of(name) == group


class Layer(torch.nn.Linear):
    fail = False

    def forward(self, x):
        if self.fail:
            raise RuntimeError("blocks.0.b was told to fail")
        return super().forward(x)


class Block(torch.nn.Module):
    def __init__(self, width: int, names: str, between=None):
        super().__init__()
        for name in names:
            self.add_module(name, Layer(width, width))
        self.names, self.between = names, between

    def forward(self, x):
        for name in self.names:
            x = torch.tanh(getattr(self, name)(x))
            if self.between is not None:
                self.between(self, name)
        return x


class Net(torch.nn.Module):
    def __init__(self, width: int = 16, between=None):
        super().__init__()
        self.stem = torch.nn.Linear(width, width)
        self.blocks = torch.nn.ModuleList(
            [Block(width, "abc", between), Block(width, "ab", between)]
        )

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return x


def stored_net(device="cpu", between=None) -> tuple[Net, UpcastAhead]:
    torch.manual_seed(0)
    net = Net(between=between).to(device)
    for name in LAYERS:
        layer = net.get_submodule(name)
        for key, tensor in list(layer._parameters.items()):
            layer._parameters[key] = torch.nn.Parameter(tensor.detach().to(FP8), False)
    fp8.upcast_for_compute(net, "custom", FP8, torch.float32, LAYERS, in_place=False, kept={})
    return net, hook_of(net, "blocks.0.a").ahead


def hook_of(net, name):
    return net.get_submodule(name)._diffusers_hook.get_hook("layerwise_casting")


def upcast_at_each_layer(net: Net, x):
    """The forward computed by hand: every stored tensor upcast where its layer runs."""

    def linear(layer, x):
        return torch.nn.functional.linear(x, layer.weight.float(), layer.bias.float())

    x = linear(net.stem, x)
    for block in net.blocks:
        for name in block.names:
            x = torch.tanh(linear(getattr(block, name), x))
    return x


def test_the_order_is_learned_within_blocks_and_later_passes_use_it():
    net, ahead = stored_net()
    x = torch.randn(3, 16)
    expected = upcast_at_each_layer(net, x)
    with torch.no_grad():
        first = net(x)
        assert (ahead.made_ahead, ahead.dropped) == (0, 0)  # nothing known before a pass
        assert ahead.following == {
            "blocks.0.a": "blocks.0.b",
            "blocks.0.b": "blocks.0.c",
            "blocks.1.a": "blocks.1.b",
        }
        later = [net(x) for _ in range(2)]
    # Each block's first stored layer is upcast where it runs; the three after it ahead.
    assert (ahead.made_ahead, ahead.dropped) == (2 * 3, 0)
    assert ahead.ahead is None  # nothing left over between passes
    for output in (first, *later):
        assert torch.equal(output, expected)
    # The module keeps its stored tensors between forwards.
    assert {net.get_submodule(n).weight.dtype for n in LAYERS} == {FP8}


def test_copies_made_from_tensors_the_layer_no_longer_holds_are_not_used():
    """Between ``a`` and ``b`` the test hands ``b`` new stored weights (as a streamed
    block bound to another slot would hold other tensors): ``b`` computes from them."""
    swap = {"on": False}

    def between(block, name):
        if swap["on"] and block is net.blocks[0] and name == "a":
            new = torch.randn_like(block.b.weight, dtype=torch.float32).to(FP8)
            block.b._parameters["weight"] = torch.nn.Parameter(new, False)

    net, ahead = stored_net(between=between)
    x = torch.randn(3, 16)
    with torch.no_grad():
        net(x)
        swap["on"] = True
        output = net(x)
        swap["on"] = False
    assert ahead.dropped == 1
    assert torch.equal(output, upcast_at_each_layer(net, x))


def test_a_forward_that_raises_drops_what_it_started_and_the_next_pass_computes_right():
    fail = {"at": None}

    def between(block, name):
        if fail["at"] == (block, name):
            raise RuntimeError("stop here")

    net, ahead = stored_net(between=between)
    x = torch.randn(3, 16)
    with torch.no_grad():
        net(x)
        fail["at"] = (net.blocks[0], "a")
        with pytest.raises(RuntimeError, match="stop here"):
            net(x)  # raises after a's forward, with b's copies made
        fail["at"] = None
        assert ahead.ahead is not None and ahead.ahead.name == "blocks.0.b"
        output = net(x)  # the stem runs first: the copies for b go unused
    assert ahead.dropped == 1 and ahead.ahead is None
    assert torch.equal(output, upcast_at_each_layer(net, x))
    assert {net.get_submodule(n).weight.dtype for n in LAYERS} == {FP8}


def test_a_layer_raising_in_its_own_forward_drops_the_copies_it_started():
    net, ahead = stored_net()
    x = torch.randn(3, 16)
    with torch.no_grad():
        net(x)
        net.blocks[0].b.fail = True
        with pytest.raises(RuntimeError, match="blocks.0.b"):
            net(x)  # b raises inside its hook, having started c's copies
        net.blocks[0].b.fail = False
        assert ahead.ahead is None and ahead.dropped == 1
        assert {net.get_submodule(n).weight.dtype for n in LAYERS} == {FP8}
        output = net(x)
    assert torch.equal(output, upcast_at_each_layer(net, x))


def test_streamed_fp8_blocks_upcast_ahead_and_equal_the_whole_fp8_run(six_blocks):  # noqa: F811
    whole = wan(six_blocks, "release", FP8_CHOICE)
    expected = generate(whole, "a fox")
    pipe = streamed(six_blocks, FP8_CHOICE, resident=3)
    aheads = []

    def watch(module):
        aheads.append(hook_of(module, "blocks.0.attn1.to_q").ahead)
        return module

    pipe.components["transformer"].add_transform(watch)
    assert np.array_equal(generate(pipe, "a fox"), expected)
    (ahead,) = aheads
    # Four calls of the transformer: from the second on, every stored layer of a
    # block after its first is made ahead.
    per_pass = sum(1 for name in ahead.layers if group_of(name)) - len(
        {group_of(name) for name in ahead.layers if group_of(name)}
    )
    assert per_pass > 0
    assert (ahead.made_ahead, ahead.dropped) == (3 * per_pass, 0)
