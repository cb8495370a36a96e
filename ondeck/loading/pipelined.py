"""Pipelined loading: a component starts computing while the rest of it arrives.

A load allocates every tensor of the component up front (its peak is the same as a whole
load's), then fills them on one background thread in the order the forward pass uses
them: everything outside the repeated blocks first, then the blocks in order. The loader
returns the module once that first group is in place; a forward pre-hook on each block
waits for exactly that block's group. Each group is complete on the device (its copies
synchronised) before its waiters are woken, so compute never reads a weight in flight.

Only calls of the component may run ahead of its weights: everything else that touches a
module still filling waits for all of it first (``LazyModule.materialize``). A change to
a block's weights can wait for that block instead (``Filling.when_in_place``): it runs
on the computing thread just before the block first computes, or when the whole fill is
waited for, whichever comes first.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import LoadError
from . import process_pool  # noqa: F401  its exit handler is registered first: see below
from .blocks import block_index

__all__ = ["Filling", "fill_groups", "start_filling", "MIN_GROUP_BYTES", "MIN_PIPELINED_BYTES"]

# Consecutive blocks are read together until a group holds this much: each group is one
# read with its own start-up and drain.
MIN_GROUP_BYTES = 64 * 2**20
# Below this a component loads whole: its load is too short to hide.
MIN_PIPELINED_BYTES = 256 * 2**20

# Fillings whose thread has started; see _stop_fillings.
_started: weakref.WeakSet[Filling] = weakref.WeakSet()


class _Lane:
    """Fills onto one device take turns, in the order they started. Two fills at once
    share the reader's threads and the bus and each arrives later than it would alone
    (three text encoders loaded together for the next run: 11 GB at about 20 GB/s,
    against 34-40 GB/s one at a time); in turn, the component needed first is whole
    first."""

    def __init__(self) -> None:
        self._turns: list[Filling] = []
        self._changed = threading.Condition()

    def join(self, filling: Filling) -> None:
        """Take a place after the fills started before; :meth:`leave` gives it up."""
        with self._changed:
            self._turns.append(filling)

    def wait_turn(self, filling: Filling) -> None:
        """Wait until the fills before ``filling`` have ended, or it is stopped."""
        with self._changed:
            self._changed.wait_for(lambda: self._turns[0] is filling or filling.stopping)

    def leave(self, filling: Filling) -> None:
        with self._changed:
            if filling in self._turns:
                self._turns.remove(filling)
            self._changed.notify_all()

    def wake(self) -> None:
        with self._changed:
            self._changed.notify_all()


_lanes: dict[str, _Lane] = {}
_lanes_lock = threading.Lock()


def _lane(device: torch.device) -> _Lane:
    with _lanes_lock:
        return _lanes.setdefault(str(device), _Lane())


def fill_groups(
    names: Sequence[Sequence[str]],
    nbytes: Sequence[int],
    path: str,
    min_group_bytes: int | None = None,
) -> tuple[list[list[int]], dict[int, int]]:
    """The order to fill a component's tensors in, and the group each block waits for.

    ``names[i]`` are the module names of tensor ``i`` (several when tied) and ``nbytes[i]``
    its size. Returns groups of tensor indices (group 0: everything outside the blocks
    under ``path``) and ``{block number: group index}``. Consecutive blocks share a group
    until it holds ``min_group_bytes`` (default :data:`MIN_GROUP_BYTES`).
    """
    least = MIN_GROUP_BYTES if min_group_bytes is None else min_group_bytes
    head: list[int] = []
    by_block: dict[int, list[int]] = {}
    for index, tensor_names in enumerate(names):
        block = block_index(list(tensor_names), path)
        if block is None:
            head.append(index)
        else:
            by_block.setdefault(block, []).append(index)
    groups = [head]
    group_of: dict[int, int] = {}
    size = least  # the first block opens a group of its own
    for block in sorted(by_block):
        if size >= least:
            groups.append([])
            size = 0
        groups[-1].extend(by_block[block])
        size += sum(nbytes[i] for i in by_block[block])
        group_of[block] = len(groups) - 1
    return groups, group_of


class Filling:
    """The weights of one loaded module, still arriving group by group.

    ``fill(group)`` puts one group's tensors in place and returns once they are complete
    on their device; it runs on the filling's own thread, group after group. Or
    ``fill_all(groups, reached)`` puts them all in place, calling ``reached(i)`` once
    group ``i`` is complete, in order (one read for all groups). ``finished`` is called
    on that thread at the end, with the error if one stopped it; the fill has ended once
    it returns. After a fill that succeeded, ``then`` runs on that thread too, once the
    end is announced: work for a later load (its skeleton) that nobody waits for.
    """

    def __init__(
        self,
        component: str,
        groups: Sequence[Any],
        fill: Callable[[Any], None],
        *,
        device: torch.device,
        finished: Callable[[BaseException | None], None] | None = None,
        started: float | None = None,
        fill_all: Callable[[list, Callable[[int], None]], None] | None = None,
        then: Callable[[], None] | None = None,
    ):
        self.component = component
        if device.type == "cuda" and device.index is None:
            # The caller's GPU: on the filling thread an unnumbered "cuda" means GPU 0.
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        # The filling thread's own stream, ordered after the work queued here, now that
        # the destinations are allocated. Its reads and host-cache copies fence on it (the
        # thread's current stream), and it synchronises it after each group; on the
        # compute's stream both would wait for every kernel queued since, and each block's
        # weights would start arriving only once the blocks before it computed.
        self._stream = None
        if device.type == "cuda":
            self._stream = torch.cuda.Stream(device)
            self._stream.wait_stream(torch.cuda.current_stream(device))
        self._groups = list(groups)
        self._fill = fill
        self._fill_all = fill_all
        self._finished = finished
        self._then = then
        self._filled = 0  # groups complete, in order
        self._progress = threading.Condition()
        self._stop = threading.Event()
        self._handles: list[Any] = []
        self._listeners: list[Callable[[str, float], None]] = []
        self._told = False  # the end was announced: later listeners hear it at once
        self.failure: BaseException | None = None
        # Whether the loader reads the filled weights back once every group is in place
        # (into the host cache): changes to them must wait for the end of the fill.
        self.reads_back = False
        self.blocks_path: str | None = None  # the blocks attach() hooked, under the module
        self._blocks: Any = None
        self._group_of: dict[int, int] = {}
        self._changes: dict[int, _BlockChanges] = {}  # see when_in_place
        self._change_handles: list[Any] = []
        self._change_failure: LoadError | None = None
        self._waited = False  # wait() returned: every weight in place, every change made
        self._cancelled = False  # cancel() was called: no change is made after it
        self.waited_seconds = 0.0
        self.seconds: float | None = None  # the whole fill, once done
        self._started = time.perf_counter() if started is None else started
        self._thread = threading.Thread(
            target=self._run, name=f"ondeck-fill-{component}", daemon=True
        )

    def start(self) -> Filling:
        _started.add(self)
        lane = _lane(self.device)
        lane.join(self)
        try:
            self._thread.start()
        except BaseException:
            lane.leave(self)
            raise
        return self

    def add_listener(self, listener: Callable[[str, float], None]) -> None:
        """``listener(kind, seconds)``: ``"wait"`` when a forward waited for its block,
        ``"fill"`` with the whole fill's seconds once every group is in place."""
        with self._progress:
            if not self._told:
                self._listeners.append(listener)
                return
        if self.failure is None:
            listener("fill", self.seconds)

    # -- the filling thread ----------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        """``cancel()`` was called: the fill stops after the group it is reading."""
        return self._stop.is_set()

    def _run(self) -> None:
        error: BaseException | None = None
        lane = _lane(self.device)
        try:
            lane.wait_turn(self)
            on_device = self._stream is not None
            context = torch.cuda.device(self.device) if on_device else contextlib.nullcontext()
            stream = torch.cuda.stream(self._stream) if on_device else contextlib.nullcontext()
            with context, stream:
                if self._fill_all is not None:
                    self._check_stop()
                    self._fill_all(self._groups, self._reached)
                    if self._filled < len(self._groups):
                        raise LoadError(
                            f"component '{self.component}': the fill ended with "
                            f"{len(self._groups) - self._filled} groups of blocks not in place",
                            component=self.component,
                        )
                else:
                    for index, group in enumerate(self._groups):
                        self._check_stop()
                        self._fill(group)
                        if on_device:
                            # Copies this thread issued on its own stream are done too.
                            self._stream.synchronize()
                        self._mark_filled(index)
        except BaseException as failure:
            error = failure
        finally:
            lane.leave(self)
            self.seconds = time.perf_counter() - self._started
            self.failure = error
            if error is not None:
                _forget_locals(error)
            self._groups = []
            try:
                if self._finished is not None:
                    self._finished(error)
            finally:
                with self._progress:
                    self._told = True
                    self._progress.notify_all()
        if error is None:
            self._tell("fill", self.seconds)
            if self._then is not None and not self._stop.is_set():
                try:
                    self._then()
                except Exception:
                    # Only a later load's head start is lost: that load does the same
                    # work on its own path, and reports its error there.
                    pass

    def _check_stop(self) -> None:
        if self._stop.is_set():
            raise self._stopped()

    def _stopped(self) -> LoadError:
        return LoadError(
            f"component '{self.component}': loading was stopped", component=self.component
        )

    def _mark_filled(self, index: int) -> None:
        with self._progress:
            if index != self._filled:
                raise RuntimeError(f"group {index} reached after {self._filled} groups")
            self._filled += 1
            self._progress.notify_all()

    def _reached(self, index: int) -> None:
        """``fill_all``'s report: group ``index`` is in place. Stops the read if the
        filling was cancelled and groups remain."""
        self._mark_filled(index)
        if index + 1 < len(self._groups):
            self._check_stop()

    def _tell(self, kind: str, seconds: float) -> None:
        with self._progress:
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(kind, seconds)
            except Exception:  # a report must never break a load or a forward
                pass

    # -- waiting ---------------------------------------------------------------------------

    def wait_group(self, index: int) -> None:
        """Block until group ``index`` is in place; raise if the fill failed before it
        (or a change to a block's weights failed: the module is not what was asked)."""
        if self._change_failure is not None:
            raise self._change_failure
        if self._filled > index:
            return
        started = time.perf_counter()
        with self._progress:
            self._progress.wait_for(lambda: self._filled > index or self.seconds is not None)
        if self._filled <= index:
            raise self._error()
        waited = time.perf_counter() - started
        self.waited_seconds += waited
        self._tell("wait", waited)

    def wait(self) -> None:
        """Block until every group is in place and the fill has ended (not for ``then``),
        then make the changes still waiting for their blocks (:meth:`when_in_place`); raise
        the fill's error if it failed, or a change's. Once it returns, the module holds no
        hook of the filling's (it can be copied or saved) and its weights are final."""
        if self._waited:
            return
        self._wait_for_end()
        self.detach()
        if self.failure is not None:
            raise self._error()
        while True:
            with self._progress:
                if self._cancelled:
                    raise self._stopped()
                undone = [entry for entry in self._changes.values() if not entry.done]
                if not undone:  # a change given meanwhile is made here, or at once after
                    self._waited = True
                    entries, self._changes, self._blocks = list(self._changes.values()), {}, None
                    handles, self._change_handles = self._change_handles, []
                    break
            for entry in undone:
                self._make_changes(entry)
        # The blocks' forwards need no ordering after the changes any more, on any stream.
        for entry in entries:
            if entry.event is not None:
                entry.event.synchronize()
        for handle in handles:
            handle.remove()

    def cancel(self) -> None:
        """Stop after the group being read and wait for the fill to end, and for a change
        another thread is making: nothing writes into the module's memory afterwards, and
        no change waiting for its block is made. Never raises."""
        self._stop.set()
        _lane(self.device).wake()  # a fill waiting for its turn stops at once
        with self._progress:
            self._cancelled = True
            entries, self._changes, self._blocks = list(self._changes.values()), {}, None
            handles, self._change_handles = self._change_handles, []
        if self._thread.ident is not None:
            self._wait_for_end()
        self.detach()
        for handle in handles:
            handle.remove()
        for entry in entries:
            with entry.lock:  # a thread making the block's changes has finished
                entry.changes = []
            try:
                if entry.event is not None:
                    entry.event.synchronize()
            except Exception:  # the device's own error: the module is being thrown away
                pass

    def when_in_place(self, block: int, change: Callable[[], None]) -> None:
        """Make ``change`` (which writes block ``block``'s weights) once the block's
        weights are in place and before anything computes with them: on the computing
        thread just before the block's next forward, or in :meth:`wait`, whichever comes
        first; the block's forward waits for it either way (on a GPU, its stream waits for
        the stream the change ran on). Each change runs once, in the order given. One that
        raises fails the load: every later wait and the block's forward raise its error,
        and nothing runs the changes again (they are not idempotent). After :meth:`wait`,
        or without blocks attached, the change is made at once, once every weight is in.
        A change must not call back into the filling. After :meth:`cancel` it is refused
        (by :meth:`wait`)."""
        with self._progress:
            entry = None
            if self._blocks is not None and not self._waited and 0 <= block < len(self._blocks):
                entry = self._changes.get(block)
                if entry is None:
                    entry = self._changes[block] = _BlockChanges(block, self._group_of.get(block))
                    hook = _ChangeHook(self, entry)
                    # Before the block's wait (prepended after it); it waits for the group.
                    hook.handle = self._blocks[block].register_forward_pre_hook(hook, prepend=True)
                    self._change_handles.append(hook.handle)
        if entry is not None:
            with entry.lock:  # not while a thread makes the block's changes
                if entry.error is not None:
                    raise entry.error
                if not entry.done:
                    entry.changes.append(change)
                    return
        # Every weight in place, or this block's and its changes made: now.
        self.wait()
        change()

    def _make_changes(self, entry: _BlockChanges) -> None:
        """Make ``entry``'s changes unless another thread has (then wait for them)."""
        if entry.group is not None:
            self.wait_group(entry.group)
        if self.reads_back:  # the loader reads the weights back once the fill ends
            self._wait_for_end()
            if self.failure is not None:
                raise self._error()
        with entry.lock:
            if entry.error is not None:
                raise entry.error
            if self._cancelled:  # the module is being thrown away
                raise self._stopped()
            if not entry.done:
                try:
                    for change in entry.changes:
                        change()
                except BaseException as cause:
                    # Its frames hold views of the weights, which outlive no failed load.
                    _forget_locals(cause)
                    entry.error = LoadError(
                        f"component '{self.component}': changing block {entry.block}'s "
                        f"weights once they were in failed with {type(cause).__name__}: "
                        f"{cause}",
                        component=self.component,
                    )
                    entry.error.__cause__ = cause
                    self._change_failure = entry.error
                    if isinstance(cause, Exception):
                        raise entry.error from cause
                    raise
                entry.changes = []
                if self.device.type == "cuda":
                    entry.event = torch.cuda.Event()
                    entry.event.record(torch.cuda.current_stream(self.device))
                entry.done = True
        if entry.event is not None:
            torch.cuda.current_stream(self.device).wait_event(entry.event)

    def _wait_for_end(self) -> None:
        with self._progress:
            self._progress.wait_for(lambda: self._told)

    def _error(self) -> LoadError:
        cause = self.failure
        if isinstance(cause, LoadError):
            return cause
        error = LoadError(
            f"component '{self.component}': loading its weights failed with "
            f"{type(cause).__name__}: {cause}",
            component=self.component,
        )
        error.__cause__ = cause
        return error

    # -- hooks on the blocks ---------------------------------------------------------------

    def attach(self, module: torch.nn.Module, path: str, group_of: dict[int, int]) -> None:
        """A forward pre-hook on each block of ``module.<path>`` waits for its group."""
        blocks = module.get_submodule(path)
        self.blocks_path, self._blocks, self._group_of = path, blocks, dict(group_of)
        for number, block in enumerate(blocks):
            group = group_of.get(number)
            if group is not None:
                wait = _BlockWait(self, group)
                # First among the block's hooks: FSDP2's gathers the block's weights in
                # its own, which must find this rank's share in place.
                wait.handle = block.register_forward_pre_hook(wait, prepend=True)
                self._handles.append(wait.handle)

    def detach(self) -> None:
        """Remove the blocks' waits (the hooks of blocks whose changes a forward has not
        passed yet stay: see :meth:`when_in_place`)."""
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()


class _BlockWait:
    """A block's forward pre-hook: wait for the block's group, then remove itself, so
    the forwards after the first pay nothing. After a failed fill it stays, and raises."""

    def __init__(self, filling: Filling, group: int):
        self.filling = filling
        self.group = group
        self.handle: Any = None

    def __call__(self, _module: Any, _args: Any) -> None:
        self.filling.wait_group(self.group)
        self.handle.remove()


class _BlockChanges:
    """The changes waiting for one block's weights (``Filling.when_in_place``)."""

    def __init__(self, block: int, group: int | None):
        self.block = block
        self.group = group
        self.changes: list[Callable[[], None]] = []
        self.lock = threading.Lock()
        self.done = False
        self.error: LoadError | None = None
        self.event: Any = None  # recorded after the changes, on the stream they ran on


class _ChangeHook:
    """A block's forward pre-hook while changes wait for it: wait for the block's
    weights, make the changes (or wait for the thread making them), then remove itself.
    After a change failed it stays, and raises."""

    def __init__(self, filling: Filling, entry: _BlockChanges):
        self.filling = filling
        self.entry = entry
        self.handle: Any = None

    def __call__(self, _module: Any, _args: Any) -> None:
        self.filling._make_changes(self.entry)
        self.handle.remove()


def _stop_fillings() -> None:
    """Stop every filling still running when the interpreter exits, after the group it
    is reading, and wait for it. Its thread (a daemon) would otherwise be frozen inside
    torch mid-copy as Python shuts down, which can abort the exit; a filling's last
    steps (caching, the spare skeleton) can still run after its module computed."""
    for filling in list(_started):
        filling.cancel()
        filling._thread.join()  # also its ``then``


# Exit handlers run last-registered first: this one, registered after the reading
# processes' (imported above), stops the fillings before those processes are closed.
atexit.register(_stop_fillings)


def start_filling(
    component: str,
    groups: Sequence[Any],
    fill: Callable[[Any], None],
    finished: Callable[[BaseException | None], None],
    *,
    device: torch.device,
    started: float | None = None,
    fill_all: Callable[[list, Callable[[int], None]], None] | None = None,
    then: Callable[[], None] | None = None,
) -> Filling:
    """A started :class:`Filling`. If it cannot start, ``finished`` hears the error (it
    gives back what the load reserved, a host cache entry say) before it propagates."""
    try:
        return Filling(
            component,
            groups,
            fill,
            device=device,
            finished=finished,
            started=started,
            fill_all=fill_all,
            then=then,
        ).start()
    except BaseException as error:
        finished(error)
        raise


def _forget_locals(error: BaseException) -> None:
    """Clear the local variables of the finished frames in ``error``'s traceback, and in
    its causes'. The failure outlives the fill (``Filling.failure``, raised again to
    every waiter), and its frames (the reader's copying thread among them) hold views of
    the module's tensors, whose memory the failed load frees: a traceback shown with its
    locals would read freed memory. The lines and names stay."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__
