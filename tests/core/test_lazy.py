"""The LazyModule contract: what loads, what does not, and what a release frees."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

import ondeck

from .helpers import CountingLoader, lazy_linear


def test_construction_repr_and_predicates_do_not_load():
    proxy, loader = lazy_linear()
    repr(proxy)
    str(proxy)
    assert ondeck.is_lazy(proxy)
    assert not ondeck.is_loaded(proxy)
    assert loader.calls == 0


def test_spec_reads_do_not_load():
    config = {"in_features": 64}
    proxy, loader = lazy_linear(config=config, dtype=torch.float32, device=torch.device("cpu"))
    assert proxy.config is config
    assert proxy.dtype is torch.float32
    assert proxy.device == torch.device("cpu")
    assert isinstance(proxy, torch.nn.Linear)
    assert isinstance(proxy, torch.nn.Module)
    assert not isinstance(proxy, torch.nn.Conv2d)
    assert loader.calls == 0


def test_class_answers_declared_then_real_class():
    class Declared(torch.nn.Module):
        pass

    proxy = ondeck.LazyModule("m", CountingLoader(), spec=ondeck.ComponentSpec(cls=Declared))
    assert proxy.__class__ is Declared
    proxy.materialize()
    assert proxy.__class__ is torch.nn.Linear


class WithDtype(torch.nn.Linear):
    @property
    def dtype(self):
        return self.weight.dtype


def test_unknown_spec_field_loads_on_read():
    loads = []
    proxy = ondeck.LazyModule("m", lambda: loads.append(1) or WithDtype(2, 2))
    assert proxy.dtype == torch.float32  # the spec did not know it: this read loads
    assert loads == [1]


def test_attribute_access_loads_exactly_once():
    proxy, loader = lazy_linear()
    assert proxy.in_features == 64
    assert proxy.weight.shape == (64, 64)
    assert loader.calls == 1
    assert ondeck.is_loaded(proxy)


def test_call_loads_and_forwards():
    proxy, loader = lazy_linear()
    out = proxy(torch.ones(1, 64))
    assert out.shape == (1, 64)
    assert loader.calls == 1


def test_concurrent_first_access_loads_once():
    loader = CountingLoader(delay=0.05)
    proxy = ondeck.LazyModule("m", loader)
    barrier = threading.Barrier(8)
    results = []

    def touch():
        barrier.wait()
        results.append(proxy.weight.data_ptr())

    threads = [threading.Thread(target=touch) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert loader.calls == 1
    assert len(set(results)) == 1


@pytest.mark.parametrize(
    "method, args",
    [
        ("to", ("cpu",)),
        ("to", (torch.float32,)),
        ("cpu", ()),
        ("eval", ()),
        ("train", ()),
        ("float", ()),
        ("requires_grad_", (False,)),
    ],
)
def test_self_returning_methods_return_the_proxy(method, args):
    proxy, _ = lazy_linear()
    assert getattr(proxy, method)(*args) is proxy


def test_half_and_bfloat16_return_the_proxy_and_survive_reload():
    proxy, loader = lazy_linear()
    assert proxy.bfloat16() is proxy
    assert proxy.weight.dtype == torch.bfloat16
    proxy.release()
    assert proxy.weight.dtype == torch.bfloat16
    assert loader.calls == 2


def test_submodules_and_values_come_back_as_themselves():
    proxy = ondeck.LazyModule("seq", lambda: torch.nn.Sequential(torch.nn.Linear(2, 2)))
    inner = proxy[0]
    module = proxy.materialize()
    assert inner is module[0]
    assert list(proxy.children())[0] is inner
    linear, _ = lazy_linear()
    assert linear.weight is linear.materialize().weight
    assert linear.in_features == 64


def test_materialize_returns_the_module():
    proxy, loader = lazy_linear()
    module = proxy.materialize()
    assert type(module) is torch.nn.Linear
    assert proxy.materialize() is module
    assert loader.calls == 1


def test_release_returns_bytes_freed_and_zero_when_unloaded():
    proxy, _ = lazy_linear(features=64)
    assert proxy.release() == 0
    proxy.materialize()
    assert proxy.release() == (64 * 64 + 64) * 4
    assert not ondeck.is_loaded(proxy)
    assert proxy.release() == 0


def test_release_frees_the_module():
    proxy, _ = lazy_linear()
    ref = weakref.ref(proxy.materialize())
    proxy.release()
    gc.collect()
    assert ref() is None


def test_release_frees_the_module_after_self_returning_methods():
    proxy, _ = lazy_linear()
    kept = proxy.to("cpu").eval()  # a caller keeping what .to() returned
    ref = weakref.ref(proxy.materialize())
    proxy.release()
    gc.collect()
    assert kept is proxy
    assert ref() is None


def test_access_after_release_reloads():
    proxy, loader = lazy_linear()
    first = proxy.weight.clone()
    proxy.release()
    assert torch.equal(proxy.weight, first)
    assert loader.calls == 2


def test_transforms_apply_after_every_load_in_order():
    proxy, _ = lazy_linear()
    order = []

    def tag(label):
        def transform(module):
            order.append(label)
            module.tags = [*getattr(module, "tags", []), label]
            return module

        return transform

    proxy.add_transform(tag("first"))
    proxy.add_transform(tag("second"))
    assert proxy.tags == ["first", "second"]
    proxy.release()
    assert proxy.tags == ["first", "second"]
    assert order == ["first", "second", "first", "second"]


def test_transform_may_replace_the_module():
    proxy, _ = lazy_linear()
    proxy.add_transform(lambda module: torch.nn.Sequential(module))
    assert isinstance(proxy.materialize(), torch.nn.Sequential)


def test_on_release_callbacks_run_on_every_release():
    proxy, _ = lazy_linear()
    seen = []
    proxy.on_release(lambda module: seen.append(type(module).__name__))
    proxy.on_release(lambda: seen.append("no-arg"))
    proxy.materialize()
    proxy.release()
    proxy.materialize()
    proxy.release()
    assert seen == ["Linear", "no-arg", "Linear", "no-arg"]


def test_failing_loader_raises_load_error_naming_component_and_retries():
    attempts = []

    def flaky():
        attempts.append(1)
        if len(attempts) == 1:
            raise OSError("disk on fire")
        return torch.nn.Linear(2, 2)

    proxy = ondeck.LazyModule("text_encoder", flaky)
    with pytest.raises(ondeck.LoadError, match="text_encoder") as caught:
        proxy.materialize()
    assert isinstance(caught.value.__cause__, OSError)
    assert not ondeck.is_loaded(proxy)
    assert proxy.in_features == 2
    assert len(attempts) == 2


def test_loader_returning_none_is_a_load_error():
    proxy = ondeck.LazyModule("vae", lambda: None)
    with pytest.raises(ondeck.LoadError, match="vae.*None"):
        proxy.materialize()
    assert not ondeck.is_loaded(proxy)


def test_hook_probes_do_not_load():
    proxy, loader = lazy_linear()
    assert not hasattr(proxy, "_hf_hook")
    assert loader.calls == 0


def test_out_of_memory_while_loading_says_what_to_do():
    def too_big():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 136.00 MiB.")

    proxy = ondeck.LazyModule("transformer", too_big, spec=ondeck.ComponentSpec(nbytes=2**30))
    with pytest.raises(ondeck.LoadError, match="out of memory while loading.*policy='release'"):
        proxy.materialize()


def test_memory_error_while_loading_is_out_of_memory_too():
    def host_full():
        raise MemoryError("cannot allocate 1 GiB")

    proxy = ondeck.LazyModule("vae", host_full)
    with pytest.raises(ondeck.LoadError, match="out of memory while loading"):
        proxy.materialize()
