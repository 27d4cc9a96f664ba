"""Pure planning: a module tree in, a plan (what to compile, what to leave, why) out.

Reads only: nothing here compiles, changes a module or calls the user's code;
``weave.apply_plan`` carries the plan out.

Vocabulary. A *region* is a module whose forward is compiled on its own. A
*boundary* is a module whose call dynamo cannot trace (an FSDP unit, say): it
splits any region that contains it. A boundary inside a checkpointed region
that dynamo traces makes dynamo give up on the whole checkpointed region (it
runs eager, forward and recompute), which is the loss autoweave exists to avoid.

The plan's data types, and where each AC wrapper's checkpoint goes, live in
``plans``. Here the tree is read for one planning pass (``Tree`` and the
readers beside it: AC wrappers, compiled wrappers, checkpoints in code, where
the boundaries sit), then walked (``_Planner``) to lay the decisions out.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch.nn as nn

from autoweave import _compat
from autoweave._settings import MODES, STRATEGIES, check_choice
from autoweave.planning import boundaries, checkpoint_calls, plans, sources
from autoweave.planning.learned import Learned
from autoweave.planning.plans import Action, CheckpointSpec, Decision, Plan

_ONE_BY_ONE = "children compiled one by one"
_BOUNDARY_INSIDE = "boundary inside; own forward eager, "
Moved = CheckpointSpec | None  # the AC moved into the pieces of every region below, or None


class _Planner:
    """One walk over the tree; ``moved`` is the AC moved into the pieces of every region below (or None)."""

    def __init__(
        self,
        tree: Tree,
        asked: str,
        fullgraph: bool,
        *,
        children_one_by_one: bool = False,
        nested_breaks: bool = False,
    ) -> None:
        self.tree = tree
        self.nested_breaks = nested_breaks
        self.asked = asked
        self.fullgraph = fullgraph
        # The dispatcher's last resort: nothing splits, every AC stays eager around its children.
        self.children_one_by_one = children_one_by_one
        self.out: list[Decision] = []
        self.resolved: set[str] = set()  # the strategies this plan's AC runs under

    def add(self, path: str, module: nn.Module, action: Action, reason: str, **extra: Any) -> None:
        self.out.append(Decision(path, type(module).__name__, action, reason, **extra))

    def plan(self, root_type: str, mode: str, found: tuple[tuple[str, str], ...], **extra: Any) -> Plan:
        shown = "+".join(sorted(self.resolved)) or self.asked
        return Plan(
            root_type, True, mode, shown, self.fullgraph, tuple(self.out), found, asked=self.asked, **extra
        )

    # A module its parent calls eagerly (or the woven root): decide what it becomes.
    def node(self, path: str, module: nn.Module, moved: Moved, *, root: bool = False) -> None:
        module = unwrap(module)
        # The compile target's own hooks run outside its compiled call whatever
        # it is (an FSDP unit after `fully_shard(block)`), so it is never a
        # boundary of its own plan.
        kind = None if root else self.tree.kind(module)
        if kind is not None:
            self.boundary(path, module, kind, moved)
        elif (spec := self.tree.ac_over_boundary(module)) is not None:
            self.checkpointed(path, module, spec, moved, opaque=False)
        elif is_container(module):
            # ModuleList / ModuleDict have no forward: their parent calls the children.
            self.add(path, module, Action.EAGER, "container without a forward: children planned")
            self.children(path, module, moved)
        elif not self.tree.has_boundary_below(module):
            self.region(path, module, moved, Action.COMPILE, "no boundary inside: compiled whole")
        elif (shape := self.shape(module)) is None and not self.children_one_by_one:
            self.split(path, module, moved, "compiled; dynamo splits it at the boundaries inside")
        else:
            why = f"{shape}: " if shape else ""
            self.weave_children(path, module, moved, f"{_BOUNDARY_INSIDE}{why}{_ONE_BY_ONE}")

    def shape(self, module: nn.Module) -> str | None:
        """Why ``module`` (a boundary below it) cannot be one region that dynamo splits, or None."""
        if calls_checkpoint(module):
            return "its forward calls checkpoint"
        # Boundaries inside a ModuleList/ModuleDict child are called from a loop in
        # this forward, and dynamo cannot resume a frame inside a loop after a break:
        # it would run this whole forward eager (the blocks' neighbours too).
        if any(is_container(c) and self.tree.has_boundary_below(c) for c in module.children()):
            return "its forward loops over blocks holding boundaries"
        return None

    def weave_children(self, path: str, module: nn.Module, moved: Moved, reason: str, **extra: Any) -> None:
        self.add(path, module, Action.WEAVE, reason, **extra)
        self.children(path, module, moved)

    def children(self, path: str, module: nn.Module, moved: Moved) -> None:
        for child_path, child in walk(module, path):
            self.node(child_path, child, moved)

    def region(
        self,
        path: str,
        module: nn.Module,
        moved: Moved,
        action: Action,
        reason: str,
        *,
        splits: bool = False,
        nested: bool = False,
    ) -> None:
        if moved is not None:
            reason += f", each piece under {moved.describe()}"
        self.add(
            path,
            module,
            action,
            reason,
            region=True,
            checkpoint=moved,
            pieces=moved is not None,
            splits=splits,
            nested=nested,
        )

    def boundary(
        self, path: str, module: nn.Module, kind: str, moved: Moved, *, opaque: bool = False
    ) -> None:
        if boundaries.forward_disabled(module):
            self.add(path, module, Action.EAGER, f"{kind}: left eager as the user asked")
        elif id(module) in self.tree.breaking and moved is not None:
            # A break in its own forward: compiled, dynamo cuts it there, and each
            # piece carries the checkpoint (the children are traced inside).
            self.split(path, module, moved, f"{kind} → compiled, split there", action=Action.BOUNDARY)
        elif (spec := self.tree.ac_over_boundary(module)) is not None:
            # An AC wrapper that is itself an FSDP unit (AC, then fully_shard per
            # block): its hooks stay eager anyway; its checkpoint is planned as any.
            self.checkpointed(path, module, spec, moved, opaque=opaque, unit=kind)
        elif not self.tree.has_boundary_below(module):
            # A break in its own forward splits the region: compiled from a copy of the
            # forward, else the frames dynamo makes at the break run the class's shared
            # code, one cache for every kind, and a hook added later (which dynamo does
            # not guard on) never reaches the graphs of the hooked block's new region.
            reason = f"{kind} → hooks stay eager, forward compiled"
            self.region(path, module, moved, Action.BOUNDARY, reason, splits=id(module) in self.tree.breaking)
        # A boundary inside a boundary: its own forward is planned like any module. One that
        # checkpoints in its own forward (HF's GradientCheckpointingLayer under FSDP2) keeps that
        # forward eager: a compile of it would trace the checkpoint, and the boundary inside makes
        # dynamo run the whole layer eager.
        elif not (hidden := _checkpoints_itself(module)) and not self.children_one_by_one:
            reason = f"{kind} → hooks stay eager, forward compiled and split at nested boundaries"
            self.split(path, module, moved, reason, action=Action.BOUNDARY)
        else:
            why = f"; its forward calls checkpoint: {_ONE_BY_ONE}" if hidden else ", inner planned below"
            reason = f"{kind} → hooks stay eager{why}"
            self.add(path, module, Action.BOUNDARY, reason, opaque=opaque and hidden)
            self.children(path, module, moved)

    def checkpointed(
        self,
        path: str,
        module: nn.Module,
        spec: CheckpointSpec,
        moved: Moved,
        *,
        opaque: bool,
        unit: str | None = None,
    ) -> None:
        wrapped = _compat.modules.CHECKPOINT_WRAPPED
        inner_path = f"{path}.{wrapped}" if path else wrapped
        inner = _compat.modules.checkpoint_wrapped(module)
        where = "kept out of the enclosing region, " if opaque else ""
        if unit is not None:
            where = f"{unit}, hooks eager; {where}"
        resolved = plans.resolve(
            spec,
            asked=self.asked,
            nested=moved is not None,
            children_one_by_one=self.children_one_by_one,
            shape=None if self.tree.kind(inner) is not None else self.shape(inner),
            measured=self.tree.measured.get(id(module)),
            unmeasurable=self.tree.unmeasurable,
            untraceable=lambda: self.tree.untraceable.get(id(spec.checkpoint_fn)),
        )
        strategy = resolved.strategy
        self.resolved.add(strategy.name)
        reason = where + resolved.reason(spec)
        self.add(path, module, strategy.action, reason, opaque=opaque, ac=spec, measure=resolved.measure)
        if strategy is plans.HOIST:
            broken = self.tree.breaking.get(id(inner))
            reason = "compiled under eager AC; dynamo splits it at the boundaries inside"
            self.split(inner_path, inner, moved, reason + (f" and at its own {broken}" if broken else ""))
        elif strategy is plans.PIECES:
            self.node(inner_path, inner, spec)
        elif self.tree.kind(inner) is None and self.tree.has_boundary_below(inner):
            self.weave_children(inner_path, inner, moved, _BOUNDARY_INSIDE + _ONE_BY_ONE)
        else:
            self.node(inner_path, inner, moved)

    def split(
        self, path: str, module: nn.Module, moved: Moved, reason: str, action: Action = Action.SPLIT
    ) -> None:
        nested = self.nested_breaks and self.breaks_only_in_hooks(module)
        if nested:
            reason += "; each unit's hooks break inside its call, where dynamo resumes (nested graph breaks)"
        self.region(path, module, moved, action, reason, splits=True, nested=nested)
        self.inside_split(path, module, moved, nested=nested)

    def breaks_only_in_hooks(self, module: nn.Module) -> bool:
        """Are the only breaks in ``module``'s call its units' hooks, each unit's forward traceable?

        Then dynamo can resume each break inside the unit's call (nested graph breaks) and
        trace the unit's forward with the block's code: the glue around the unit stays in
        the block's graphs. A break of any other kind keeps them off: dynamo guards a
        resumed nested frame's values as constants (a float from ``.item()``: a recompile
        per value), and a forward of the instance's own is a frame of its own per block.
        """
        if boundaries.own_forward(module) is not None:
            return False
        for inner in module.modules():
            inner = unwrap(inner)
            if id(inner) in self.tree.breaking or checkpoint_spec(inner) is not None:
                return False
            # A full backward hook's setup breaks inside torch/utils/hooks.py, and the frame dynamo
            # resumes there fails in its list comprehension (``UnboundLocalError: '.0'``, Python
            # 3.11, torch 2.13): plain torch never raises it. A hook's registration re-plans.
            if _compat.modules.backward_hooked(inner):
                return False
            if inner is not module and self.tree.kind(inner) is not None:
                if not boundaries.breaks_in_hooks(inner) or self.tree.has_boundary_below(inner):
                    return False
        return True

    def inside_split(self, path: str, module: nn.Module, moved: Moved, *, nested: bool = False) -> None:
        # Descendants traced by a split region: boundaries break the graph by
        # themselves; checkpoints over a boundary must be kept out of the trace.
        for child_path, child in walk(module, path):
            child = unwrap(child)
            kind = self.tree.kind(child)
            if nested and kind is not None:
                reason = f"{kind} → hooks stay eager, forward traced in the enclosing region"
                self.add(child_path, child, Action.BOUNDARY, reason)
            elif id(child) in self.tree.breaking and checkpoint_spec(child) is None:
                # A break dynamo met in its own forward: the enclosing region splits
                # there by itself (as with AC outside the compile); no region of its own.
                self.add(child_path, child, Action.BOUNDARY, f"{kind} → the enclosing region splits there")
                if self.tree.has_boundary_below(child):
                    self.inside_split(child_path, child, moved)
            elif kind is not None:
                self.boundary(child_path, child, kind, moved, opaque=True)
            elif (spec := self.tree.ac_over_boundary(child)) is not None:
                self.checkpointed(child_path, child, spec, moved, opaque=True)
            elif self.tree.has_boundary_below(child) and _checkpoints_itself(child):
                reason = f"kept out of the enclosing region; its forward calls checkpoint: {_ONE_BY_ONE}"
                self.weave_children(child_path, child, moved, reason, opaque=True)
            elif self.tree.has_boundary_below(child):
                self.inside_split(child_path, child, moved, nested=nested)


def _checkpoints_itself(module: nn.Module) -> bool:
    """Does ``module`` call checkpoint in its own forward or ``__call__`` (read from its code)?"""
    return calls_checkpoint(module) or checkpoint_calls.call_checkpoints(module)


def plan(
    module: nn.Module,
    *,
    mode: str = "auto",
    strategy: str = "auto",
    fullgraph: bool = False,
    classify: Classifier | None = None,
    outer_ac: CheckpointSpec | None = None,
    call_traced: bool = True,
    learned: Learned | None = None,
    children_one_by_one: bool = False,
    nested_breaks: bool = False,
) -> Plan:
    """Decide how to compile ``module`` (the object handed to ``torch.compile``).

    Compiles nothing. ``mode``: ``auto`` weaves only where plain torch.compile
    would lose a checkpointed region (or fail under ``fullgraph``), ``always``
    weaves whenever a boundary is inside, ``off`` never weaves. ``strategy``
    (``auto``, ``hoist``, ``pieces``) is what is asked for the AC of a woven
    block; ``plans.resolve`` decides what runs, and the plan records that.
    Under ``fullgraph`` a region may still split at the boundaries autoweave
    handles (the runtime checks that no other break happened).

    ``call_traced`` is whether the compile traces the target's ``__call__``
    (``torch.compile(module)``) or only its ``_call_impl`` (in-place
    ``module.compile()``).

    ``learned`` is what the run learned under the target (``Learned.for_target``;
    ``dispatch/plan_inputs`` assembles it): modules dynamo was seen breaking in
    are boundaries of this plan; selective-AC wrappers whose pieces were
    measured holding more than eager selective AC would, and checkpoints whose
    ``context_fn`` a traced checkpoint cannot take, are what ``plans.resolve``
    weighs.
    ``children_one_by_one`` is the dispatcher's last resort after a fallback it
    could not locate: nothing splits, every AC stays eager around its children.
    ``nested_breaks``: this torch resumes a break inside the call it is in
    (``_compat.dynamo.nested_breaks_supported``); a region whose only breaks are
    its units' hooks then traces the units' forwards (``Decision.nested``).
    """
    check_choice("mode", mode, MODES)
    check_choice("strategy", strategy, STRATEGIES)
    tree = Tree(classify or boundaries.classify, learned or Learned())
    target = unwrap(module)
    found = tuple(
        (name, kind)
        for name, m in target.named_modules()
        if m is not target and (kind := tree.kind(m)) is not None
    )
    root_type = type(target).__name__
    places = tuple((path, source) for path, _ in found if (source := sources.boundary_source(target, path)))

    def plain(reason: str) -> Plan:
        return Plan.plain(root_type, mode, strategy, fullgraph, found, reason, places)

    if not found:
        return plain("no boundary inside: compiled as plain torch.compile would")
    if mode == "off":
        return plain("weaving is off (mode=off): compiled as plain torch.compile would")
    planner = _Planner(
        tree, strategy, fullgraph, children_one_by_one=children_one_by_one, nested_breaks=nested_breaks
    )
    outer = None
    if outer_ac is not None:
        outer = plans.resolve_outer(
            outer_ac, asked=strategy, untraceable=lambda: tree.untraceable.get(id(outer_ac.checkpoint_fn))
        )
    if outer is not None and outer.strategy is plans.PIECES:
        # AC outside the compile: plain torch splits at the boundary, but an eager
        # selective policy around compiled code sees inductor's kernels, not the
        # ops it was written for. Move the checkpoint into each region's pieces instead.
        planner.resolved.add(outer.strategy.name)
        planner.node("", target, outer_ac, root=True)
        if outer.why:
            root = planner.out[0]
            planner.out[0] = dataclasses.replace(root, reason=f"{root.reason} ({outer.why})")
        return planner.plan(root_type, mode, found, sources=places, outer_push_down=outer_ac)
    own_spec = checkpoint_spec(target)
    # A layer that checkpoints in its own __call__ (HF's GradientCheckpointingLayer):
    # torch.compile(layer) traces that checkpoint; the dispatcher runs __call__ eagerly.
    call_ac = call_traced and own_spec is None and checkpoint_calls.call_checkpoints(target)
    traced_ac = own_spec is not None or call_ac or tree.traced_ac_over_boundary(target)
    if outer_ac is not None and not outer_ac.reentrant and not traced_ac:
        # AC that stays outside an in-place compile (full AC; a custom checkpoint_fn; a
        # context_fn a traced checkpoint cannot take): plain torch.compile splits the graph
        # at the boundaries, but compiles on the class's shared code, so one dynamo cache
        # serves every layer of the class. Its entries for a layer that breaks do not
        # guard on what differs (the MLP's type), so a dense layer's recompute ran an
        # MoE layer's graphs and the checkpoint failed (NeMo Automodel's DeepSeek-V3).
        # The same split, on code of its own per kind of block, keeps them apart.
        planner.resolved.add(outer.strategy.name)
        reason = (
            f"the AC around it stays eager, outside the compile ({outer.why}); compiled on code of its own "
            "per kind of block, split at the boundaries inside (plain torch.compile would share one dynamo "
            "cache among every layer of its class, where a recompute can run another layer's graphs)"
        )
        planner.split("", target, None, reason)
        return planner.plan(root_type, mode, found, sources=places)
    if mode == "auto" and not traced_ac and not fullgraph:
        return plain(
            "boundaries inside but no checkpoint around them: plain torch.compile "
            "splits the graph there and keeps the rest compiled"
        )
    if call_ac:
        planner.resolved.add(plans.HOIST.name)
        reason = "its __call__ checkpoints: that AC stays eager around a compile of its forward"
        planner.add("", target, Action.HOIST, reason)
    planner.node("", target, None, root=True)
    return planner.plan(root_type, mode, found, sources=places)


Classifier = Callable[[nn.Module], "str | None"]


def checkpoint_spec(module: nn.Module) -> CheckpointSpec | None:
    """The AC a CheckpointWrapper applies, or ``None`` for any other module."""
    try:
        wrapper_cls = _compat.modules.checkpoint_wrapper_class()
    except _compat.lookup.UnsupportedTorch:
        return None
    if not isinstance(module, wrapper_cls):
        return None
    fn = _compat.modules.checkpoint_fn(module)
    keywords = dict(getattr(fn, "keywords", {}) or {})
    selective = checkpoint_calls.context_fn_of(fn) is not None
    reentrant = _compat.modules.reentrant(module) or bool(keywords.get("use_reentrant"))
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

    A heuristic (see ``checkpoint_calls``): when it misses one, the runtime still
    notices dynamo's fallback at the first call and re-plans from the next call.
    """
    forward = boundaries.user_forward(module)
    while isinstance(forward, functools.partial):
        forward = forward.func
    return checkpoint_calls.code_checkpoints(forward, getattr(forward, "__self__", None))


def traces_checkpoint(module: nn.Module, *, call_traced: bool = True) -> bool:
    """Would a compile of ``module`` trace some checkpoint (where a break would cost the region)?"""
    target = unwrap(module)
    return any(
        checkpoint_spec(m) is not None
        or calls_checkpoint(m)
        or ((call_traced or m is not target) and checkpoint_calls.call_checkpoints(m))
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
        self.unmeasurable = learned.unmeasurable
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

    def ac_over_boundary(self, m: nn.Module) -> CheckpointSpec | None:
        """The AC of a CheckpointWrapper with a boundary below it, or None."""
        return spec if (spec := checkpoint_spec(m)) is not None and self.has_boundary_below(m) else None

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
