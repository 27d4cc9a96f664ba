"""Pure planning: a module tree in, a plan (what to compile, what to leave, why) out.

Nothing here compiles or changes a module; ``weave.apply_plan`` does that.

Vocabulary. A *region* is a module whose forward is compiled on its own. A
*boundary* is a module whose call dynamo cannot trace (an FSDP unit, say): it
splits any region that contains it. A boundary inside a checkpointed region
that dynamo traces makes dynamo give up on the whole checkpointed region (it
runs eager, forward and recompute), which is the loss autoweave exists to avoid.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from autoweave import _compat
from autoweave._settings import MODES, STRATEGIES, check_choice
from autoweave.planning import boundaries, checkpoint_calls, sources
from autoweave.planning.learned import Learned

Classifier = Callable[[nn.Module], "str | None"]


class Action(str, enum.Enum):
    PLAIN = "plain"  # the root compiles exactly as plain torch.compile would
    COMPILE = "compile"  # compiled whole as one region; no boundary inside
    SPLIT = "split"  # compiled as one region that dynamo splits at the boundaries inside
    WEAVE = "weave"  # own forward eager; children planned one by one
    BOUNDARY = "boundary"  # hooks stay eager; the inner forward is planned on its own
    HOIST = "hoist"  # AC wrapper stays eager around a compile of its inner module (which may split)
    SIBLINGS = "siblings"  # AC wrapper stays eager around its inner module's children, compiled one by one
    PUSH_DOWN = "push-down"  # AC wrapper stops checkpointing; each region below checkpoints itself
    PIECES = "pieces"  # AC wrapper stops checkpointing; each compiled piece below (between breaks) checkpoints itself
    EAGER = "eager"  # left alone


@dataclass(frozen=True)
class CheckpointSpec:
    """The activation checkpointing a CheckpointWrapper applies, as the user configured it."""

    selective: bool
    reentrant: bool
    options: tuple[tuple[str, str], ...]  # printable keyword options
    known: bool = True  # torch.utils.checkpoint underneath (else a user checkpoint_fn)
    checkpoint_fn: Any = field(default=None, compare=False, repr=False)

    def describe(self) -> str:
        kind = "selective AC" if self.selective else "full AC" if self.known else "custom AC"
        if self.reentrant:
            kind += " (reentrant)"
        return kind


@dataclass(frozen=True)
class Decision:
    path: str  # submodule path relative to the compile target ("" is the target)
    module_type: str
    action: Action
    reason: str
    region: bool = False  # this module's forward is compiled on its own
    opaque: bool = False  # kept out of the enclosing region's trace (a deliberate break)
    checkpoint: CheckpointSpec | None = None  # pushed-down AC applied inside this region
    # The region is compiled without a traced checkpoint; each graph dynamo cuts it
    # into (between breaks) is checkpointed on its own (``pieces``), glue included.
    pieces: bool = False
    splits: bool = False  # dynamo may cut this region at the boundaries (or breaks) inside
    ac: CheckpointSpec | None = None  # the AC this wrapper had (HOIST / PIECES / PUSH_DOWN / SIBLINGS)


@dataclass(frozen=True)
class Plan:
    root_type: str
    woven: bool
    mode: str
    strategy: str
    fullgraph: bool
    decisions: tuple[Decision, ...]
    boundaries: tuple[tuple[str, str], ...]  # (path, reason)
    # checkpoint_wrapper(torch.compile(block)) under selective AC: the enclosing
    # wrapper's checkpoint, moved into this plan's regions (the wrapper stops checkpointing).
    outer_push_down: CheckpointSpec | None = None
    # Where each boundary sits in the user's source (path -> sources.Source), for messages.
    sources: tuple[tuple[str, Any], ...] = field(default=(), compare=False)

    def source(self, path: str) -> Any:
        """The boundary at ``path``'s place in the user's source (``sources.Source``), or None."""
        return dict(self.sources).get(path)

    def regions(self) -> list[Decision]:
        return [d for d in self.decisions if d.region]

    def decision(self, path: str) -> Decision | None:
        for d in self.decisions:
            if d.path == path:
                return d
        return None

    def plain_instead(self, reason: str) -> Plan:
        """This plan given up for plain torch.compile (the weave failed), saying why."""
        decision = Decision("", self.root_type, Action.PLAIN, reason)
        return Plan(
            self.root_type, False, self.mode, self.strategy, self.fullgraph, (decision,), self.boundaries
        )

    def headline(self) -> str:
        """One line: why plain, or how many regions (and under which mode and strategy)."""
        if not self.woven:
            return self.decisions[0].reason
        return (
            f"woven into {len(self.regions())} compiled regions (mode={self.mode}, strategy={self.strategy})"
        )


# -- reading the tree ---------------------------------------------------------------------


def checkpoint_spec(module: nn.Module) -> CheckpointSpec | None:
    """The AC a CheckpointWrapper applies, or ``None`` for any other module."""
    try:
        wrapper_cls = _compat.checkpoint_wrapper_class()
    except _compat.UnsupportedTorch:
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
        optimized = _compat.optimized_module()
    except _compat.UnsupportedTorch:
        return module
    while isinstance(module, optimized):
        module = _compat.compiled_inner(module)
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


def _is_container(module: nn.Module) -> bool:
    forward = boundaries.user_forward(module)
    return getattr(forward, "__func__", forward) is nn.Module.forward


def _walk(module: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Module]]:
    for name, child in module.named_children():
        yield (f"{prefix}.{name}" if prefix else name), child


class _Tree:
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


# -- planning -----------------------------------------------------------------------------


@dataclass
class _Context:
    fullgraph: bool
    strategy: str
    checkpoint: CheckpointSpec | None = None  # AC pushed down into every region below
    pieces: bool = False  # ... applied to each compiled piece, so regions below may split


class _Planner:
    def __init__(self, tree: _Tree, strategy: str, fullgraph: bool) -> None:
        self.tree = tree
        self.strategy = strategy
        self.fullgraph = fullgraph
        self.out: list[Decision] = []

    def add(self, path: str, module: nn.Module, action: Action, reason: str, **extra: Any) -> None:
        self.out.append(Decision(path, type(module).__name__, action, reason, **extra))

    # A module its parent calls eagerly (or the woven root): decide what it becomes.
    def node(self, path: str, module: nn.Module, ctx: _Context, *, root: bool = False) -> None:
        module = unwrap(module)
        # The compile target's own hooks run outside its compiled call whatever
        # it is (an FSDP unit after `fully_shard(block)`), so it is never a
        # boundary of its own plan.
        kind = None if root else self.tree.kind(module)
        if kind is not None:
            self.boundary(path, module, kind, ctx)
            return
        spec = checkpoint_spec(module)
        if spec is not None and self.tree.has_boundary_below(module):
            self.checkpointed(path, module, spec, ctx, opaque=False)
            return
        if _is_container(module):
            # ModuleList / ModuleDict have no forward: their parent calls the children.
            self.add(path, module, Action.EAGER, "container without a forward: children planned")
            for child_path, child in _walk(module, path):
                self.node(child_path, child, ctx)
            return
        if not self.tree.has_boundary_below(module):
            self.region(path, module, ctx, Action.COMPILE, "no boundary inside: compiled whole")
            return
        hidden = calls_checkpoint(module)
        # Boundaries inside a ModuleList/ModuleDict child are called from a loop in
        # this forward, and dynamo cannot resume a frame inside a loop after a break:
        # it would run this whole forward eager (the blocks' neighbours too).
        looped = any(_is_container(c) and self.tree.has_boundary_below(c) for c in module.children())
        if self.can_split(ctx) and self.strategy != "siblings" and not hidden and not looped:
            self.split(path, module, ctx, "compiled; dynamo splits it at the boundaries inside")
            return
        why = (
            "its forward calls checkpoint: children compiled one by one"
            if hidden
            else "its forward loops over blocks holding boundaries: children compiled one by one"
            if looped
            else "fullgraph: each region compiled on its own"
            if ctx.fullgraph
            else "AC pushed into each region"
            if ctx.checkpoint
            else "children compiled one by one"
        )
        self.add(path, module, Action.WEAVE, f"boundary inside; own forward eager, {why}")
        for child_path, child in _walk(module, path):
            self.node(child_path, child, ctx)

    def can_split(self, ctx: _Context) -> bool:
        # A split region breaks at boundaries. Under fullgraph that is allowed at
        # the boundaries only (the runtime checks the first call), except when
        # siblings are asked for. Under a pushed-down checkpoint it is allowed when
        # each piece is checkpointed on its own: a break inside one traced
        # checkpoint is exactly the fallback we avoid.
        if ctx.fullgraph and self.strategy == "siblings":
            return False
        return ctx.checkpoint is None or ctx.pieces

    def region(
        self,
        path: str,
        module: nn.Module,
        ctx: _Context,
        action: Action,
        reason: str,
        *,
        splits: bool = False,
    ) -> None:
        if ctx.checkpoint is not None:
            reason += (
                f", each piece under {ctx.checkpoint.describe()}"
                if ctx.pieces
                else f", inside {ctx.checkpoint.describe()} pushed down"
            )
        self.add(
            path,
            module,
            action,
            reason,
            region=True,
            checkpoint=ctx.checkpoint,
            pieces=ctx.pieces,
            splits=splits,
        )

    def boundary(
        self, path: str, module: nn.Module, kind: str, ctx: _Context, *, opaque: bool = False
    ) -> None:
        if boundaries.forward_disabled(module):
            self.add(path, module, Action.EAGER, f"{kind}: left eager as the user asked")
            return
        if id(module) in self.tree.breaking and ctx.pieces:
            # A break in its own forward: compiled, dynamo cuts it there, and each
            # piece carries the checkpoint (the children are traced inside).
            self.split(path, module, ctx, f"{kind} → compiled, split there", action=Action.BOUNDARY)
            return
        if id(module) in self.tree.breaking and ctx.checkpoint is not None:
            # A break in its own forward: compiled under the pushed-down checkpoint
            # it would fall back anyway. Its children are regions of their own
            # (each under the checkpoint); a module without children runs eager
            # under the checkpoint, so the policy still decides for its ops.
            if any(True for _ in module.children()):
                self.add(path, module, Action.WEAVE, f"{kind} → own forward eager, children compiled")
                for child_path, child in _walk(module, path):
                    self.node(child_path, child, ctx)
                return
            self.add(
                path,
                module,
                Action.EAGER,
                f"{kind} → eager under {ctx.checkpoint.describe()} pushed down",
                checkpoint=ctx.checkpoint,
            )
            return
        spec = checkpoint_spec(module)
        if spec is not None and self.tree.has_boundary_below(module):
            # An AC wrapper that is itself an FSDP unit (AC, then fully_shard per
            # block): its hooks stay eager anyway; its checkpoint is planned as any.
            self.checkpointed(path, module, spec, ctx, opaque=opaque, unit=kind)
            return
        if not self.tree.has_boundary_below(module):
            self.region(path, module, ctx, Action.BOUNDARY, f"{kind} → hooks stay eager, forward compiled")
            return
        # A boundary inside a boundary: its own forward is planned like any module.
        self.add(path, module, Action.BOUNDARY, f"{kind} → hooks stay eager, inner planned below")
        if self.can_split(ctx) and self.strategy != "siblings":
            self.out.pop()
            self.split(
                path,
                module,
                ctx,
                f"{kind} → hooks stay eager, forward compiled and split at nested boundaries",
                action=Action.BOUNDARY,
            )
            return
        for child_path, child in _walk(module, path):
            self.node(child_path, child, ctx)

    def checkpointed(
        self,
        path: str,
        module: nn.Module,
        spec: CheckpointSpec,
        ctx: _Context,
        *,
        opaque: bool,
        unit: str | None = None,
    ) -> None:
        inner_path = f"{path}.{_compat.CHECKPOINT_WRAPPED}" if path else _compat.CHECKPOINT_WRAPPED
        inner = _compat.checkpoint_wrapped(module)
        where = "kept out of the enclosing region, " if opaque else ""
        if unit is not None:
            where = f"{unit}, hooks eager; {where}"
        strategy = self.strategy
        measured = self.tree.measured.get(id(module)) if strategy == "auto" else None
        # A context_fn that a traced checkpoint cannot take (``traced_contexts``): no
        # strategy that moves the checkpoint into compiled graphs can run this block.
        untraceable = (
            self.tree.untraceable.get(id(spec.checkpoint_fn))
            if strategy in ("auto", "pieces", "push-down")
            else None
        )
        if strategy == "auto":
            # Full AC: eager AC around a compile that splits captures everything
            # and recomputes compiled. A selective policy must see the ops it was
            # written for, so the checkpoint goes into the compiled graphs, unless
            # its pieces were measured holding more than eager selective AC would
            # (``memory``): then eager AC stays around the compile, as for full AC.
            strategy = "pieces" if (spec.selective or not spec.known) and measured is None else "hoist"
        if untraceable is not None:
            strategy = "hoist"
        if strategy == "pieces" and not spec.known:
            strategy = "push-down"  # a custom checkpoint_fn: called as written, around each region
        if strategy in ("pieces", "push-down") and (spec.reentrant or ctx.checkpoint is not None):
            strategy = "siblings"  # reentrant AC cannot be traced; nested AC stays as written
        if strategy == "hoist" and ctx.checkpoint is not None:
            strategy = "siblings"
        if strategy == "hoist":
            why = (
                f" ({untraceable}: eager AC calls it as the wrapper does)"
                if untraceable
                else f" (measured: {measured}; eager AC around the compile holds at most eager SAC's; "
                "strategy='pieces' keeps the pieces)"
                if measured
                else ""
            )
            self.add(
                path,
                module,
                Action.HOIST,
                f"{where}{spec.describe()} stays eager around a compile of the inner block{why}",
                opaque=opaque,
                ac=spec,
            )
            broken = self.tree.breaking.get(id(inner))
            self.split(
                inner_path,
                inner,
                ctx,
                "compiled under eager AC; dynamo splits it at the boundaries inside"
                + (f" and at its own {broken}" if broken else ""),
            )
        elif strategy == "pieces":
            self.add(
                path,
                module,
                Action.PIECES,
                f"{where}{spec.describe()} moved into each compiled piece below",
                opaque=opaque,
                ac=spec,
            )
            inner_ctx = _Context(ctx.fullgraph, ctx.strategy, checkpoint=spec, pieces=True)
            self.node_inner(inner_path, inner, inner_ctx)
        elif strategy == "push-down":
            self.add(
                path,
                module,
                Action.PUSH_DOWN,
                f"{where}{spec.describe()} moved into each compiled region below",
                opaque=opaque,
                ac=spec,
            )
            self.node_inner(inner_path, inner, _Context(ctx.fullgraph, ctx.strategy, checkpoint=spec))
        else:
            self.add(
                path,
                module,
                Action.SIBLINGS,
                f"{where}{spec.describe()} stays eager around compiled children",
                opaque=opaque,
                ac=spec,
            )
            self.node_inner(inner_path, inner, ctx, force_weave=True)

    def node_inner(self, path: str, module: nn.Module, ctx: _Context, *, force_weave: bool = False) -> None:
        if force_weave and self.tree.kind(module) is None and self.tree.has_boundary_below(module):
            self.add(
                path, module, Action.WEAVE, "boundary inside; own forward eager, children compiled one by one"
            )
            for child_path, child in _walk(module, path):
                self.node(child_path, child, ctx)
            return
        self.node(path, module, ctx)

    def split(
        self, path: str, module: nn.Module, ctx: _Context, reason: str, action: Action = Action.SPLIT
    ) -> None:
        self.region(path, module, ctx, action, reason, splits=True)
        self.inside_split(path, module, ctx)

    def inside_split(self, path: str, module: nn.Module, ctx: _Context) -> None:
        # Descendants traced by a split region: boundaries break the graph by
        # themselves; checkpoints over a boundary must be kept out of the trace.
        for child_path, child in _walk(module, path):
            child = unwrap(child)
            kind = self.tree.kind(child)
            if id(child) in self.tree.breaking and checkpoint_spec(child) is None:
                # A break dynamo met in its own forward: the enclosing region splits
                # there by itself (as with AC outside the compile); no region of its own.
                self.add(child_path, child, Action.BOUNDARY, f"{kind} → the enclosing region splits there")
                if self.tree.has_boundary_below(child):
                    self.inside_split(child_path, child, ctx)
                continue
            if kind is not None:
                self.boundary(child_path, child, kind, ctx, opaque=True)
                continue
            spec = checkpoint_spec(child)
            if spec is not None and self.tree.has_boundary_below(child):
                self.checkpointed(child_path, child, spec, ctx, opaque=True)
            elif self.tree.has_boundary_below(child) and (
                calls_checkpoint(child) or checkpoint_calls.call_checkpoints(child)
            ):
                self.add(
                    child_path,
                    child,
                    Action.WEAVE,
                    "kept out of the enclosing region; its forward calls checkpoint: children compiled one by one",
                    opaque=True,
                )
                for grand_path, grand in _walk(child, child_path):
                    self.node(grand_path, grand, ctx)
            elif self.tree.has_boundary_below(child):
                self.inside_split(child_path, child, ctx)


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
) -> Plan:
    """Decide how to compile ``module`` (the object handed to ``torch.compile``).

    Compiles nothing. ``mode``: ``auto`` weaves only where plain torch.compile
    would lose a checkpointed region (or fail under ``fullgraph``), ``always``
    weaves whenever a boundary is inside, ``off`` never weaves. ``strategy``
    places the AC of a woven block: ``hoist`` (eager AC around a compile that may
    split), ``pieces`` (the block compiled and split at its breaks, each compiled
    piece checkpointed with the user's policy and options: glue included),
    ``push-down`` (AC moved into each compiled child region; the glue stays eager),
    ``siblings`` (eager AC around children compiled one by one), ``auto`` (hoist
    for full AC, pieces for selective AC unless they were ``measured`` holding more
    than eager selective AC, push-down for a custom ``checkpoint_fn``).
    Under ``fullgraph`` a region may still split at the boundaries autoweave
    handles (the runtime checks that no other break happened), unless the
    strategy is ``siblings``.

    ``call_traced`` is whether the compile traces the target's ``__call__``
    (``torch.compile(module)``) or only its ``_call_impl`` (in-place
    ``module.compile()``).

    ``learned`` is what the run learned under the target (``Learned.for_target``;
    ``dispatch/plan_inputs`` assembles it): modules dynamo was seen breaking in
    are boundaries of this plan; selective-AC wrappers whose pieces were
    measured holding more than eager selective AC would are planned with hoist
    under ``auto``; checkpoints whose ``context_fn`` a traced checkpoint cannot
    take are planned with hoist under ``auto``, ``pieces`` and ``push-down``,
    and an AC outside the compile stays there.
    """
    found_plan = _plan(
        module,
        mode=mode,
        strategy=strategy,
        fullgraph=fullgraph,
        classify=classify,
        outer_ac=outer_ac,
        call_traced=call_traced,
        learned=learned,
    )
    target = unwrap(module)
    places = tuple(
        (path, source)
        for path, _ in found_plan.boundaries
        if (source := sources.boundary_source(target, path))
    )
    return dataclasses.replace(found_plan, sources=places)


def _plan(
    module: nn.Module,
    *,
    mode: str,
    strategy: str,
    fullgraph: bool,
    classify: Classifier | None,
    outer_ac: CheckpointSpec | None,
    call_traced: bool,
    learned: Learned | None,
) -> Plan:
    check_choice("mode", mode, MODES)
    check_choice("strategy", strategy, STRATEGIES)
    tree = _Tree(classify or boundaries.classify, learned or Learned())
    target = unwrap(module)
    found = tuple(
        (name, tree.kind(m) or "")
        for name, m in target.named_modules()
        if m is not target and tree.kind(m) is not None
    )
    root_type = type(target).__name__

    def plain(reason: str) -> Plan:
        decision = Decision("", root_type, Action.PLAIN, reason)
        return Plan(root_type, False, mode, strategy, fullgraph, (decision,), found)

    if not found:
        return plain("no boundary inside: compiled as plain torch.compile would")
    if mode == "off":
        return plain("weaving is off (mode=off): compiled as plain torch.compile would")
    outer_untraceable = None if outer_ac is None else tree.untraceable.get(id(outer_ac.checkpoint_fn))
    if (
        outer_ac is not None
        and not outer_ac.reentrant
        and outer_untraceable is None
        and (outer_ac.selective or not outer_ac.known or strategy in ("push-down", "pieces"))
    ):
        # AC outside the compile: plain torch splits at the boundary, but an eager
        # selective policy around compiled code sees inductor's kernels, not the
        # ops it was written for. Move the checkpoint into each region instead.
        planner = _Planner(tree, strategy, fullgraph)
        pieces = outer_ac.known and strategy in ("auto", "pieces")
        planner.node("", target, _Context(fullgraph, strategy, checkpoint=outer_ac, pieces=pieces), root=True)
        return Plan(
            root_type, True, mode, strategy, fullgraph, tuple(planner.out), found, outer_push_down=outer_ac
        )
    own_spec = checkpoint_spec(target)
    # A layer that checkpoints in its own __call__ (HF's GradientCheckpointingLayer):
    # torch.compile(layer) traces that checkpoint; the dispatcher runs __call__ eagerly.
    call_ac = call_traced and own_spec is None and checkpoint_calls.call_checkpoints(target)
    traced_ac = own_spec is not None or call_ac or tree.traced_ac_over_boundary(target)
    if outer_ac is not None and not outer_ac.reentrant and not traced_ac:
        # AC that stays outside an in-place compile (full AC; a context_fn a traced
        # checkpoint cannot take): plain torch.compile splits the graph at the
        # boundaries, but compiles on the class's shared code, so one dynamo cache
        # serves every layer of the class. Its entries for a layer that breaks do not
        # guard on what differs (the MLP's type), so a dense layer's recompute ran an
        # MoE layer's graphs and the checkpoint failed (NeMo Automodel's DeepSeek-V3).
        # The same split, on code of its own per kind of block, keeps them apart.
        why = "full AC" if outer_untraceable is None else f"selective AC: {outer_untraceable}"
        planner = _Planner(tree, strategy, fullgraph)
        planner.split(
            "",
            target,
            _Context(fullgraph, strategy),
            f"the AC around it stays eager, outside the compile ({why}); compiled on code of its own per "
            "kind of block, split at the boundaries inside (plain torch.compile would share one dynamo "
            "cache among every layer of its class, where a recompute can run another layer's graphs)",
        )
        return Plan(root_type, True, mode, strategy, fullgraph, tuple(planner.out), found)
    if mode == "auto" and not traced_ac and not fullgraph:
        return plain(
            "boundaries inside but no checkpoint around them: plain torch.compile "
            "splits the graph there and keeps the rest compiled"
        )
    planner = _Planner(tree, strategy, fullgraph)
    if call_ac:
        planner.add(
            "",
            target,
            Action.HOIST,
            "its __call__ checkpoints: that AC stays eager around a compile of its forward",
        )
    planner.node("", target, _Context(fullgraph, strategy), root=True)
    return Plan(root_type, True, mode, strategy, fullgraph, tuple(planner.out), found)
