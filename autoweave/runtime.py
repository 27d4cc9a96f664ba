"""The routing point: every compile and checkpoint_wrapper request passes through here.

``torch.compile(module)`` still returns an ``OptimizedModule`` and
``module.compile()`` still compiles in place; what changes is that the decision
is deferred to the first forward. By then ``fully_shard`` has usually run (the
common order is AC, then compile, then FSDP), so the boundaries are known. The
decision is re-made if the module tree under the target changes later.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.nn as nn

from autoweave import _bootstrap, capture, plan_log, planner, report, weave
from autoweave._failopen import guard
from autoweave._log import logger

_off: contextvars.ContextVar[bool] = contextvars.ContextVar("autoweave_off", default=False)
MODE_ATTR = "_autoweave_mode"
STRATEGY_ATTR = "_autoweave_strategy"


@contextmanager
def disabled() -> Iterator[None]:
    """Compile requests made inside this block go to plain torch."""
    token = _off.set(True)
    try:
        yield
    finally:
        _off.reset(token)


def _original(name: str) -> Any:
    from autoweave import patches

    return patches.original(name)


# -- routing ------------------------------------------------------------------------------


def route_compile(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``torch.compile(...)``: weave-aware for modules, untouched for everything else."""
    model = args[0] if args else kwargs.get("model")
    if _off.get() or not isinstance(model, nn.Module):
        # Functions, and the decorator form (model=None), which re-enters
        # torch.compile with the function it decorates.
        return wrapped(*args, **kwargs)
    compiled = wrapped(*args, **report.plain_kwargs(model, kwargs))
    with guard(f"preparing the weave for {type(model).__name__}") as failed:
        _Dispatcher.attach_to_optimized(compiled, _compile_kwargs(args[1:], kwargs))
    if failed:
        return wrapped(*args, **kwargs)
    return compiled


def route_module_compile(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``module.compile(...)`` in place."""
    if _off.get() or not isinstance(instance, nn.Module):
        return wrapped(*args, **kwargs)
    with guard(f"preparing the weave for {type(instance).__name__}") as failed:
        _Dispatcher.attach_in_place(instance, _compile_kwargs(args, kwargs))
    if failed:
        return wrapped(*args, **kwargs)
    return None


def route_checkpoint_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``checkpoint_wrapper(...)``: plain result; a compiled target is re-planned under the new AC."""
    wrapper = wrapped(*args, **kwargs)
    if _off.get():
        return wrapper
    target = args[0] if args else kwargs.get("module")
    dispatcher = getattr(target, "_autoweave_dispatcher", None) if target is not None else None
    if dispatcher is not None:
        with guard("watching the AC around a compiled module"):
            _gate_outer_ac(dispatcher, wrapper)
    return wrapper


def _gate_outer_ac(dispatcher: _Dispatcher, wrapper: nn.Module) -> None:
    """checkpoint_wrapper(torch.compile(block)): decide before the checkpoint starts.

    Plain torch copes with full AC outside the compile; a selective policy must
    move inside the compiled regions (planner.plan's ``outer_ac``). That is known
    only at the first call, and by the time the compiled block runs, the eager
    checkpoint has begun: so the wrapper's forward asks the dispatcher first and
    skips its own checkpoint when the plan moved it inside.
    """
    dispatcher.outer = weakref.ref(wrapper)
    wrapper_forward = type(wrapper).forward
    inner = wrapper._checkpoint_wrapped_module

    def forward(*args: Any, **kwargs: Any) -> Any:
        dispatcher.ensure_decided()
        plan = dispatcher.plan
        if plan is not None and plan.outer_push_down is not None and dispatcher.woven:
            return inner(*args, **kwargs)
        return wrapper_forward(wrapper, *args, **kwargs)

    wrapper.__dict__["forward"] = forward


def _compile_kwargs(args: tuple, kwargs: dict) -> dict[str, Any]:
    # torch.compile's options are keyword-only after ``model``; keep any
    # positional extras out of the region calls rather than guess their names.
    out = {k: v for k, v in kwargs.items() if k != "model"}
    if args:
        logger.debug("ignoring positional compile arguments %r", args)
    return out


# -- the deferred decision ----------------------------------------------------------------


class _RecompileLimitFilter(logging.Filter):
    """Turns dynamo's recompile-limit warning for a woven region into an autoweave warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if capture.RECOMPILE_LIMIT_NEEDLE in message and "autoweave_" in message:
            logger.warning(
                "a woven region hit dynamo's recompile limit and now runs eager: %s",
                message.splitlines()[1].strip() if "\n" in message else message,
            )
        return True


_recompile_filter_installed = False


def _install_recompile_filter() -> None:
    global _recompile_filter_installed
    if not _recompile_filter_installed:
        _recompile_filter_installed = True
        logging.getLogger(capture.RECOMPILE_LIMIT_LOGGER).addFilter(_RecompileLimitFilter())


def _fingerprint(target: nn.Module) -> tuple:
    from autoweave.boundaries import MARK

    return tuple((name, type(m), getattr(m, MARK, None)) for name, m in target.named_modules())


class _Dispatcher:
    """Stands in for a compiled forward until the first call, then runs the plan."""

    def __init__(
        self,
        target: nn.Module,
        compile_kwargs: dict[str, Any],
        plain: Callable[[], Callable[..., Any]],
        eager: Callable[..., Any],
    ) -> None:
        self.target = target  # the module handed to compile (an AC wrapper, a block)
        self.compile_kwargs = compile_kwargs
        self._make_plain = plain
        self._plain: Callable[..., Any] | None = None
        self._eager = eager
        self._lock = threading.RLock()
        self._fingerprint: tuple | None = None
        self._applied: weave.Applied | None = None
        self._watch_first_call = False
        self._pending: planner.Plan | None = None
        self._called = False
        self.plan: planner.Plan | None = None
        self.outer: Callable[[], nn.Module | None] | None = None  # weakref to an enclosing AC wrapper

    # How the dispatcher is put in place -------------------------------------------------

    @classmethod
    def attach_to_optimized(cls, optimized: nn.Module, compile_kwargs: dict[str, Any]) -> None:
        plain_forward = optimized.forward
        target = optimized._orig_mod
        dispatcher = cls(target, compile_kwargs, lambda: plain_forward, target.__call__)
        optimized.forward = dispatcher
        object.__setattr__(optimized, "_autoweave_dispatcher", dispatcher)

    @classmethod
    def attach_in_place(cls, module: nn.Module, compile_kwargs: dict[str, Any]) -> None:
        previous = module.__dict__.get("_autoweave_dispatcher")
        if previous is not None:
            previous.release()  # compiled twice (pipeline stages do): one layer only
        compile_fn = _original("compile")

        def plain() -> Callable[..., Any]:
            # Exactly what nn.Module.compile does.
            return compile_fn(module._call_impl, **report.plain_kwargs(module, compile_kwargs))

        dispatcher = cls(module, compile_kwargs, plain, module._call_impl)
        module._compiled_call_impl = dispatcher
        object.__setattr__(module, "_autoweave_dispatcher", dispatcher)

    # The call path ----------------------------------------------------------------------

    @property
    def woven(self) -> bool:
        return self._applied is not None

    def ensure_decided(self) -> bool:
        """Plan (or re-plan, when the module tree changed) before running; True if it planned now."""
        if self._pending is not None:
            self._apply_pending()
        if self._fingerprint is None or _fingerprint(self.target) != self._fingerprint:
            self._decide()
            return True
        return False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.ensure_decided() and self._called and plan_log.pending:
            plan_log.next_call(self)  # called again: every block has planned; log the one summary
        self._called = True
        if self._applied is not None:
            return self._eager(*args, **kwargs)
        if self._plain is None:
            self._plain = self._make_plain()
        if not self._watch_first_call:
            return self._plain(*args, **kwargs)
        self._watch_first_call = False
        with capture.FallbackCounter() as watch:
            out = self._plain(*args, **kwargs)
        if watch.count:
            self._on_hidden_fallback(watch.messages)
        return out

    def _decide(self) -> None:
        with self._lock:
            fingerprint = _fingerprint(self.target)
            if fingerprint == self._fingerprint:
                return  # another thread decided while we waited
            self.release()
            settings = _bootstrap.settings()
            mode = getattr(self.target, MODE_ATTR, None) or settings.mode
            strategy = getattr(self.target, STRATEGY_ATTR, None) or settings.strategy
            with guard(f"planning {type(self.target).__name__}") as failed:
                outer = self.outer() if self.outer is not None else None
                plan = planner.plan(
                    self.target,
                    mode=mode,
                    strategy=strategy,
                    fullgraph=bool(self.compile_kwargs.get("fullgraph")),
                    outer_ac=planner.checkpoint_spec(outer) if outer is not None else None,
                )
                self._apply(plan)
            if failed:
                self.plan = None
                self._applied = None
            # A boundary inside that plain torch copes with, unless a checkpoint
            # hides in the forward's code: watch the first plain call for dynamo's
            # fallback message and weave if it appears.
            self._watch_first_call = (
                self._applied is None
                and self.plan is not None
                and bool(self.plan.boundaries)
                and mode == "auto"
            )
            self._fingerprint = fingerprint

    def _apply(self, plan: planner.Plan) -> None:
        self.plan = plan
        if plan.woven:
            _install_recompile_filter()
            self._applied = weave.apply_plan(
                planner.unwrap(self.target), plan, _original("compile"), self.compile_kwargs
            )
        logger.debug("%s", plan.summary())
        plan_log.record_plan(self, plan)

    def _on_hidden_fallback(self, hits: list[str]) -> None:
        with self._lock, guard(f"re-planning {type(self.target).__name__}"):
            logger.info(
                "%s: dynamo fell back to eager on a checkpoint inside its forward; "
                "weaving its children from the next call on",
                type(self.target).__name__,
            )
            # Applied at the next call, not now: this call's backward will
            # recompute its checkpoints through the modules as they ran.
            self._pending = planner.plan(
                self.target,
                mode="always",
                strategy="siblings",
                fullgraph=bool(self.compile_kwargs.get("fullgraph")),
            )

    def _apply_pending(self) -> None:
        with self._lock, guard(f"weaving {type(self.target).__name__}") as failed:
            plan, self._pending = self._pending, None
            if plan is not None:
                self.release()
                self._apply(plan)
        if failed:
            self._applied = None

    def release(self) -> None:
        """Undo what the current plan installed (before a re-plan)."""
        with self._lock:
            if self._applied is not None:
                self._applied.revert()
                self._applied = None


def dispatcher_of(module: nn.Module) -> _Dispatcher | None:
    """The autoweave dispatcher behind ``torch.compile(module)`` or ``module.compile()``."""
    return module.__dict__.get("_autoweave_dispatcher")


def set_mode(module: nn.Module, mode: str | None = None, *, strategy: str | None = None) -> nn.Module:
    """Per-module override of ``AUTOWEAVE_MODE`` / ``AUTOWEAVE_STRATEGY``; returns the module."""
    if mode is not None and mode not in planner.MODES:
        raise ValueError(f"mode={mode!r} not understood (accepted: {', '.join(planner.MODES)})")
    if strategy is not None and strategy not in planner.STRATEGIES:
        raise ValueError(f"strategy={strategy!r} not understood (accepted: {', '.join(planner.STRATEGIES)})")
    target = planner.unwrap(module)
    for obj in {id(module): module, id(target): target}.values():
        if mode is not None:
            object.__setattr__(obj, MODE_ATTR, mode)
        if strategy is not None:
            object.__setattr__(obj, STRATEGY_ATTR, strategy)
    return module


# The plan summary at exit (when no second step logged it) and, with
# AUTOWEAVE_REPORT, the report: this module loads when the patches do.
report.install(_bootstrap.settings())

__all__ = [
    "disabled",
    "dispatcher_of",
    "route_checkpoint_wrapper",
    "route_compile",
    "route_module_compile",
    "set_mode",
]
