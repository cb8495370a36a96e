"""The staging of casts on the device (``reader._DeviceCasts``), driven on the CPU: where
each chunk lands in the two halves, which chunks are cast together, and that every
tensor ends up equal to its own cast, whatever order the chunks arrive in.

On a GPU the two streams order the copies and the casts (tests/loading/test_fp8_cuda.py);
here every operation runs when issued, so the stream objects only record what waits for
what.
"""

from __future__ import annotations

import contextlib
import ctypes
import random

import pytest
import torch
from safetensors.torch import save_file

from ondeck.loading import ReadJob, casting, read_header
from ondeck.loading.chunks import plan_chunks

FP8 = torch.float8_e4m3fn
CHUNK = 4096
CURRENT: list = []  # the streams set current, in order (torch.cuda.set_stream, faked)


class FakeStream:
    def __init__(self, device=None):
        self.device = device
        self.waited: list = []
        self.cuda_stream = id(self)  # the handle the driver is given

    def wait_event(self, event) -> None:
        self.waited.append(event)

    def wait_stream(self, stream) -> None:
        self.waited.append(stream)


class FakeEvent:
    done = False  # what query() answers: the work before it has finished

    def __init__(self):
        self.recorded_on: list = []
        self.cuda_event = id(self)

    def record(self, stream) -> None:
        self.recorded_on.append(stream)

    def query(self) -> bool:
        return self.done


@pytest.fixture(params=["one call", "a copy_ each"])
def cpu_streams(request, monkeypatch):
    """Fake streams, and the casts of a half of several runs issued either by
    ``torch._foreach_copy_`` or, as on a torch without it, by a ``copy_`` each."""
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "set_stream", CURRENT.append)
    CURRENT.clear()
    calls, several = [], []
    if request.param == "a copy_ each":
        monkeypatch.delattr(torch, "_foreach_copy_")
    else:
        foreach = torch._foreach_copy_
        monkeypatch.setattr(
            torch, "_foreach_copy_", lambda *a, **k: calls.append(1) or foreach(*a, **k)
        )
    issue = casting.DeviceCasts._issue

    def counting(pending, half):
        several.extend([1] if len(pending) > 1 else [])
        return issue(pending, half)

    monkeypatch.setattr(casting.DeviceCasts, "_issue", staticmethod(counting))
    yield
    if request.param == "one call":
        assert len(calls) == len(several)  # a half of several runs: one call for all


def tensors_and_chunks(tmp_path, sizes, file_dtype=torch.bfloat16, chunk_bytes=CHUNK):
    generator = torch.Generator().manual_seed(11)
    tensors = {
        f"t{i}": torch.randn(size, generator=generator).to(file_dtype)
        for i, size in enumerate(sizes)
    }
    path = tmp_path / "cast.safetensors"
    save_file(tensors, str(path))
    raw = path.read_bytes()
    jobs = [
        ReadJob(info, torch.empty(info.shape, dtype=FP8))
        for info in read_header(path).tensors.values()
    ]
    chunks, _ = plan_chunks(jobs, chunk_bytes, "transformer")

    def file_bytes(chunk):
        info = chunk.job.info
        data = bytearray(raw[info.start + chunk.lo : info.start + chunk.hi])
        return torch.frombuffer(data, dtype=torch.uint8)

    return tensors, jobs, chunks, file_bytes


def assert_each_cast(jobs, tensors) -> None:
    """Every job's destination holds its tensor cast to fp8, bit for bit."""
    for job in jobs:
        expected = tensors[job.info.name].to(FP8)
        assert torch.equal(job.destination.view(torch.uint8), expected.view(torch.uint8)), (
            job.info.name
        )


def stage(chunks, file_bytes, half_chunks, chunk_bytes=CHUNK):
    """Every chunk through one thread's staging buffer; the casts issued, half by half."""
    issued: list[list] = []
    original = casting.DeviceCasts._issue

    def issue(pending, half):
        issued.append(
            [(staged.job.info.name, staged.hi, staged.end - staged.start) for staged in pending]
        )
        # Issued on the cast stream, made current, after the copies: it waits for an
        # event just recorded on the copies' stream.
        waited = casts.casts.waited[-1]
        assert CURRENT[-1] is casts.casts and waited.recorded_on[-1] is casts.copies
        assert len(waited.recorded_on) == len(issued)  # recorded anew for each half
        original(pending, half)

    half = half_chunks * casting.aligned(chunk_bytes)
    buffer = torch.empty(2 * half, dtype=torch.uint8)
    casts = casting.DeviceCasts(buffer, FakeStream("cpu"), FakeEvent(), chunk_bytes)
    casts._issue = issue
    for chunk in chunks:
        casts.add(chunk, file_bytes(chunk))
    casts.flush()
    # The copies' stream is current again after every half.
    assert CURRENT == [casts.casts, casts.copies] * len(issued)
    return casts, issued


@pytest.mark.parametrize("half_chunks", [1, 2, 5])
@pytest.mark.parametrize("chunk_bytes", [CHUNK, CHUNK + 64])
def test_chunks_in_order_are_cast_together_and_equal_the_tensors_cast(
    tmp_path, cpu_streams, half_chunks, chunk_bytes
):
    """Chunks of 4160 bytes: each place in a half starts 256-byte aligned, so a tensor's
    consecutive chunks lie apart there, and are cast apart."""
    sizes = [CHUNK * 3 // 2 + 5, 7, CHUNK * 5, 3, CHUNK // 2 + 1]  # bf16: 3, 1, 10, 1, 1 chunks
    tensors, jobs, chunks, file_bytes = tensors_and_chunks(tmp_path, sizes, chunk_bytes=chunk_bytes)
    _, issued = stage(chunks, file_bytes, half_chunks, chunk_bytes)
    assert_each_cast(jobs, tensors)
    casts = sum(len(batch) for batch in issued)
    if half_chunks == 1 or chunk_bytes % 256:
        assert casts == len(chunks)  # nothing to cast together
    else:
        assert casts < len(chunks)
    # A half never holds more than its bytes.
    largest = max(sum(nbytes for *_, nbytes in batch) for batch in issued)
    assert largest <= half_chunks * chunk_bytes


def test_chunks_out_of_order_land_apart_and_still_equal_the_tensors_cast(tmp_path, cpu_streams):
    tensors, jobs, chunks, file_bytes = tensors_and_chunks(tmp_path, [CHUNK * 6, 9, CHUNK * 4])
    shuffled = list(chunks)
    random.Random(3).shuffle(shuffled)
    casts, issued = stage(shuffled, file_bytes, half_chunks=3)
    assert_each_cast(jobs, tensors)
    # Each staged run ends where a chunk of its tensor ended.
    ends = {name: {c.hi for c in chunks if c.job.info.name == name} for name in tensors}
    assert all(hi in ends[name] for batch in issued for name, hi, _ in batch)
    # Every half but the first is copied into only after waiting for its last casts.
    assert len(casts.copies.waited) == max(0, len(issued) - 2) > 0


def test_a_file_of_float32_cast_via_bfloat16(tmp_path, cpu_streams):
    """``via``: the chunks staged together are rounded through it as one."""
    tensors, jobs, chunks, file_bytes = tensors_and_chunks(
        tmp_path, [CHUNK * 2 + 3, 5], file_dtype=torch.float32
    )
    for job in jobs:
        job.via = torch.bfloat16
    stage(chunks, file_bytes, half_chunks=4)
    for job in jobs:
        expected = tensors[job.info.name].to(torch.bfloat16).to(FP8)
        assert torch.equal(job.destination.view(torch.uint8), expected.view(torch.uint8))


def test_a_buffer_of_one_chunk_casts_each_chunk_behind_its_copy(tmp_path, cpu_streams):
    """No room for two halves: the casts go on the copies' own stream, no events, a
    chunk's casts issued before the next chunk is copied over them."""
    tensors, jobs, chunks, file_bytes = tensors_and_chunks(tmp_path, [CHUNK * 3, 5, CHUNK])
    buffer = torch.empty(casting.aligned(CHUNK), dtype=torch.uint8)
    copies = FakeStream("cpu")
    casts = casting.DeviceCasts(buffer, copies, FakeEvent(), CHUNK)
    assert casts.casts is copies
    for chunk in chunks:
        casts.add(chunk, file_bytes(chunk))
    casts.flush()
    assert_each_cast(jobs, tensors)
    assert copies.waited == []


@pytest.mark.parametrize("chunk_bytes", [CHUNK, CHUNK + 64, 3 * CHUNK + 8, 8 * 2**20, 2**25 + 64])
@pytest.mark.parametrize("workers", [1, 3, 16])
def test_a_threads_staging_is_its_share_in_two_halves_or_one_chunk(chunk_bytes, workers):
    nbytes = casting.staging_bytes(chunk_bytes, workers)
    aligned = casting.aligned(chunk_bytes)
    if nbytes >= 2 * aligned:
        assert nbytes % 512 == 0  # two halves, each aligned
        assert nbytes * workers <= casting.CAST_STAGING_BYTES
    else:
        assert nbytes == aligned >= chunk_bytes
    # The reading processes' one copying thread, at the default ring, gets halves.
    if workers == 1 and chunk_bytes <= 8 * 2**20:
        assert nbytes == casting.CAST_STAGING_BYTES


def test_a_half_whose_casts_are_done_is_copied_into_without_a_wait(
    tmp_path, cpu_streams, monkeypatch
):
    """The copy stream waits for a half's last casts only while they are still running."""
    monkeypatch.setattr(FakeEvent, "done", True)
    tensors, jobs, chunks, file_bytes = tensors_and_chunks(tmp_path, [CHUNK * 6, 9, CHUNK * 4])
    casts, issued = stage(chunks, file_bytes, half_chunks=2)
    assert len(issued) > 2 and casts.copies.waited == []
    assert_each_cast(jobs, tensors)


class FakeDriver:
    """The driver's calls on the CPU: a copy is a ``memmove``; records, waits and queries
    are logged, each query answering ``done``."""

    def __init__(self, done: bool):
        self.answer = done
        self.log: list[tuple] = []

    def copy(self, destination, source, nbytes, stream) -> None:
        ctypes.memmove(destination, source, nbytes)
        self.log.append(("copy", stream))

    def record(self, event, stream) -> None:
        self.log.append(("record", event, stream))

    def wait(self, stream, event) -> None:
        self.log.append(("wait", stream, event))

    def done(self, event) -> bool:
        self.log.append(("done", event))
        return self.answer


@pytest.mark.parametrize("casts_done", [False, True])
def test_through_the_driver_each_half_is_ordered_by_handles(tmp_path, cpu_streams, casts_done):
    """With a driver the copies, records, waits and queries go to it by handle: a half's
    casts wait for an event recorded on the copy stream after its copies and end with
    that half's event on the cast stream; a half is copied into again after its casts,
    waited for only while they run. The cast stream is made current once, not per half.
    Every tensor still equals its cast."""
    tensors, jobs, chunks, file_bytes = tensors_and_chunks(tmp_path, [CHUNK * 6, 9, CHUNK * 4])
    driver = FakeDriver(casts_done)
    buffer = torch.empty(4 * casting.aligned(CHUNK), dtype=torch.uint8)
    casts = casting.DeviceCasts(buffer, FakeStream("cpu"), FakeEvent(), CHUNK, driver)
    for chunk in chunks:
        casts.add(chunk, file_bytes(chunk))
    casts.flush()
    assert_each_cast(jobs, tensors)
    assert CURRENT == [casts.casts]
    copies, cast_stream, copied = casts.copies_handle, casts.casts_handle, casts.copied_handle
    log = driver.log
    assert sum(entry[0] == "copy" for entry in log) == len(chunks)
    assert all(entry == ("copy", copies) for entry in log if entry[0] == "copy")
    halves = [i for i, entry in enumerate(log) if entry == ("wait", cast_stream, copied)]
    assert len(halves) > 2
    for number, at in enumerate(halves):
        assert log[at - 1] == ("record", copied, copies)  # after the half's copies
        assert log[at + 1] == ("record", casts.cast_handles[number % 2], cast_stream)
    # Every return to a half whose casts were issued asks whether they are done, and
    # makes the copies wait for them only when they are not.
    queries = [i for i, entry in enumerate(log) if entry[0] == "done"]
    assert len(queries) == len(halves) - 2  # the first two halves had no casts before
    for at in queries:
        waited = log[at + 1] == ("wait", copies, log[at][1])
        assert waited != casts_done
        assert log[at + 1 + waited][0] == "copy"
