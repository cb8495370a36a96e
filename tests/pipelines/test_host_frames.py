"""Decoded video to host frames: diffusers' values, one host copy."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from ondeck.pipelines.wan import host_frames


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_frames_equal_diffusers_postprocess_bit_for_bit(dtype):
    from diffusers.video_processor import VideoProcessor

    generator = torch.Generator().manual_seed(0)
    # Values past [-1, 1] on both sides: the clamp must be the same too.
    video = (torch.randn(2, 3, 5, 16, 24, generator=generator) * 1.5).to(dtype)
    expected = VideoProcessor(vae_scale_factor=8).postprocess_video(video.clone(), "np")

    frames = host_frames(video.clone())

    assert frames.dtype == np.float32 and frames.shape == expected.shape == (2, 5, 16, 24, 3)
    assert frames.flags.c_contiguous
    assert np.array_equal(frames.view(np.uint32), expected.view(np.uint32))


_PEAK = textwrap.dedent(
    """
    import json, sys
    import torch
    from diffusers.video_processor import VideoProcessor
    from ondeck.pipelines.wan import host_frames

    def status(field):  # KiB
        with open("/proc/self/status") as lines:
            return next(int(line.split()[1]) for line in lines if line.startswith(field))

    processor = VideoProcessor(vae_scale_factor=8)
    video = torch.empty(1, 3, 33, 480, 832).uniform_(-1.2, 1.2)  # 0.15 GiB
    before = status("VmRSS:")
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # the high-water mark starts again from here
    except OSError:
        pass  # not allowed here: the check below finds it
    if status("VmHWM:") > before + 16 * 1024:
        print(json.dumps({"reset": False}))
        sys.exit(0)
    if sys.argv[1] == "ondeck":
        frames = host_frames(video)
    else:
        frames = processor.postprocess_video(video, "np")
    grew = status("VmHWM:") - before
    print(json.dumps({"reset": True, "grew": grew, "frames": frames.nbytes}))
    """
)


def _peak_growth(way: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _PEAK, way], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(sys.platform != "linux", reason="reads and resets /proc/self's VmHWM")
def test_host_frames_take_one_copy_of_host_memory_where_diffusers_takes_two():
    ondeck = _peak_growth("ondeck")
    diffusers = _peak_growth("diffusers")
    if not (ondeck["reset"] and diffusers["reset"]):
        pytest.skip("this kernel does not let a process reset its VmHWM")
    frames_kib = ondeck["frames"] / 1024
    # diffusers: the denormalised frames and their stack; ondeck: the finished array only.
    assert diffusers["grew"] > 1.6 * frames_kib
    assert ondeck["grew"] < 1.2 * frames_kib
