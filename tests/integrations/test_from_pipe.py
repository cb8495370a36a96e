"""diffusers' ``from_pipe`` on an ondeck pipeline is refused with what to do instead:
the pipeline it would build has no runtime, so what it loaded would stay loaded."""

from __future__ import annotations

import numpy as np
import pytest

import ondeck
import ondeck.diffusers
from ondeck.errors import OndeckError

from .breadth_pipelines import ALL_FAMILIES
from .tiny_pipelines import run

FAMILY = ALL_FAMILIES["wan"]
REFUSED = r"from_pipe cannot take this ondeck WanPipeline.*ondeck\.diffusers\.from_pretrained"


def load(path):
    pipe = ondeck.diffusers.from_pretrained(path, policy="release")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def loaded(pipe) -> list[str]:
    return sorted(name for name, proxy in pipe.ondeck.deferred.items() if ondeck.is_loaded(proxy))


def test_from_pipe_is_refused_with_what_to_do_instead(folders):
    pipe = load(folders["wan"])
    with pytest.raises(OndeckError, match=REFUSED):
        FAMILY.pipeline_type().from_pipe(pipe)


def test_from_pipe_given_the_components_is_refused_before_loading_any(folders):
    """Passing the components (as diffusers' warning advises) is refused too, and
    nothing loads: diffusers' ``.to(dtype)`` on the new pipeline would load them all."""
    pipe = load(folders["wan"])
    with pytest.raises(OndeckError, match=REFUSED):
        FAMILY.pipeline_type().from_pipe(pipe, vae=pipe.vae, transformer=pipe.transformer)
    assert loaded(pipe) == []


def test_an_auto_pipelines_from_pipe_is_refused(folders):
    from diffusers import AutoPipelineForImage2Image

    pipe = ondeck.diffusers.from_pretrained(folders["flux"], policy="release")
    with pytest.raises(OndeckError, match="from_pipe cannot take this ondeck FluxPipeline"):
        AutoPipelineForImage2Image.from_pipe(pipe)
    assert loaded(pipe) == []


def test_the_pipeline_works_as_before_after_a_refused_from_pipe(folders, references):
    pipe = load(folders["wan"])
    with pytest.raises(OndeckError, match=REFUSED):
        FAMILY.pipeline_type().from_pipe(pipe)

    assert np.array_equal(run(pipe, FAMILY), references["wan"][0])
    assert loaded(pipe) == []
