"""Tiny modules and counting loaders shared by the core tests."""

from __future__ import annotations

import threading
import time

import torch

import ondeck
from ondeck.loader import DeclaredLoader


class CountingLoader(DeclaredLoader):
    """A zero-argument loader that counts its calls and builds a fresh Linear; it declares
    the loader protocol with its defaults (tests set ``upcast_bytes`` on it)."""

    def __init__(self, features: int = 64, delay: float = 0.0):
        self.features = features
        self.delay = delay
        self.calls = 0
        self._lock = threading.Lock()

    def __call__(self) -> torch.nn.Module:
        if self.delay:
            time.sleep(self.delay)
        with self._lock:
            self.calls += 1
        torch.manual_seed(self.features)
        return torch.nn.Linear(self.features, self.features)


def lazy_linear(
    name: str = "m", features: int = 64, **spec
) -> tuple[ondeck.LazyModule, CountingLoader]:
    loader = CountingLoader(features)
    spec.setdefault("cls", torch.nn.Linear)
    return ondeck.LazyModule(name, loader, spec=ondeck.ComponentSpec(**spec)), loader


class Apply(ondeck.Stage):
    """A stage that runs one component on state['x']."""

    def __init__(self, component, name: str | None = None):
        super().__init__()
        self.component = component
        if name:
            self.name = name

    def forward(self, state):
        state["x"] = self.component(state["x"])
        state.setdefault("order", []).append(self.name)
        return state


class ThreeStages(ondeck.Pipeline):
    lazy_components = ("encoder", "denoiser", "decoder")

    def create_stages(self):
        c = self.components
        return [
            Apply(c["encoder"], "Encode"),
            Apply(c["denoiser"], "Denoise"),
            Apply(c["decoder"], "Decode"),
        ]


class ProfiledThreeStages(ThreeStages):
    """Three stages whose activation profile is kept per input width, as "three"."""

    profile_model = "three"

    def profile_shape(self, state):
        return {"width": state["x"].shape[1]}


def use_profiles(monkeypatch, path):
    """Activation profiles in ``path`` stand in for the user's for this test."""
    from ondeck import profiles

    store = profiles.ActivationProfiles(path)
    monkeypatch.setattr(profiles, "_default", store)
    return store


def three_loaders(features: int = 32) -> dict[str, CountingLoader]:
    return {name: CountingLoader(features) for name in ("encoder", "denoiser", "decoder")}


def state(features: int = 32) -> dict:
    return {"x": torch.ones(2, features)}


class ClockEvent:
    """A timing event on the host clock, in the shape of CUDA's (milliseconds apart)."""

    def __init__(self):
        self.at = None

    def record(self, stream=None):
        self.at = time.perf_counter()

    def synchronize(self):
        assert self.at is not None

    def elapsed_time(self, end):
        return (end.at - self.at) * 1000


class FixedEvent:
    """A timing event in the shape of CUDA's that puts every call at ``MILLISECONDS``:
    a plan weighed by timed calls decides the same on any machine."""

    MILLISECONDS = 0.1

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return self.MILLISECONDS


class TorchOperations(torch.overrides.TorchFunctionMode):
    """The torch functions this thread calls meanwhile, attribute reads left out. Each
    one gives up the interpreter's lock, which a load beside a running pipeline then waits
    to get back."""

    def __init__(self):
        super().__init__()
        self.called: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name not in ("__get__", "__set__"):
            self.called.append(name)
        return func(*args, **(kwargs or {}))
