"""Applying a plan: the only code that changes modules.

Everything is done in place through instance attributes (``forward``), so the
module tree, parameter objects, ``named_parameters()`` and ``state_dict()`` keys
are exactly what the user built. ``Applied.revert`` undoes it.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from autoweave import _compat, _events
from autoweave._failopen import swallowed, warn_each
from autoweave._instances import install_forward, restore_forward
from autoweave._log import logger
from autoweave._state import run
from autoweave.planning import kinds, learned, sources, wrappers
from autoweave.planning.boundaries import own_forward, user_forward
from autoweave.planning.learned import verdict_of
from autoweave.planning.plans import Action, Plan
from autoweave.weave import on_own_code
from autoweave.weave.first_call_memory import FirstCall
from autoweave.weave.guarded_state import GuardedState
from autoweave.weave.pieces import CheckpointPieces, RegionBackend
from autoweave.weave.shared_kinds import Install, KindRegion

_labels = itertools.count()


def _backend_kwargs(
    kwargs: dict[str, Any], label: str, pieces_fn: Any
) -> tuple[dict[str, Any], RegionBackend | None]:
    """The region's compile kwargs, through a new ``RegionBackend`` (pieces under ``pieces_fn`` if given).

    ``backend``, ``mode`` and ``options`` become the one callable torch would
    build from them, held by the region's backend (``_compat.backends.wrap_backend``).
    Where that callable cannot be rebuilt (AOTInductor options) the region compiles
    as asked, without fail-open or observers; pieces cannot do without it: raised.
    """
    try:
        untuned = _compat.backends.untuned_backend(kwargs)
        wrap = functools.partial(RegionBackend, label=label, checkpoint_fn=pieces_fn, untuned=untuned)
        region_kw = _compat.backends.wrap_backend(kwargs, wrap)
    except _compat.lookup.UnsupportedTorch as exc:
        if pieces_fn is not None:
            raise
        logger.debug("region %s: compiled as asked, its graphs not guarded (%s)", label, exc)
        return kwargs, None
    return region_kw, region_kw["backend"]


# Every region runs on a code object of its own (``autoweave.weave.on_own_code``):
# Dynamo keeps its cache (and its recompile limit, 8) per code object. Compiling
# every region through one shared function (``Module._call_impl``, a class's
# ``forward``) puts unrelated modules in one cache: same-class siblings with
# different shapes recompile until the limit and then silently run eager. A
# code object per *kind* of region (see ``_region_key``) keeps unrelated
# modules apart while identical blocks still share one graph. It also gives
# dynamo a frame outside ``torch.nn`` to start from: in-place compile of a
# built-in leaf such as ``nn.Linear`` otherwise captures nothing.
#
# For regions that split, the class ``forward`` itself is copied: a graph
# break inside a function that a trampoline merely calls makes dynamo break at
# the trampoline's call and trace ``forward``'s own (shared) code as a new
# frame, under whichever compile reached it first. A copy keeps the split
# region, and the resume functions dynamo makes at each break, on this
# region's own cache.


def _shared_region(forward: Callable[..., Any], checkpoint_fn: Any, label: str) -> Callable[..., Any]:
    """A function ``region(module, *args)`` running the class ``forward`` (under AC if asked).

    The module is an argument of the compiled frame, not a closure: dynamo then
    guards on its type and treats its parameters as inputs, the way
    ``torch.compile(block)`` does, so identical layers reuse one graph.
    """
    if checkpoint_fn is None:

        def region(module: Any, *args: Any, **kwargs: Any) -> Any:
            return forward(module, *args, **kwargs)

    else:

        def region(module: Any, *args: Any, **kwargs: Any) -> Any:
            def body(*a: Any, **k: Any) -> Any:
                return forward(module, *a, **k)

            # Called from the region's own frame: a break inside the checkpoint
            # then costs one fallback, not a second one at an inlined caller.
            return checkpoint_fn(body, *args, **kwargs)

    return on_own_code(region, label)


def _private_region(call: Callable[..., Any], checkpoint_fn: Any, label: str) -> Callable[..., Any]:
    """A region for a module with an instance-level forward (under AC if asked): nothing to share."""
    if checkpoint_fn is None:

        def region(*args: Any, **kwargs: Any) -> Any:
            return call(*args, **kwargs)

    else:

        def region(*args: Any, **kwargs: Any) -> Any:
            return checkpoint_fn(call, *args, **kwargs)

    return on_own_code(region, label)


def _region_key(module: nn.Module, decision: Any, compile_kwargs: dict[str, Any]) -> tuple:
    """Regions with equal keys run the same code on same-shaped modules: they share one cache.

    Numbers on the modules (``layer_idx``) are not in it: a kind splits on one only
    when dynamo guards on it (``shared_kinds``).
    """
    kind = kinds.block_kind(module, getattr(decision.checkpoint, "checkpoint_fn", None))
    return (kind, decision.action, decision.pieces, decision.nested, kinds.identity(compile_kwargs))


def _label(path: str, cls: type[nn.Module]) -> str:
    safe = "".join(c if c.isalnum() else "_" for c in (path or "root"))
    return f"autoweave_{cls.__name__}_{safe}_{next(_labels)}"


@dataclass
class Applied:
    """What ``apply_plan`` changed, so it can be reverted exactly."""

    changes: list[tuple[nn.Module, Any]] = field(default_factory=list)
    regions: dict[str, str] = field(default_factory=dict)  # module path -> region label (shared code)
    reverted: bool = False

    def _set_forward(self, module: nn.Module, fn: Any, opaque: bool = False) -> None:
        # An opaque block stays out of an enclosing trace (see ``apply_plan``).
        fn = _compat.dynamo.disable(fn, recursive=True) if opaque else fn
        self.changes.append((module, install_forward(module, fn)))

    def installer(self, path: str, opaque: bool) -> Install:
        """What a kind calls to run the block at ``path`` on a region, at apply and when it splits; it holds this weakly.

        The kind lives as long as the run does (its backend in dynamo's cache too), and
        this holds every module the plan changed: held from there, a dropped model stays.
        """
        ref = weakref.ref(self)

        def install(module: nn.Module, forward: Any, label: str) -> None:
            applied = ref()
            # None: the dispatcher let the plan go, and the model with it. Reverted: the kind
            # moving a block whose plan was undone: it stays as the user built it.
            if applied is not None and not applied.reverted:
                applied._set_forward(module, forward, opaque)
                applied.regions[path] = label

        return install

    def revert(self) -> None:
        self.reverted = True
        for module, previous in reversed(self.changes):
            restore_forward(module, previous)
        self.changes.clear()
        self.regions.clear()


def _without_checkpoint(wrapper: nn.Module) -> Callable[..., Any]:
    """An AC wrapper's forward with its checkpoint moved into the compiled pieces below it.

    Under ``torch.compiler.set_stance("force_eager")`` the pieces run as the user's
    code, without the checkpoint they carry: the wrapper then checkpoints, as it does
    in plain torch (eager selective AC's learned, not a forward that keeps everything),
    and its recompute runs eager too, whatever the stance when backward runs.

    So does a call under ``set_stance("fail_on_recompile")`` that no graph of the
    block's region fits (a block frozen after warm-up): plain torch runs the block
    eager under its checkpoint and trains, where the region would raise (issue 41,
    item 5). A later frame of the region that fits none runs eager without raising
    (``dynamo.recompiles_run_eager``), holding that frame's activations for the call.
    """
    import torch

    inner = _compat.modules.checkpoint_wrapped(wrapper)

    def eager(*args: Any, **kwargs: Any) -> Any:
        with torch.compiler.set_stance("force_eager"):
            return inner(*args, **kwargs)

    def runs_eager(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        if _compat.dynamo.eager_stance() == "force_eager":
            return True
        return _compat.dynamo.fails_on_recompile() and _compat.regions.region_would_convert(
            inner.__dict__.get("forward"), args, kwargs
        )

    def forward(*args: Any, **kwargs: Any) -> Any:
        if runs_eager(args, kwargs):
            if _compat.dynamo.fails_on_recompile():
                warn_each(
                    f"fail-on-recompile:{id(wrapper)}", refused_note(f"{type(wrapper).__name__} (pieces)")
                )
            return _compat.modules.checkpoint_fn(wrapper)(eager, *args, **kwargs)
        return inner(*args, **kwargs)

    return forward


def _region_forward(
    module: nn.Module,
    decision: Any,
    compile_fn: Callable[..., Any],
    kwargs: dict[str, Any],
    pieces: list[CheckpointPieces] | None = None,
) -> tuple[Callable[..., Any] | KindRegion, str]:
    """The compiled forward to install on ``module`` (or the kind that installs it), and its region label.

    A region compiled as pieces appends its ``CheckpointPieces`` to ``pieces``.
    """
    checkpoint_fn, pieces_fn = _checkpoint_fns(decision)
    key = _region_key(module, decision, kwargs)
    own = own_forward(module)
    if own is not None:
        # An instance-level forward: compiled code of its own. Its backend is still its
        # kind's: the frames its forward breaks into (the user's shared function, the
        # class's children) are cached per code object, and under a backend of each
        # instance's own dynamo would recompile them per instance (BACKEND_MATCH) up to
        # the recompile limit. Pieces measure what each region holds: one of its own.
        if pieces_fn is None:
            label, region_kw, backend = _kind_backend(key, decision, type(module), kwargs)
        else:
            label = _label(decision.path, type(module))
            region_kw, backend = _backend_kwargs(kwargs, label, pieces_fn)
        region = _private_region(own, checkpoint_fn, label)
        region = _compat.regions.lookups_in_order(
            compile_fn(region, **_compat.regions.with_headroom(region_kw)),
            _compat.checkpoints.as_recompute_sees,
            **_at_limit(region, label, region_kw, pieces_fn),
            nested=decision.nested,
        )
    else:
        # One compiled region, and one backend, per kind: identical blocks share both,
        # until dynamo guards on a number that differs between them (``shared_kinds``).
        # The kind outlives its blocks (the run's table, dynamo's backend cache): it is
        # built from the block's class, never the block, so a dropped model is freed.
        if key not in run.shared_regions:
            run.shared_regions[key] = KindRegion(
                functools.partial(_build_kind_region, key, decision, type(module), compile_fn, kwargs)
            )
        region = run.shared_regions[key]
        _, _, backend, label = region.base
    # Every block of a kind measures through the one backend its graphs were cut by.
    if backend is not None and backend.pieces is not None and pieces is not None:
        pieces.append(backend.pieces)
    return region, label


def _checkpoint_fns(decision: Any) -> tuple[Any, Any]:
    """The region's traced ``checkpoint_fn`` and its ``pieces_fn``: one of them, or neither, is None.

    Pieces: not traced, the checkpoint is applied by the region's backend to each
    graph piece dynamo cuts the region into (see ``pieces``).
    """
    checkpoint_fn = None if decision.checkpoint is None else decision.checkpoint.checkpoint_fn
    return (None, checkpoint_fn) if decision.pieces else (checkpoint_fn, None)


def _build_kind_region(
    key: tuple,
    decision: Any,
    cls: type[nn.Module],
    compile_fn: Callable[..., Any],
    kwargs: dict[str, Any],
    split: tuple,
) -> tuple[Callable[..., Any], Callable[..., Any], RegionBackend | None, str]:
    """The region of kind ``key`` for the blocks whose guarded numbers are ``split``, on code of its own."""
    checkpoint_fn, pieces_fn = _checkpoint_fns(decision)
    key = (*key, split) if split else key
    label, region_kw, backend = _kind_backend(key, decision, cls, kwargs, pieces_fn)
    forward = cls.forward
    converted = None
    # torch's own modules keep the trampoline: dynamo skips frames whose code
    # lives in torch's files, and a copy keeps its file name.
    if decision.splits and checkpoint_fn is None and sources.user_function(forward):
        region = on_own_code(forward, label, through_wrappers=True)
        converted = _run_wrappers_eagerly(region)
    else:
        region = _shared_region(forward, checkpoint_fn, label)
    # A recompute must run the graph its forward ran (``lookups_in_order``), from inputs that
    # meet the same guards (``as_recompute_sees``), and at the recompile limit the same code.
    compiled = _compat.regions.lookups_in_order(
        compile_fn(region, **_compat.regions.with_headroom(region_kw)),
        _compat.checkpoints.as_recompute_sees,
        **_at_limit(region, label, region_kw, pieces_fn),
        nested=decision.nested,
        converted=converted,
    )
    return compiled, region, backend, label


def _at_limit(
    region: Callable[..., Any], label: str, region_kw: dict[str, Any], pieces_fn: Any = None
) -> dict[str, Any]:
    """``lookups_in_order``'s arguments for a region at its recompile limit: what runs, and the warning.

    A pieces region (``pieces_fn``, the user's checkpoint its backend applies to each piece)
    runs eager under that checkpoint, as plain torch runs the block: dynamo off in its
    forward and in its recompute alike.
    """
    eager = region if pieces_fn is None else _under_checkpoint(pieces_fn, region)

    def on_limit(frame: str, every: bool, storm: bool, checkpointed: bool) -> None:
        # ``every``: a frame resumed after a break is at the limit, not only the region's own.
        # ``storm``: not at the limit yet, but it compiled again at every call (the watchdog).
        # ``checkpointed``: under an eager checkpoint, whose recompute runs what its forward ran.
        under = checkpointed or pieces_fn is not None
        runs = "from this call on, every call" if every else "a call none of its graphs fits"
        where = (
            f"compiled again call after call (frame {frame})"
            if storm
            else f"is at dynamo's recompile limit (frame {frame})"
        )
        tag = "steady-state" if storm else "recompile-limit"
        told = warn_each(
            f"{tag}:{label}",
            f"[{tag}] woven region {label} {where}: "
            f"{runs} runs eager{' under its checkpoint, forward and recompute alike' if under else ''}, "
            "as in plain torch. "
            "TORCH_LOGS=recompiles says which guard failed each time",
        )
        if told:  # once per region, as the warning
            _events.publish(_events.AT_LIMIT, label)

    def on_refused() -> None:
        warn_each(f"fail-on-recompile:{label}", refused_note(f"woven region {label}"))

    def on_failure(exc: BaseException) -> None:
        swallowed(
            "internal-error",
            "internal-error",  # the first is the one to report, as every internal error
            f"failed while deciding at the entry of woven region {label}: {type(exc).__name__}: {exc}; "
            "from this call on it runs eager",
            exc,
        )

    return {
        "eager": eager,
        "recompile_limit": region_kw.get("recompile_limit"),
        "on_limit": on_limit,
        "on_refused": on_refused,
        "on_failure": on_failure,
        "state": GuardedState,
    }


def _under_checkpoint(checkpoint_fn: Any, region: Callable[..., Any]) -> Callable[..., Any]:
    off = _compat.dynamo.outside_dynamo(region, traced_as=region)

    def eager(*args: Any, **kwargs: Any) -> Any:
        return checkpoint_fn(off, *args, **kwargs)

    return eager


def refused_note(what: str) -> str:
    """The warning for a call that would recompile under ``set_stance("fail_on_recompile")``."""
    return (
        f"[fail-on-recompile] {what}: a call none of its graphs fits runs eager under its checkpoint "
        "(the stance forbids compiling it again). Plain torch runs such a block eager too, or raises "
        "where its own frame around the block recompiles. TORCH_LOGS=recompiles says which guard failed"
    )


def _run_wrappers_eagerly(region: Callable[..., Any]) -> Callable[..., Any]:
    """Compile a copied decorator chain from the function it wraps, not from each wrapper.

    A graph break inside the wrapped function makes dynamo break at every
    wrapper's call of the next one: each wrapper is a frame of its own, traced
    down to the break, restarted, compiled to an empty graph and a resume
    function (transformers' layers: two ``forward_with_checkpointing`` and a
    ``deprecate_kwarg`` wrapper, three frames a kind traced twice each). A
    wrapper that only passes its call on (``planning.wrappers``) runs as in
    eager; the first compiled frame is then the next one, as in a hand weave
    that compiles the layer's own ``forward``. A wrapper that computes on
    tensors stays a compiled frame: run eager, its ops would be left out of the
    graphs and, under ``pieces``, out of any checkpoint.

    Returns the first function of the chain that dynamo converts.
    """
    fn, first = region, None
    while True:
        wrapped = getattr(fn, "__wrapped__", None)
        copied = getattr(getattr(wrapped, "__code__", None), "co_name", None) == region.__code__.co_name
        if not copied:
            return first or fn
        if wrappers.passes_call_on(fn):
            _compat.dynamo.skip_own_frame(fn)
        else:
            first = first or fn
        fn = wrapped


def _kind_backend(
    key: tuple, decision: Any, cls: type[nn.Module], kwargs: dict[str, Any], pieces_fn: Any = None
) -> tuple[str, dict[str, Any], RegionBackend | None]:
    """The label, compile kwargs and ``RegionBackend`` of the kind of region ``key``: built once."""
    if key not in run.region_backends:
        label = _label(decision.path, cls)
        run.region_backends[key] = (label, *_backend_kwargs(kwargs, label, pieces_fn))
    return run.region_backends[key]


def _policy_bytes(pieces: list[CheckpointPieces]) -> int | None:
    """What the policy saved in these regions' pieces while they were traced (None: not known)."""
    sizes = [p.policy_saved_bytes for p in pieces]
    if not pieces or any(size is None for size in sizes) or not all(p.traced for p in pieces):
        return None
    return sum(sizes)  # type: ignore[arg-type]


def _measuring_first_call(
    applied: Applied,
    module: nn.Module,
    decision: Any,
    pieces: list[CheckpointPieces],
    agree: Callable[[list[bool]], list[bool]],
) -> Callable[..., Any]:
    """``module``'s forward without its checkpoint, its first call with grad measured (``memory``)."""

    def done(verdict: learned.Verdict | None) -> None:
        # Said under the block's own region (the inner module), else under the first piece's.
        inner = applied.regions.get(f"{decision.path}.{_compat.modules.CHECKPOINT_WRAPPED}".lstrip("."))
        backend = next((p for p in pieces if p.label == inner), pieces[0] if pieces else None)
        if backend is not None:
            if verdict is None:
                backend.note("not measured: saved-tensor hooks were in force around its first call")
            else:
                again = "; planned again with hoist from the next call" if verdict.hoist else ""
                backend.note(f"measured: {verdict.describe()}{again}")
        # The measure steps aside: no cost per call.
        applied._set_forward(module, _without_checkpoint(module), decision.opaque)

    def failed() -> tuple[str, ...]:
        return tuple(why for p in pieces for why in p.failed_pieces)

    return FirstCall(
        module, _without_checkpoint(module), functools.partial(_policy_bytes, pieces), done, failed, agree
    )


def apply_plan(
    root: nn.Module,
    plan: Plan,
    compile_fn: Callable[..., Any],
    compile_kwargs: dict[str, Any],
    agree: Callable[[list[bool]], list[bool]] = list,
) -> Applied:
    """Install the plan's regions under ``root`` (the unwrapped compile target).

    ``compile_fn`` compiles a function (``torch.compile``), each region through
    its ``RegionBackend`` (whose observers the report subscribes to).
    ``agree(flags)``: each
    flag, true if it is on any rank that runs the plan (``dispatch/plan_inputs``).
    """
    applied = Applied()
    # The pieces backends of the regions under each AC moved into them (by the spec's id).
    pieces: dict[int, list[CheckpointPieces]] = {}
    try:
        for decision in plan.decisions:
            if decision.action is Action.PLAIN:
                continue
            module = root.get_submodule(decision.path) if decision.path else root
            forward: Callable[..., Any] | None = None
            if decision.region:
                kwargs = dict(compile_kwargs)
                # A region that splits is checked at its first call instead (see runtime).
                kwargs["fullgraph"] = bool(kwargs.get("fullgraph")) and not decision.splits
                below = pieces.setdefault(id(decision.checkpoint), []) if decision.pieces else None
                region, label = _region_forward(module, decision, compile_fn, kwargs, below)
                applied.regions[decision.path] = label
                if isinstance(region, KindRegion):
                    # The kind installs the block's forward, now and when it splits.
                    region.bind(module, applied.installer(decision.path, decision.opaque))
                    continue
                forward = region
            elif decision.measure and verdict_of(module) is None:
                # auto chose pieces for this selective AC: whether they hold more than
                # eager SAC would is measured at the first call (``first_call_memory``); a
                # block of a kind measured since this plan was made is not measured again.
                forward = _measuring_first_call(
                    applied, module, decision, pieces.setdefault(id(decision.ac), []), agree
                )
            elif decision.action is Action.PIECES:
                forward = _without_checkpoint(module)
            if decision.opaque:
                # Keep this checkpointed module out of the enclosing region's
                # trace: dynamo breaks the graph here instead of giving up on
                # the checkpoint. Regions below still compile on their own.
                forward = forward or user_forward(module)
            if forward is not None:
                applied._set_forward(module, forward, decision.opaque)
    except BaseException:
        applied.revert()
        raise
    return applied
