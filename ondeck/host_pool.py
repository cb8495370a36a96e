"""A pipeline's host memory: its budget, what the process holds beside the host memory
ondeck counts on its own, how much the process grows during a run, and the watch that
keeps a run within the budget."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import memory
from .host_watch import HostWatch
from .lazy import loader_of
from .loading import FolderLoader
from .memory import format_bytes

__all__ = [
    "OUTPUT_HOST_COPIES",
    "RUN_GROWTH_MIN_BYTES",
    "HostGrowth",
    "HostMemory",
    "HostPlan",
    "elastic_share",
    "output_host_bytes",
]

# Before a run is measured, a run's growth is estimated as its decoded output in host
# memory (float32 RGB frames, this many copies: the decode's output brought to the host,
# its conversion, the array handed back) ...
OUTPUT_HOST_COPIES = 3
# ... and, on a CUDA device, this much for what every run allocates on the host: the
# loads' pinned read buffers, torch's pinned and CPU allocators' caches, activations
# brought to the host. On the CPU the device plan counts weights and activations, which
# are host memory there.
RUN_GROWTH_MIN_BYTES = 2**30


@dataclass(frozen=True)
class HostGrowth:
    """How much the process grows during a run beyond what it held when the run's plan
    was made (the host memory ondeck counts on its own aside), and where that comes from."""

    nbytes: int
    source: str
    measured: bool = False  # from a watched run, not estimated


def output_host_bytes(height: int, width: int, frames: int | None = None, batch: int = 1) -> int:
    """Host bytes of a decoded output of this shape: float32 RGB, ``OUTPUT_HOST_COPIES``."""
    return OUTPUT_HOST_COPIES * 4 * 3 * batch * max(1, frames or 1) * height * width


class HostMemory:
    """The host half of a ``Pipeline``: the host budget and its pool, the reserve for a
    run's growth (measured once a run was watched, estimated before), and the watch.

    The plan counts the host copies, rings and host cache on their own; ``process`` is
    the rest of the process when the plan is made, and ``host_growth`` how much that rest
    grows during a run (activations on the host, the decoded output, allocator caches):
    without it the plan would hand the process's growth to pinned copies and rings.
    """

    host_memory: int | None
    host_watch: HostWatch | None
    policy: Any
    tracker: Any
    device: Any
    deferred: dict[str, Any]
    run_shape: dict[str, Any] | None
    plan: Any  # the pipeline's: ``plan() -> Plan``
    loaded_before: Any  # the pipeline's: ``loaded_before(name) -> bool``
    more_runs: bool
    # Whether something beside the plan may release components between runs (a server
    # making room for another model): an elastic host cache then keeps any of them.
    released_between_runs: bool = False

    def init_host_memory(self, host_memory: int | None) -> None:
        # The host budget: given, else from the machine and its cgroup (``host_facts``).
        self.host_memory = host_memory
        self.host_watch = None
        self._run_host: tuple[int, str, int, int] | None = None  # read once a run
        # The last watched run's growth, and the output bytes estimated for that run.
        self._measured_growth: tuple[int, int] | None = None

    def host_budget_bytes(self) -> int:
        """The RSS this process may reach: ``host_memory`` if given, else the machine's."""
        if self.host_memory is not None:
            return self.host_memory
        return memory.host_facts().budget_bytes

    def host_pool(self) -> tuple[int, str, int, int]:
        """The host budget, where it comes from, what the process holds besides the host
        copies, rings and host-cache entries ondeck holds (those the plan counts on their
        own), and the host cache's budget. Read once a run while one is on, else now."""
        if self._run_host is not None:
            return self._run_host
        facts = memory.host_facts()
        budget_bytes, source = facts.budget_bytes, facts.source
        if self.host_memory is not None:
            budget_bytes, source = self.host_memory, "given"
        caches = self._host_caches()
        streaming = getattr(self.policy, "streaming", None)
        # Entries and loads still filling theirs: both are in the process's RSS.
        held = sum(cache.held_bytes for cache in caches)
        held += streaming.host_bytes() if streaming is not None else 0
        # An elastic cache takes what the plan leaves (``fit_host_caches``), not room of
        # its own.
        cache = sum(cache.budget_bytes for cache in caches if not cache.elastic)
        return budget_bytes, source, max(0, facts.process_bytes - held), cache

    def host_room_bytes(self) -> int:
        """Host memory the streamed blocks' pinned copies and rings may take: the host
        budget less the process, its growth during a run and the host cache's budget."""
        budget_bytes, _, process, cache = self.host_pool()
        return budget_bytes - process - self.host_growth().nbytes - cache

    def elastic_caches(self) -> tuple[tuple[int, ...], int]:
        """The elastic host caches' caps, and what they hold now (``HostPlan``'s)."""
        elastic = self._elastic_caches()
        return tuple(cache.cap_bytes for cache in elastic), sum(c.held_bytes for c in elastic)

    def fit_host_caches(self, plan: Any = None) -> None:
        """Give the elastic host caches what ``plan`` (default: the plan now) leaves of
        the host room once its pinned copies and rings are counted (``elastic_share``).
        They take nothing of a component no run will load again: one not loaded yet that
        the plan keeps on the device through every stage (not under ``release``, which
        frees each component after its last turn; not where something else may release
        it between runs: ``released_between_runs``). Before the last run (``more_runs``
        False: a one-shot command) they keep what they hold and take nothing more: no
        later run would reload it."""
        elastic = self._elastic_caches()
        if not elastic:
            return
        plan = self.plan() if plan is None else plan
        room = self.host_room_bytes() - plan.pinned_host_bytes - plan.ring_bytes
        share = elastic_share(room, memory.local_ranks(), len(elastic))
        stages = [set(resident) for _, resident, _ in plan.stages]
        always = set.intersection(*stages) if stages else set()
        if plan.policy == "release" or self.released_between_runs:
            always = set()
        refused = [
            loader.cache_owner
            for name, proxy in self.deferred.items()
            if name in always
            and not self.loaded_before(name)
            and isinstance(loader := loader_of(proxy), FolderLoader)
        ]
        for cache in elastic:
            cache.fit(share, refused, adding=self.more_runs)

    def host_growth(self) -> HostGrowth:
        """The reserve for the process's growth during a run: the last watched run's,
        more where this run's output is larger; before a run, an estimate."""
        output = self.output_host_bytes()
        if self._measured_growth is not None:
            grown, then = self._measured_growth
            larger = max(0, output - then)
            return HostGrowth(
                grown + larger,
                "measured: the last run's peak less the process at its start"
                + (f", and {format_bytes(larger)} more output" if larger else ""),
                measured=True,
            )
        floor = RUN_GROWTH_MIN_BYTES if memory.resolve_device(self.device).type == "cuda" else 0
        return HostGrowth(
            output + floor,
            f"estimated: the decoded output {format_bytes(output)}"
            + (f" and {format_bytes(floor)} for a run's buffers and caches" if floor else ""),
        )

    def output_host_bytes(self) -> int:
        """A run's decoded output in host memory, from its shape (``run_shape``'s
        height, width and frames) where known, else 0. Pipelines that know it otherwise
        say so here."""
        shape = self.run_shape or {}
        height, width, frames = (shape.get(key) for key in ("height", "width", "frames"))
        if not (isinstance(height, int) and isinstance(width, int)):
            return 0
        return output_host_bytes(height, width, frames if isinstance(frames, int) else None)

    def counted_host_bytes(self) -> int:
        """The host memory ondeck holds that a plan counts on its own: host-cache entries
        (those being filled too), and streamed blocks' host copies and rings. (On a device
        whose memory is the host's, loaded weights are host memory the host plan does not
        count otherwise: a run that loads them grows the process by them.)"""
        held = sum(cache.held_bytes for cache in self._host_caches())
        streaming = getattr(self.policy, "streaming", None)
        if streaming is not None:
            held += streaming.host_bytes()
        return held

    def _elastic_caches(self) -> list[Any]:
        return [cache for cache in self._host_caches() if cache.elastic]

    def _host_caches(self) -> list[Any]:
        caches: dict[int, Any] = {}
        for proxy in self.deferred.values():
            loader = loader_of(proxy)
            if isinstance(loader, FolderLoader) and loader.host_cache is not None:
                caches[id(loader.host_cache)] = loader.host_cache
        return list(caches.values())

    def relieve_host_memory(self) -> int:
        """Free host memory ondeck holds for speed only: host-cache entries first, then
        host copies of streamed blocks whose component is not loaded; returns the bytes."""
        freed = 0
        for cache in self._host_caches():
            freed += cache.resident_bytes
            cache.clear()
        streaming = getattr(self.policy, "streaming", None)
        if streaming is not None:
            freed += streaming.drop_host_copies()
        return freed

    def _watch_host(self) -> None:
        self._run_host = None
        self._run_host = self.host_pool()  # read once a run: it reads the host's facts
        budget = self._run_host[0]
        if self.host_watch is None:
            self.host_watch = HostWatch(budget, self.relieve_host_memory)
        self.host_watch.budget_bytes = budget
        self.host_watch.counted = self.counted_host_bytes
        self.host_watch.reserve_bytes = self.host_growth().nbytes
        self.host_watch.start()

    def _unwatch_host(self) -> None:
        self._run_host = None
        watch = self.host_watch
        if watch is not None:
            watch.stop()
            self.tracker.host_peak_bytes = max(self.tracker.host_peak_bytes, watch.peak_bytes)
            self.tracker.host_growth_bytes = watch.growth_bytes
            self._measured_growth = (watch.growth_bytes, self.output_host_bytes())

    def check_host_memory(self) -> None:
        """Fail the run (between stages) if the host watch saw the budget exceeded."""
        if self.host_watch is not None:
            self.host_watch.check()


def elastic_share(room: int, ranks: int, caches: int) -> int:
    """What each of ``caches`` elastic host caches may take of ``room`` (the host room a
    plan leaves): every rank a launcher started on this host sees the same free memory,
    so the ranks share it, and a rank's caches share its part evenly."""
    return max(0, room) // ranks // caches


@dataclass(frozen=True)
class HostPlan:
    """The host pool: what the process holds now, the reserve for its growth during a run,
    the pinned host copies of streamed blocks, the rings of blocks read from the files each
    pass, and the host cache's budget, against the host budget."""

    budget_bytes: int
    source: str
    process_bytes: int
    pinned_bytes: int
    cache_bytes: int
    ring_bytes: int = 0
    growth_bytes: int = 0
    growth_source: str = ""
    # The elastic host caches' caps (none: there are none) and what they hold; before a
    # last run (``elastic_adding`` False) what they hold is all they keep. What is left
    # is shared among them and among the ranks on this host (``local_ranks``).
    elastic_caps: tuple[int, ...] = ()
    elastic_held: int = 0
    elastic_adding: bool = True
    local_ranks: int = 1

    @property
    def peak_bytes(self) -> int:
        return (
            self.process_bytes
            + self.growth_bytes
            + self.pinned_bytes
            + self.ring_bytes
            + self.cache_bytes
        )

    def fits(self) -> bool:
        return self.peak_bytes <= self.budget_bytes

    def _elastic_text(self) -> str:
        if not self.elastic_caps:
            return ""
        if not self.elastic_adding:
            return (
                f"; an elastic host cache keeps the {format_bytes(self.elastic_held)} it "
                "holds and takes nothing in a last run"
            )
        left = self.budget_bytes - self.peak_bytes
        share = elastic_share(left, self.local_ranks, len(self.elastic_caps))
        take = sum(min(cap, share) for cap in self.elastic_caps)
        return (
            "; an elastic host cache takes what is left for the components a later run "
            f"loads again, up to {format_bytes(take)}"
            + (f" (this rank's share of {self.local_ranks})" if self.local_ranks > 1 else "")
        )

    def describe(self) -> list[str]:
        lines = [
            f"host: {format_bytes(self.peak_bytes)} predicted of a budget of "
            f"{format_bytes(self.budget_bytes)} ({self.source}): the process now "
            f"{format_bytes(self.process_bytes)}, its growth during a run "
            f"{format_bytes(self.growth_bytes)} ({self.growth_source or 'not known'}), "
            f"pinned copies of streamed blocks {format_bytes(self.pinned_bytes)}, "
            + (
                f"rings of blocks read from the files {format_bytes(self.ring_bytes)}, "
                if self.ring_bytes
                else ""
            )
            + f"host cache {format_bytes(self.cache_bytes)}"
            + self._elastic_text()
        ]
        if not self.fits():
            lines.append(
                f"host: over by {format_bytes(self.peak_bytes - self.budget_bytes)}; a run "
                "stops with a HostMemoryError before the kernel would kill it once dropping "
                "the host cache is not enough. What would fit: fp8 storage (--weights fp8, "
                "storage_dtype=) halves the streamed blocks' host memory, a lower resolution "
                "keeps more blocks on the device, a smaller host cache (--host-cache, "
                "host_cache=), a larger host budget (--host-memory, host_memory=), or a "
                "larger card"
            )
        return lines
