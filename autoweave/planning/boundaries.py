"""What counts as a boundary, and the tree-change signal that tells a plan to look again.

A boundary is a module whose call cannot be traced into the enclosing graph. Its
hooks stay eager; what happens to its inner forward is the planner's business.
``classify`` returns a short human reason, or ``None``.

The tree-change signal is one number that changes whenever a compiled module's
plan might. A plan depends on the module tree under the compile target (which
children, which of them are FSDP units, what the user marked) and on what the
run learned. Re-reading the tree at every forward costs time proportional to the
number of submodules; instead each dispatcher remembers the generation it
planned at and re-reads the tree only after the generation moved.

The counter lives on ``_state.run`` (``bump``, ``watch``). What moves it:
``dispatch/tree_watch`` (a submodule registered into a watched module, a hook
registered on one or removed, ``fully_shard`` running), autoweave's own marks
(``boundary``, ``set_mode``, ``register_boundary``) and what a run learns
(``planning/learned``). A spurious bump costs one tree walk per compiled module;
a missed one would keep a stale plan, so every source bumps.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch.nn as nn

from autoweave import _compat
from autoweave._instances import PRIOR as PRIOR
from autoweave._instances import users_own
from autoweave._state import run

# A published entry-point group, never renamed with the module: third-party packages name
# their boundary kinds under it; ``dispatch/plan_inputs`` loads them, before the first plan.
ENTRY_POINT_GROUP = "autoweave.boundaries"
MARK = "_autoweave_boundary"

Predicate = Callable[[nn.Module], "str | bool | None"]

_lock = threading.Lock()
_predicates: list[tuple[str, Predicate]] = []


def boundary(module: nn.Module, reason: str = "marked with autoweave.boundary()") -> nn.Module:
    """Mark ``module`` as a boundary (its call is kept out of compiled regions); returns it."""
    # object.__setattr__ keeps the mark out of nn.Module's attribute bookkeeping
    # (and out of state_dict).
    object.__setattr__(module, MARK, reason)
    bump()
    return module


def register_boundary(predicate: Predicate, *, name: str | None = None) -> Predicate:
    """Register ``predicate(module) -> reason | True | None`` as a kind of boundary."""
    with _lock:
        _predicates.append((name or getattr(predicate, "__qualname__", repr(predicate)), predicate))
    bump()
    return predicate


def _hooks_disabled(module: nn.Module) -> bool:
    hooks = (hook for found in _compat.modules.forward_hook_dicts(module) for hook in found.values())
    return any(_compat.dynamo.dynamo_disabled(hook) for hook in hooks)


def own_forward(module: nn.Module) -> Any:
    """The forward the user set on this instance, autoweave's installs peeled off; None if none.

    Every forward autoweave installs carries what it replaced under ``PRIOR``, so
    planning always sees the user's code, however often a module was re-planned.
    """
    return users_own(module.__dict__.get("forward"))


def user_forward(module: nn.Module) -> Any:
    """The user's forward, bound: the instance override if any, else the class's."""
    own = own_forward(module)
    return own if own is not None else type(module).forward.__get__(module)


def forward_disabled(module: nn.Module) -> bool:
    """True when the user disabled compile for this module's forward."""
    return _compat.dynamo.dynamo_disabled(user_forward(module))


def breaks_in_hooks(module: nn.Module) -> bool:
    """Is ``module`` a boundary only for its hooks (an FSDP2 unit, a ``disable``d hook), its forward traceable?"""
    if getattr(module, MARK, None) or own_forward(module) is not None or forward_disabled(module):
        return False
    fsdp2 = _compat.modules.fsdp2_module()
    return (fsdp2 is not None and isinstance(module, fsdp2)) or _hooks_disabled(module)


def classify(module: nn.Module) -> str | None:
    """Why ``module`` is a boundary, or ``None`` when it is traceable."""
    mark = getattr(module, MARK, None)
    if mark:
        return mark if isinstance(mark, str) else "marked with autoweave.boundary()"
    fsdp2 = _compat.modules.fsdp2_module()
    if fsdp2 is not None and isinstance(module, fsdp2):
        return "FSDP unit (fully_shard)"
    fsdp1 = _compat.modules.fsdp1_module()
    if fsdp1 is not None and isinstance(module, fsdp1):
        return "FSDP1 unit (FullyShardedDataParallel)"
    if forward_disabled(module):
        return "forward is torch.compiler.disable'd"
    if _hooks_disabled(module):
        return "a hook is torch.compiler.disable'd"
    with _lock:
        predicates = list(_predicates)
    for name, predicate in predicates:
        verdict = predicate(module)
        if verdict:
            return verdict if isinstance(verdict, str) else f"registered boundary ({name})"
    return None


def bump() -> None:
    """Something a plan depends on may have changed."""
    run.generation += 1


def watch(modules: Iterable[Any]) -> None:
    """A tree walk read ``modules``: a registration into any of them from now on bumps."""
    run.watched.update(modules)
