"""The Triton upcast of float8 weights: torch's conversion bit for bit, every value, and
the kernel the stored layers' hooks use for their forward."""

from __future__ import annotations

import pytest
import torch

from ondeck.loading import fp8, upcast

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

FLOAT8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def kernel_runs() -> bool:
    index = torch.cuda.current_device()
    return upcast._converts_float8(index) and upcast._kernel() is not None


def builders() -> list:
    import threading

    return [t for t in threading.enumerate() if t.name == "ondeck-upcast-build"]


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits where a value is a number; NaN where the other is NaN (its payload
    may differ)."""
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return False
    width = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a[~nan].view(width), b[~nan].view(width))


@pytest.fixture
def counted(monkeypatch):
    """Counts the kernel's launches."""
    if not kernel_runs():
        pytest.skip("no Triton, or a device without float8 conversion")
    for thread in builders():  # an earlier load's, which would count here
        thread.join(timeout=120)
    launches = []
    kernel = upcast._kernel()

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(upcast, "_kernel", lambda: Counting())
    return launches


@pytest.mark.parametrize("storage", FLOAT8)
@pytest.mark.parametrize("compute", [torch.bfloat16, torch.float16, torch.float32])
def test_every_float8_value_upcasts_to_torchs_bits(counted, storage, compute):
    every = torch.arange(256, dtype=torch.uint8, device="cuda").view(storage)
    # Enough elements for the kernel, and a count that ends inside a block.
    rows = upcast._SMALLEST // 7 + 11
    stored = every.repeat(rows * 7 // 256 + 1)[: rows * 7].reshape(rows, 7)
    assert stored.numel() % upcast._BLOCK
    widened = upcast.upcast(stored, compute)
    if (storage, compute) == (torch.float8_e5m2, torch.bfloat16):
        assert not counted, "float8_e5m2 to bfloat16 is torch's to convert"
    else:
        assert counted, "the kernel did not run"
    assert widened.dtype == compute and widened.shape == stored.shape
    assert same_values(widened, stored.to(compute))


def test_where_the_kernel_does_not_apply_torch_converts(counted, monkeypatch):
    big = torch.randn(512, 512, device="cuda").to(torch.float8_e4m3fn)
    cases = [
        big[:, :256],  # not contiguous
        big[:8],  # too few elements
        big.cpu(),
    ]
    for stored in cases:
        assert same_values(upcast.upcast(stored, torch.bfloat16), stored.to(torch.bfloat16))
    monkeypatch.setenv("ONDECK_TRITON_UPCAST", "0")
    assert same_values(upcast.upcast(big, torch.bfloat16), big.to(torch.bfloat16))
    assert not counted


def test_a_stored_layer_computes_with_the_kernels_upcast(counted):
    torch.manual_seed(0)
    layer = torch.nn.Linear(512, 1024, device="cuda", dtype=torch.bfloat16)
    reference = torch.nn.Linear(512, 1024, device="cuda", dtype=torch.bfloat16)
    layer.weight.data = layer.weight.data.to(torch.float8_e4m3fn)
    reference.weight.data = layer.weight.data.to(torch.bfloat16)
    reference.bias.data = layer.bias.data.clone()
    holder = torch.nn.Sequential(layer)
    fp8.upcast_for_compute(holder, "diffusers", torch.float8_e4m3fn, torch.bfloat16, ["0"])
    x = torch.randn(4, 512, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(holder(x), reference(x))
    assert counted, "the layer's hook did not use the kernel"
    assert layer.weight.dtype == torch.float8_e4m3fn


def test_a_stored_load_builds_the_kernel_on_a_thread_of_its_own(counted, monkeypatch):
    monkeypatch.setattr(upcast, "_prepared", set())
    upcast.prepare("cuda", torch.float8_e5m2, torch.float16)
    upcast.prepare("cuda", torch.float8_e5m2, torch.float16)  # once per dtypes
    started = builders()
    assert len(started) <= 1
    for thread in started:
        thread.join(timeout=120)
    assert len(counted) == 1, "the preparation did not run the kernel"
    upcast.prepare("cpu", torch.float8_e5m2, torch.float16)
    assert len(counted) == 1


def test_under_compile_the_upcast_is_torchs_and_the_graph_whole():
    stored = torch.randn(512, 512, device="cuda").to(torch.float8_e4m3fn)
    compiled = torch.compile(lambda w: upcast.upcast(w, torch.bfloat16) * 2, fullgraph=True)
    assert same_values(compiled(stored), stored.to(torch.bfloat16) * 2)
