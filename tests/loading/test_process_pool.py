"""Reading processes: the same bytes as safetensors, and a load that fails leaves them sound."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from ondeck.errors import LoadError
from ondeck.loading import process_pool, read_header, read_into

from .helpers import (
    NO_READING_PROCESSES,
    WHY_NO_READING_PROCESSES,
    jobs_for,
    raise_after,
    random_tensor,
    same_bits,
    write_safetensors,
)
from .test_reads import DTYPES

pytestmark = pytest.mark.skipif(NO_READING_PROCESSES, reason=WHY_NO_READING_PROCESSES)


@pytest.fixture(autouse=True)
def fresh_processes(monkeypatch):
    """Each test starts without reading processes and stops those it started."""
    monkeypatch.delenv("ONDECK_READ_PROCESSES", raising=False)
    monkeypatch.setattr(process_pool, "_unavailable", False)
    monkeypatch.setattr(process_pool, "_warned", False)
    process_pool.close_shared()
    yield
    process_pool.close_shared()


def read_by_processes(path, *, dtype=None, **options) -> dict[str, torch.Tensor]:
    jobs = jobs_for(path, dtype)
    options = {"buffer_bytes": 4096, "buffer_count": 6, "threads": 3, **options}
    stats = read_into(jobs, progress=False, processes=True, **options)
    assert stats.readers == "processes"
    return {job.info.name: job.destination for job in jobs}


def pids() -> list[int]:
    return [process.pid for process in process_pool._shared._processes]


def test_every_dtype_read_by_processes_is_bit_identical(tmp_path):
    tensors = {f"t{i}": random_tensor(d, (41, 7), i) for i, d in enumerate(DTYPES)}
    tensors["big"] = random_tensor(torch.float32, (1000, 37), 99)  # many chunks, every process
    path = tmp_path / "all.safetensors"
    save_file(tensors, str(path))
    loaded = read_by_processes(path)
    for name, tensor in load_file(str(path)).items():
        assert same_bits(loaded[name], tensor), name


def test_unaligned_and_cast_reads_by_processes(tmp_path):
    tensors = {"odd": random_tensor(torch.int8, (3,), 3), "w": torch.randn(513, 3)}
    path = write_safetensors(tmp_path / "odd.safetensors", tensors, pad=3)
    assert read_header(path).tensors["w"].start % 4 != 0
    loaded = read_by_processes(path, buffer_bytes=64)
    assert same_bits(loaded["w"], tensors["w"]) and same_bits(loaded["odd"], tensors["odd"])
    cast = read_by_processes(path, dtype=torch.float64, buffer_bytes=64)
    assert torch.equal(cast["w"], tensors["w"].double())


def small_and_large(tmp_path):
    """Small tensors between larger ones, as a model's biases and norms lie in its file."""
    tensors = {}
    for index in range(6):
        tensors[f"b{index}.bias"] = random_tensor(torch.float32, (5 + index,), index)
        tensors[f"b{index}.norm"] = random_tensor(torch.bfloat16, (7,), 10 + index)
        tensors[f"b{index}.weight"] = random_tensor(torch.float32, (40, 10 + index), 20 + index)
    return save_file(tensors, str(tmp_path / "m.safetensors")) or tmp_path / "m.safetensors"


def count_requests(monkeypatch) -> list[tuple[int, int]]:
    """The (offset, length) of every read the processes are asked for, from now on."""
    asked: list[tuple[int, int]] = []
    original = process_pool.ReadingProcesses.request

    def request(self, reads):
        asked.extend((offset, length) for _, _, offset, length in reads)
        return original(self, reads)

    monkeypatch.setattr(process_pool.ReadingProcesses, "request", request)
    return asked


def test_small_tensors_that_follow_one_another_are_read_together(tmp_path, monkeypatch):
    path = small_and_large(tmp_path)
    asked = count_requests(monkeypatch)
    loaded = read_by_processes(path, buffer_bytes=1024)
    for name, tensor in load_file(str(path)).items():
        assert same_bits(loaded[name], tensor), name
    header = read_header(path)
    chunks = sum(-(-info.nbytes // 1024) for info in header.tensors.values())
    assert len(asked) < chunks * 2 // 3
    assert all(length <= 1024 for _, length in asked)
    assert sum(length for _, length in asked) == sum(i.nbytes for i in header.tensors.values())
    # Each read is one range of the file, and together they cover every tensor once.
    covered = sorted(asked)
    assert all(a + n == b for (a, n), (b, _) in zip(covered, covered[1:], strict=False))


def test_the_reads_a_process_is_asked_for_at_once_go_in_one_message(tmp_path, monkeypatch):
    from ondeck.loading.read_worker import READ

    sent: list[int] = []
    original = process_pool.ReadingProcesses._send

    def send(self, channel, message, fds=()):
        if message[:1] == b"R":
            sent.append(len(message) // READ.size)
        return original(self, channel, message, fds)

    monkeypatch.setattr(process_pool.ReadingProcesses, "_send", send)
    tensor = random_tensor(torch.float32, (3000,), 1)
    path = write_safetensors(tmp_path / "w.safetensors", {"w": tensor})
    loaded = read_by_processes(path, buffer_bytes=1024, buffer_count=6, threads=3)
    assert same_bits(loaded["w"], tensor)
    assert sent[0] == 2  # the first round: two slots for each of three processes
    assert sum(sent) == -(-tensor.nbytes // 1024)


def test_tensors_for_two_devices_are_never_read_together(tmp_path):
    """A slot is free again once its copies on one stream are done: a read whose
    tensors go to two devices would free it while the other device still copies."""
    from ondeck.loading import ReadJob
    from ondeck.loading.chunks import plan_chunks
    from ondeck.loading.process_feed import read_runs

    path = small_and_large(tmp_path)
    infos = sorted(read_header(path).tensors.values(), key=lambda info: info.start)
    # In file order: the weights and biases alternate devices, the norms (last) share one.
    devices = ["cpu", "meta"] * 6 + ["cpu"] * 6
    jobs = [
        ReadJob(info, torch.empty(info.shape, dtype=info.dtype, device=device))
        for info, device in zip(infos, devices, strict=True)
    ]
    plan, _ = plan_chunks(jobs, 1024, None)
    runs = list(read_runs(plan, 1024))
    assert all(len({chunk.target.device for chunk in run}) == 1 for run in runs)
    assert any(len(run) > 1 for run in runs)  # what follows on one device still joins


def test_a_cast_is_read_alone_and_still_exact(tmp_path, monkeypatch):
    path = small_and_large(tmp_path)
    asked = count_requests(monkeypatch)
    loaded = read_by_processes(path, dtype=torch.float64, buffer_bytes=1024)
    for name, tensor in load_file(str(path)).items():
        assert same_bits(loaded[name], tensor.double()), name
    header = read_header(path)
    assert len(asked) == sum(-(-info.nbytes // 1024) for info in header.tensors.values())


def test_a_file_ending_inside_a_joint_read_names_the_tensor_it_ended_in(tmp_path, monkeypatch):
    from ondeck.loading import reads

    path = small_and_large(tmp_path)
    jobs = jobs_for(path)
    norm = read_header(path).tensors["b5.norm"]
    # The file ends while it is read, inside b5.norm.
    monkeypatch.setattr(reads, "check_unchanged", lambda *_, **__: None)
    os.truncate(path, norm.start + 3)  # read in one with the other norms
    with pytest.raises(LoadError, match=r"tensor 'b5\.norm': file ended at byte"):
        read_into(jobs, progress=False, processes=True, threads=3, buffer_bytes=1024)


def test_processes_stay_for_the_next_load(tmp_path):
    path = write_safetensors(tmp_path / "w.safetensors", {"w": torch.randn(300, 20)})
    read_by_processes(path)
    first = pids()
    assert read_by_processes(path)["w"].equal(load_file(str(path))["w"])
    assert pids() == first


def test_a_truncated_file_names_the_tensor_and_the_processes_serve_the_next_load(
    tmp_path, monkeypatch
):
    from ondeck.loading import reads

    tensor = torch.randn(4000)
    path = write_safetensors(tmp_path / "w.safetensors", {"w": tensor})
    jobs = jobs_for(path)
    # The file ends while it is read, after its identity was checked at the open.
    monkeypatch.setattr(reads, "check_unchanged", lambda *_, **__: None)
    os.truncate(path, os.path.getsize(path) - 5000)
    with pytest.raises(LoadError, match=r"w\.safetensors, tensor 'w': file ended at byte"):
        read_into(
            jobs, progress=False, processes=True, threads=3, buffer_bytes=1024, buffer_count=6
        )
    first = pids()
    good = write_safetensors(tmp_path / "good.safetensors", {"w": tensor})
    assert same_bits(read_by_processes(good, buffer_bytes=1024)["w"], tensor)
    assert pids() == first  # no stale answer of the failed load reached this one


def test_a_process_killed_mid_load_fails_it_and_the_next_starts_new_ones(tmp_path, monkeypatch):
    from ondeck.loading import ring

    tensor = torch.randn(20000)
    path = write_safetensors(tmp_path / "w.safetensors", {"w": tensor})
    read_by_processes(path)
    victims = pids()
    original = ring.deliver

    def deliver_after_a_kill(*args):
        if process_pool._shared._processes[0].poll() is None:
            os.kill(victims[0], signal.SIGKILL)
            process_pool._shared._processes[0].wait()
        return original(*args)

    monkeypatch.setattr(ring, "deliver", deliver_after_a_kill)
    with pytest.raises(LoadError, match="reading process"):
        read_by_processes(path)
    monkeypatch.undo()
    assert same_bits(read_by_processes(path)["w"], tensor)
    assert set(pids()).isdisjoint(victims)


def test_a_process_killed_between_loads_is_replaced(tmp_path):
    tensor = torch.randn(3000)
    path = write_safetensors(tmp_path / "w.safetensors", {"w": tensor})
    read_by_processes(path)
    victim = pids()[0]
    os.kill(victim, signal.SIGKILL)
    process_pool._shared._processes[0].wait()
    assert same_bits(read_by_processes(path)["w"], tensor)
    assert victim not in pids()


def test_a_failed_copy_stops_the_load_and_the_processes_serve_the_next(tmp_path, monkeypatch):
    from ondeck.loading import ring

    tensor = torch.randn(20000)
    path = write_safetensors(tmp_path / "w.safetensors", {"w": tensor})
    calls = raise_after(monkeypatch, ring, "deliver", 5, RuntimeError("copy fault"))
    with pytest.raises(RuntimeError, match="copy fault"):
        read_by_processes(path)
    assert calls["n"] < 20  # of 20 chunks: it stopped at the first failure
    monkeypatch.undo()
    assert same_bits(read_by_processes(path)["w"], tensor)


def test_a_copy_failing_among_several_answers_still_ends_the_load(tmp_path, monkeypatch):
    from ondeck.loading import ring

    path = write_safetensors(tmp_path / "w.safetensors", {"w": torch.randn(20000)})
    original = process_pool.ReadingProcesses.replies

    def late_replies(self, timeout):
        time.sleep(0.05)  # every process has answered: one call returns several answers
        return original(self, timeout)

    monkeypatch.setattr(process_pool.ReadingProcesses, "replies", late_replies)
    raise_after(monkeypatch, ring, "deliver", 0, RuntimeError("copy fault"))
    outcome = []

    def load():
        try:
            read_by_processes(path)
        except RuntimeError as error:
            outcome.append(error)

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "the failed load never ended"
    assert "copy fault" in str(outcome[0])


def test_while_reading_failure_stops_the_processes_reads(tmp_path):
    tensor = torch.randn(50000)
    path = write_safetensors(tmp_path / "w.safetensors", {"w": tensor})

    def build():
        raise ValueError("module class refused")

    with pytest.raises(ValueError, match="module class refused"):
        read_into(
            jobs_for(path), progress=False, processes=True, buffer_bytes=1024, while_reading=build
        )
    assert same_bits(read_by_processes(path)["w"], tensor)


def test_a_busy_pool_leaves_a_concurrent_load_to_threads(tmp_path):
    tensor = torch.randn(300, 20)
    path = write_safetensors(tmp_path / "w.safetensors", {"w": tensor})
    read_by_processes(path)
    pool = process_pool._shared
    assert pool.lock.acquire(blocking=False)  # as if another load held them
    try:
        jobs = jobs_for(path)
        stats = read_into(jobs, progress=False, processes=True, buffer_bytes=4096, buffer_count=6)
        assert stats.readers == "threads"
        assert same_bits(jobs[0].destination, tensor)
    finally:
        pool.lock.release()


def test_switched_off_by_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("ONDECK_READ_PROCESSES", "0")
    path = write_safetensors(tmp_path / "w.safetensors", {"w": torch.randn(30)})
    stats = read_into(jobs_for(path, torch.float64), progress=False, processes=True)
    assert stats.readers == "threads" and process_pool._shared is None


def test_processes_that_cannot_start_warn_once_and_threads_read(tmp_path, monkeypatch):
    monkeypatch.setattr(process_pool, "_PROGRAM", tmp_path / "absent" / "program.py")
    monkeypatch.setattr(process_pool.sys, "executable", str(tmp_path / "no-python"))
    tensor = torch.randn(300)
    path = write_safetensors(tmp_path / "w.safetensors", {"w": tensor})
    with pytest.warns(RuntimeWarning, match="reading processes unavailable"):
        jobs = jobs_for(path)
        assert read_into(jobs, progress=False, processes=True).readers == "threads"
    assert same_bits(jobs[0].destination, tensor)
    jobs = jobs_for(path)
    assert read_into(jobs, progress=False, processes=True).readers == "threads"  # no retry


def test_closing_the_pool_ends_its_processes(tmp_path):
    path = write_safetensors(tmp_path / "w.safetensors", {"w": torch.randn(300)})
    read_by_processes(path)
    processes = list(process_pool._shared._processes)
    process_pool.close_shared()
    assert all(process.poll() is not None for process in processes)


def test_cpu_loads_keep_reading_directly_unless_asked(tmp_path):
    path = write_safetensors(tmp_path / "w.safetensors", {"w": torch.randn(300)})
    assert read_into(jobs_for(path), progress=False).readers == "threads"
    assert process_pool._shared is None


def test_two_loads_at_once_are_both_right(tmp_path):
    tensors = {f"w{i}": torch.randn(3000) for i in range(4)}
    path = write_safetensors(tmp_path / "w.safetensors", tensors)
    results, errors = [], []

    def load():
        try:
            jobs = jobs_for(path)
            read_into(jobs, progress=False, processes=True, buffer_bytes=1024, buffer_count=6)
            results.append({job.info.name: job.destination for job in jobs})
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=load) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(results) == 4
    for loaded in results:
        for name, tensor in tensors.items():
            assert same_bits(loaded[name], tensor), name


def test_a_forked_child_starts_its_own_processes(tmp_path):
    tensor = torch.randn(5000)
    path = write_safetensors(tmp_path / "w.safetensors", {"w": tensor})
    read_by_processes(path)
    parents = pids()
    child = os.fork()
    if child == 0:  # the child: exit status 0 only if it read right without the parent's
        status = 1
        try:
            loaded = read_by_processes(path)
            status = 0 if same_bits(loaded["w"], tensor) and set(pids()).isdisjoint(parents) else 2
            process_pool.close_shared()
        finally:
            os._exit(status)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert same_bits(read_by_processes(path)["w"], tensor)  # the parent's still answer it
    assert pids() == parents


def test_an_interpreter_that_cannot_run_the_program_falls_back_to_threads(tmp_path, monkeypatch):
    monkeypatch.setattr(process_pool, "_PROGRAM", tmp_path / "absent.py")  # python exits 2
    tensor = torch.randn(300)
    path = write_safetensors(tmp_path / "w.safetensors", {"w": tensor})
    jobs = jobs_for(path)
    with pytest.warns(RuntimeWarning, match="did not start"):
        assert read_into(jobs, progress=False, processes=True).readers == "threads"
    assert same_bits(jobs[0].destination, tensor)


def test_file_descriptors_past_1024_do_not_stop_the_processes(tmp_path):
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 1200
    if soft < wanted:
        if hard != resource.RLIM_INFINITY and hard < wanted:
            pytest.skip("cannot open 1200 files here")
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    held = []
    try:
        held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
        tensor = torch.randn(3000)
        path = write_safetensors(tmp_path / "w.safetensors", {"w": tensor})
        assert same_bits(read_by_processes(path)["w"], tensor)
    finally:
        for fd in held:
            os.close(fd)
        process_pool.close_shared()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_more_slots_than_a_socket_holds_answers_for_do_not_deadlock(tmp_path):
    tensor = torch.randn(100000)
    path = write_safetensors(tmp_path / "w.safetensors", {"w": tensor})
    outcome = []
    worker = threading.Thread(
        target=lambda: outcome.append(
            read_by_processes(path, threads=1, buffer_bytes=64, buffer_count=4096)
        ),
        daemon=True,
    )
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "the load deadlocked"
    assert same_bits(outcome[0]["w"], tensor)
    assert process_pool._shared.slot_count <= process_pool.MAX_SLOTS_PER_PROCESS


def test_closing_at_exit_leaves_a_running_load_its_processes(tmp_path, monkeypatch):
    from ondeck.loading import ring

    tensor = torch.randn(20000)
    path = write_safetensors(tmp_path / "w.safetensors", {"w": tensor})
    original = ring.deliver
    attempts = []

    def deliver_and_try_to_close(*args):
        if not attempts:
            attempts.append(process_pool.close_shared(wait_seconds=0.05))
        return original(*args)

    monkeypatch.setattr(ring, "deliver", deliver_and_try_to_close)
    assert same_bits(read_by_processes(path)["w"], tensor)
    assert attempts and process_pool._shared is not None  # it waited, then let them be


def test_an_interrupt_after_the_lease_leaves_the_processes_free(tmp_path, monkeypatch):
    from ondeck.loading import reads

    tensor = torch.randn(3000)
    path = write_safetensors(tmp_path / "w.safetensors", {"w": tensor})
    read_by_processes(path)
    first = pids()
    raise_after(monkeypatch, reads, "plan_chunks", 0, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        read_by_processes(path)
    monkeypatch.undo()
    assert same_bits(read_by_processes(path)["w"], tensor)  # "processes": the lock is free
    assert pids() == first


def test_a_process_gone_after_its_last_answer_leaves_the_load_whole(tmp_path, monkeypatch):
    tensor = torch.randn(3000)
    path = write_safetensors(tmp_path / "w.safetensors", {"w": tensor})
    read_by_processes(path)
    first = pids()

    def gone(self):
        raise process_pool.ReadingProcessExited("a reading process is gone: broken pipe")

    monkeypatch.setattr(process_pool.ReadingProcesses, "close_files", gone)
    assert same_bits(read_by_processes(path)["w"], tensor)
    monkeypatch.undo()
    assert same_bits(read_by_processes(path)["w"], tensor)
    assert set(pids()).isdisjoint(first)  # the doubtful ones were replaced


def test_slots_of_an_odd_size_still_cast(tmp_path):
    tensor = torch.randn(500)
    path = write_safetensors(tmp_path / "w.safetensors", {"w": tensor})
    loaded = read_by_processes(path, dtype=torch.float64, buffer_bytes=66)
    assert torch.equal(loaded["w"], tensor.double())


def test_a_forked_child_lets_go_of_the_parents_processes(tmp_path):
    path = write_safetensors(tmp_path / "w.safetensors", {"w": torch.randn(300)})
    read_by_processes(path)
    pool = process_pool._shared  # a reference the child inherits too
    child = os.fork()
    if child == 0:
        time.sleep(3)  # alive while the parent closes its processes
        os._exit(0 if pool is not None else 1)
    try:
        started = time.monotonic()
        process_pool.close_shared()
        assert time.monotonic() - started < 2  # the processes saw their sockets close
    finally:
        os.waitpid(child, 0)


def test_ranks_on_one_host_share_the_cores(monkeypatch):
    from ondeck.loading import process_feed, ring

    monkeypatch.setattr(ring.os, "cpu_count", lambda: 32)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert process_feed.default_processes() == 12
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert process_feed.default_processes() == 6
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "64")
    assert process_feed.default_processes() == 1


def test_a_ring_too_large_falls_back_once_and_other_sizes_still_use_processes(tmp_path):
    tensor = torch.randn(3000)
    path = write_safetensors(tmp_path / "w.safetensors", {"w": tensor})
    jobs = jobs_for(path)
    with pytest.warns(RuntimeWarning, match="reading processes unavailable"):
        stats = read_into(jobs, progress=False, processes=True, buffer_bytes=2**50, buffer_count=2)
    assert stats.readers == "threads" and same_bits(jobs[0].destination, tensor)
    assert same_bits(read_by_processes(path)["w"], tensor)  # asserts "processes"


def test_a_bundled_app_reads_on_threads(tmp_path, monkeypatch):
    monkeypatch.setattr(process_pool.sys, "frozen", True, raising=False)
    path = write_safetensors(tmp_path / "w.safetensors", {"w": torch.randn(300)})
    stats = read_into(jobs_for(path), progress=False, processes=True)
    assert stats.readers == "threads" and process_pool._shared is None


@pytest.mark.parametrize("option", ["threads", "buffer_bytes", "buffer_count"])
def test_sizes_below_one_are_refused(tmp_path, option):
    path = write_safetensors(tmp_path / "w.safetensors", {"w": torch.randn(30)})
    with pytest.raises(ValueError, match=f"{option} must be at least 1"):
        read_into(jobs_for(path), progress=False, processes=True, **{option: -1})


class _LateStream:
    """Stands in for a CUDA side stream whose copies happen only when their event is found
    complete (or the stream is waited for): a slot read into again too early shows up as
    wrong bytes."""

    device = torch.device("cpu")

    def __init__(self):
        self.next_copy = None
        self.events = []

    def synchronize(self):
        for event in self.events:
            event.synchronize()


class _LateEvent:
    def __init__(self):
        self.copy = None
        self.polls = 0

    def record(self, stream):
        self.copy, self.polls = stream.next_copy, 0
        stream.events.append(self)

    def query(self):
        self.polls += 1
        if self.polls < 3:
            return False
        self.synchronize()
        return True

    def synchronize(self):
        if self.copy is not None:
            target, source = self.copy
            target.copy_(source)
            self.copy = None


def test_a_ring_slot_is_read_into_again_only_after_its_copy_finished(tmp_path, monkeypatch):
    from ondeck.loading import ring

    stream = _LateStream()

    def deliver_later(chunk, staged, *rest):
        staged = staged[: chunk.hi - chunk.lo]  # the whole ring slot
        source = staged.view(chunk.job.info.dtype) if chunk.cast else staged
        stream.next_copy = (chunk.part(), source)
        return stream

    monkeypatch.setattr(ring, "side_streams", lambda fences: {stream.device: stream})
    monkeypatch.setattr(ring, "deliver", deliver_later)
    monkeypatch.setattr(torch.cuda, "Event", _LateEvent)
    tensor = torch.randn(20000)
    path = write_safetensors(tmp_path / "w.safetensors", {"w": tensor})
    loaded = read_by_processes(path, threads=2, buffer_bytes=1024, buffer_count=4)
    assert same_bits(loaded["w"], tensor)
    assert len(stream.events) == -(-tensor.nbytes // 1024)  # every chunk copied late


def grouped_file(tmp_path, count=5):
    """Tensors of a few chunks each (and one empty), split into groups out of file order."""
    tensors = {f"t{i}": random_tensor(torch.float32, (40 + i, 31), i) for i in range(count)}
    tensors["empty"] = torch.empty(0, 4)
    path = write_safetensors(tmp_path / "g.safetensors", tensors)
    jobs = {job.info.name: job for job in jobs_for(path)}
    groups = [[jobs["t3"]], [], [jobs["t0"], jobs["empty"]], [jobs["t4"], jobs["t1"]], [jobs["t2"]]]
    return tensors, groups


def checking_in_place(groups, tensors, reached: list[int]):
    """A ``reached`` that notes each group and asserts its tensors are in place."""

    def check(index: int) -> None:
        reached.append(index)
        for job in groups[index]:
            assert same_bits(job.destination, tensors[job.info.name]), job.info.name

    return check


def test_a_read_in_groups_hands_over_each_group_complete_and_in_order(tmp_path, monkeypatch):
    """One read through the processes; at each group's turn its tensors are in place,
    while a later group's chunks may already have been read. Each chunk's copy is slowed,
    so that a group handed over early would be seen incomplete."""
    from ondeck.loading import process_feed, reads, ring

    tensors, groups = grouped_file(tmp_path)
    feeds: list[int] = []  # one feeding thread per read through the processes
    feed = process_feed.feed
    monkeypatch.setattr(
        process_feed,
        "feed",
        lambda state, lease: feeds.append(len(state.chunks)) or feed(state, lease),
    )
    deliver = ring.deliver

    def slowly(*args):
        time.sleep(0.005)
        return deliver(*args)

    monkeypatch.setattr(ring, "deliver", slowly)
    reached: list[int] = []
    check = checking_in_place(groups, tensors, reached)

    stats = reads.read_in_groups(
        groups, check, progress=False, processes=True, threads=3, buffer_bytes=1024, buffer_count=6
    )
    assert stats.readers == "processes" and len(feeds) == 1  # one read for all the groups
    assert reached == [0, 1, 2, 3, 4]
    assert stats.nbytes == sum(t.nbytes for t in tensors.values())


def test_a_read_in_groups_by_threads_reads_group_after_group(tmp_path):
    tensors, groups = grouped_file(tmp_path)
    from ondeck.loading import reads

    reached: list[int] = []
    check = checking_in_place(groups, tensors, reached)

    stats = reads.read_in_groups(groups, check, progress=False, processes=False)
    assert stats.readers == "threads" and reached == [0, 1, 2, 3, 4]


def test_an_error_at_a_group_stops_the_read_and_the_processes_serve_the_next(tmp_path):
    from ondeck.loading import reads

    tensors, groups = grouped_file(tmp_path)
    options = dict(progress=False, processes=True, threads=3, buffer_bytes=1024, buffer_count=6)

    def refuse(index: int) -> None:
        if index == 2:
            raise LoadError("component 'transformer': loading was stopped")

    with pytest.raises(LoadError, match="loading was stopped"):
        reads.read_in_groups(groups, refuse, **options)
    first = pids()
    (tmp_path / "again").mkdir()
    tensors, groups = grouped_file(tmp_path / "again")
    reached: list[int] = []
    reads.read_in_groups(groups, reached.append, **options)
    assert reached == [0, 1, 2, 3, 4] and pids() == first
    for group in groups:
        for job in group:
            assert same_bits(job.destination, tensors[job.info.name])


def test_a_truncated_file_fails_a_read_in_groups_after_the_groups_before_it(tmp_path, monkeypatch):
    from ondeck.loading import reads

    # The file ends while it is read, after its identity was checked at the open.
    monkeypatch.setattr(reads, "check_unchanged", lambda *_, **__: None)

    tensors, groups = grouped_file(tmp_path)
    path = groups[0][0].info.path
    jobs = [job for group in groups for job in group if job.info.nbytes]
    last = max(jobs, key=lambda job: job.info.end)
    os.truncate(path, last.info.start + 8)  # inside the last tensor of the file
    reached: list[int] = []
    with pytest.raises(LoadError, match=rf"g\.safetensors, tensor '{last.info.name}'"):
        reads.read_in_groups(
            groups, reached.append, progress=False, processes=True, buffer_bytes=1024
        )
    failed_group = next(i for i, group in enumerate(groups) if last in group)
    assert reached == list(range(failed_group))


def test_a_read_in_groups_with_a_bad_size_takes_no_processes(tmp_path):
    from ondeck.loading import reads

    _, groups = grouped_file(tmp_path)
    with pytest.raises(ValueError, match="buffer_count must be at least 1, not 0"):
        reads.read_in_groups(groups, lambda _: None, processes=True, buffer_count=0)
    stats = reads.read_in_groups(
        groups, lambda _: None, progress=False, processes=True, buffer_bytes=1024
    )
    assert stats.readers == "processes"  # the pool was not left leased


def test_answers_that_come_together_are_handed_over_in_plan_order(tmp_path, monkeypatch):
    """The processes answer in any order; those of one poll are delivered in plan order,
    so that a tensor's chunks are staged side by side and cast as one."""
    from ondeck.loading import ring

    replies = process_pool.ReadingProcesses.replies
    batches: list[int] = []

    def reversed_replies(pool, timeout):
        time.sleep(0.002)  # let answers gather
        answers = replies(pool, timeout)
        if answers:
            batches.append(len(answers))
        return answers[::-1]

    delivered: list[int] = []
    deliver = ring.deliver

    def noting(chunk, *rest):
        delivered.append(chunk.lo)
        return deliver(chunk, *rest)

    monkeypatch.setattr(process_pool.ReadingProcesses, "replies", reversed_replies)
    monkeypatch.setattr(ring, "deliver", noting)
    tensor = torch.randn(30000)
    path = write_safetensors(tmp_path / "w.safetensors", {"w": tensor})
    assert same_bits(read_by_processes(path, buffer_bytes=1024, buffer_count=8)["w"], tensor)
    assert max(batches) > 1 and sum(batches) == len(delivered)
    start = 0
    for size in batches:
        together = delivered[start : start + size]
        assert together == sorted(together), together
        start += size
