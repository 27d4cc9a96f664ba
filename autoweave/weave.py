"""Applying a plan: the only code that changes modules.

Everything is done in place through instance attributes (``forward``), so the
module tree, parameter objects, ``named_parameters()`` and ``state_dict()`` keys
are exactly what the user built. ``Applied.revert`` undoes it.
"""

from __future__ import annotations

import itertools
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from autoweave import _compat
from autoweave.boundaries import PRIOR
from autoweave.planner import Action, CheckpointSpec, Plan

_MISSING = object()
_labels = itertools.count()


def _trampoline(call: Callable[..., Any], label: str) -> Callable[..., Any]:
    """A function with a code object of its own that calls ``call``.

    Dynamo keeps its cache (and its recompile limit) per code object. Compiling
    every region through one shared function (``Module._call_impl``, a class's
    ``forward``) makes same-class siblings with different shapes share one cache
    and hit the limit (8), after which they silently run eager; a fresh code
    object per region gives each region its own cache. It also gives dynamo a
    frame outside ``torch.nn`` to start from: in-place compile of a built-in leaf
    such as ``nn.Linear`` otherwise captures nothing.
    """

    def region(*args: Any, **kwargs: Any) -> Any:
        return call(*args, **kwargs)

    code = region.__code__.replace(co_name=label, co_qualname=label)
    fn = types.FunctionType(code, region.__globals__, label, None, region.__closure__)
    fn.__qualname__ = label
    return fn


def _prior_forward(module: nn.Module) -> Any:
    """The user's forward: an instance override if any, else the class's, bound."""
    current = module.__dict__.get("forward", _MISSING)
    while current is not _MISSING and hasattr(current, PRIOR):
        current = getattr(current, PRIOR)
    if current is _MISSING or current is None:
        return type(module).forward.__get__(module)
    return current


def _label(path: str, module: nn.Module) -> str:
    safe = "".join(c if c.isalnum() else "_" for c in (path or "root"))
    return f"autoweave_{type(module).__name__}_{safe}_{next(_labels)}"


@dataclass
class Applied:
    """What ``apply_plan`` changed, so it can be reverted exactly."""

    changes: list[tuple[nn.Module, Any]] = field(default_factory=list)
    regions: dict[str, str] = field(default_factory=dict)  # region label -> module path

    def _set_forward(self, module: nn.Module, fn: Any) -> None:
        previous = module.__dict__.get("forward", _MISSING)
        if previous is not _MISSING and hasattr(previous, PRIOR):
            previous = getattr(previous, PRIOR)  # a re-plan replaces our own install
        setattr(fn, PRIOR, None if previous is _MISSING else previous)
        self.changes.append((module, previous))
        module.__dict__["forward"] = fn

    def revert(self) -> None:
        for module, previous in reversed(self.changes):
            if previous is _MISSING or previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = previous
        self.changes.clear()
        self.regions.clear()


def _with_checkpoint(forward: Callable[..., Any], spec: CheckpointSpec) -> Callable[..., Any]:
    checkpoint_fn = spec.checkpoint_fn

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint_fn(forward, *args, **kwargs)

    return checkpointed


def _without_checkpoint(wrapper: nn.Module) -> Callable[..., Any]:
    inner = wrapper._checkpoint_wrapped_module

    def forward(*args: Any, **kwargs: Any) -> Any:
        return inner(*args, **kwargs)

    return forward


def apply_plan(
    root: nn.Module,
    plan: Plan,
    compile_fn: Callable[..., Any],
    compile_kwargs: dict[str, Any],
) -> Applied:
    """Install the plan's regions under ``root`` (the unwrapped compile target)."""
    applied = Applied()
    try:
        for decision in plan.decisions:
            if decision.action is Action.PLAIN:
                continue
            module = root.get_submodule(decision.path) if decision.path else root
            forward: Callable[..., Any] | None = None
            if decision.region:
                call = _prior_forward(module)
                if decision.checkpoint is not None:
                    call = _with_checkpoint(call, decision.checkpoint)
                label = _label(decision.path, module)
                kwargs = dict(compile_kwargs)
                kwargs["fullgraph"] = bool(kwargs.get("fullgraph")) and decision.action is not Action.SPLIT
                forward = compile_fn(_trampoline(call, label), **kwargs)
                applied.regions[label] = decision.path
            elif decision.action is Action.PUSH_DOWN:
                forward = _without_checkpoint(module)
            if decision.opaque:
                # Keep this checkpointed module out of the enclosing region's
                # trace: dynamo breaks the graph here instead of giving up on
                # the checkpoint. Regions below still compile on their own.
                forward = _compat.disable(forward or _prior_forward(module), recursive=True)
            if forward is not None:
                applied._set_forward(module, forward)
    except BaseException:
        applied.revert()
        raise
    return applied
