"""Where a module checkpoints, and whether a checkpoint dynamo traces can take its ``context_fn``.

Both are read before the module runs. Where it checkpoints: its forward's code,
its ``__call__``. A checkpoint written in code is invisible in the module tree.
Reading names (``"checkpoint" in co_names``) misses ``from
torch.utils.checkpoint import checkpoint as ckpt``, ``self._ckpt =
partial(checkpoint, ...)`` and helper methods, and falsely matches
``self.checkpoint`` flags. So the code is read for what its names *are*: each
load of a global, a closure variable or an attribute of ``self`` is resolved
against the live objects (the function's globals, its closure, the module
instance), and a call target that resolves to torch's ``checkpoint`` (or a
``functools.partial`` of it) counts. User functions and methods it calls are
read too, a few levels deep.

Best effort by design: what it misses, dynamo's fallback message at the first
call still catches (the dispatcher re-plans from the next call).

Whether a traced checkpoint can take a wrapper's ``context_fn``: ``pieces`` puts
the user's checkpoint inside compiled graphs, where torch's checkpoint demands
that ``context_fn`` return two ``TorchDispatchMode`` objects ("In torch.compile
mode, `context_fn` ... must generate a tuple of two `TorchDispatchMode`s",
torch/utils/checkpoint.py). ``create_selective_checkpoint_contexts`` does. A
``context_fn`` that wraps those modes in ordinary context managers does not:
NeMo Automodel's ``apply_ac`` composes its per-op policy with an
attention-backend snapshot and, for MoE blocks, a ``@contextmanager`` that swaps
the gate's expert-load buffer around the recompute. Every piece of such a block
would raise inside the trace and run eager (21 of 28 forward GEMMs on NeMo's
DeepSeek-V3, as many as plain torch); eager AC around the compiled block
(``hoist``) calls that ``context_fn`` exactly as the user's wrapper does, and
compiles everything but the breaks.

Told, not guessed: a ``functools.partial`` of torch's own factory is known to be
traceable (``known_traceable``); any other ``context_fn`` is called once by
``dispatch/plan_inputs`` (``probe``), outside any trace, and what it returned is
judged here (``why_not_traceable``, which looks at the value and never enters
it).
"""

from __future__ import annotations

import dis
import functools
import sys
import types
from typing import Any

from autoweave import _compat
from autoweave.planning import sources

_CHECKPOINT_FUNCTIONS = frozenset({"checkpoint", "checkpoint_sequential"})
_LOADS_FROM = {"LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "LOAD_CLASSDEREF", "LOAD_FAST", "LOAD_FAST_CHECK"}
_ATTRIBUTE_LOADS = {"LOAD_ATTR", "LOAD_METHOD"}
_MISSING = object()
_DEPTH = 3


def is_checkpoint(obj: Any) -> bool:
    """Is ``obj`` torch's activation checkpoint function (or a partial / wrapper of it)?"""
    for _ in range(8):
        if isinstance(obj, functools.partial):
            obj = obj.func
            continue
        module = getattr(obj, "__module__", None)
        name = getattr(obj, "__name__", None)
        if module == "torch.utils.checkpoint" and name in _CHECKPOINT_FUNCTIONS:
            return True
        wrapped = getattr(obj, "__wrapped__", None)
        if wrapped is None or wrapped is obj:
            return False
        obj = wrapped
    return False


def _instance_attribute(owner: Any, name: str) -> Any:
    """``owner.name`` without running properties or ``__getattr__`` side effects where avoidable."""
    own = owner.__dict__ if hasattr(owner, "__dict__") else {}
    for mapping in (own, *(own.get(store, {}) for store in _compat.modules.MODULE_STORES)):
        found = mapping.get(name, _MISSING)
        if found is not _MISSING:
            return found
    for cls in type(owner).__mro__:
        if name in cls.__dict__:
            attr = cls.__dict__[name]
            if isinstance(attr, (types.FunctionType, staticmethod, classmethod)):
                return attr.__get__(owner, type(owner))
            if isinstance(attr, (bool, int, type(None))):
                return attr  # a class-level flag (``gradient_checkpointing = False``)
            return _MISSING  # a property or descriptor: not read
    return _MISSING


def _attribute(obj: Any, name: str) -> Any:
    if obj is _MISSING:
        return _MISSING
    if isinstance(obj, (types.ModuleType, type)):
        return getattr(obj, name, _MISSING)
    return _instance_attribute(obj, name)


# Conditional jumps (Python 3.10-3.13 spellings) and the flag value that takes them:
# with that value the instructions up to the target are skipped, i.e. do not run now.
_JUMPS = {
    "POP_JUMP_IF_FALSE": False,
    "POP_JUMP_FORWARD_IF_FALSE": False,
    "POP_JUMP_IF_TRUE": True,
    "POP_JUMP_FORWARD_IF_TRUE": True,
}
# Flipped by train()/eval() between calls: never taken as a fixed flag.
_MODES = frozenset({"training"})


class _Flag:
    """A plain flag reached from the module by attributes (``bool``/``int``/``None``), as read while planning.

    ``self.gradient_checkpointing``, or one held on an object the module holds:
    ``self.config.use_checkpoint`` (transformers' layers read their config).
    """

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = bool(value)


def code_checkpoints(
    fn: Any, owner: Any = None, *, depth: int = _DEPTH, seen: set[int] | None = None
) -> bool:
    """Does calling ``fn`` (a function or bound method; ``owner`` is its ``self``) checkpoint?"""
    seen = set() if seen is None else seen
    if isinstance(fn, types.MethodType):
        owner, fn = fn.__self__, fn.__func__
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType) or id(code) in seen:
        return False
    seen.add(id(code))
    return _read(code, fn, owner, depth, seen)


def _read(code: types.CodeType, fn: Any, owner: Any, depth: int, seen: set[int]) -> bool:
    globals_ = getattr(fn, "__globals__", {})
    cells = dict(zip(code.co_freevars, getattr(fn, "__closure__", None) or (), strict=False))
    self_name = code.co_varnames[0] if owner is not None and code.co_argcount else None
    current: Any = _MISSING
    rooted = False  # ``current`` is the module or reached from it by attribute loads alone
    importing: Any = _MISSING
    assigned: dict[str, Any] = {}  # locals bound to something resolved (``import ... as``, aliases)
    previous: Any = None
    callees: list[Any] = []  # user functions and bound methods (code_checkpoints reads a method's self)
    dormant_until = -1
    for instruction in dis.get_instructions(code):
        if instruction.offset < dormant_until:
            continue
        op, name = instruction.opname, instruction.argval
        fromlist, previous = previous, instruction.argval
        reached, rooted = rooted, False
        if op in _JUMPS:
            # ``if self.gradient_checkpointing and ...: return checkpoint(...)`` with the
            # flag off: that branch does not run now, and must not make the plan worse.
            target = name if isinstance(name, int) else -1
            if isinstance(current, _Flag) and current.value == _JUMPS[op] and target > instruction.offset:
                dormant_until = target
            current = _MISSING
            continue
        if op == "TO_BOOL":  # 3.13+: the test's value stays what it was
            continue
        if op == "IMPORT_NAME":
            # Imports inside the function: ``import torch.utils.checkpoint`` binds
            # the top package, ``from ... import checkpoint as ck`` the attribute.
            importing = sys.modules.get(name, _MISSING)
            current = importing if fromlist else sys.modules.get(str(name).split(".")[0], _MISSING)
            continue
        if op == "IMPORT_FROM":
            current = getattr(importing, name, _MISSING) if importing is not _MISSING else _MISSING
            if is_checkpoint(current):
                return True
            continue
        if op in ("STORE_FAST", "STORE_DEREF", "STORE_NAME"):
            if current is not _MISSING:
                assigned[name] = current
            current = _MISSING
            continue
        if op.startswith("LOAD_FAST") and name in assigned:
            current = assigned[name]
        elif op in _LOADS_FROM:
            current = _MISSING
            if op in ("LOAD_GLOBAL", "LOAD_NAME"):
                current = globals_.get(name, _MISSING)
                if current is _MISSING:
                    builtins = globals_.get("__builtins__", {})
                    current = (builtins if isinstance(builtins, dict) else vars(builtins)).get(name, _MISSING)
            elif op in ("LOAD_DEREF", "LOAD_CLASSDEREF") and name in cells:
                current = sources.cell_value(cells[name], _MISSING)
            elif op.startswith("LOAD_FAST") and name == self_name:
                current = owner
        elif op in _ATTRIBUTE_LOADS:
            current = _attribute(current, name)
            if reached and name not in _MODES and isinstance(current, (bool, int, type(None))):
                current = _Flag(current)  # only a branch test reads it
                continue
            rooted = reached and current is not _MISSING
        else:
            current = _MISSING
            continue
        rooted = rooted or (current is owner and owner is not None)
        if current is _MISSING or current is owner:
            continue
        if is_checkpoint(current):
            return True
        if depth > 0 and callable(current):
            target = current.__func__ if isinstance(current, types.MethodType) else current
            if sources.user_function(target):
                callees.append(current)
    for const in code.co_consts:
        if isinstance(const, types.CodeType) and id(const) not in seen:
            # Nested functions and lambdas: their globals are the enclosing function's.
            seen.add(id(const))
            if _read(const, fn, None, depth, seen):
                return True
    return any(code_checkpoints(callee, depth=depth - 1, seen=seen) for callee in callees)


def call_checkpoints(module: Any) -> bool:
    """Does the module's class override ``__call__`` with code that checkpoints (HF's layers do)?"""
    import torch.nn as nn

    # The class attribute, found as Python would (not callable(): every module is).
    call = next(
        (cls.__dict__["__call__"] for cls in type(module).__mro__ if "__call__" in cls.__dict__), None
    )
    if call is None or call is nn.Module.__call__ or not sources.user_function(call):
        return False
    return code_checkpoints(call, module)


# The strategies that would trace the user's checkpoint inside compiled graphs.
TRACING_STRATEGIES = ("auto", "pieces")


def context_fn_of(checkpoint_fn: Any) -> Any:
    """The ``context_fn`` a wrapper's ``checkpoint_fn`` hands torch's checkpoint (None: none, or full AC)."""
    keywords = getattr(checkpoint_fn, "keywords", None) or {}
    context_fn = keywords.get("context_fn")
    if context_fn is None or getattr(context_fn, "__name__", "") == "noop_context_fn":
        return None
    return context_fn


def known_traceable(context_fn: Any) -> bool:
    """A ``functools.partial`` of torch's own factory: two dispatch modes, without calling it."""
    factory = _compat.checkpoints.selective_contexts_factory()
    return factory is not None and getattr(context_fn, "func", None) is factory


def why_not_traceable(context_fn: Any, contexts: Any) -> str | None:
    """Why a traced checkpoint cannot take ``context_fn``, which returned ``contexts``; None when it can."""
    name = getattr(context_fn, "__qualname__", None) or type(context_fn).__name__
    if not (isinstance(contexts, tuple) and len(contexts) == 2):
        return f"its context_fn ({name}) returns {type(contexts).__name__}, not a pair of contexts"
    if all(_compat.checkpoints.is_dispatch_mode(c) for c in contexts):
        return None
    kinds = " and ".join(type(c).__name__ for c in contexts)
    return (
        f"its context_fn ({name}) returns {kinds}, not the two TorchDispatchModes a checkpoint "
        "inside a compiled graph requires"
    )
