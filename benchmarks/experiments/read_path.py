"""Where the time of a warm page-cache load goes: the pieces of the read path, one at a time.

Run on a CUDA machine:  python benchmarks/read_path.py [--folder DIR] [--layers 24]

Uses the checkpoint load_throughput.py builds (built here if absent), warm in the page
cache, and measures, each the median of ``--repeats``:
  memory     host memcpy bandwidth (torch CPU copy) with 1..16 threads
  pread      page cache -> host buffers only (pinned and pageable), threads x buffer size
  register   cudaHostRegister of mapped page-cache pages, then one DMA per chunk
  mapped     whole files to the device through windows of their mapping, on 1-8 threads:
             copied from pageable memory, or registered (torch's or a ctypes cudart
             binding) around each window's copy; a sample checked against the files
  reader     ComponentLoader end to end, threads x buffer size x buffer count, with the
             time of each step (allocate, install, read_into; reads, ring waits, copy issue)
Writes read_path.json to $OUT; prints a table last.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import os
import platform
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from common import (  # noqa: E402
    PhaseClock,
    build_transformer_folder,
    median,
    out_dir,
    warm_page_cache,
)

GB = 1e9
MiB = 2**20


def host_facts() -> dict:
    facts = {"kernel": platform.release(), "cpus": os.cpu_count()}
    for command in (["lscpu"], ["df", "-T", "."], ["nvidia-smi", "topo", "-m"]):
        try:
            facts[command[0]] = subprocess.run(
                command, capture_output=True, text=True, timeout=20
            ).stdout
        except (OSError, subprocess.SubprocessError) as error:
            facts[command[0]] = repr(error)
    nodes = sorted(Path("/sys/devices/system/node").glob("node[0-9]*"))
    facts["numa_nodes"] = {node.name: (node / "cpulist").read_text().strip() for node in nodes}
    try:
        facts["thp"] = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        pass
    return facts


def memcpy_gbps(nbytes: int, threads: int, repeats: int) -> float:
    source = torch.empty(nbytes, dtype=torch.uint8)
    source.fill_(1)
    target = torch.empty_like(source)
    target.fill_(0)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        runs = []
        for _ in range(repeats):
            started = time.perf_counter()
            target.copy_(source)
            runs.append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(previous)
    return nbytes / median(runs) / GB


def chunks_of(files: list[str], size: int) -> list[tuple[str, int, int]]:
    jobs = []
    for path in files:
        total = os.path.getsize(path)
        jobs += [(path, lo, min(size, total - lo)) for lo in range(0, total, size)]
    return jobs


def pread_seconds(files: list[str], threads: int, buffer_bytes: int, pinned: bool) -> float:
    """Every byte of the files read into per-thread buffers; nothing else."""
    jobs = chunks_of(files, buffer_bytes)
    buffers = [
        torch.empty(buffer_bytes, dtype=torch.uint8, pin_memory=pinned) for _ in range(threads)
    ]
    for buffer in buffers:
        buffer.fill_(0)  # fault the pages in before timing
    fds = {path: os.open(path, os.O_RDONLY) for path in files}
    cursor = iter(jobs)
    lock = threading.Lock()

    def work(buffer: torch.Tensor) -> None:
        while True:
            with lock:
                job = next(cursor, None)
            if job is None:
                return
            path, offset, length = job
            view = (ctypes.c_char * length).from_address(buffer.data_ptr())
            done = 0
            while done < length:
                done += os.preadv(fds[path], [memoryview(view)[done:]], offset + done)

    workers = [threading.Thread(target=work, args=(b,)) for b in buffers]
    started = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    seconds = time.perf_counter() - started
    for fd in fds.values():
        os.close(fd)
    return seconds


def register_phases(files: list[str], chunk: int) -> dict:
    """Pin each file's page-cache pages chunk by chunk with cudaHostRegister (read-only),
    DMA each chunk to the device, unregister, one after the other. Seconds of each phase."""
    cudart = torch.cuda.cudart()
    phases = {"register": 0.0, "copy": 0.0, "unregister": 0.0, "bytes": 0}
    device = torch.empty(chunk, dtype=torch.uint8, device="cuda")
    mapped = MappedFiles(files)
    try:
        for address, length, _ in mapped.windows(chunk):
            t0 = time.perf_counter()
            error = cudart.cudaHostRegister(address, length, READ_ONLY)
            t1 = time.perf_counter()
            if int(error) != 0:
                return {"error": f"cudaHostRegister returned {error}"}
            host = torch.frombuffer(
                (ctypes.c_uint8 * length).from_address(address), dtype=torch.uint8
            )
            device[:length].copy_(host, non_blocking=True)
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            cudart.cudaHostUnregister(address)
            t3 = time.perf_counter()
            phases["register"] += t1 - t0
            phases["copy"] += t2 - t1
            phases["unregister"] += t3 - t2
            phases["bytes"] += length
    finally:
        mapped.close()
    return phases


READ_ONLY = 8  # cudaHostRegisterReadOnly


class MappedFiles:
    """The files mapped read-only (address space only: nothing is read until touched),
    cut into page-aligned windows laid end to end in one destination."""

    def __init__(self, files: list[str]):
        import mmap

        from ondeck.loading.page_cache import _LIBC

        self._libc = _LIBC
        self.maps: list[tuple[int, int, int]] = []  # (fd, address, size)
        self.total = 0
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            size = os.path.getsize(path)
            address = _LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            self.maps.append((fd, address, size))
            self.total += size

    def windows(self, window: int) -> list[tuple[int, int, int]]:
        """(address, length, offset in the destination) of every window."""
        found, base = [], 0
        for _, address, size in self.maps:
            found += [
                (address + lo, min(window, size - lo), base + lo) for lo in range(0, size, window)
            ]
            base += size
        return found

    def close(self) -> None:
        for fd, address, size in self.maps:
            self._libc.munmap(address, size)
            os.close(fd)


def loaded_cudart():
    """libcudart through ctypes (which lets go of the GIL for every call): the copy this
    process already loaded, else the CUDA runtime wheel's (it shares the device's primary
    context with torch). None where neither is found."""
    import site

    paths = [
        line.split()[-1]
        for line in Path("/proc/self/maps").read_text().splitlines()
        if "libcudart" in line and line.split()[-1].startswith("/")
    ]
    for root in site.getsitepackages() + [site.getusersitepackages()] + sys.path:
        paths += sorted(str(p) for p in Path(root).glob("nvidia/cu*/lib/libcudart.so*"))
    for path in paths:
        try:
            library = ctypes.CDLL(path)
        except OSError:
            continue
        library.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        library.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        print(f"ctypes cudart: {path}", flush=True)
        return library
    return None


def window_copy_seconds(files: list[str], window: int, threads: int, register) -> dict:
    """Every file to one device buffer through windows of its mapped page cache, ``threads``
    windows at a time, each on its thread's stream. ``register`` is None (copy from
    pageable memory: the driver stages it) or a (register, unregister) pair, called
    around each window's copy. Also checks a sample of windows against the files."""
    mapped = MappedFiles(files)
    try:
        windows = mapped.windows(window)
        destination = torch.empty(mapped.total, dtype=torch.uint8, device="cuda")
        counter = itertools.count()
        errors: list[BaseException] = []

        def work() -> None:
            stream = torch.cuda.Stream()
            torch.cuda.set_stream(stream)
            in_flight: deque = deque()
            try:
                while not errors:
                    index = next(counter)
                    if index >= len(windows):
                        return
                    address, length, at = windows[index]
                    if register is not None:
                        error = register[0](address, length, READ_ONLY)
                        if int(error) != 0:
                            raise RuntimeError(f"cudaHostRegister returned {error}")
                    host = torch.frombuffer(
                        (ctypes.c_uint8 * length).from_address(address), dtype=torch.uint8
                    )
                    destination[at : at + length].copy_(host, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
                    in_flight.append((event, address))
                    if len(in_flight) > 1:
                        done, done_address = in_flight.popleft()
                        done.synchronize()
                        if register is not None:
                            register[1](done_address)
            except BaseException as error:
                errors.append(error)
            finally:
                for done, done_address in in_flight:
                    done.synchronize()
                    if register is not None:
                        register[1](done_address)

        workers = [threading.Thread(target=work) for _ in range(threads)]
        torch.cuda.synchronize()
        started = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        if errors:
            return {"error": repr(errors[0])}
        step = max(1, len(windows) // 8)
        for address, length, at in windows[::step]:
            expected = torch.frombuffer(
                bytearray((ctypes.c_uint8 * length).from_address(address)), dtype=torch.uint8
            )
            if not torch.equal(destination[at : at + length].cpu(), expected):
                return {"error": f"window at {at} differs from the file"}
        return {"seconds": seconds, "gb_per_second": mapped.total / seconds / GB}
    finally:
        mapped.close()


class Phases(PhaseClock):
    """Time the load's steps by wrapping them: allocating destinations, read_into (the
    module is installed meanwhile), and within it reads, waits for a ring buffer and copy
    issues.
    With ``copy=False`` the copier issues no device copies (reads alone)."""

    def __init__(self, copy: bool = True):
        from ondeck.loading import components, process_pool, reads, ring

        steps = {
            "pread": (ring, "pread_exact"),
            "copy issue": (ring, "deliver"),
            "ring wait": (ring.Slot, "wait"),
            "read_into": (reads, "read_into"),
            "reply wait": (process_pool.ReadingProcesses, "replies"),
            "allocate": (components, "_allocate"),
            "install": (components, "_install"),
        }
        super().__init__(steps, events=False)
        self.copy = copy
        self._ring = ring

    def __enter__(self):
        self._deliver = self._ring.deliver
        if not self.copy:
            self._ring.deliver = _deliver_nothing  # then timed as the copy issue
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._ring.deliver = self._deliver

    def summary(self, loads: int) -> dict:
        """Per load: seconds (thread-seconds for steps on several threads), calls, mean µs."""
        return {
            name: {
                "seconds_per_load": round(total / loads, 4),
                "calls_per_load": self.counts[name] // loads,
                "mean_us": round(total / self.counts[name] * 1e6, 1),
            }
            for name, total in self.totals.items()
        }


def _deliver_nothing(chunk, staged, streams, casts, driver=None):
    return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", default=".bench-data/dit16")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sections", default="memory,pread,register,mapped,reader")
    parser.add_argument(
        "--loads",
        default="16:8:32:threads,8:8:16:threads,8:8:32,16:8:32,8:16:16,8:8:32:nocopy",
        help="reader section: readers:buffer MiB:buffer count[:switch µs][:nocopy][:threads]"
        " (threads: reading threads, not processes), comma-separated",
    )
    args = parser.parse_args()
    sections = set(args.sections.split(","))

    from ondeck.loading import ComponentLoader, ModelFolder

    folder_path = build_transformer_folder(Path(args.folder), num_layers=args.layers)
    files = sorted(str(p) for p in (folder_path / "transformer").glob("*.safetensors"))
    nbytes = sum(os.path.getsize(f) for f in files)
    results: dict = {"facts": host_facts(), "checkpoint_bytes": nbytes}
    print(results["facts"].get("lscpu", ""))
    print(results["facts"].get("nvidia-smi", ""))
    print({k: v for k, v in results["facts"].items() if k in ("kernel", "numa_nodes", "thp")})
    rows: list[tuple[str, float]] = []

    def row(name: str, gbps: float) -> None:
        rows.append((name, gbps))
        print(f"{name:<48} {gbps:7.2f} GB/s", flush=True)

    for threads in (1, 8, 16) if "memory" in sections else ():
        row(f"memcpy 2 GiB, {threads} threads", memcpy_gbps(2 << 30, threads, args.repeats))

    warm_page_cache(files)
    for pinned in (True, False) if "pread" in sections else ():
        for threads in (8, 16):
            for buffer_mib in (4, 8, 16):
                if not pinned and buffer_mib != 8:
                    continue
                seconds = median(
                    [
                        pread_seconds(files, threads, buffer_mib * MiB, pinned)
                        for _ in range(args.repeats)
                    ]
                )
                kind = "pinned" if pinned else "pageable"
                row(f"pread {kind}, {threads} thr, {buffer_mib} MiB", nbytes / seconds / GB)

    for chunk_mib in (64, 512) if "register" in sections else ():
        try:
            phases = register_phases(files, chunk_mib * MiB)
        except Exception as error:  # an unsupported mapping must not end the profile
            phases = {"error": repr(error)}
        results[f"register {chunk_mib} MiB"] = phases
        print(f"register {chunk_mib} MiB: {phases}", flush=True)
        if "bytes" in phases:
            for phase in ("register", "copy", "unregister"):
                row(f"register {chunk_mib} MiB: {phase} only", phases["bytes"] / phases[phase] / GB)

    if "mapped" in sections:
        cudart = torch.cuda.cudart()
        callers = {
            "pageable": None,
            "torch cudart": (cudart.cudaHostRegister, cudart.cudaHostUnregister),
        }
        library = loaded_cudart()
        if library is not None:
            callers["ctypes cudart"] = (library.cudaHostRegister, library.cudaHostUnregister)
        for caller, register in callers.items():
            for window_mib, threads in ((64, 1), (64, 4), (64, 8), (256, 4)):
                try:
                    outcome = window_copy_seconds(files, window_mib * MiB, threads, register)
                except Exception as error:  # an unsupported mapping must not end the profile
                    outcome = {"error": repr(error)}
                torch.cuda.empty_cache()
                name = f"mapped, {caller}: {threads} thr, {window_mib} MiB windows"
                results[name] = outcome
                if "gb_per_second" in outcome:
                    row(name, outcome["gb_per_second"])
                else:
                    print(f"{name}: {outcome}", flush=True)

    if "reader" in sections:
        folder = ModelFolder.open(folder_path)
        for spec in args.loads.split(","):
            threads, buffer_mib, count, *extra = spec.split(":")
            threads, buffer_mib, count = int(threads), int(buffer_mib), int(count)
            copy = "nocopy" not in extra
            on_threads = "threads" in extra
            switch = [float(x) / 1e6 for x in extra if x not in ("nocopy", "threads")]
            os.environ["ONDECK_READ_PROCESSES"] = "0" if on_threads else "1"
            default_switch = sys.getswitchinterval()
            sys.setswitchinterval(switch[0] if switch else default_switch)
            loader = ComponentLoader(
                folder,
                "transformer",
                device="cuda",
                dtype=torch.bfloat16,
                progress=False,
                threads=threads,
                buffer_bytes=buffer_mib * MiB,
                buffer_count=count,
            )
            with Phases(copy) as phases:
                runs = []
                for _ in range(args.repeats):
                    torch.cuda.synchronize()
                    started = time.perf_counter()
                    module = loader()
                    torch.cuda.synchronize()
                    runs.append(time.perf_counter() - started)
                    del module
                    torch.cuda.empty_cache()
            sys.setswitchinterval(default_switch)
            what = "load" if copy else "load without device copies"
            what += ", threads" if on_threads else ", processes"
            name = f"{what}: {threads} thr, {buffer_mib} MiB x {count}"
            if switch:
                name += f", switch {switch[0] * 1e6:.0f} µs"
            row(name, nbytes / median(runs) / GB)
            results[name] = phases.summary(args.repeats)
            print("   ", results[name], flush=True)

    results["rows"] = dict(rows)
    results["date"] = time.strftime("%Y-%m-%d")
    results["torch"] = torch.__version__
    (out_dir() / "read_path.json").write_text(json.dumps(results, indent=2, default=str))
    print()
    print(f"{'what':<48} {'GB/s':>8}")
    for name, gbps in rows:
        print(f"{name:<48} {gbps:8.2f}")


if __name__ == "__main__":
    main()
