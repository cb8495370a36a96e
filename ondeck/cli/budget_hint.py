"""What a run that does not fit its ``--budget`` suggests: the policy's hint made to fit
the pipeline (no fewer frames for one that makes images) and its weights (``--weights
fp8`` where the stage that overflows holds a model stored as it computes)."""

from __future__ import annotations

from typing import Any

from ..errors import BudgetError
from ..lazy import loader_of
from ..loading import FolderLoader, QuantizedComponentLoader
from ..loading.fp8 import is_autoencoder
from ..policy import OVER_BUDGET_HINT


def pipeline_loaders(pipe: Any) -> dict[str, Any]:
    """Each deferred component's loader, by name, as the pipeline holds them."""
    return getattr(pipe, "loaders", None) or {
        name: loader_of(proxy) for name, proxy in getattr(pipe, "deferred", {}).items()
    }


def fp8_would_shrink(pipe: Any, plan: Any, weights: Any) -> bool:
    """Whether ``--weights fp8`` would store narrower a model of the stage that overflows
    ``plan``: no ``--weights`` was given, and a model there other than a VAE (which keeps
    its dtype) is stored as it computes (not saved in float8, not quantized)."""
    overflow = plan.overflow() if plan is not None and weights is None else None
    if overflow is None:
        return False
    held = next((use.components for use in plan.uses if use.name == overflow[0]), ())
    loaders = pipeline_loaders(pipe)
    return any(_stored_as_computed(loaders.get(name)) for name in held)


def _stored_as_computed(loader: Any) -> bool:
    if not isinstance(loader, FolderLoader) or isinstance(loader, QuantizedComponentLoader):
        return False
    cls = loader.spec.cls
    return loader.storage_dtype is None and cls is not None and not is_autoencoder(cls)


def fitting_hint(error: BudgetError, *, video: bool, fp8: bool) -> BudgetError:
    """``error`` with its hint of what to try fitted: fewer frames only for a ``video``,
    ``--weights fp8`` where it would make the overflowing stage smaller (``fp8``)."""
    if OVER_BUDGET_HINT not in str(error):
        return error  # another kind (the host's memory, say): as it is
    tries = ["a lower resolution", *(["fewer frames"] if video else []), "a larger budget"]
    if fp8:
        tries.append("--weights fp8 (`ondeck plan` with the same flags shows what fits)")
    listed = " or ".join(tries) if len(tries) == 2 else f"{', '.join(tries[:-1])}, or {tries[-1]}"
    return BudgetError(str(error).replace(OVER_BUDGET_HINT, f"Try {listed}."), plan=error.plan)
