"""ondeck: run multi-stage generative pipelines in the memory of their largest stage.

Importing ondeck does not import diffusers; ``import ondeck.diffusers`` does.
"""

from .interrupt import exits_on_interrupt

# Ctrl-C during these imports (torch's) ends the ondeck command with one line, status 130.
with exits_on_interrupt():
    from .errors import BudgetError, ConcurrentRunError, LoadError, OndeckError
    from .folder_pipelines import (
        plan,  # ``ondeck.plan`` is this function; the module is ondeck.planning
    )
    from .lazy import ComponentSpec, LazyModule, is_lazy, is_loaded
    from .memory import format_bytes, parse_bytes
    from .planning import Plan
    from .policy import BudgetPolicy, EagerPolicy, Policy, ReleasePolicy
    from .stages import Pipeline, Stage
    from .tracker import MemoryTracker

__version__ = "0.1.0"

__all__ = [
    "BudgetError",
    "BudgetPolicy",
    "ComponentSpec",
    "ConcurrentRunError",
    "EagerPolicy",
    "LazyModule",
    "LoadError",
    "MemoryTracker",
    "OndeckError",
    "Pipeline",
    "Plan",
    "Policy",
    "ReleasePolicy",
    "Stage",
    "format_bytes",
    "is_lazy",
    "is_loaded",
    "parse_bytes",
    "plan",
]
