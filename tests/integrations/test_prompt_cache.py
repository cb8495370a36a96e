"""Encoders answer a call they have answered before without loading: every family gives
diffusers' outputs with it, a new input is encoded, and anything that may change the
weights (a transform, a setting, an adapter) makes the encoder compute again."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from transformers.modeling_outputs import BaseModelOutputWithPast

import ondeck
import ondeck.diffusers
from ondeck.integrations.diffusers import PipelineComponent
from ondeck.integrations.diffusers.encodings import MAX_INPUT_BYTES, EncodingCache

from .breadth_pipelines import ALL_FAMILIES
from .tiny_pipelines import run


def load(path, *, prompt_cache=True):
    pipe = ondeck.diffusers.from_pretrained(
        path, device="cpu", policy="release", progress=False, prompt_cache=prompt_cache
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def encoders(pipe) -> dict[str, object]:
    return {
        name: proxy for name, proxy in pipe.ondeck.deferred.items() if proxy.answers is not None
    }


@pytest.mark.parametrize("family", list(ALL_FAMILIES))
def test_a_prompt_encoded_before_is_answered_without_loading_the_encoders(
    family, folders, references
):
    pipe = load(folders[family])
    kept = encoders(pipe)
    assert kept, f"{family}: no encoder keeps its answers"
    for call, expected in enumerate(references[family], start=1):
        output = run(pipe, ALL_FAMILIES[family])
        assert np.array_equal(output, expected), f"{family}: call {call} differs"
    loads = {name: proxy.load_count for name, proxy in pipe.ondeck.deferred.items()}
    assert {name: loads[name] for name in kept} == dict.fromkeys(kept, 1), loads
    assert set(loads.values()) == {1, 2}, "the others load under release in each call"
    report = pipe.ondeck.report()["prompt_cache"]
    assert all(report[name]["hits"] >= 1 for name in kept), report


def test_without_the_option_no_encoder_keeps_answers(folders):
    pipe = load(folders["sd3"], prompt_cache=False)
    assert encoders(pipe) == {}
    run(pipe, ALL_FAMILIES["sd3"])
    run(pipe, ALL_FAMILIES["sd3"])
    assert {proxy.load_count for proxy in pipe.ondeck.deferred.values()} == {2}


def test_a_new_prompt_is_encoded_and_each_answer_matches_an_uncached_run(folders):
    family = ALL_FAMILIES["wan"]
    cached, plain = load(folders["wan"]), load(folders["wan"], prompt_cache=False)
    for prompt in ("a fox", "a heron", "a fox"):
        expected = run(plain, family, prompt=prompt)
        assert np.array_equal(run(cached, family, prompt=prompt), expected), prompt
    answers = cached.text_encoder.answers
    # "a fox", "a heron" and the negative prompt: each encoded once, then answered.
    assert (answers.misses, answers.hits, len(answers)) == (3, 3, 3)


def _zero_embeddings(module):
    module.get_input_embeddings().weight.data.zero_()
    return module


def test_a_transform_added_after_a_call_makes_the_encoder_compute_again(folders):
    family = ALL_FAMILIES["wan"]
    pipe = load(folders["wan"])
    before = run(pipe, family)
    pipe.ondeck.add_transform("text_encoder", _zero_embeddings)
    after = run(pipe, family)
    assert not np.array_equal(before, after), "the answer kept from other weights was used"
    assert pipe.text_encoder.answers.hits == 0


@pytest.mark.parametrize(
    "change",
    [
        lambda encoder: setattr(encoder, "some_flag", True),
        lambda encoder: encoder.get_input_embeddings(),
        lambda encoder: encoder.to(torch.float32),
        lambda encoder: encoder.retarget(None, torch.float32),  # as runtime.place() does
        lambda encoder: delattr(encoder, "some_flag"),
    ],
    ids=["setting", "attribute", "placement", "retarget", "deletion"],
)
def test_anything_but_a_call_forgets_the_answers(folders, change):
    pipe = load(folders["wan"])
    run(pipe, ALL_FAMILIES["wan"])
    pipe.text_encoder.materialize().some_flag = False  # for the deletion to find
    assert len(pipe.text_encoder.answers) == 2
    change(pipe.text_encoder)
    assert len(pipe.text_encoder.answers) == 0


def test_an_encoder_in_training_mode_keeps_nothing(folders):
    pipe = load(folders["wan"])
    pipe.text_encoder.train()  # dropout: its answers are random
    run(pipe, ALL_FAMILIES["wan"])
    assert len(pipe.text_encoder.answers) == 0


class _Doubling(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(2.0))
        self.during_call = lambda: None

    def forward(self, x):
        self.during_call()
        return x * self.scale


def test_an_answer_computed_while_the_answers_were_forgotten_is_not_kept():
    """A change that comes while a call computes (from another thread, say) may have
    changed the weights the call used: its answer is not kept."""
    from ondeck.integrations.diffusers import PipelineComponent

    module = _Doubling().eval()
    proxy = PipelineComponent("text_encoder", lambda: module)
    proxy.keep_answers()
    module.during_call = proxy.answers.clear  # what a forget on another thread does
    ids = torch.tensor([1.0, 2.0])
    with torch.no_grad():
        assert torch.equal(proxy(ids), torch.tensor([2.0, 4.0]))
        assert len(proxy.answers) == 0
        module.during_call = lambda: None
        proxy(ids)
        assert len(proxy.answers) == 1 and torch.equal(proxy(ids), torch.tensor([2.0, 4.0]))
    assert (proxy.answers.hits, proxy.answers.misses) == (1, 2)


def test_an_encoder_with_adapters_keeps_nothing(folders):
    pipe = load(folders["wan"])
    pipe.text_encoder.record_adapter("style")  # as a recorded load_adapter call does
    run(pipe, ALL_FAMILIES["wan"])
    assert len(pipe.text_encoder.answers) == 0
    assert pipe.text_encoder.load_count == 1


# -- the cache itself -----------------------------------------------------------------------


def test_inputs_are_keyed_by_their_bytes_and_large_or_unknown_ones_are_not_kept():
    cache = EncodingCache()
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        assert cache.key((ids,), {"mask": ids.bool()}) == cache.key(
            (ids.clone(),), {"mask": ids > 0}
        )
        assert cache.key((ids,), {}) != cache.key((ids + 1,), {})
        assert cache.key((ids.bfloat16(),), {}) != cache.key((ids.float(),), {})
        big = torch.zeros(MAX_INPUT_BYTES // 4 + 1)
        assert cache.key((big,), {}) is None
        assert cache.key((object(),), {}) is None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = cache.key((ids,), {})
        assert autocast != cache.key((ids,), {}), "autocast changes what a call returns"
    assert cache.key((ids,), {}) is None, "gradients are being recorded"


def test_an_answer_comes_back_as_a_fresh_copy_of_its_class_without_a_key_value_cache():
    from transformers.cache_utils import DynamicCache

    cache = EncodingCache()
    hidden = torch.arange(6.0).reshape(1, 2, 3)
    answer = BaseModelOutputWithPast(
        last_hidden_state=hidden, past_key_values=DynamicCache(), hidden_states=(hidden, hidden)
    )
    cache.put(("key",), answer, cache.generation)
    hidden.zero_()  # the caller changing what it got changes nothing kept
    kept = cache.get(("key",))
    assert kept.hidden_states[0] is kept.hidden_states[1], "one tensor, copied once"
    found = cache.get(("key",))
    assert type(found) is BaseModelOutputWithPast
    assert found.past_key_values is None
    assert torch.equal(found[0], torch.arange(6.0).reshape(1, 2, 3))
    found.last_hidden_state.add_(1)
    again = cache.get(("key",))
    assert torch.equal(again.last_hidden_state, torch.arange(6.0).reshape(1, 2, 3))
    assert torch.equal(again.hidden_states[1], torch.arange(6.0).reshape(1, 2, 3))
    assert (cache.hits, cache.misses) == (3, 0)


def test_the_least_recently_used_answers_go_first_when_the_bytes_run_out():
    cache = EncodingCache(max_bytes=4 * 1024)
    for index in range(3):
        cache.put((index,), torch.zeros(256), cache.generation)  # 1 KiB each
    assert cache.get((0,)) is not None  # now the most recently used
    cache.put((3,), torch.zeros(512), cache.generation)
    assert {key for key in ((0,), (1,), (2,), (3,)) if cache.get(key) is not None} == {
        (0,),
        (2,),
        (3,),
    }
    cache.put((4,), torch.zeros(1024), cache.generation)  # half the bytes or more: not kept
    assert cache.get((4,)) is None and len(cache) == 3


def test_a_tensor_an_answer_holds_twice_is_counted_once():
    """T5's last hidden state is also the last of its hidden states: kept once, so its
    bytes count once against the cache's."""
    cache = EncodingCache(max_bytes=4 * 1024)
    hidden = torch.zeros(384)  # 1.5 KiB: twice would be over half the cache's bytes
    answer = BaseModelOutputWithPast(last_hidden_state=hidden, hidden_states=(hidden,))
    cache.put(("key",), answer, cache.generation)
    assert len(cache) == 1


@pytest.fixture(scope="module")
def sd_controlnet_folder(tmp_path_factory):
    def get(name):
        folder = tmp_path_factory.mktemp("textual-inversion") / name
        ALL_FAMILIES[name].build(folder)
        return folder

    return get


class _Hooked(torch.Tensor):
    """A tensor whose host copy runs ``on_copy`` once: the moment another thread acts."""

    on_copy = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to and kwargs.get("copy") and cls.on_copy is not None:
            action, cls.on_copy = cls.on_copy, None
            action()
        return super().__torch_function__(func, types, args, kwargs)


class _Scaling(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = 2.0

    def forward(self, x):
        return (x * self.scale).as_subclass(_Hooked)


def test_an_answer_is_not_kept_when_a_setting_changed_while_it_was_copied_to_the_host():
    """A setting changed on the encoder (from another thread: a server's control thread,
    a second pipeline sharing the encoder) while a call's answer is copied to host memory
    forgets the kept answers, and that answer, from before the change, is not kept after
    it: the generation is checked again, under the cache's lock, once the copy is made."""
    module = _Scaling().eval()
    proxy = PipelineComponent("text_encoder", lambda: module)
    proxy.keep_answers()

    def change_on_another_thread():
        worker = threading.Thread(target=setattr, args=(proxy, "scale", 3.0))
        worker.start()
        worker.join()

    ids = torch.tensor([1.0, 2.0])
    with torch.no_grad():
        _Hooked.on_copy = change_on_another_thread
        proxy(ids)  # computed with scale 2; the change lands during the host copy
        assert module.scale == 3.0
        again = proxy(ids)
    assert torch.equal(again, torch.tensor([3.0, 6.0])), "an answer from before the change"


def test_a_textual_inversion_outlives_the_text_encoders_reloads(sd_controlnet_folder):
    """``pipe.load_textual_inversion`` (diffusers' own) resizes the loaded text encoder's
    embedding table and writes the new token's row in place; under ``release`` the
    encoder reloads for the next prompt, and the table is made again (its size and the
    rows from the first new token on), so a new prompt with the token renders as plain
    diffusers renders it. After ``unload_textual_inversion`` the same holds."""
    name = "sd_controlnet"
    family = ALL_FAMILIES[name]
    folder = sd_controlnet_folder(name)
    ours = ondeck.diffusers.from_pretrained(
        folder, device="cpu", policy="release", progress=False, prompt_cache=True
    )
    plain = family.pipeline_type().from_pretrained(folder)
    embedding = torch.randn(
        ours.text_encoder.config.hidden_size, generator=torch.Generator().manual_seed(3)
    )
    for pipe in (ours, plain):
        pipe.set_progress_bar_config(disable=True)
        pipe.load_textual_inversion({"<cat>": embedding.clone()}, token="<cat>")
    for prompt in ("a <cat>", "a <cat> fox"):
        expected = run(plain, family, prompt=prompt)
        got = run(ours, family, prompt=prompt)
        assert np.allclose(got, expected, atol=1e-5), f"{prompt!r}: the token's embedding is lost"
    for pipe in (ours, plain):
        pipe.unload_textual_inversion("<cat>")
    assert np.allclose(
        run(ours, family, prompt="a fox"), run(plain, family, prompt="a fox"), atol=1e-5
    )


def test_answers_kept_count_as_calls_where_a_turn_ends_with_its_last_call(folders, references):
    """A negative prompt answered from before is still a call of its encoder: the turn
    that ends with it ends the same whether it was answered or computed, so a new negative
    prompt after a kept one loads no encoder twice."""
    pipe = load(folders["sd3"])
    prompts = [("a fox", ""), ("a cat", ""), ("a dog", "blurry"), ("a cow", "blurry")]
    for call, (prompt, negative) in enumerate(prompts, start=1):
        before = {name: proxy.load_count for name, proxy in pipe.ondeck.deferred.items()}
        run(pipe, ALL_FAMILIES["sd3"], prompt=prompt, negative_prompt=negative)
        loads = {
            name: proxy.load_count - before[name] for name, proxy in pipe.ondeck.deferred.items()
        }
        # (After a kept negative prompt, a new one loads the CLIP encoders twice: the
        # turns learned from the call before did not hold them for it.)
        assert loads["text_encoder_3"] == loads["transformer"] == 1, f"call {call}: {loads}"
