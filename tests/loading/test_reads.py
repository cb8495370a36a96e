"""read_into: every dtype read bit for bit as safetensors reads it, into any destination
and dtype, and a read that fails (a bad file, a failing reader, an interrupt) stops every
reader before it propagates."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from ondeck.errors import LoadError
from ondeck.loading import ReadJob, read_header, read_into, reads, ring

from .helpers import jobs_for, random_tensor, same_bits, write_safetensors

DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def read_all(path, *, dtype=None, **options) -> dict[str, torch.Tensor]:
    """Read every tensor of a file through the reader into fresh CPU tensors."""
    jobs = jobs_for(path, dtype)
    read_into(jobs, progress=False, **options)
    return {job.info.name: job.destination for job in jobs}


@pytest.fixture
def every_dtype(tmp_path):
    tensors = {
        f"t_{str(d).split('.')[1]}": random_tensor(d, (5, 7), i) for i, d in enumerate(DTYPES)
    }
    path = tmp_path / "all.safetensors"
    save_file(tensors, str(path))
    return path


@pytest.mark.parametrize("buffer_bytes", [reads.DEFAULT_BUFFER_BYTES, 64])
def test_every_dtype_reads_bit_identical_to_safetensors(every_dtype, buffer_bytes):
    expected = load_file(str(every_dtype))
    loaded = read_all(every_dtype, buffer_bytes=buffer_bytes, buffer_count=2, threads=3)
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert same_bits(loaded[name], tensor), name


def test_float8_e8m0_reads_bit_identical(tmp_path):
    tensor = random_tensor(torch.float8_e8m0fnu, (9,))
    path = write_safetensors(tmp_path / "e8m0.safetensors", {"t": tensor})
    assert same_bits(read_all(path)["t"], tensor)


def test_odd_sizes_leave_offsets_unaligned_and_still_read_exactly(tmp_path):
    tensors = {
        "bytes": random_tensor(torch.uint8, (7,), 1),
        "floats": random_tensor(torch.float32, (3, 5), 2),
        "odd": random_tensor(torch.int8, (3,), 3),
        "doubles": random_tensor(torch.float64, (11,), 4),
        "halves": random_tensor(torch.bfloat16, (13,), 5),
    }
    path = write_safetensors(tmp_path / "odd.safetensors", tensors, pad=3)
    assert read_header(path).tensors["floats"].start % 4 != 0
    for buffer_bytes in (64, 1 << 20):
        loaded = read_all(path, buffer_bytes=buffer_bytes, buffer_count=1)
        for name, tensor in tensors.items():
            assert same_bits(loaded[name], tensor), name


def test_empty_and_scalar_tensors(tmp_path):
    tensors = {"empty": torch.zeros(0, 4), "scalar": torch.tensor(3.25), "flag": torch.tensor(True)}
    path = tmp_path / "edge.safetensors"
    save_file(tensors, str(path))
    loaded = read_all(path)
    assert loaded["empty"].shape == (0, 4)
    assert loaded["scalar"].shape == () and loaded["scalar"].item() == 3.25
    assert loaded["flag"].item() is True


def test_large_tensor_is_split_across_chunks_and_threads(tmp_path):
    tensor = random_tensor(torch.float32, (1000, 37), 9)
    path = write_safetensors(tmp_path / "big.safetensors", {"w": tensor})
    loaded = read_all(path, buffer_bytes=4096, buffer_count=2, threads=4)
    assert same_bits(loaded["w"], tensor)


def test_destination_of_another_dtype_is_cast(tmp_path):
    tensor = torch.randn(257, 3)
    path = write_safetensors(tmp_path / "w.safetensors", {"w": tensor})
    for dtype in (torch.bfloat16, torch.float64, torch.float16):
        loaded = read_all(path, dtype=dtype, buffer_bytes=64)
        assert torch.equal(loaded["w"], tensor.to(dtype)), dtype


def test_non_contiguous_destination_is_filled(tmp_path):
    tensor = torch.randn(6, 4)
    path = write_safetensors(tmp_path / "w.safetensors", {"w": tensor})
    info = read_header(path).tensors["w"]
    destination = torch.empty(4, 6).t()
    read_into([ReadJob(info, destination)], progress=False)
    assert torch.equal(destination, tensor)


def test_sharded_checkpoint_reads_every_shard(wan_folder):
    from ondeck.loading import ModelFolder

    from .helpers import shard

    expected = load_file(str(next((wan_folder / "vae").glob("*.safetensors"))))
    shard(wan_folder / "vae", parts=3)
    tensors = ModelFolder.open(wan_folder).tensors("vae")
    assert len({info.path for info in tensors.values()}) == 3
    jobs = [ReadJob(info, torch.empty(info.shape, dtype=info.dtype)) for info in tensors.values()]
    read_into(jobs, progress=False, buffer_bytes=256)
    for job in jobs:
        assert same_bits(job.destination, expected[job.info.name]), job.info.name


def test_cpu_reads_of_the_file_dtype_need_no_staging_buffer(tmp_path, monkeypatch):
    path = write_safetensors(tmp_path / "w.safetensors", {"w": torch.randn(100, 100)})
    monkeypatch.setattr(ring, "Slot", None)  # any staging would fail
    assert read_all(path, buffer_bytes=1024)["w"].shape == (100, 100)


def test_staging_never_exceeds_the_ring(tmp_path, monkeypatch):
    buffers, reads = [], []
    original_slot, original_pread = ring.Slot.__init__, ring.pread_exact

    def recording_slot(slot, buffer):
        buffers.append(buffer.nbytes)
        original_slot(slot, buffer)

    def counting_pread(*args):
        reads.append(args[2])
        return original_pread(*args)

    monkeypatch.setattr(ring.Slot, "__init__", recording_slot)
    monkeypatch.setattr(ring, "pread_exact", counting_pread)
    path = write_safetensors(tmp_path / "w.safetensors", {"w": torch.randn(300, 100)})
    read_all(path, dtype=torch.float64, buffer_bytes=1024, buffer_count=3, threads=4)
    assert len(reads) > 3 * len(buffers)  # the 120 kB tensor went through the ring many times
    assert 1 <= len(buffers) <= 3 and set(buffers) == {1024}


def test_chunks_of_the_files_dtype_are_made_without_a_torch_operation(tmp_path):
    # The copying thread of a read through the processes copies each chunk to an
    # address; a view per tensor gives up the interpreter's lock once a tensor.
    from ondeck.loading.chunks import plan_chunks
    from tests.core.helpers import TorchOperations

    tensors = {"w": torch.randn(40, 30), "b": torch.randn(30), "s": torch.tensor(2.0)}
    path = write_safetensors(tmp_path / "w.safetensors", tensors)
    plan, _ = plan_chunks(jobs_for(path), 1024, None)
    with TorchOperations() as operations:
        chunks = list(plan)
    assert operations.called == []
    for chunk in chunks:
        start = chunk.job.destination.data_ptr() + chunk.lo
        assert chunk.address == start == chunk.part().data_ptr()
        assert chunk.part().numel() == chunk.hi - chunk.lo


def test_shape_mismatch_is_a_load_error(tmp_path):
    path = write_safetensors(tmp_path / "w.safetensors", {"w": torch.zeros(4)})
    info = read_header(path).tensors["w"]
    with pytest.raises(LoadError, match="shape") as caught:
        read_into([ReadJob(info, torch.empty(5))], progress=False, component="vae")
    assert "'w'" in str(caught.value) and "'vae'" in str(caught.value)


def test_file_shrunk_after_the_header_was_read_is_a_load_error(tmp_path):
    path = write_safetensors(tmp_path / "w.safetensors", {"w": torch.zeros(1000)})
    info = read_header(path).tensors["w"]
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(LoadError, match="changed after its header was read") as caught:
        read_into([ReadJob(info, torch.empty(1000))], progress=False)
    assert str(path) in str(caught.value)


def test_stats_report_bytes_and_source(tmp_path):
    path = write_safetensors(tmp_path / "w.safetensors", {"w": torch.zeros(1000)})
    info = read_header(path).tensors["w"]
    stats = read_into([ReadJob(info, torch.empty(1000))], progress=False)
    assert stats.nbytes == 4000
    assert stats.source in ("page cache", "disk")
    assert stats.seconds > 0


def test_progress_bar_is_off_for_small_loads_and_when_disabled(monkeypatch):
    monkeypatch.delenv("ONDECK_PROGRESS", raising=False)
    assert reads.progress_bar(1000, True, "vae", "disk") is None
    assert reads.progress_bar(2**30, False, "vae", "disk") is None
    monkeypatch.setenv("ONDECK_PROGRESS", "0")
    assert reads.progress_bar(2**30, True, "vae", "disk") is None
    monkeypatch.setenv("ONDECK_PROGRESS", "1")
    bar = reads.progress_bar(2**30, True, "vae", "page cache")
    assert bar is not None and "vae from page cache" in bar.desc
    bar.close()


def test_while_reading_runs_during_the_read_and_its_failure_stops_it(tmp_path):
    tensor = torch.randn(300, 100)
    path = write_safetensors(tmp_path / "w.safetensors", {"w": tensor})
    info = read_header(path).tensors["w"]
    destination = torch.empty(300, 100, dtype=torch.float64)
    ran = []
    read_into(
        [ReadJob(info, destination)],
        progress=False,
        buffer_bytes=1024,
        while_reading=lambda: ran.append(1),
    )
    assert ran == [1] and torch.equal(destination, tensor.double())

    def fail():
        raise RuntimeError("skeleton broke")

    with pytest.raises(RuntimeError, match="skeleton broke"):
        read_into(
            [ReadJob(info, destination)], progress=False, buffer_bytes=1024, while_reading=fail
        )


def test_a_worker_that_fails_before_its_first_read_fails_the_read(tmp_path, monkeypatch):
    path = write_safetensors(tmp_path / "w.safetensors", {"w": torch.randn(300, 100)})
    info = read_header(path).tensors["w"]

    def broken_slot(slot, buffer):
        raise RuntimeError("no pinned memory left")

    monkeypatch.setattr(ring.Slot, "__init__", broken_slot)
    with pytest.raises(RuntimeError, match="no pinned memory left"):
        read_into([ReadJob(info, torch.empty(300, 100, dtype=torch.float64))], progress=False)


def test_an_interrupt_while_threads_start_leaves_no_thread_reading(tmp_path, monkeypatch):
    import threading

    path = write_safetensors(tmp_path / "w.safetensors", {"w": torch.randn(3000, 100)})
    info = read_header(path).tensors["w"]
    original_start = threading.Thread.start

    def start_then_interrupt(thread):
        original_start(thread)
        if thread.name.startswith("ondeck-read"):
            raise KeyboardInterrupt

    monkeypatch.setattr(threading.Thread, "start", start_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        read_into(
            [ReadJob(info, torch.empty(3000, 100, dtype=torch.float64))],
            progress=False,
            buffer_bytes=1024,
        )
    monkeypatch.undo()
    assert not [t for t in threading.enumerate() if t.name.startswith("ondeck-read")]
