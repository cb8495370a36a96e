"""Which stage first made a value that is not finite (NaN or infinity).

Every deferred component gets forward hooks (through its load transforms, so they
survive reloads) that fold "were all floating tensors finite?" into a flag on the
device, with no synchronisation per call. The flags are read once, after a run whose
frames are not finite: a component whose first call already got a non-finite input
was handed it by the stage before; one whose outputs were not finite is the culprit
(a denoiser's later inputs are its own loop's: they are not checked).
"""

from __future__ import annotations

from typing import Any

from ..lazy import is_lazy


class FiniteWatch:
    def __init__(self) -> None:
        self._flags: dict[str, dict[str, Any]] = {}

    def attach(self, pipe: Any) -> None:
        for name, component in pipe.components.items():
            if is_lazy(component):
                component.add_transform(self._transform(name))

    def reset(self) -> None:
        self._flags = {}

    def _transform(self, name: str):
        def watch(module: Any) -> Any:
            module.register_forward_pre_hook(self._before(name), with_kwargs=True)
            module.register_forward_hook(self._after(name), with_kwargs=True)
            # A VAE's decode() is not its forward: its decoder's outputs are the VAE's.
            # (Its inputs come from layers of the VAE's own, so they are not the stage's.)
            decoder = getattr(module, "decoder", None)
            if decoder is not None and hasattr(decoder, "register_forward_hook"):
                decoder.register_forward_hook(self._after(name), with_kwargs=True)
            return module

        return watch

    def _before(self, name: str):
        def hook(module: Any, args: Any, kwargs: Any) -> None:
            flags = self._flags.setdefault(name, {})
            if "first_input" in flags:
                return  # later calls take what this stage's own loop made
            finite = _all_finite((args, kwargs))
            if finite is not None:
                flags["first_input"] = finite

        return hook

    def _after(self, name: str):
        def hook(module: Any, args: Any, kwargs: Any, result: Any) -> None:
            finite = _all_finite(result)
            if finite is not None:
                flags = self._flags.setdefault(name, {})
                flags["outputs"] = finite if "outputs" not in flags else flags["outputs"] & finite

        return hook

    def first_bad_stage(self, pipe: Any) -> str:
        """``'Denoise' (transformer)``: the first stage whose output was not finite."""
        holders = _holders(pipe)
        ordered = sorted(self._flags, key=lambda name: holders.get(name, (len(holders), ""))[0])
        for name in ordered:
            flags = self._flags[name]
            stage = holders.get(name, (0, name))[1]
            if not _true(flags.get("first_input")):
                return f"the one before '{stage}' ({name}), which was handed values not finite"
            if not _true(flags.get("outputs")):
                return f"'{stage}' ({name})"
        return "the last stage, after its components ran (the conversion to pixels)"


def _true(flag: Any) -> bool:
    return True if flag is None else bool(flag)


def _holders(pipe: Any) -> dict[str, tuple[int, str]]:
    """Each component's first stage: (its index, its name)."""
    names = {id(component): name for name, component in pipe.components.items()}
    found: dict[str, tuple[int, str]] = {}
    for index, stage in enumerate(getattr(pipe, "stages", ())):
        values = list(vars(stage).values())
        for value in list(values):
            if isinstance(value, (list, tuple)):
                values.extend(value)
        for value in values:
            name = names.get(id(value))
            if name is not None and name not in found:
                found[name] = (index, stage.name)
    return found


def _all_finite(value: Any) -> Any:
    """A 0-d bool tensor: every floating tensor in ``value`` is finite (None: none)."""
    import torch

    tensors: list[torch.Tensor] = []
    _collect(value, tensors, 0)
    if not tensors:
        return None
    checks = [torch.isfinite(t).all() for t in tensors]
    return (
        checks[0]
        if len(checks) == 1
        else torch.stack([c.to(checks[0].device) for c in checks]).all()
    )


def _collect(value: Any, into: list, depth: int) -> None:
    import torch

    if depth > 4:
        return
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and value.numel() and value.device.type != "meta":
            into.append(value.detach())
    elif isinstance(value, dict):
        for item in value.values():
            _collect(item, into, depth + 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect(item, into, depth + 1)
    elif hasattr(value, "to_tuple"):  # diffusers' and transformers' output classes
        _collect(value.to_tuple(), into, depth + 1)
