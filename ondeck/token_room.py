"""Room for a transformer's activations before any is measured, from the call's tokens.

With no profile, a turn whose component streams keeps a tenth of the budget for its
activations (``streaming.layout.UNMEASURED_ACTIVATION_FRACTION``): 0.7 GiB on an 8 GiB
card, where a video transformer at 480p, 33 frames takes 1.67 GB, and its first steps ran
at the card's limit. ``TokenRoom`` counts what the call's tokens make instead, where that
is more, in a process's first run; both pipelines (ondeck's Wan stages and the diffusers
runtime) keep one. An estimate alone never refuses a call: where it alone would make the
plan overflow, the turn counts as never measured. A turn planned so keeps the first
run's reserve in later runs (``Snapshot.limit_stages``), as one whose allocator reached
the card's limit: that first run no longer shows it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from .memory import format_bytes
from .streaming.layout import UNMEASURED_ACTIVATION_FRACTION

__all__ = [
    "ACTIVATION_ELEMENTS_PER_TOKEN_WIDTH",
    "CountsTokens",
    "TokenRoom",
    "feed_forward_width",
    "token_bytes",
]

# What a transformer's pass holds beside its weights, in elements of its compute dtype
# per token and per unit of its feed-forward width: the widest intermediate of a block
# and what stays beside it. Measured at 480x832 (and 480x848), 33 frames, on the
# Wan 2.1 14B-shaped transformer (14,040 tokens, width 13,824: 1.67 GB, 4.3) and the
# HunyuanVideo-shaped one (14,310 tokens, width 12,288: 1.66 GB, 4.7); taken a little
# above both, since too little room runs the allocator at the card's limit.
ACTIVATION_ELEMENTS_PER_TOKEN_WIDTH = 4.8
# Pipelines that batch the guided and unguided passes (SD3, CogVideoX, LTX) take twice
# what the call's batch counts: the estimate is low for them, and the share of the
# budget kept anyway (at least a tenth) covers them at the usual image sizes.


def feed_forward_width(config: Any) -> int | None:
    """A transformer's feed-forward width from its config: ``ffn_dim``, else
    ``mlp_ratio`` (4 where none) times its heads' width; None for a config with neither
    (a text encoder's, a UNet's without a patch size, a VAE's)."""
    if not isinstance(config, Mapping):
        return None
    ffn = config.get("ffn_dim")
    if isinstance(ffn, int):
        return ffn
    heads, width = config.get("num_attention_heads"), config.get("attention_head_dim")
    if not (isinstance(heads, int) and isinstance(width, int)) or "patch_size" not in config:
        return None
    ratio = config.get("mlp_ratio")
    return int((ratio if isinstance(ratio, (int, float)) else 4.0) * heads * width)


def token_bytes(tokens: int, width: int, dtype: Any) -> int:
    """Device bytes a pass over ``tokens`` of a transformer ``width`` wide takes, computing
    in ``dtype`` (float32 where unknown; stored fp8 weights compute in at least 2 bytes)."""
    element_bytes = max(2, getattr(dtype, "itemsize", None) or 4)
    return int(tokens * width * ACTIVATION_ELEMENTS_PER_TOKEN_WIDTH * element_bytes)


class TokenRoom:
    """A pipeline's estimates by tokens: whether they count in the run in progress, and
    the stages a run planned by them."""

    def __init__(self) -> None:
        # False while they alone would make the run's plan overflow: set as it starts.
        self.counting = True
        self.sized: set[str] = set()  # stages a run planned by them: they keep the reserve
        self._planning = threading.local()  # ``without``: a plan made without them

    def needs(
        self,
        pipeline: Any,
        snapshot: Any,
        estimates: Callable[[], Mapping[str, int | None]],
    ) -> dict[str, int]:
        """Per stage holding a component ``estimates()`` gives an estimate for, neither
        measured nor stored, that estimate where it is more than the share of the budget
        such a stage keeps otherwise (the streaming options' share, at least a tenth);
        only in a process's first run, under a budget (``pipeline.policy``'s)."""
        policy = pipeline.policy
        budget = getattr(policy, "budget_bytes", None)
        if not self.counting or getattr(self._planning, "without", False):
            return {}
        if budget is None or snapshot.runs_completed:
            return {}
        options = getattr(getattr(policy, "streaming", None), "options", None)
        share = getattr(options, "unmeasured_activation_fraction", 0.0)
        floor = budget * max(share, UNMEASURED_ACTIVATION_FRACTION)
        known = {**snapshot.stored_activation, **snapshot.measured_activation}
        needs: dict[str, int] = {}
        for name, need in estimates().items():
            if need is None or need <= floor:
                continue
            for stage in pipeline.stages_holding(name) - known.keys():
                needs[stage] = max(need, needs.get(stage, 0))
        return needs

    def plan(
        self,
        plan: Callable[[], Any],
        needs: Callable[[], dict[str, int]],
        counts: Callable[[], Mapping[str, int | None]],
    ) -> Any:
        """``plan()``, or where it overflows with ``needs()`` counted, ``plan()`` without
        them (an estimate alone never refuses). Its note names the stages the plan counts
        them for: those whose activations in the snapshot it planned by (``counts()``)
        are the estimate, not a room kept since the stage ran out of memory."""
        planned = plan()
        counted = needs()
        if counted and planned.overflow() is not None:
            with self._without():
                return plan()
        if counted:
            known = counts()
            shown = {stage: n for stage, n in counted.items() if known.get(stage) == n}
            named = ", ".join(f"'{stage}' {format_bytes(n)}" for stage, n in shown.items())
            if named:
                planned.activation_note += f"\nestimated from the call's tokens: {named}"
        return planned

    @contextlib.contextmanager
    def _without(self) -> Iterator[None]:
        """This thread's plans leave the estimates out; a run in another goes on as it is."""
        self._planning.without = True
        try:
            yield
        finally:
            self._planning.without = False

    def run_starts(
        self, plan: Callable[[], Any], needs: Callable[[], dict[str, int]], executor: Any
    ) -> None:
        """Before a run's steps: the estimates count in it unless they alone make its plan
        (``plan()``) overflow; the stages they count for keep the first run's reserve in
        later runs, and in later processes (stored as the allocator's evidence)."""
        self.counting = True
        counted = needs()
        if counted and plan().overflow() is not None:
            self.counting = False
            return
        for stage in counted:
            self.sized.add(stage)
            executor.write_allocator(stage, retried=False, limit=True)


class CountsTokens:
    """A ``Pipeline`` base (listed before it) whose stages never measured count what
    their tokens make (``TokenRoom``): in its snapshots, its plans, and before each run.
    The pipeline gives ``_token_estimates()``, per component, for the run's shape."""

    token_room: TokenRoom

    def _token_estimates(self) -> dict[str, int | None]:
        return {}

    def _needs_now(self) -> dict[str, int]:
        return self.token_room.needs(self, super().snapshot(), self._token_estimates)

    def snapshot(self, **options: Any) -> Any:
        """The pipeline's snapshot, with the stages counted by their tokens measured as
        that, and those a run planned so kept at the first run's reserve."""
        snapshot = super().snapshot(**options)
        needs = self.token_room.needs(self, snapshot, self._token_estimates)
        sized = frozenset(self.token_room.sized)
        if not needs and not sized:
            return snapshot
        return dataclasses.replace(
            snapshot,
            measured_activation={**snapshot.measured_activation, **needs},
            measured_beside_stored=snapshot.measured_beside_stored or bool(needs),
            limit_stages=snapshot.limit_stages | sized,
        )

    def plan(self, budget: int | str | None = None) -> Any:
        """The plan, by ``TokenRoom.plan``."""
        return self.token_room.plan(
            functools.partial(super().plan, budget),
            self._needs_now,
            lambda: self.snapshot().measured_activation,
        )

    def forget_measured(self, name: str) -> None:
        """A component replaced: the stages holding it no longer keep the reserve."""
        self.token_room.sized -= self.stages_holding(name)
        super().forget_measured(name)

    def _before_run(self) -> None:
        self.token_room.run_starts(super().plan, self._needs_now, self.executor)
        super()._before_run()
