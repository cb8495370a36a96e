"""Any diffusers pipeline, with its heavy components loaded on demand.

``from_pretrained(path)`` returns the genuine diffusers pipeline object (an instance of
the class ``model_index.json`` names), whose ``nn.Module`` components are
:class:`PipelineComponent` proxies: nothing is loaded until a call first uses a
component, and the policy decides when it goes.

A call of the pipeline is modelled as ondeck stages, one per component, in the order
the call first touches them (``model_cpu_offload_seq`` until a call has been seen).
A stage starts when its component is first touched in the call and holds every
component the call touches until the next stage starts, so ``release`` frees a
component once no later stage needs it, and ``budget`` keeps components resident
across calls, evicts by next use and prefetches the next one, exactly as for an
ondeck :class:`~ondeck.Pipeline`.

What survives a release, because it is re-applied after every load:

- transforms: ``pipe.ondeck.add_transform("transformer", torch.compile)``;
- LoRA: ``pipe.load_lora_weights(...)`` and the adapter methods of the components
  (``set_adapters``, ``fuse_lora``, ``delete_adapters``, ...), which are recorded as
  transforms instead of loading the component;
- settings made through a component: ``pipe.vae.enable_tiling()``,
  ``pipe.transformer.compile()``, ``pipe.transformer.set_attention_backend(...)``,
  ``pipe.vae.use_framewise_decoding = False`` (plain values);
- placement: ``pipe.to(device)`` and ``pipe.vae.to(dtype)`` redirect future loads.
"""

from .component import PipelineComponent
from .loading import from_pretrained
from .pipeline_class import ondeck_pipeline_class
from .runtime import ComponentTurn, DiffusersRuntime

__all__ = [
    "ComponentTurn",
    "DiffusersRuntime",
    "PipelineComponent",
    "from_pretrained",
    "ondeck_pipeline_class",
]
