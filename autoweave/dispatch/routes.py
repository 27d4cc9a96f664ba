"""The routing point: every compile and checkpoint_wrapper request passes through here.

``torch.compile(module)`` still returns an ``OptimizedModule`` and
``module.compile()`` still compiles in place; what changes is that a dispatcher
(``dispatchers``) is attached, which defers the decision to the first forward.
Functions, the decorator form and anything inside ``disabled()`` go to torch
untouched.
"""

from __future__ import annotations

import contextvars
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import torch.nn as nn

from autoweave import _compat, _events, _installs, _instances
from autoweave._failopen import guard
from autoweave._log import logger
from autoweave.dispatch.dispatchers import State, _compile_function, _Dispatcher
from autoweave.weave import keep_checkpoint

_off: contextvars.ContextVar[bool] = contextvars.ContextVar("autoweave_off", default=False)


@contextmanager
def disabled() -> Iterator[None]:
    """Compile requests made inside this block go to plain torch."""
    token = _off.set(True)
    try:
        yield
    finally:
        _off.reset(token)


# -- routing ------------------------------------------------------------------------------


def route_compile(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``torch.compile(...)``: weave-aware for modules, untouched for everything else."""
    model = args[0] if args else kwargs.get("model")
    if _off.get() or not isinstance(model, nn.Module) or kwargs.get("disable"):
        # Functions, the decorator form (model=None), which re-enters
        # torch.compile with the function it decorates, and compiles the user
        # switched off: exactly torch's.
        return wrapped(*args, **kwargs)
    _make_decorated_checkpoints_traceable(model)
    # torch's own compile first, outside any guard: what it rejects (a bad
    # backend, conflicting options) raises here, with torch's error, as without us.
    compiled = wrapped(*args, **kwargs)
    if _events.listened(_events.PLAIN_COMPILED):  # the report counts the plain compile's graphs
        _events.publish(_events.PLAIN_COMPILED, model, compiled)
    with guard(f"preparing the weave for {type(model).__name__}") as failed:
        _Dispatcher.attach_to_optimized(compiled, _compile_kwargs(args[1:], kwargs))
    if failed:
        return wrapped(*args, **kwargs)
    return compiled


def route_module_compile(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``module.compile(...)`` in place."""
    if _off.get() or not isinstance(instance, nn.Module) or kwargs.get("disable"):
        return wrapped(*args, **kwargs)
    compile_kwargs = _compile_kwargs(args, kwargs)
    _make_decorated_checkpoints_traceable(instance)
    # What nn.Module.compile does, done now and outside any guard: torch's
    # errors (a bad backend, conflicting options) raise at .compile(), as without us.
    plain = _compile_function(_compat.modules.call_impl(instance), **compile_kwargs)
    if _events.listened(_events.PLAIN_COMPILED):
        _events.publish(_events.PLAIN_COMPILED, instance, plain)
    with guard(f"preparing the weave for {type(instance).__name__}") as failed:
        dispatcher = _Dispatcher.attach_in_place(instance, compile_kwargs, plain)
        if (wrapper := _wrapper_of(instance)) is not None:
            # The block inside a checkpoint wrapper, compiled in place after the
            # wrapper was built (NeMo Automodel's per-layer compile): the same AC
            # outside the compile as checkpoint_wrapper(torch.compile(block)).
            _gate_outer_ac(dispatcher, wrapper)
    if failed:
        _compat.modules.set_compiled_call(instance, plain)
    return None


def _make_decorated_checkpoints_traceable(model: nn.Module) -> None:
    # torch 2.15's @checkpoint on a forward: compiled as written it fails in backward
    # (see weave.keep_checkpoint); the call form compiles, with the same options.
    with guard(f"making {type(model).__name__}'s decorated checkpoints traceable"):
        keep_checkpoint.make_traceable(model)


def route_checkpoint_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``checkpoint_wrapper(...)``: plain result; a compiled target is re-planned under the new AC."""
    wrapper = wrapped(*args, **kwargs)
    if _off.get():
        return wrapper
    target = args[0] if args else kwargs.get("module")
    dispatcher = _instances.dispatcher_of(target) if isinstance(target, nn.Module) else None
    if dispatcher is not None:
        with guard("watching the AC around a compiled module"):
            _gate_outer_ac(dispatcher, wrapper)
    elif isinstance(target, nn.Module) and isinstance(wrapper, nn.Module):
        with suppress(TypeError):
            _wrappers[target] = weakref.ref(wrapper)  # if the block is compiled in place later
    return wrapper


# Blocks (held weakly) -> the checkpoint wrapper built around them, for a later in-place compile.
_wrappers: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def _wrapper_of(block: nn.Module) -> nn.Module | None:
    """The checkpoint wrapper that still wraps ``block`` (None: none, or it was unwrapped since)."""
    ref = _wrappers.get(block)
    wrapper = ref() if ref is not None else None
    children = _compat.modules.children_of(wrapper) if wrapper is not None else {}
    return wrapper if children.get(_compat.modules.CHECKPOINT_WRAPPED) is block else None


def _gate_outer_ac(dispatcher: _Dispatcher, wrapper: nn.Module) -> None:
    """checkpoint_wrapper(torch.compile(block)): decide before the checkpoint starts.

    Plain torch copes with full AC outside the compile; a selective policy must
    move inside the compiled regions (planner.plan's ``outer_ac``). That is known
    only at the first call, and by the time the compiled block runs, the eager
    checkpoint has begun: so the wrapper's forward asks the dispatcher first and
    skips its own checkpoint when the plan moved it inside.

    The gate is an install (``_installs``): ``autoweave.disable()`` removes the
    gate of every wrapper whose block has not woven, so that wrapper is what
    plain torch built; a woven block keeps its gate (its plan may have moved the
    wrapper's checkpoint inside, and reverting a weave would recompile mid-training).
    """
    dispatcher.set_outer(wrapper)
    wrapper_ref = weakref.ref(wrapper)
    wrapper_forward = type(wrapper).forward

    def gate(*args: Any, **kwargs: Any) -> Any:
        wrapper = wrapper_ref()
        dispatcher.ensure_decided()
        if dispatcher.skip_outer_checkpoint:
            return _compat.modules.checkpoint_wrapped(wrapper)(*args, **kwargs)
        return wrapper_forward(wrapper, *args, **kwargs)

    # An outer compile over the wrapper traces the wrapper's own forward, as plain torch
    # would, never the gate (see ``_compat.dynamo.outside_dynamo``). That stand-in holds the
    # wrapper, so ``_gates`` holds the gate weakly: its values must not keep a key alive.
    forward = _compat.dynamo.outside_dynamo(gate, traced_as=wrapper_forward.__get__(wrapper))
    previous = _instances.install_forward(wrapper, forward)
    with _gates_lock:
        _gates[wrapper] = (dispatcher, weakref.ref(forward), previous)
    _installs.install("gates on checkpoint wrappers around compiled blocks", lambda: _ungate_unwoven)


# Every gated wrapper (held weakly) -> (its block's dispatcher, the gate (weakly), the forward it replaced).
_gates: weakref.WeakKeyDictionary[nn.Module, tuple[_Dispatcher, Any, Any]] = weakref.WeakKeyDictionary()
_gates_lock = threading.Lock()


def _ungate_unwoven() -> None:
    """The undo of the gates: each wrapper whose block has not woven is plain torch's again."""
    with _gates_lock:
        gated = list(_gates.items())
        _gates.clear()
    for wrapper, (dispatcher, gate_ref, previous) in gated:
        gate = gate_ref()
        if (
            dispatcher.woven
            or dispatcher.state is State.LEARNED
            or gate is None
            or wrapper.__dict__.get("forward") is not gate
        ):
            continue  # woven (or about to be): keeps its gate; someone else's forward on top: theirs stays
        dispatcher.set_outer(None)  # planned from now on without a gate to skip the wrapper's AC
        _instances.restore_forward(wrapper, previous)


def _compile_kwargs(args: tuple, kwargs: dict) -> dict[str, Any]:
    # torch.compile's options are keyword-only after ``model``; keep any
    # positional extras out of the region calls rather than guess their names.
    if args:
        logger.debug("ignoring positional compile arguments %r", args)
    return {k: v for k, v in kwargs.items() if k != "model"}
