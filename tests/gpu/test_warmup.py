"""The CUDA libraries started behind a pipeline's set-up, on the device."""

from __future__ import annotations

import pytest
import torch

from ondeck import warmup

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_every_operation_ran_on_the_device_and_a_second_start_does_nothing():
    assert "cuda:0" in warmup._started  # the session's start (conftest)
    warmup.wait()
    assert warmup.last_error is None
    assert warmup.start("cuda:0", torch.float16) is None
