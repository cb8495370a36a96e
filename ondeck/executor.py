"""Carries out what a policy decided: loads, prefetches, releases, profile writes.

The one place that changes what is resident: a policy returns ``Steps``, the
executor acts on them. It owns every thread it starts (a prefetch pool, the next
run's early load) and joins them on ``close()``; the pipeline closes it. Those threads
load onto the pipeline's CUDA device as the current one: a new thread's current device
is the first GPU, whatever the thread that started it set (``torch.cuda.set_device``
holds per thread), and whatever uses the current device there (FSDP2 shards onto it)
would otherwise build on the first GPU for every rank.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from .lazy import wait_filled
from .memory import free_cached_memory
from .profiles import AllocatorEvidence, default_profiles
from .snapshot import Steps

__all__ = ["Executor"]


class Executor:
    """Acts for one pipeline on its deferred components (``pipeline.deferred``),
    reporting waits to its tracker (``pipeline.tracker``)."""

    def __init__(self, pipeline: Any):
        self.pipeline = pipeline
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[str, Future] = {}
        self._next_run: threading.Thread | None = None
        self._next_run_names: tuple[str, ...] = ()
        self._next_run_error: BaseException | None = None
        self._local = threading.local()

    # -- what the policy decided ----------------------------------------------------

    def attach(self, steps: Steps) -> None:
        """Steps taken when the pipeline takes a policy on (eager: load everything)."""
        self._load(steps.load, complete=True)

    def before_run(self, steps: Steps) -> None:
        if steps.streaming is not None:
            streaming, plan = steps.streaming
            streaming.apply(self.pipeline, plan)
        self.release(steps.release)
        self._load(steps.load, complete=True)

    def before_stage(self, steps: Steps) -> None:
        self.release(steps.release)
        # The stage may start computing while the component's blocks arrive.
        self._load(steps.load, complete=False)
        self.release(steps.prefetch_release)
        for name in steps.prefetch:
            self._start_prefetch(name)
        if steps.prefetch_next_run:
            self._start_next_run(steps.prefetch_next_run, after=steps.load)

    def release(self, names: Iterable[str]) -> None:
        """Release each component (after its prefetch, if one runs); the first error is
        raised once every other one is released."""
        first_error: Exception | None = None
        for name in names:
            try:
                self.wait_for((name,))
                self.pipeline.deferred[name].release()
            except Exception as error:  # release the others before reporting
                first_error = first_error or error
        if first_error is not None:
            raise first_error

    def release_all(self, *, quietly: bool = False) -> int:
        """Release every deferred component once prefetches stop; returns the bytes
        freed. ``quietly`` (after a failed run): a failure only warns."""
        if not quietly:
            self.cancel_prefetch()
        freed, first_error = 0, None
        for name, proxy in self.pipeline.deferred.items():
            try:
                freed += proxy.release()
            except Exception as error:  # release the others before reporting
                if not quietly:
                    first_error = first_error or error
                    continue
                warnings.warn(
                    f"releasing '{name}' after a failed run failed: {error!r}", stacklevel=4
                )
        if first_error is not None:
            raise first_error
        return freed

    def recover(self, steps: Steps) -> None:
        """Out of memory: free what the policy let go, and the allocator's cache."""
        self.release(steps.release)
        free_cached_memory()

    def _load(self, names: Iterable[str], *, complete: bool) -> None:
        deferred = self.pipeline.deferred
        for name in names:
            if complete:
                deferred[name].materialize()
            else:
                deferred[name].materialize(complete=False)

    # -- prefetch threads -----------------------------------------------------------

    def _start_prefetch(self, name: str) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ondeck-prefetch")
        proxy = self.pipeline.deferred[name]

        def load() -> None:
            with self._prefetching():
                proxy.materialize(complete=False)

        self._pending[name] = self._pool.submit(load)

    def _start_next_run(self, names: tuple[str, ...], after: tuple[str, ...] = ()) -> None:
        """Load the next run's ``names`` on a thread of its own, once the weights of the
        stage's own components (``after``, loaded by now) are all in."""
        own = [self.pipeline.deferred[name] for name in after]
        proxies = [self.pipeline.deferred[name] for name in names]

        def load() -> None:
            try:
                with self._prefetching():
                    for proxy in own:
                        wait_filled(proxy)  # the rest of a pipelined load, if one runs
                    for proxy in proxies:
                        proxy.materialize(complete=False)
            except BaseException as error:  # the next run's own access retries and reports
                self._next_run_error = error

        self._next_run_names, self._next_run_error = names, None
        self._next_run = threading.Thread(target=load, name="ondeck-next-run", daemon=True)
        self._next_run.start()

    @property
    def loading_ahead(self) -> frozenset[str]:
        """The next run's components this run's last stage loads (or loaded) early."""
        return frozenset(self._next_run_names) if self._next_run is not None else frozenset()

    @contextmanager
    def _prefetching(self) -> Iterator[None]:
        """Marks the calling thread as a prefetch's (``in_prefetch_thread``) meanwhile,
        with the pipeline's CUDA device current."""
        device = getattr(self.pipeline, "device", None)
        on_cuda = device is not None and device.type == "cuda" and device.index is not None
        self._local.prefetching = True
        try:
            with torch.cuda.device(device) if on_cuda else nullcontext():
                yield
        finally:
            self._local.prefetching = False

    @property
    def prefetching(self) -> frozenset[str]:
        """Components a prefetch is loading now, or will."""
        return frozenset(self._pending)

    def in_prefetch_thread(self) -> bool:
        return getattr(self._local, "prefetching", False)

    def wait_for(self, names: Iterable[str]) -> None:
        """Wait for the prefetches of ``names``; a wait is charged to the component."""
        for name in names:
            future = self._pending.get(name)
            if future is None:
                continue
            started = time.perf_counter()
            try:
                future.result()
            except Exception as error:
                # The stage's own access retries the load and reports the error itself.
                warnings.warn(f"prefetching '{name}' failed: {error!r}", stacklevel=3)
            # Not on an interrupt: the aborted run's clean-up still sees it pending.
            self._pending.pop(name, None)
            waited = time.perf_counter() - started
            if waited > 1e-4:
                self.pipeline.tracker.waited(name, waited)

    def _join_next_run(self, *, report: bool = False) -> None:
        thread, self._next_run = self._next_run, None
        if thread is None:
            return
        started = time.perf_counter()
        thread.join()
        waited = time.perf_counter() - started
        if report and waited > 1e-4 and self._next_run_names:
            # One wait, charged once, to the first of the components it was for.
            self.pipeline.tracker.waited(self._next_run_names[0], waited)
        if report and self._next_run_error is not None:
            warnings.warn(
                f"loading {list(self._next_run_names)} ahead of the run failed: "
                f"{self._next_run_error!r}",
                stacklevel=3,
            )

    def finish_run(self) -> None:
        """The run is over: prefetches not started are dropped, the next run's early
        load is waited for (usually done long before: the last stage computes for longer
        than it loads)."""
        self._cancel_pending()
        self._join_next_run(report=True)

    def _cancel_pending(self) -> None:
        for name, future in list(self._pending.items()):
            if future.cancel():
                self._pending.pop(name, None)
        for name in list(self._pending):
            self.wait_for((name,))

    def cancel_prefetch(self) -> None:
        """Drop prefetches not started yet; wait for those already loading."""
        self._cancel_pending()
        self._join_next_run()

    def close(self) -> None:
        """Stop and join every thread started (a later run may start new ones)."""
        self.cancel_prefetch()
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    # -- measurements ---------------------------------------------------------------

    def _profile_key(self) -> tuple[str, dict[str, Any]] | None:
        """The model and run shape the pipeline's profile is kept under; None where it
        keeps none (no model named, no shape known yet)."""
        model, shape = self.pipeline.profile_model, self.pipeline.run_shape
        return None if model is None or shape is None else (model, shape)

    def write_profile(self, stage: str, nbytes: int) -> None:
        """Store ``stage``'s activation peak in the profile of the pipeline's model at the
        run's shape."""
        if (key := self._profile_key()) is not None:
            default_profiles().record(*key, stage, nbytes)

    def write_allocator(self, stage: str, *, retried: bool, limit: bool) -> None:
        """Store what ``stage``'s allocator did in this run beside its peak
        (``ActivationProfiles.record_allocator``)."""
        if (key := self._profile_key()) is not None:
            default_profiles().record_allocator(*key, stage, retried=retried, limit=limit)

    def write_turns(self, turns: list[tuple[str, tuple[str, ...]]]) -> None:
        """Store the turns a complete call showed (``ActivationProfiles.record_turns``)."""
        if (key := self._profile_key()) is not None:
            default_profiles().record_turns(*key, turns)

    def stored_turns(self) -> list[tuple[str, tuple[str, ...]]] | None:
        """The turns a call at the run's shape showed in any process; None where none."""
        key = self._profile_key()
        return default_profiles().stored_turns(*key) if key is not None else None

    def activation_profile(self) -> tuple[dict[str, int], str]:
        """Per-stage activation bytes stored for the model at the run's shape, and a note
        on where they come from."""
        key = self._profile_key()
        return default_profiles().lookup(*key) if key is not None else ({}, "")

    def allocator_evidence(self) -> AllocatorEvidence:
        """What the allocator showed of the model's stages at the run's shape, in any
        process (none where the pipeline has no profile)."""
        key = self._profile_key()
        return (
            default_profiles().allocator_evidence(*key) if key is not None else AllocatorEvidence()
        )
