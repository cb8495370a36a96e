"""What a diffusers call did, turn by turn, and when a turn may end with its last call.

A turn starts when its component is first touched. Once a call has shown how often each
component is called, the next call can end a turn as its last call returns, so the next
component loads while the device still finishes this one (a pipeline waits for the
device between its encoders and its loop, drawing its noise on the host). That is a
guess from the last call; ``TurnEnds`` makes it only where a wrong guess is unlikely:
the same kind of call (``call_signature``), components called as often as then, none
used after its last call then, and the next turn's component touched then.
``ComponentTurn`` is the stage each turn is to the runtime.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ...stages import Stage
from ...tiles import TILE_SAFETY

if TYPE_CHECKING:
    from ...lazy import LazyModule
    from .decode import FittingDecode

__all__ = [
    "CallRecord",
    "ComponentTurn",
    "TurnEnds",
    "call_signature",
    "usable_turns",
    "with_untouched",
]


class CallRecord:
    """What one call did: components in first-touch order, and what each turn touched."""

    def __init__(self) -> None:
        self.first_touch: list[str] = []
        self.held: dict[str, list[str]] = {}
        # Per component called: its calls, an answer kept from an earlier call included,
        # and whether its last use was a call or something else (a method, an
        # attribute): one used after its last call keeps its turn past it.
        self.calls: dict[str, int] = {}
        self.last_use: dict[str, str] = {}

    def touched(self, name: str) -> None:
        if name not in self.held:
            self.first_touch.append(name)
            self.held[name] = [name]
            return
        turn = self.held[self.first_touch[-1]]
        if name not in turn:
            turn.append(name)

    def used(self, name: str) -> None:
        """``name`` was used other than by a call: after a call of it, that counts."""
        if name in self.last_use:
            self.last_use[name] = "other"

    def called(self, name: str) -> None:
        """A call of ``name`` returned (or was answered from what it answered before)."""
        self.calls[name] = self.calls.get(name, 0) + 1
        self.last_use[name] = "call"

    def used_after_last_call(self) -> frozenset[str]:
        return frozenset(name for name, use in self.last_use.items() if use != "call")

    def turns(self) -> list[tuple[str, tuple[str, ...]]]:
        return [(name, tuple(self.held[name])) for name in self.first_touch]


def call_signature(args: tuple, kwargs: dict[str, Any]) -> tuple:
    """What in a call's arguments may change how often it calls each component: numbers,
    flags, settings and sizes, not the text of its prompts, the values of its tensors or
    which generator it draws from. Two calls alike here call alike in every pipeline the
    tests run; a call unlike the last ends no turn early."""

    def shape(value: Any, text: bool) -> Any:
        if value is None or isinstance(value, (bool, int, float)):
            return value
        if isinstance(value, str):
            return "text" if text else value
        if isinstance(value, (list, tuple)):
            if not text and all(isinstance(item, (bool, int, float)) for item in value):
                return tuple(value)
            return (type(value).__name__, len(value))
        size = getattr(value, "shape", None)
        if size is None:
            size = getattr(value, "size", None)  # an image's (width, height)
            size = size if isinstance(size, tuple) else None
        if size is not None:
            return (type(value).__name__, tuple(size))
        return type(value).__name__

    return (
        tuple(shape(value, True) for value in args),
        tuple((name, shape(value, "prompt" in name)) for name, value in sorted(kwargs.items())),
    )


class TurnEnds:
    """From the last complete call: when a turn of this one may end with its last call."""

    def __init__(self) -> None:
        self.signature: tuple | None = None
        self.calls: dict[str, int] = {}
        self.touched: frozenset[str] = frozenset()
        self.used_after_last_call: frozenset[str] = frozenset()

    def learn(self, record: CallRecord, signature: tuple) -> None:
        self.signature = signature
        self.calls = dict(record.calls)
        self.touched = frozenset(record.first_touch)
        # A component this call did not call keeps what an earlier call showed of it.
        kept = self.used_after_last_call - set(record.last_use)
        self.used_after_last_call = kept | record.used_after_last_call()

    def untouched(self, name: str, signature: tuple) -> bool:
        """Whether the last complete call, of the same kind, did not touch ``name``: a
        later call of that kind loads nothing ahead for it (the VAE of calls returning
        latents). A call stopped early by its callback is not learned from."""
        return signature == self.signature and bool(self.touched) and name not in self.touched

    def ends(self, record: CallRecord, signature: tuple, held: list[str], following: str) -> bool:
        """Whether the turn holding ``held`` has made its last call, the next one being
        ``following``'s."""
        return (
            signature == self.signature
            and following in self.touched
            and not self.used_after_last_call & set(held)
            and all(self.calls.get(name, 0) > 0 for name in held)
            and all(record.calls.get(name, 0) >= self.calls[name] for name in held)
        )


def usable_turns(
    stored: list[tuple[str, tuple[str, ...]]] | None, components: tuple[str, ...]
) -> list[tuple[str, tuple[str, ...]]] | None:
    """Turns an earlier process's call showed (``ActivationProfiles.stored_turns``), where
    they fit this pipeline: a turn for each of its ``components`` and no other, each
    holding only its components and its own. None where they do not (a folder whose
    components changed since)."""
    if not stored:
        return None
    names = [name for name, _ in stored]
    if sorted(names) != sorted(components):
        return None
    if any(name not in held or not set(held) <= set(components) for name, held in stored):
        return None
    return [(name, tuple(held)) for name, held in stored]


def with_untouched(
    turns: list[tuple[str, tuple[str, ...]]], seeded: Sequence[str], touched: set[str]
) -> list[tuple[str, tuple[str, ...]]]:
    """The turns a call showed, with a turn of its own for each component it did not
    touch (the VAE of a call that returned latents, a second expert a one-step call never
    reached), where the seeded order puts it: after the turn of the component seeded
    before it. Placed first, a later call touching it would find its turn passed and load
    it beside the turn in progress, above the plan's peak."""
    turns = list(turns)
    for position, name in enumerate(seeded):
        if name in touched:
            continue
        at = 0
        for earlier in reversed(seeded[:position]):
            found = [i for i, (_, holding) in enumerate(turns) if earlier in holding]
            if found:
                at = found[0] + 1
                break
        turns.insert(at, (name, (name,)))
    return turns


class ComponentTurn(Stage):
    """The stretch of a diffusers call that starts when ``name`` is first touched.

    It holds every component the call touches before the next turn starts. The call
    itself runs the work; this stage only marks where residency decisions fall.
    """

    def __init__(self, name: str, components: list[LazyModule]):
        super().__init__()
        self.name = name
        self.components = components

    def forward(self, state: Any) -> Any:
        return state

    def needs_components(self, state: Any) -> bool:
        """Not where the last call of this kind did not touch it (a VAE, for latents)."""
        pipeline = self._ondeck_pipeline
        return pipeline is None or pipeline.turn_needed(self.name)

    def _decoder(self) -> FittingDecode | None:
        pipeline = self._ondeck_pipeline
        return pipeline.decoders.get(self.name) if pipeline is not None else None

    def whole_activations(self, measured: int) -> int | None:
        decoder = self._decoder()
        if decoder is None or not decoder.decoded:  # a turn that only encodes: as measured
            return measured
        whole = decoder.whole_activations(measured)
        if whole is not None:
            decoder.measured(whole)
        return whole

    def fit_activations(self, need: int, room: int) -> int:
        decoder = self._decoder()
        if decoder is None or decoder.style is None:
            return need
        # The VAE tiles down to what the room holds, and no finer than it can: a need
        # measured (an estimate alone never refuses) that its finest tiles do not fit
        # overflows the plan, refused before any load.
        fitted = min(need, max(0, int(room * TILE_SAFETY)))
        if decoder.bytes_per_element is None:
            return fitted
        finest = decoder.finest_area(self._ondeck_pipeline.call_arguments)
        return max(fitted, int(need * finest)) if finest is not None else fitted
