"""fp8 storage into CUDA memory: each chunk cast on the device as it arrives, through the
reading processes and the threads, equal to diffusers' layerwise casting bit for bit."""

from __future__ import annotations

import shutil

import pytest
import torch

from ondeck.embedded import build_wan_folder
from ondeck.lazy import module_nbytes
from ondeck.loading import ComponentLoader, HostCache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The tiny Wan folder as saved (float32), and with its transformer in bfloat16."""
    from safetensors.torch import load_file, save_file

    fp32 = build_wan_folder(tmp_path_factory.mktemp("fp8-cuda") / "fp32", preset="tiny")
    bf16 = tmp_path_factory.mktemp("fp8-cuda") / "bf16"
    shutil.copytree(fp32, bf16, dirs_exist_ok=True)
    for path in (bf16 / "transformer").glob("*.safetensors"):
        tensors = {
            key: value.to(torch.bfloat16) if value.is_floating_point() else value
            for key, value in load_file(str(path)).items()
        }
        save_file(tensors, str(path), metadata={"format": "pt"})
    return {"fp32": fp32, "bf16": bf16}


@pytest.fixture(params=["processes", "threads"])
def readers(request, monkeypatch) -> str:
    monkeypatch.setenv("ONDECK_READ_PROCESSES", "1" if request.param == "processes" else "0")
    return request.param


def reference(folder):
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel.from_pretrained(
        folder / "transformer", torch_dtype=torch.bfloat16
    ).to("cuda")
    model.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=torch.bfloat16)
    return model.eval()


def forward(model):
    config = model.config
    generator = torch.Generator().manual_seed(3)
    latents = torch.randn(1, config.in_channels, 2, 8, 8, generator=generator)
    text = torch.randn(1, 5, config.text_dim, generator=generator)
    with torch.no_grad():
        return model(
            latents.to("cuda", torch.bfloat16),
            torch.tensor([500], device="cuda"),
            text.to("cuda", torch.bfloat16),
            return_dict=False,
        )[0]


def same_bits(a, b) -> bool:
    return a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def assert_same_module(ours, theirs) -> None:
    mine, expected = ours.state_dict(), theirs.state_dict()
    assert mine.keys() == expected.keys()
    assert [key for key in mine if not same_bits(mine[key], expected[key])] == []


@pytest.mark.parametrize("saved_as", ["bf16", "fp32"])
def test_fp8_into_cuda_equals_diffusers_layerwise_casting(folders, saved_as, readers):
    loader = ComponentLoader(
        folders[saved_as],
        "transformer",
        device="cuda",
        dtype=torch.bfloat16,
        storage_dtype="fp8",
        pipelined=False,
    )
    ours = loader()
    theirs = reference(folders[saved_as])
    assert ours.blocks[0].attn1.to_q.weight.dtype == FP8
    assert_same_module(ours, theirs)
    assert same_bits(forward(ours), forward(theirs))
    assert module_nbytes(ours) == loader.spec.nbytes


def test_pipelined_fp8_into_cuda_computes_as_its_blocks_arrive(folders):
    loader = ComponentLoader(
        folders["bf16"],
        "transformer",
        device="cuda",
        dtype=torch.bfloat16,
        storage_dtype="fp8",
        pipelined=True,
    )
    module, filling = loader.begin()
    output = forward(module)
    filling.wait()
    theirs = reference(folders["bf16"])
    assert same_bits(output, forward(theirs))
    assert_same_module(module, theirs)


def test_the_pinned_host_cache_holds_and_serves_the_fp8_bytes(folders):
    cache = HostCache(budget_bytes=2**30)
    loader = ComponentLoader(
        folders["fp32"],
        "transformer",
        device="cuda",
        dtype=torch.bfloat16,
        storage_dtype="fp8",
        host_cache=cache,
    )
    first = loader()
    held = sum(slot.nbytes for slot in loader.template.slots)
    (key,) = cache.keys()
    entry = cache.get(key)
    # The entry holds each tensor as stored (fp8 where cast), not as the fp32 file has
    # it. (Its pinned arenas round up to powers of two, so resident_bytes alone cannot
    # tell: on a model this small one arena may be as large as half the file.)
    assert sum(raw.numel() for raw in entry.values()) == held
    assert held < loader.folder.file_bytes("transformer")
    assert cache.resident_bytes >= held
    second = loader()
    assert loader.last_source == "host cache"
    assert_same_module(second, first)
    assert same_bits(forward(second), forward(reference(folders["fp32"])))


@pytest.mark.parametrize("via", [None, torch.bfloat16])
def test_casts_of_many_chunks_equal_one_cast_of_the_tensor(tmp_path, readers, via):
    """Tensors of many chunks (the last one short) and of less than one chunk, cast to
    fp8 on the device, equal the tensor cast at once, through either reader."""
    from safetensors.torch import save_file

    from ondeck.loading import ReadJob, read_header, read_into

    generator = torch.Generator().manual_seed(5)
    file_dtype = torch.float32 if via is not None else torch.bfloat16
    tensors = {
        "big": torch.randn(40 * 2**20 // 4 + 3, generator=generator),
        "small": torch.randn(7, 3, generator=generator),
    }
    tensors = {name: t.to(file_dtype) for name, t in tensors.items()}
    path = tmp_path / "cast.safetensors"
    save_file(tensors, str(path))
    jobs = [
        ReadJob(info, torch.empty(info.shape, dtype=FP8, device="cuda"), via=via)
        for info in read_header(path).tensors.values()
    ]
    stats = read_into(jobs, progress=False, buffer_bytes=2**20)
    assert stats.readers == readers
    for job in jobs:
        source = tensors[job.info.name].cuda()
        expected = (source.to(via) if via is not None else source).to(FP8)
        assert same_bits(job.destination, expected), job.info.name


@pytest.mark.parametrize("held_back", ["casts", "copies"])
def test_each_stream_waits_for_the_other_at_a_staging_half(
    tmp_path, readers, monkeypatch, held_back
):
    """A long kernel before each half's casts: the chunks copied into that half next wait
    for them. A long kernel before each chunk's copy: the half's casts wait for its
    copies. Either way every tensor still equals its one cast. Halves of two chunks, so
    the load goes round the staging buffer many times."""
    from safetensors.torch import save_file

    from ondeck.loading import ReadJob, casting, read_header, read_into

    issue = casting.DeviceCasts._issue
    add = casting.DeviceCasts.add
    casts: list[int] = []

    def late_casts(pending, half):
        torch.cuda._sleep(20_000_000)  # tens of milliseconds on the casts stream
        casts.append(len(pending))
        issue(pending, half)

    def late_copy(self, chunk, source):
        with torch.cuda.stream(self.copies):  # before the copy, on its stream
            torch.cuda._sleep(5_000_000)
        add(self, chunk, source)

    def counted(pending, half):
        casts.append(len(pending))
        issue(pending, half)

    chunk = 2**16
    monkeypatch.setattr(casting, "CAST_STAGING_BYTES", 4 * chunk)
    if held_back == "casts":
        monkeypatch.setattr(casting.DeviceCasts, "_issue", staticmethod(late_casts))
    else:
        monkeypatch.setattr(casting.DeviceCasts, "add", late_copy)
        monkeypatch.setattr(casting.DeviceCasts, "_issue", staticmethod(counted))
    generator = torch.Generator().manual_seed(9)
    tensors = {
        f"t{i}": torch.randn(3 * chunk // 2 + i, generator=generator).to(torch.bfloat16)
        for i in range(6)
    }
    path = tmp_path / "late.safetensors"
    save_file(tensors, str(path))
    jobs = [
        ReadJob(info, torch.empty(info.shape, dtype=FP8, device="cuda"))
        for info in read_header(path).tensors.values()
    ]
    stats = read_into(jobs, progress=False, buffer_bytes=chunk, threads=1)
    assert stats.readers == readers
    for job in jobs:
        assert same_bits(job.destination, tensors[job.info.name].cuda().to(FP8)), job.info.name
    # One reader: the chunks arrive in order, and a tensor's chunks side by side in a
    # half are cast together.
    chunks = sum(-(-t.nbytes // chunk) for t in tensors.values())
    assert len(casts) > 2 and sum(casts) < chunks


@pytest.mark.parametrize("stored", ["fp8", "bf16"])
def test_a_read_in_groups_hands_over_each_group_done_on_the_device(tmp_path, monkeypatch, stored):
    """One read through the processes for every group: when a group is handed over, its
    copies (and casts) are done on the device, though each copy and each half's casts
    were queued behind a long kernel. The destinations start as NaN."""
    from safetensors.torch import save_file

    from ondeck.loading import ReadJob, casting, read_header, reads, ring

    monkeypatch.setenv("ONDECK_READ_PROCESSES", "1")
    issue, deliver = casting.DeviceCasts._issue, ring.deliver

    def late_casts(pending, half):
        torch.cuda._sleep(10_000_000)
        issue(pending, half)

    def late_copy(chunk, staged, streams, *rest):
        with torch.cuda.stream(streams[chunk.target.device]):  # before the copy, on its stream
            torch.cuda._sleep(2_000_000)
        return deliver(chunk, staged, streams, *rest)

    chunk = 2**16
    monkeypatch.setattr(casting, "CAST_STAGING_BYTES", 4 * chunk)
    monkeypatch.setattr(casting.DeviceCasts, "_issue", staticmethod(late_casts))
    monkeypatch.setattr(ring, "deliver", late_copy)
    generator = torch.Generator().manual_seed(5)
    tensors = {
        f"t{i}": torch.randn(chunk // 3 + 97 * i, generator=generator).to(torch.bfloat16)
        for i in range(9)
    }
    path = tmp_path / "groups.safetensors"
    save_file(tensors, str(path))
    dtype = FP8 if stored == "fp8" else torch.bfloat16
    jobs = {
        info.name: ReadJob(info, torch.full(info.shape, float("nan"), device="cuda").to(dtype))
        for info in read_header(path).tensors.values()
    }
    groups = [[jobs[f"t{i}"] for i in members] for members in ([8, 0], [3], [1, 2, 4], [7, 5, 6])]
    reached: list[int] = []

    def check(index: int) -> None:
        reached.append(index)
        for job in groups[index]:
            expected = tensors[job.info.name].cuda().to(dtype)
            assert same_bits(job.destination, expected), job.info.name

    stats = reads.read_in_groups(groups, check, progress=False, buffer_bytes=chunk)
    assert stats.readers == "processes" and reached == [0, 1, 2, 3]
