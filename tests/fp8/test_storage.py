"""fp8 storage, bf16 compute: ondeck's loads equal diffusers' own layerwise casting."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from references import in_fresh_tensors

import ondeck
from ondeck.lazy import module_nbytes
from ondeck.loading import ComponentLoader, HostCache, reads

from .conftest import FP8, same_bits, transformer_inputs


def reference_transformer(folder, compute=torch.bfloat16):
    """diffusers' way: the model loaded in its compute dtype, then layerwise casting."""
    from diffusers import WanTransformer3DModel

    model = in_fresh_tensors(
        WanTransformer3DModel.from_pretrained(folder / "transformer", torch_dtype=compute)
    )
    model.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=compute)
    return model.eval()


def run_transformer(model):
    latents, timestep, text = transformer_inputs(model.config)
    with torch.no_grad():
        return model(latents, timestep, text, return_dict=False)[0]


def watch_reads(monkeypatch) -> list:
    seen: list = []
    original = reads.read_into

    def watch(jobs, **options):
        seen.extend(jobs)
        return original(jobs, **options)

    monkeypatch.setattr(reads, "read_into", watch)
    return seen


@pytest.mark.parametrize("saved_as", ["wan_fp32", "wan_bf16"])
def test_fp8_storage_equals_diffusers_layerwise_casting_bit_for_bit(saved_as, request):
    folder = request.getfixturevalue(saved_as)
    ours = ComponentLoader(folder, "transformer", dtype=torch.bfloat16, storage_dtype="fp8")()
    reference = reference_transformer(folder)

    theirs = reference.state_dict()
    mine = ours.state_dict()
    assert mine.keys() == theirs.keys()
    different = [key for key in mine if not same_bits(mine[key], theirs[key])]
    assert different == []
    assert sum(tensor.dtype == FP8 for tensor in mine.values()) > len(mine) // 2
    assert same_bits(run_transformer(ours), run_transformer(reference))


def test_layers_diffusers_skips_or_keeps_in_float32_stay_as_they_are(wan_bf16):
    model = ComponentLoader(wan_bf16, "transformer", dtype=torch.bfloat16, storage_dtype="fp8")()
    dtypes = {name: tensor.dtype for name, tensor in model.state_dict().items()}
    assert dtypes["blocks.0.attn1.to_q.weight"] == FP8
    assert dtypes["blocks.0.ffn.net.0.proj.weight"] == FP8
    # WanTransformer3DModel keeps these in float32 and skips its embeddings and norms.
    assert dtypes["blocks.0.scale_shift_table"] == torch.float32
    assert dtypes["blocks.0.norm2.weight"] == torch.float32
    assert dtypes["patch_embedding.weight"] == torch.bfloat16
    assert dtypes["condition_embedder.text_embedder.linear_1.weight"] == torch.bfloat16
    assert dtypes["proj_out.weight"] == torch.bfloat16


def rounded_to_fp8(model):
    """The hand-made reference: every Linear and Embedding weight (UMT5 has no norm or
    projection among them) rounded to fp8 and back, the model computing in bf16."""
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, (torch.nn.Linear, torch.nn.Embedding)):
                layer.weight.copy_(layer.weight.to(FP8).to(layer.weight.dtype))
    return model


@pytest.mark.parametrize("pipelined", [False, True])
def test_text_encoder_in_fp8_equals_its_weights_rounded_to_fp8_computed_in_bf16(
    wan_bf16, pipelined
):
    from transformers import UMT5EncoderModel

    loader = ComponentLoader(
        wan_bf16, "text_encoder", dtype=torch.bfloat16, storage_dtype="fp8", pipelined=pipelined
    )
    ours, filling = loader.begin()
    assert (filling is not None) == pipelined  # the copy-beside hooks, or in place
    if filling is not None:
        filling.wait()
    reference = rounded_to_fp8(
        in_fresh_tensors(
            UMT5EncoderModel.from_pretrained(wan_bf16 / "text_encoder", torch_dtype=torch.bfloat16)
        ).eval()
    )
    assert isinstance(ours, UMT5EncoderModel)
    assert type(ours).__name__ == "UMT5EncoderModel"
    # transformers answers its first parameter's dtype; pipelines cast embeddings to it.
    assert ours.dtype == torch.bfloat16
    assert ours.shared.weight.dtype == FP8
    # UMT5 keeps `wo` "in float32" for float16's range; with bf16 compute it is stored too.
    feed_forward = ours.encoder.block[0].layer[1].DenseReluDense
    assert feed_forward.wo.weight.dtype == FP8
    ids = torch.tensor([[5, 9, 13, 2]])
    with torch.no_grad():
        mine = ours(input_ids=ids).last_hidden_state
        theirs = reference(input_ids=ids).last_hidden_state
    assert mine.dtype == torch.bfloat16
    assert same_bits(mine, theirs)
    assert feed_forward.wo.weight.dtype == FP8  # the forward left fp8 behind


class _Shapes(torch.utils._python_dispatch.TorchDispatchMode):
    """The shape and dtype of every tensor the ops inside it return."""

    def __init__(self):
        super().__init__()
        self.made: list[tuple[tuple[int, ...], torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.made.append((tuple(tensor.shape), tensor.dtype))
        return out


@pytest.mark.parametrize("pipelined", [False, True])
def test_an_fp8_embedding_upcasts_the_rows_it_looks_up_never_its_whole_table(wan_bf16, pipelined):
    loader = ComponentLoader(
        wan_bf16, "text_encoder", dtype=torch.bfloat16, storage_dtype="fp8", pipelined=pipelined
    )
    model = loader()
    table = model.shared.weight
    assert table.dtype == FP8
    ids = torch.tensor([[5, 9, 13, 2], [7, 7, 0, 31]])
    with torch.no_grad(), _Shapes() as shapes:
        rows = model.shared(ids)
    # The values diffusers' hook gives: the whole table upcast, then looked up.
    assert same_bits(rows, torch.nn.functional.embedding(ids, table.to(torch.bfloat16)))
    assert table.dtype == FP8 and model.shared.weight is table
    assert shapes.made, "the dispatch mode saw no op"
    # Views of the table in fp8 and bytes, and bf16 of the rows alone: no bf16 table.
    assert (tuple(table.shape), torch.bfloat16) not in shapes.made, shapes.made
    assert (tuple(ids.shape) + (table.shape[1],), torch.bfloat16) in shapes.made
    # A lookup that rewrites its table (max_norm) goes through the casting hook instead.
    model.shared.max_norm = 1e9
    with torch.no_grad(), _Shapes() as shapes:
        again = model.shared(ids)
    model.shared.max_norm = None
    assert same_bits(again, rows)
    assert (tuple(table.shape), torch.bfloat16) in shapes.made
    assert model.shared.weight.dtype == FP8


def test_an_embedding_subclass_with_its_own_forward_is_upcast_whole(wan_bf16):
    from ondeck.loading import fp8

    class Scaled(torch.nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) * 2

    layer = Scaled(8, 4)
    assert not fp8._gathers_rows(layer)
    assert fp8._gathers_rows(torch.nn.Embedding(8, 4))
    holder = torch.nn.Sequential(layer).to(torch.bfloat16)
    fp8.upcast_for_compute(holder, "torch", FP8, torch.bfloat16, ["0"])
    ids = torch.tensor([1, 3])
    with torch.no_grad():
        assert same_bits(holder(ids), layer.weight.to(torch.bfloat16)[ids] * 2)


def test_with_float16_compute_the_layers_kept_in_float32_stay_float32(wan_bf16):
    model = ComponentLoader(
        wan_bf16, "text_encoder", dtype=torch.float16, storage_dtype="fp8", pipelined=False
    )()
    feed_forward = model.encoder.block[0].layer[1].DenseReluDense
    assert feed_forward.wo.weight.dtype == torch.float32
    assert feed_forward.wi_0.weight.dtype == FP8
    with torch.no_grad():
        hidden = model(input_ids=torch.tensor([[5, 9, 13, 2]])).last_hidden_state
    assert hidden.dtype == torch.float16 and torch.isfinite(hidden).all()


def test_the_plan_counts_the_text_encoders_kept_layers_as_fp8(wan_bf16):
    from transformers import UMT5EncoderModel

    from ondeck.pipelines.wan import WanTextToVideo

    computed = UMT5EncoderModel.from_pretrained(
        wan_bf16 / "text_encoder", torch_dtype=torch.bfloat16
    )
    stored_in_fp8 = set()
    for layer in computed.modules():
        if isinstance(layer, (torch.nn.Linear, torch.nn.Embedding)):
            stored_in_fp8.add(id(layer.weight))
    tensors = [*computed.parameters(), *computed.buffers()]  # tied weights once
    expected = sum(t.numel() * (1 if id(t) in stored_in_fp8 else t.element_size()) for t in tensors)
    wo_bytes = sum(
        block.layer[1].DenseReluDense.wo.weight.numel() for block in computed.encoder.block
    )

    pipe = WanTextToVideo.from_folder(
        wan_bf16, device="cpu", dtype=torch.bfloat16, storage_dtype="fp8", progress=False
    )
    planned = pipe.plan().component_bytes["text_encoder"]
    assert planned == expected  # `wo` at one byte a weight, not two
    assert module_nbytes(pipe.components["text_encoder"].materialize()) == planned
    bf16 = sum(t.numel() * t.element_size() for t in tensors)
    # The resident ratio from the headers: every Linear and Embedding weight halves.
    assert planned / bf16 < (planned + wo_bytes) / bf16


def test_stored_tensors_are_allocated_in_fp8_and_cast_as_they_are_read(wan_fp32, monkeypatch):
    seen = watch_reads(monkeypatch)
    ComponentLoader(wan_fp32, "transformer", dtype=torch.bfloat16, storage_dtype="fp8")()
    weights = {job.info.name: job for job in seen}
    query = weights["blocks.0.attn1.to_q.weight"]
    # Read from the float32 file straight into its fp8 home: no wider copy is ever made.
    assert query.info.dtype == torch.float32
    assert query.destination.dtype == FP8
    assert query.via == torch.bfloat16  # rounded as the bfloat16 model would be
    wider = [job for job in seen if job.destination.dtype.itemsize > 1 and job.via is not None]
    assert wider == []


def test_the_spec_counts_the_stored_bytes_before_loading(wan_bf16, monkeypatch):
    computed = ComponentLoader(wan_bf16, "transformer", dtype=torch.bfloat16)
    stored = ComponentLoader(wan_bf16, "transformer", dtype=torch.bfloat16, storage_dtype="fp8")
    seen = watch_reads(monkeypatch)
    predicted = stored.spec.nbytes
    assert seen == []
    assert predicted < computed.spec.nbytes
    assert module_nbytes(stored()) == predicted


def test_a_float8_checkpoint_loads_as_float8_without_an_upcast_copy(wan_float8, monkeypatch):
    assert ComponentLoader(wan_float8, "transformer").storage_dtype == FP8  # by default
    seen = watch_reads(monkeypatch)
    loader = ComponentLoader(wan_float8, "transformer", dtype=torch.bfloat16)
    assert loader.storage_dtype == FP8
    model = loader()
    float8_reads = [job for job in seen if job.info.dtype == FP8]
    assert float8_reads
    assert all(job.destination.dtype == FP8 and job.via is None for job in float8_reads)
    assert same_bits(run_transformer(model), run_transformer(reference_transformer(wan_float8)))


def test_release_frees_and_the_reload_is_fp8_again(wan_bf16):
    proxy = ondeck.LazyModule(
        "transformer",
        ComponentLoader(wan_bf16, "transformer", dtype=torch.bfloat16, storage_dtype="fp8"),
    )
    first = run_transformer(proxy.materialize())
    stored = module_nbytes(proxy.materialize())
    assert proxy.release() == stored
    assert not ondeck.is_loaded(proxy)
    assert proxy.blocks[0].attn1.to_q.weight.dtype == FP8
    assert same_bits(run_transformer(proxy.materialize()), first)
    assert module_nbytes(proxy.materialize()) == stored  # the forward left fp8 behind


def test_the_host_cache_holds_the_stored_bytes(wan_fp32, monkeypatch):
    monkeypatch.setattr(HostCache, "enabled_for", staticmethod(lambda device: True))
    cache = HostCache(budget_bytes=2**30, pin=False)
    loader = ComponentLoader(
        wan_fp32, "transformer", dtype=torch.bfloat16, storage_dtype="fp8", host_cache=cache
    )
    first = loader()
    assert loader.last_source != "host cache"
    held = sum(slot.nbytes for slot in loader.template.slots)  # the file's tensors, as stored
    assert cache.resident_bytes == held < loader.folder.file_bytes("transformer") // 2
    second = loader()
    assert loader.last_source == "host cache"
    for key, tensor in first.state_dict().items():
        assert same_bits(second.state_dict()[key], tensor), key


def test_the_wan_pipeline_runs_with_text_encoder_and_transformer_in_fp8(wan_bf16):
    from ondeck.pipelines.wan import WanTextToVideo

    def frames(storage_dtype):
        pipe = WanTextToVideo.from_folder(
            wan_bf16,
            device="cpu",
            dtype=torch.bfloat16,
            policy="budget",
            progress=False,
            storage_dtype=storage_dtype,
        )
        shape = dict(height=16, width=16, num_frames=5, num_inference_steps=2)
        video = pipe.generate("a fox", seed=0, max_sequence_length=16, **shape)
        return pipe, video

    pipe, stored = frames("fp8")
    _, computed = frames(None)
    # The text encoder's embeddings reach the transformer in bf16 (its dtype answers bf16).
    assert pipe.components["text_encoder"].dtype == torch.bfloat16
    assert pipe.components["text_encoder"].shared.weight.dtype == FP8
    assert pipe.components["transformer"].blocks[0].attn1.to_q.weight.dtype == FP8
    assert pipe.components["vae"].decoder.conv_in.weight.dtype == torch.float32
    assert np.isfinite(stored).all()
    difference = np.abs(stored - computed).max()
    assert 0 < difference < 0.25


def test_a_pipelined_load_in_fp8_equals_diffusers_and_caches_the_stored_bytes(
    wan_fp32, monkeypatch
):
    monkeypatch.setattr(HostCache, "enabled_for", staticmethod(lambda device: True))
    cache = HostCache(budget_bytes=2**30, pin=False)
    loader = ComponentLoader(
        wan_fp32,
        "transformer",
        dtype=torch.bfloat16,
        storage_dtype="fp8",
        pipelined=True,
        host_cache=cache,
    )
    module, filling = loader.begin()
    assert filling is not None  # its blocks arrive behind the compute
    first = run_transformer(module)  # each block waits for its own weights
    reference = run_transformer(reference_transformer(wan_fp32))
    assert same_bits(first, reference)
    filling.wait()
    assert cache.resident_bytes == sum(slot.nbytes for slot in loader.template.slots)
    again = loader()
    assert loader.last_source == "host cache"
    assert same_bits(run_transformer(again), reference)


class _Upcasts(torch.utils._python_dispatch.TorchDispatchMode):
    """The bytes of every fp8-to-wider copy the ops inside it make."""

    def __init__(self):
        super().__init__()
        self.copies: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and args[0].dtype == FP8:
            self.copies.append(out.numel() * out.element_size())
        return out


@pytest.mark.parametrize("component", ["transformer", "text_encoder"])
def test_upcast_bytes_are_the_largest_copies_one_stored_layer_makes(wan_bf16, component):
    loader = ComponentLoader(wan_bf16, component, dtype=torch.bfloat16, storage_dtype="fp8")
    planned = loader.upcast_bytes  # before anything loads: from the skeleton
    model = loader()
    layers = [
        sum(t.numel() for t in layer.parameters(recurse=False) if t.dtype == FP8) * 2
        for layer in model.modules()
        if isinstance(layer, (torch.nn.Linear, torch.nn.Conv3d))
    ]
    assert planned == max(layers) > 0
    with torch.no_grad(), _Upcasts() as seen:
        if component == "transformer":
            run_transformer(model)
        else:
            model(input_ids=torch.tensor([[5, 9, 13, 2]]))
    # The forward's largest copy is one of those layers' weights; none is larger.
    assert seen.copies and max(seen.copies) <= planned
    assert max(seen.copies) >= max(layers) // 2
    assert ComponentLoader(wan_bf16, component, dtype=torch.bfloat16).upcast_bytes == 0
