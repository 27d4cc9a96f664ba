"""Reading a module tree for one planning pass: AC wrappers, compiled wrappers, checkpoints in
code, and where the boundaries sit.

Reads only: nothing here changes a module or calls the user's code.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch.nn as nn

from autoweave import _compat
from autoweave.planning import boundaries, checkpoint_calls
from autoweave.planning.learned import Learned
from autoweave.planning.plans import CheckpointSpec

Classifier = Callable[[nn.Module], "str | None"]


def checkpoint_spec(module: nn.Module) -> CheckpointSpec | None:
    """The AC a CheckpointWrapper applies, or ``None`` for any other module."""
    try:
        wrapper_cls = _compat.modules.checkpoint_wrapper_class()
    except _compat.lookup.UnsupportedTorch:
        return None
    if not isinstance(module, wrapper_cls):
        return None
    fn = getattr(module, "checkpoint_fn", None)
    keywords = dict(getattr(fn, "keywords", {}) or {})
    context_fn = keywords.get("context_fn")
    selective = context_fn is not None and getattr(context_fn, "__name__", "") != "noop_context_fn"
    impl = getattr(module, "checkpoint_impl", None)
    reentrant = getattr(impl, "name", "") == "REENTRANT" or bool(keywords.get("use_reentrant"))
    options = tuple(sorted((k, _short(v)) for k, v in keywords.items()))
    known = getattr(getattr(fn, "func", None), "__name__", "") == "checkpoint"
    return CheckpointSpec(selective, reentrant, options, known, checkpoint_fn=fn)


def _short(value: Any) -> str:
    func = getattr(value, "func", None)
    if func is not None:  # functools.partial: name the function and the policy
        args = ", ".join(getattr(a, "__name__", repr(a)) for a in getattr(value, "args", ()))
        return f"{getattr(func, '__name__', func)}({args})"
    return getattr(value, "__name__", repr(value))


def unwrap(module: nn.Module) -> nn.Module:
    """See through an OptimizedModule (``_orig_mod``) to the module it compiles."""
    try:
        optimized = _compat.modules.optimized_module()
    except _compat.lookup.UnsupportedTorch:
        return module
    while isinstance(module, optimized):
        module = _compat.modules.compiled_inner(module)
    return module


def calls_checkpoint(module: nn.Module) -> bool:
    """Does this module's own forward call torch's ``checkpoint`` (read from its code)?

    A heuristic (see ``checkpoints``): when it misses one, the runtime still
    notices dynamo's fallback at the first call and re-plans from the next call.
    """
    forward = boundaries.user_forward(module)
    while isinstance(forward, functools.partial):
        forward = forward.func
    return checkpoint_calls.code_checkpoints(forward, getattr(forward, "__self__", None))


def traces_checkpoint(module: nn.Module, *, call_traced: bool = True) -> bool:
    """Would a compile of ``module`` trace some checkpoint (where a break would cost the region)?"""
    target = unwrap(module)
    if call_traced and checkpoint_calls.call_checkpoints(target):
        return True
    return any(
        checkpoint_spec(m) is not None
        or calls_checkpoint(m)
        or (m is not target and checkpoint_calls.call_checkpoints(m))
        for m in target.modules()
    )


def is_container(module: nn.Module) -> bool:
    """A ModuleList / ModuleDict (no forward of its own: its parent calls the children)."""
    forward = boundaries.user_forward(module)
    return getattr(forward, "__func__", forward) is nn.Module.forward


def walk(module: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Module]]:
    """``module``'s children with their plan paths."""
    for name, child in module.named_children():
        yield (f"{prefix}.{name}" if prefix else name), child


class Tree:
    """Memoised boundary facts for one planning pass."""

    def __init__(self, classify: Classifier, learned: Learned) -> None:
        self.classify = classify
        # Modules dynamo was seen breaking in (id -> reason): boundaries of this plan.
        self.breaking = dict(learned.breaks)
        # Selective-AC wrappers whose pieces were measured holding more than eager SAC (id -> why).
        self.measured = learned.measured
        # Checkpoints (by id of their checkpoint_fn) whose context_fn a traced checkpoint cannot take.
        self.untraceable = learned.untraceable  # read lazily: a lookup may probe
        self._kind: dict[int, str | None] = {}
        self._has: dict[int, bool] = {}

    def kind(self, module: nn.Module) -> str | None:
        key = id(module)
        if key not in self._kind:
            self._kind[key] = self.classify(module) or self.breaking.get(key)
        return self._kind[key]

    def has_boundary_below(self, module: nn.Module) -> bool:
        """Is there a boundary among the strict descendants of ``module``?"""
        key = id(module)
        if key not in self._has:
            self._has[key] = any(
                self.kind(child) is not None or self.has_boundary_below(child) for child in module.children()
            )
        return self._has[key]

    def traced_ac_over_boundary(self, module: nn.Module) -> bool:
        """Would a compile of ``module`` trace a checkpoint that has a boundary inside?"""
        if self.has_boundary_below(module) and calls_checkpoint(module):
            return True
        for child in module.children():
            child = unwrap(child)
            if self.kind(child) is not None and boundaries.forward_disabled(child):
                continue  # nothing of it is traced
            # An FSDP unit's hooks break the graph, but its forward (and the
            # checkpoint of an AC wrapper that is itself the unit) is traced.
            if self.has_boundary_below(child) and (
                checkpoint_spec(child) is not None or checkpoint_calls.call_checkpoints(child)
            ):
                return True
            if self.traced_ac_over_boundary(child):
                return True
        return False
