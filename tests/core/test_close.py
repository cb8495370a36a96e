"""A pipeline closes: its policy's threads are joined and nothing stays resident; a
closed pipeline still runs (and starts what it needs again)."""

from __future__ import annotations

import threading

import pytest
import torch

from .helpers import ThreeStages, state, three_loaders


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("ondeck-prefetch")]


@pytest.mark.parametrize("policy", ["budget", "release", "eager"])
def test_with_block_joins_threads_and_frees_everything(policy):
    before = set(prefetch_threads())
    options = {"budget": 10**9} if policy == "budget" else {}
    with ThreeStages(three_loaders(), policy=policy, **options) as pipe:
        first = pipe(state())["x"]
        if policy == "budget":
            assert set(prefetch_threads()) - before  # its prefetch thread ran
    assert set(prefetch_threads()) <= before
    assert list(pipe.resident()) == []
    again = pipe(state())["x"]  # closing is not the end of the pipeline
    assert torch.equal(first, again)
    pipe.close()
    assert list(pipe.resident()) == []
