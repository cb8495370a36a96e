"""``import ondeck.diffusers``: diffusers pipelines with their components on demand.

    import ondeck.diffusers

    pipe = ondeck.diffusers.from_pretrained("Wan2.1-T2V-14B-Diffusers", torch_dtype=torch.bfloat16)
    frames = pipe("a red fox in the snow", num_frames=33).frames

A thin front for :mod:`ondeck.integrations.diffusers`; importing ``ondeck`` alone
does not import diffusers.
"""

from .integrations.diffusers import (
    ComponentTurn,
    DiffusersRuntime,
    PipelineComponent,
    from_pretrained,
    ondeck_pipeline_class,
)

__all__ = [
    "ComponentTurn",
    "DiffusersRuntime",
    "PipelineComponent",
    "from_pretrained",
    "ondeck_pipeline_class",
]
