"""benchmarks/experiments/run_trace.py's analysis: a stage's device time split by kernel
kind and its idle time, from a chrome trace and the tracker's events."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def run_trace(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from experiments import run_trace

    yield run_trace
    for name in ("common", "families", "experiments.run_trace", "experiments"):
        sys.modules.pop(name, None)


def kernel(name: str, start_us: float, us: float, stream: int = 7) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": start_us, "dur": us,
            "args": {"stream": stream}}  # fmt: skip


def test_kernel_kinds(run_trace):
    kinds = {
        "nvjet_tst_256x128_64x4_2x1_v_bz_coopB_TNN": "gemm",
        "sm90_xmma_gemm_bf16bf16_bf16f32": "gemm",
        "void pytorch_flash::flash_fwd_kernel<...>": "attention",
        "widen": "upcast",
        "void at::native::unrolled_elementwise_kernel<direct_copy_kernel_cuda>": "conversion",
        "void at::native::vectorized_elementwise_kernel<4, RMSNorm>": "other",
    }
    assert {name: run_trace.kernel_kind(name) for name in kinds} == kinds


def test_a_stages_busy_time_by_kind_and_its_idle_time(run_trace):
    events = [
        kernel("spin", 0, 10),
        kernel("nvjet_gemm", 1000, 500),
        kernel("widen", 1500, 200),
        kernel("flash_fwd", 2000, 800),
        kernel("nvjet_gemm", 9000, 500),  # after the stage: not its own
        {
            "ph": "X",
            "cat": "gpu_memcpy",
            "name": "Memcpy HtoD (Pinned -> Device)",
            "ts": 1700,
            "dur": 200,
            "args": {"stream": 9, "bytes": 1000},
        },  # fmt: skip
    ]
    run = {
        "events": [
            [0.0005, "stage_start", "transformer", 0, 0.0],
            [0.0035, "stage_end", "transformer", 0, 0.0],
        ],  # fmt: skip
        "stacks": [],
    }
    (stage,) = run_trace.analyse({"traceEvents": events}, run)["stages"]
    assert stage["kernels"] == {"attention": 1, "gemm": 1, "upcast": 1}
    assert stage["kinds"] == pytest.approx({"attention": 0.0008, "gemm": 0.0005, "upcast": 0.0002})
    assert stage["gpu_busy_s"] == pytest.approx(0.0015)
    # Idle 0.5 ms before the first product, 0.3 ms between the upcast and attention (0.2
    # of it while a copy ran), 0.7 ms from attention's end to the stage's.
    assert stage["idle_copying_s"] == pytest.approx(0.0002)
    assert stage["idle_no_copy_s"] == pytest.approx(0.0013)
