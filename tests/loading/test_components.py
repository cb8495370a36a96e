from __future__ import annotations

import gc
import random
import weakref

import pytest
import torch
from diffusers import AutoencoderKLWan

from ondeck.errors import LoadError
from ondeck.lazy import LazyModule, module_nbytes
from ondeck.loading import ComponentLoader, ModelFolder, load_auxiliary, load_component, reads, ring

from .helpers import (
    MODELS,
    assert_same_state,
    from_pretrained,
    raise_after,
    rewrite_weights,
    shard,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_loaded_component_equals_from_pretrained(wan_template, name, dtype):
    loaded = ComponentLoader(wan_template, name, dtype=dtype, buffer_bytes=256)()
    reference = from_pretrained(wan_template, name, dtype)
    assert type(loaded) is MODELS[name]
    assert not loaded.training
    assert_same_state(loaded, reference)


def test_keep_in_fp32_modules_match_from_pretrained(wan_template):
    loaded = ComponentLoader(wan_template, "transformer", dtype=torch.bfloat16)()
    dtypes = {name: p.dtype for name, p in loaded.named_parameters()}
    assert dtypes["scale_shift_table"] == torch.float32
    assert dtypes["condition_embedder.time_embedder.linear_1.weight"] == torch.float32
    assert dtypes["blocks.0.attn1.to_q.weight"] == torch.bfloat16
    # transformers keeps UMT5's "wo" in fp32 only for fp16, as from_pretrained does.
    for dtype, expected in ((torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16)):
        encoder = ComponentLoader(wan_template, "text_encoder", dtype=dtype)()
        wo = encoder.encoder.block[0].layer[1].DenseReluDense.wo.weight
        assert wo.dtype == expected
        assert_same_state(encoder, from_pretrained(wan_template, "text_encoder", dtype))


def test_outputs_match_from_pretrained_bit_for_bit(wan_template):
    loaded = ComponentLoader(wan_template, "transformer", dtype=torch.bfloat16)()
    reference = from_pretrained(wan_template, "transformer", torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(1, 16, 1, 4, 4, generator=generator).bfloat16(),
        timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 5, 32, generator=generator).bfloat16(),
    )
    with torch.no_grad():
        ours = loaded(**inputs).sample
        theirs = reference(**inputs).sample
    assert torch.equal(ours, theirs)


def test_tied_weights_share_one_tensor(wan_template):
    encoder = ComponentLoader(wan_template, "text_encoder")()
    assert encoder.encoder.embed_tokens.weight is encoder.shared.weight
    assert ModelFolder.open(wan_template).spec("text_encoder").nbytes == module_nbytes(encoder)


def test_sharded_component_equals_from_pretrained(wan_folder):
    shard(wan_folder / "vae", parts=3)
    loaded = ComponentLoader(wan_folder, "vae", buffer_bytes=128, buffer_count=2)()
    assert_same_state(loaded, from_pretrained(wan_folder, "vae", torch.float32))


def test_loader_records_statistics(wan_template):
    loader = ComponentLoader(wan_template, "vae")
    loader()
    assert loader.last_load_bytes == ModelFolder.open(wan_template).file_bytes("vae")
    assert loader.last_load_seconds > 0
    assert loader.last_source in ("page cache", "disk")


def test_loader_works_as_a_lazy_module_loader(wan_template):
    loader = ComponentLoader(wan_template, "vae")
    assert loader.returns_fresh_module
    vae = LazyModule("vae", loader, spec=loader.spec)
    assert vae.config.scale_factor_temporal == 4
    assert type(vae.materialize()).__name__ == "AutoencoderKLWan"
    assert vae.release() == loader.spec.nbytes


def test_release_then_reload_gives_the_same_module(wan_template):
    loader = ComponentLoader(wan_template, "transformer")
    transformer = LazyModule("transformer", loader, spec=loader.spec)
    before = {k: v.clone() for k, v in transformer.materialize().state_dict().items()}
    buffers = [b.clone() for b in transformer.materialize().buffers()]
    assert transformer.release() > 0
    reloaded = transformer.materialize()
    assert all(torch.equal(before[k], v) for k, v in reloaded.state_dict().items())
    assert all(torch.equal(a, b) for a, b in zip(buffers, reloaded.buffers(), strict=True))


def test_load_component_handles_models_and_other_parts(wan_template):
    from diffusers import UniPCMultistepScheduler
    from transformers import ByT5Tokenizer

    assert isinstance(load_component(wan_template, "vae"), AutoencoderKLWan)
    assert isinstance(load_component(wan_template, "scheduler"), UniPCMultistepScheduler)
    assert isinstance(load_auxiliary(wan_template, "tokenizer"), ByT5Tokenizer)


def test_auxiliary_failure_is_a_load_error(wan_folder):
    (wan_folder / "scheduler" / "scheduler_config.json").write_text("{not json")
    with pytest.raises(LoadError, match="'scheduler'"):
        load_auxiliary(wan_folder, "scheduler")


# -- bad weights -----------------------------------------------------------------------------


def test_wrong_shape_names_file_component_and_tensor(wan_folder):
    def widen(tensors):
        tensors["scale_shift_table"] = torch.zeros(1, 2, 99)

    path = rewrite_weights(wan_folder / "transformer", widen)
    with pytest.raises(LoadError, match="has shape \\[1, 2, 99\\]") as caught:
        ComponentLoader(wan_folder, "transformer")()
    message = str(caught.value)
    assert str(path) in message and "'transformer'" in message and "scale_shift_table" in message


def test_missing_tensor_names_file_component_and_tensor(wan_folder):
    path = rewrite_weights(wan_folder / "transformer", lambda t: t.pop("scale_shift_table"))
    with pytest.raises(LoadError, match="missing") as caught:
        ComponentLoader(wan_folder, "transformer")()
    message = str(caught.value)
    assert str(path) in message and "'transformer'" in message and "scale_shift_table" in message


def test_unexpected_tensor_names_file_component_and_tensor(wan_folder):
    def add(tensors):
        tensors["leftover.weight"] = torch.zeros(3)

    path = rewrite_weights(wan_folder / "vae", add)
    with pytest.raises(LoadError, match="does not have") as caught:
        ComponentLoader(wan_folder, "vae")()
    message = str(caught.value)
    assert str(path) in message and "'vae'" in message and "leftover.weight" in message


# -- failures free what the load took ----------------------------------------------------------


class Spy:
    """Records the half-built module and the destinations of the next load, weakly."""

    def __init__(self, monkeypatch, folder: ModelFolder):
        self.modules: list[weakref.ref] = []
        self.destinations: list[torch.Tensor] = []
        template = folder.template("transformer")
        original = type(template).fresh

        def fresh(skeleton):
            built = original(skeleton)
            self.modules.append(weakref.ref(built.module))
            return built

        monkeypatch.setattr(type(template), "fresh", fresh)


def fail_reads(monkeypatch, error: BaseException, after: int, spy: Spy | None = None):
    """Make the reader raise ``error`` after ``after`` successful tensor reads."""
    calls = raise_after(monkeypatch, ring, "pread_exact", after, error)
    if spy is not None:
        original_read = reads.read_into

        def read_into(jobs, **kwargs):
            spy.destinations.extend(job.destination for job in jobs)
            return original_read(jobs, **kwargs)

        monkeypatch.setattr(reads, "read_into", read_into)
    return calls


@pytest.mark.parametrize("error", [LoadError("disk vanished"), KeyboardInterrupt(), MemoryError()])
def test_failed_load_leaves_nothing_referenced(wan_template, monkeypatch, error):
    from ondeck.loading import components

    folder = ModelFolder.open(wan_template)
    spy = Spy(monkeypatch, folder)

    def fail_after_building(module, component):
        raise error

    # Fail once the module is built and filled: the last moment a load can fail.
    monkeypatch.setattr(components, "_finish", fail_after_building)
    loader = ComponentLoader(folder, "transformer", threads=2)
    with pytest.raises(type(error)) as caught:
        loader()
    gc.collect()
    assert spy.modules and spy.modules[0]() is None
    del caught
    monkeypatch.undo()
    assert_same_state(loader(), from_pretrained(wan_template, "transformer", torch.float32))


def test_allocation_failure_frees_what_was_allocated(wan_template, monkeypatch):
    from ondeck.loading import components

    allocated = []
    real_empty = torch.empty

    def empty(*args, **kwargs):
        device = kwargs.get("device")
        # Not a destination the loader allocates: no device, or the meta device on which
        # the skeleton is built (torch's meta kernels call torch.empty themselves).
        if device is None or torch.device(device).type == "meta":
            return real_empty(*args, **kwargs)
        if len(allocated) == 10:
            raise MemoryError("device full")
        tensor = real_empty(*args, **kwargs)
        allocated.append(tensor)
        return tensor

    monkeypatch.setattr(components.torch, "empty", empty)
    with pytest.raises(MemoryError):
        ComponentLoader(wan_template, "transformer")()
    assert all(t.untyped_storage().nbytes() == 0 for t in allocated)


def test_failed_load_frees_memory_even_if_a_reference_survives(wan_template, monkeypatch):
    folder = ModelFolder.open(wan_template)
    spy = Spy(monkeypatch, folder)
    fail_reads(monkeypatch, LoadError("disk vanished"), after=5, spy=spy)
    with pytest.raises(LoadError):
        ComponentLoader(folder, "vae")()
    assert spy.destinations
    assert all(t.untyped_storage().nbytes() == 0 for t in spy.destinations)


@pytest.mark.parametrize("seed", range(4))
def test_failure_at_a_random_tensor_then_success(wan_template, monkeypatch, seed):
    folder = ModelFolder.open(wan_template)
    count = len(folder.tensors("vae"))
    after = random.Random(seed).randrange(count)
    fail_reads(monkeypatch, OSError("injected"), after=after)
    loader = ComponentLoader(folder, "vae", threads=3)
    with pytest.raises(OSError):
        loader()
    monkeypatch.undo()
    assert_same_state(loader(), from_pretrained(wan_template, "vae", torch.float32))


def test_lazy_module_retries_after_a_failed_load(wan_template, monkeypatch):
    loader = ComponentLoader(wan_template, "vae")
    vae = LazyModule("vae", loader, spec=loader.spec)
    fail_reads(monkeypatch, LoadError("disk vanished"), after=3)
    with pytest.raises(LoadError, match="disk vanished") as caught:
        vae.materialize()
    assert caught.value.component == "vae"
    monkeypatch.undo()
    assert isinstance(vae.materialize(), AutoencoderKLWan)


def test_set_tensor_through_module_paths_reaches_a_module_shared_by_two_parents():
    """A load installs every tensor through one table of the module's paths; a module
    that two parents share (as T5's encoder shares its embedding) is in it under both."""
    from ondeck.loading.skeleton import module_paths, set_tensor

    shared = torch.nn.Linear(2, 2)
    root = torch.nn.Module()
    root.first = torch.nn.Sequential(shared)
    root.second = torch.nn.Sequential(torch.nn.Identity(), shared)
    modules = module_paths(root)
    assert modules[""] is root and modules["first.0"] is modules["second.1"] is shared
    value = torch.nn.Parameter(torch.ones(2, 2))
    set_tensor(root, "second.1.weight", value, parameter=True, modules=modules)
    assert root.first[0].weight is value
    buffer = torch.zeros(3)
    set_tensor(root, "scale", buffer, parameter=False, modules=modules)
    assert root.scale is buffer
