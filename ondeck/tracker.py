"""The timeline of what was resident when: loads, releases, waits and each stage's peak."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import timeline
from .memory import allocator_counts, measured_device_bytes, process_peak_rss_bytes

__all__ = ["Event", "MemoryTracker", "StageRecord"]


@dataclass
class Event:
    seconds: float
    kind: str  # load | fill | release | stage_start | stage_end | wait
    name: str
    nbytes: int
    resident_bytes: int
    measured_bytes: int | None = None
    duration_seconds: float | None = None
    run: int = 0


@dataclass
class StageRecord:
    run: int
    stage: str
    seconds: float
    exposed_load_seconds: float
    resident_bytes_at_start: int
    peak_measured_bytes: int | None
    activation_bytes: int | None
    # Times the CUDA allocator found no room, freed its cache and tried again during the
    # stage (each waits for the device): memory at its limit. None off CUDA.
    allocator_retries: int | None = None
    # Of those, the ones that still found no room: out-of-memory errors (a tiled decode
    # learning its tiles raises and catches them on purpose). None off CUDA.
    allocator_ooms: int | None = None
    # Where the stage's peak stayed under one reached before it (``activation_bytes``
    # None): the most its activations can have been, that earlier peak less the fewest
    # weights resident while it computed. None where measured exactly, or off CUDA.
    activation_bound_bytes: int | None = None


class CallTimer:
    """Each call's time on the device, between two timing events recorded on the
    computing stream as the call starts and returns (``event()`` makes one: CUDA's
    ``Event(enable_timing=True)``), less the time the stream stood waiting inside the
    call for streamed blocks still being copied (``mark`` before such a wait, ``stalled``
    after it). Read once the run is over, when the events are done: what is left is the
    call's compute, which the plan weighs copies against. The quickest call of a run is
    kept (other waits, such as a pipelined load's, still count in its own call)."""

    def __init__(self, event: Any, stream: Any = lambda: None):
        self._event = event
        self._stream = stream  # the stream to record on: None, the current one
        self._open: dict[str, list[_TimedCall]] = {}
        self._timed: list[tuple[str, _TimedCall, Any]] = []

    @classmethod
    def for_device(cls, device: Any) -> CallTimer | None:
        """A timer on ``device``'s current stream on CUDA; None elsewhere."""
        if not str(device).startswith("cuda"):
            return None
        import torch

        return cls(
            lambda: torch.cuda.Event(enable_timing=True),
            lambda: torch.cuda.current_stream(device),
        )

    def _recorded(self) -> Any:
        event = self._event()
        event.record(self._stream())
        return event

    def started(self, name: str) -> None:
        self._open.setdefault(name, []).append(_TimedCall(self._recorded()))

    def ended(self, name: str) -> None:
        opened = self._open.get(name)
        if opened:
            self._timed.append((name, opened.pop(), self._recorded()))

    def mark(self) -> Any:
        """An event recorded now, where a wait for copies may follow (``stalled``)."""
        return self._recorded()

    def stalled(self, name: str, since: Any) -> None:
        """``name``'s call stood waiting from ``since`` (``mark``) to now. Outside a call
        of ``name`` (a stage that runs the module itself) it counts nowhere."""
        opened = self._open.get(name)
        if opened:
            opened[-1].stalls.append((since, self._recorded()))

    def quickest(self) -> dict[str, float]:
        """Per component, its quickest call's seconds so far in this run, less its waits."""
        quickest: dict[str, float] = {}
        for name, call, end in self._timed:
            end.synchronize()
            milliseconds = call.start.elapsed_time(end)
            milliseconds -= sum(start.elapsed_time(stop) for start, stop in call.stalls)
            seconds = max(0.0, milliseconds / 1000)
            quickest[name] = min(seconds, quickest.get(name, seconds))
        return quickest

    def clear(self) -> None:
        self._open, self._timed = {}, []


@dataclass
class _TimedCall:
    start: Any  # the event recorded as the call started
    stalls: list[tuple[Any, Any]] = field(default_factory=list)  # (mark, end) of each wait


def _resets_peaks_by_default() -> bool:
    return os.environ.get("ONDECK_RESET_PEAKS", "0").strip().lower() in ("1", "true", "yes")


@dataclass
class MemoryTracker:
    """Records every load, release and stage boundary with resident and measured bytes.

    Holds names and numbers only, never a module: the tracker must not keep anything
    alive that a release is meant to free.

    On CUDA each stage's peak device bytes allocated is measured. ``reset_peaks`` says
    how. False (the default, or ``ONDECK_RESET_PEAKS=0``): torch's peak statistics are
    only read, never reset, so the caller's ``torch.cuda.max_memory_allocated()`` still
    covers everything before and during the run; a stage's peak is then known exactly
    when the stage raised that figure (or started at it), and is None when it stayed
    below a peak reached earlier. True (``ONDECK_RESET_PEAKS=1``): the statistics are
    reset as each stage starts and as its compute starts, so every stage's peak is
    exact, and the caller's ``max_memory_allocated()`` afterwards covers only the time
    since the last stage's compute began (the tracker's ``peak_measured_bytes`` keeps
    the figure from before).
    """

    device: str = "cpu"
    events: list[Event] = field(default_factory=list)
    stages: list[StageRecord] = field(default_factory=list)
    resident: dict[str, int] = field(default_factory=dict)
    peak_resident_bytes: int = 0
    bytes_loaded: int = 0
    runs: int = 0
    runs_completed: int = 0  # of those, the ones that completed (``run_finished``)
    peak_measured_bytes: int = 0
    # Seconds computing waited for loads, over every stage of every run (``stages`` keeps
    # the last ``keep_runs`` runs' own).
    exposed_load_total: float = 0.0
    # The process's highest RSS while runs were on (the host watch's samples).
    host_peak_bytes: int = 0
    # How far the process, besides the host memory a plan counts on its own, rose in the
    # last run above where it started: the reserve the next plan keeps for a run.
    host_growth_bytes: int = 0
    keep_runs: int = 4
    reset_peaks: bool = field(default_factory=_resets_peaks_by_default)
    # Per component, its calls in the last run that completed (``called``).
    calls_per_run: dict[str, int] = field(default_factory=dict)
    # Per component, its quickest call's device time in the last run that completed
    # (``call_timer``): what a call computes when nothing keeps it waiting. Only where
    # the device times its work (CUDA events).
    seconds_per_call: dict[str, float] = field(default_factory=dict)
    call_timer: CallTimer | None = None
    # Per component loaded in the last run that completed, the rate its load reached
    # (bytes over the seconds to its last weight in place): what loading it costs, as
    # the plan weighs reloading against staying.
    load_bytes_per_second: dict[str, float] = field(default_factory=dict)
    # The same less what only a first load under a plan does (page-locking and filling
    # streamed blocks' host copies): what loading it again under the same plan costs.
    reload_bytes_per_second: dict[str, float] = field(default_factory=dict)
    # Per stage never measured exactly (its peak stayed under an earlier one, as the
    # caller's peak counters are left alone): the least of its ``activation_bound_bytes``
    # over the runs, which a plan may count instead of a guess.
    activation_bounds: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._start = time.perf_counter()
        self._stage_started: float | None = None
        self._exposed: float = 0.0
        self._event_peak = 0  # the most measured at any event, the dropped runs' included
        self._stage_resident_at_start = 0
        self._compute_resident = 0
        # The fewest weights resident since the stage began computing (its compute mark,
        # else its first call); None before.
        self._least_resident: int | None = None
        # Read where the measured part of a stage begins: the device's peak so far and
        # its bytes allocated then (None off CUDA).
        self._peak_at_mark: int | None = None
        self._allocated_at_mark: int | None = None
        # Reset mode: the stage's peak before its compute began (its statistics reset then).
        self._peak_before_reset: int | None = None
        self._allocator_counts_at_start: tuple[int, int] | None = None
        self._calls: dict[str, int] = {}
        # Per component, the seconds of its last load that a reload does not repeat.
        self._setup_seconds: dict[str, float] = {}
        # Components whose ``load_bytes_per_second`` is still the process's first run's.
        self._first_run_rates: set[str] = set()

    @property
    def later_load_bytes_per_second(self) -> dict[str, float]:
        """``load_bytes_per_second`` but the rates a process's first run alone gave: its
        loads read files for the first time and page-lock host copies beside them, and
        where stored peaks let the next load start early, share the reads. What a plan
        prices reloading by (``streaming.StreamingInputs.load_bytes_per_second``)."""
        with self._lock:
            rates = self.load_bytes_per_second.items()
            return {n: r for n, r in rates if n not in self._first_run_rates}

    @property
    def started_at(self) -> float:
        """The ``time.perf_counter()`` reading that events' ``seconds`` count from."""
        return self._start

    @property
    def resident_bytes(self) -> int:
        return sum(self.resident.values())

    def _measure(self) -> int | None:
        try:
            return measured_device_bytes(self.device)
        except Exception:
            return None

    def _record(self, kind: str, name: str, nbytes: int, duration: float | None = None) -> None:
        measured = self._measure()
        self._event_peak = max(self._event_peak, measured or 0)
        self.events.append(
            Event(
                seconds=time.perf_counter() - self._start,
                kind=kind,
                name=name,
                nbytes=nbytes,
                resident_bytes=self.resident_bytes,
                measured_bytes=measured,
                duration_seconds=duration,
                run=self.runs,
            )
        )

    def loaded(
        self,
        name: str,
        nbytes: int,
        seconds: float,
        *,
        exposed: bool = True,
        setup_seconds: float = 0.0,
    ) -> None:
        """``name`` is loaded: ``nbytes`` on the device after ``seconds``, of which
        ``setup_seconds`` made what later loads find ready (streamed blocks' host copies)."""
        with self._lock:
            self._setup_seconds[name] = setup_seconds
            self.resident[name] = nbytes
            self.bytes_loaded += nbytes
            self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)
            self._compute_resident = max(self._compute_resident, self.resident_bytes)
            if exposed and self._stage_started is not None:
                self._exposed += seconds
            self._record("load", name, nbytes, seconds)

    def resized(self, name: str, nbytes: int) -> None:
        """``name``, resident, now holds ``nbytes`` (adapters' layers added to it)."""
        with self._lock:
            if name in self.resident:
                self.resident[name] = nbytes
                self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)

    def filled(self, name: str, seconds: float, *, setup_seconds: float = 0.0) -> None:
        """A pipelined load of ``name`` has every weight in place, ``seconds`` after it
        began (``setup_seconds`` of them as for ``loaded``); its ``load`` event marked
        when compute could start."""
        with self._lock:
            self._setup_seconds[name] = setup_seconds
            self._record("fill", name, self.resident.get(name, 0), seconds)

    def released(self, name: str, nbytes: int) -> None:
        with self._lock:
            self.resident.pop(name, None)
            if self._least_resident is not None:
                self._least_resident = min(self._least_resident, self.resident_bytes)
            self._record("release", name, nbytes)

    def waited(self, name: str, seconds: float) -> None:
        with self._lock:
            if self._stage_started is not None:
                self._exposed += seconds
            self._record("wait", name, 0, seconds)

    def called(self, name: str) -> None:
        """``name`` was called (one forward pass) in the run under way."""
        with self._lock:
            self._calls[name] = self._calls.get(name, 0) + 1
            if self._least_resident is None and self._stage_started is not None:
                self._least_resident = self.resident_bytes  # a turn's compute begins
        if self.call_timer is not None:
            self.call_timer.started(name)

    def calls_so_far(self) -> dict[str, int]:
        """The run's calls per component so far, to put back with ``restore_calls``."""
        with self._lock:
            return dict(self._calls)

    def restore_calls(self, calls: dict[str, int]) -> None:
        """Forget the calls made since ``calls_so_far``: an attempt that ran out of memory
        and runs again counts once."""
        with self._lock:
            self._calls = dict(calls)

    def returned(self, name: str) -> None:
        """A call of ``name`` returned."""
        if self.call_timer is not None:
            self.call_timer.ended(name)

    def run_finished(self) -> None:
        """A run completed: its calls per component become ``calls_per_run``, and their
        quickest device times ``seconds_per_call``. A component the run did not call
        (every answer it gave was kept from before) keeps its figures: the next run,
        with a new prompt, calls it again, and a plan that forgot it would flip."""
        timed = self.call_timer.quickest() if self.call_timer is not None else {}
        with self._lock:
            self.runs_completed += 1
            self.calls_per_run = {**self.calls_per_run, **self._calls}
            self._calls = {}
            if timed:
                self.seconds_per_call = {**self.seconds_per_call, **timed}
            loads: dict[str, tuple[int, float]] = {}
            for event in self.events:  # a pipelined load's fill ends it, and comes last
                if event.run == self.runs and event.kind in ("load", "fill"):
                    if event.duration_seconds and event.nbytes:
                        loads[event.name] = (event.nbytes, event.duration_seconds)
            self.load_bytes_per_second.update({n: b / s for n, (b, s) in loads.items()})
            if self.runs_completed == 1:
                self._first_run_rates = set(loads)
            else:
                self._first_run_rates -= set(loads)
            for name, (nbytes, seconds) in loads.items():
                setup = self._setup_seconds.get(name, 0.0)
                again = seconds - setup if 0 < setup < seconds else seconds
                self.reload_bytes_per_second[name] = nbytes / again

    def reload_cost(self, names: Iterable[str]) -> tuple[int, float] | None:
        """The bytes of ``names`` resident now and the seconds loading them again takes
        at their measured reload rates; None where a rate is unknown or nothing is held."""
        freed, seconds = 0, 0.0
        for name in names:
            nbytes = self.resident.get(name, 0)
            rate = self.reload_bytes_per_second.get(name)
            if nbytes and not rate:
                return None
            freed += nbytes
            seconds += nbytes / rate if nbytes else 0.0
        return (freed, seconds) if freed else None

    def run_started(self) -> None:
        """A run begins; events and stage records of older runs than ``keep_runs`` go.

        Totals (peaks, bytes loaded) cover every run; the timeline covers the last ones,
        so a long-lived process does not grow with every generation.
        """
        with self._lock:
            self.runs += 1
            self._calls = {}
            oldest = self.runs - self.keep_runs + 1
            if self.stages and self.stages[0].run < oldest:
                self.stages = [s for s in self.stages if s.run >= oldest]
                self.events = [e for e in self.events if e.run >= oldest]
        if self.call_timer is not None:
            self.call_timer.clear()

    def _on_cuda(self) -> bool:
        return str(self.device).startswith("cuda")

    def _mark(self, *, stage_start: bool) -> None:
        """The measured part of a stage begins here (at its start, then at its compute)."""
        import torch

        if not self._on_cuda():
            return
        peak = int(torch.cuda.max_memory_allocated(self.device))
        self._peak_at_mark = peak
        self._allocated_at_mark = int(torch.cuda.memory_allocated(self.device))
        if self.reset_peaks:
            # Keep what the statistics held before they go: the peak before this stage
            # (for the overall figure), or this stage's own loads before its compute.
            if stage_start:
                self.peak_measured_bytes = max(self.peak_measured_bytes, peak)
                self._peak_before_reset = None
            else:
                self._peak_before_reset = max(self._peak_before_reset or 0, peak)
            torch.cuda.reset_peak_memory_stats(self.device)

    def _stage_peak(self) -> tuple[int | None, int | None]:
        """(peak allocated since the mark when it is known, peak allocated over all)."""
        import torch

        if not self._on_cuda():
            return None, None
        peak = int(torch.cuda.max_memory_allocated(self.device))
        if self._peak_at_mark is None:  # no stage began: the peak is older
            return None, peak
        if self.reset_peaks:
            return peak, max(peak, self._peak_before_reset or 0)
        if peak > self._peak_at_mark or peak == self._allocated_at_mark:
            # Raised the device's peak, or began at it: either way, this is the stage's.
            return peak, peak
        return None, peak  # stayed below a peak reached before: not this stage's

    def stage_started(self, stage: str) -> None:
        """A stage begins: the policy may now load or evict before it computes."""
        with self._lock:
            self._stage_started = time.perf_counter()
            self._exposed = 0.0
            self._stage_resident_at_start = self.resident_bytes
            self._compute_resident = self.resident_bytes
            self._least_resident = None
            self._allocator_counts_at_start = allocator_counts(self.device)
            self._mark(stage_start=True)  # compute_started moves it, where it is called
            self._record("stage_start", stage, 0)

    def compute_started(self) -> None:
        """The stage's own work begins; device peaks from here on are its activations.

        With ``reset_peaks``, resets the device's peak statistics after keeping the peak
        reached since the stage started, so its loads before the compute still count.
        """
        with self._lock:
            self._mark(stage_start=False)
            self._compute_resident = self._least_resident = self.resident_bytes

    def stage_finished(self, stage: str, loading_bytes: int = 0) -> StageRecord:
        """The stage is done. ``loading_bytes``: components still loading in the
        background (a prefetch), whose tensors the device peak may already hold."""
        with self._lock:
            started = self._stage_started or time.perf_counter()
            compute_peak, overall_peak = self._stage_peak()
            activation = bound = peak = None
            least = self._least_resident
            if compute_peak is None and overall_peak is not None and least is not None:
                # Below the peak reached before: nothing allocated while computing passed it.
                bound = max(0, overall_peak - least)
            if compute_peak is not None:
                # Weights resident, or arriving, at any point of the stage are not
                # activations.
                weights = max(self._compute_resident, self.resident_bytes + loading_bytes)
                activation = max(0, compute_peak - weights)
                peak = max(compute_peak, self._peak_before_reset or 0)
            if overall_peak is not None:
                self.peak_measured_bytes = max(self.peak_measured_bytes, overall_peak)
            counts, at_start = allocator_counts(self.device), self._allocator_counts_at_start
            retries = ooms = None  # not counted at both ends: unknown, not a lifetime total
            if counts is not None and at_start is not None:
                retries, ooms = counts[0] - at_start[0], counts[1] - at_start[1]
            record = StageRecord(
                run=self.runs,
                stage=stage,
                seconds=time.perf_counter() - started,
                exposed_load_seconds=self._exposed,
                resident_bytes_at_start=self._stage_resident_at_start,
                peak_measured_bytes=peak,
                activation_bytes=activation,
                allocator_retries=retries,
                allocator_ooms=ooms,
                activation_bound_bytes=bound,
            )
            self.stages.append(record)
            self.exposed_load_total += self._exposed
            self._stage_started = None
            self._peak_at_mark = self._allocated_at_mark = self._peak_before_reset = None
            self._least_resident = None
            self._allocator_counts_at_start = None
            self._record("stage_end", stage, 0)
            return record

    def keep_bound(self, record: StageRecord) -> None:
        """A stage that completed without running out of memory: its bound joins
        ``activation_bounds``. One that raised or ran out bounds nothing of later runs."""
        bound = record.activation_bound_bytes
        if bound is not None and not record.allocator_ooms:
            known = self.activation_bounds.get(record.stage)
            self.activation_bounds[record.stage] = bound if known is None else min(known, bound)

    def run_peak_measured_bytes(self, run: int) -> int | None:
        """Peak device bytes allocated during ``run`` (CUDA only; without ``reset_peaks``,
        only stages that raised the device's peak count, so None when none did)."""
        peaks = [s.peak_measured_bytes for s in self.stages if s.run == run]
        peaks = [p for p in peaks if p is not None]
        return max(peaks) if peaks else None

    def exposed_load_seconds(self, run: int | None = None) -> float:
        return sum(s.exposed_load_seconds for s in self.stages if run is None or s.run == run)

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "runs": self.runs,
            "reset_peaks": self.reset_peaks,
            "peak_resident_bytes": self.peak_resident_bytes,
            "host_peak_bytes": self.host_peak_bytes,
            "host_growth_bytes": self.host_growth_bytes,
            "bytes_loaded": self.bytes_loaded,
            "calls_per_run": dict(self.calls_per_run),
            "seconds_per_call": dict(self.seconds_per_call),
            "load_bytes_per_second": dict(self.load_bytes_per_second),
            "reload_bytes_per_second": dict(self.reload_bytes_per_second),
            "peak_measured_bytes": max(self.peak_measured_bytes, self._event_peak),
            "process_peak_rss_bytes": process_peak_rss_bytes(),
            "exposed_load_seconds": self.exposed_load_total,
            "stages": [asdict(s) for s in self.stages],
            "events": [asdict(e) for e in self.events],
        }

    def write_json(self, path: str | os.PathLike, **extra: Any) -> Path:
        path = Path(path)
        path.write_text(json.dumps({**self.to_dict(), **extra}, indent=2))
        return path

    def plot(
        self,
        path: str | os.PathLike,
        *,
        title: str = "ondeck memory timeline",
        budget_bytes: int | None = None,
    ) -> Path:
        """A PNG of the timeline (``ondeck.timeline``; needs matplotlib), with the
        policy's ``budget_bytes`` as a line where given."""
        return timeline.plot(self, path, title=title, budget_bytes=budget_bytes)
