"""The routing point: every compile and checkpoint_wrapper request passes through here.

``torch.compile(module)`` still returns an ``OptimizedModule`` and
``module.compile()`` still compiles in place; what changes is that the decision
is deferred to the first forward. By then ``fully_shard`` has usually run (the
common order is AC, then compile, then FSDP), so the boundaries are known. The
decision is re-made if the module tree under the target changes later.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch.nn as nn

from autoweave import _compat, _instances, _settings
from autoweave._failopen import AutoweaveError, FailedFrames, _strict, frames_fail_open, guard, warn_each
from autoweave._log import logger
from autoweave._state import run as _run
from autoweave.observe import counting, graph_breaks, report, summary
from autoweave.planning import learned_breaks, memory, planner, tree_changes
from autoweave.weave import apply


def _compile_function(*args: Any, **kwargs: Any) -> Any:
    """torch.compile for a function: autoweave's wrapper, if on, passes functions straight through."""
    import torch

    return torch.compile(*args, **kwargs)


# -- the deferred decision ----------------------------------------------------------------


class _RecompileLimitFilter(logging.Filter):
    """Turns dynamo's recompile-limit warning for a woven region into an autoweave warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if counting.RECOMPILE_LIMIT_NEEDLE in message and "autoweave_" in message:
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
        logging.getLogger(counting.RECOMPILE_LIMIT_LOGGER).addFilter(_RecompileLimitFilter())


def _fingerprint(target: nn.Module) -> tuple:
    from autoweave.planning.boundaries import MARK

    modules = list(target.named_modules())
    tree_changes.watch(m for _, m in modules)  # a registration into any of them moves the signal
    # A block measured holding more as pieces than eager SAC would is planned again (memory).
    return tuple((name, type(m), getattr(m, MARK, None), memory.hoist_reason(m)) for name, m in modules)


class _Dispatcher:
    """Stands in for a compiled forward until the first call, then runs the plan.

    The per-call cost does not grow with the model: the module tree is re-read
    only when ``_state.run.generation`` moved since the last look (a submodule was
    registered, ``fully_shard`` ran, a mark changed), so a call is an integer
    comparison and the call of what the plan installed.
    """

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
        self._generation = -1  # _state.run.generation when the tree was last read
        self._fingerprint: tuple | None = None
        self._applied: apply.Applied | None = None
        self._trial = False  # the woven regions have not run yet: their compile may still fail
        self.fell_back = False  # fullgraph=True met a break autoweave does not compile around: plain torch
        self._watch_first_call = False
        self._pending: planner.Plan | None = None
        self._called = False
        self.plan: planner.Plan | None = None
        self.outer: Callable[[], nn.Module | None] | None = None  # weakref to an enclosing AC wrapper
        self.skip_outer_checkpoint = False  # the enclosing wrapper's AC moved into the regions
        self._call_traced = True  # torch.compile(module) traces __call__; in-place compile does not
        # What a first-call fallback taught (modules that break, planning options): kept for re-plans.
        self._learned: dict[str, Any] = {}
        self.call = self._make_call()  # what torch's compiled forward slot holds: see _make_call
        _run.live.add(self)

    # How the dispatcher is put in place -------------------------------------------------

    @classmethod
    def attach_to_optimized(cls, optimized: nn.Module, compile_kwargs: dict[str, Any]) -> None:
        plain_forward = optimized.forward
        target = optimized._orig_mod
        dispatcher = cls(target, compile_kwargs, lambda: plain_forward, target.__call__)
        optimized.forward = dispatcher.call
        _instances.attach(optimized, dispatcher)
        # copy.deepcopy(optimized) rebuilds a plain OptimizedModule: weave the copy too.
        optimized.__dict__["__deepcopy__"] = _instances.CopyHook(optimized, _rebuild_copy)

    @classmethod
    def attach_in_place(
        cls, module: nn.Module, compile_kwargs: dict[str, Any], plain: Callable[..., Any]
    ) -> None:
        previous = _instances.dispatcher_of(module)
        if previous is not None:
            previous.release()  # compiled twice (pipeline stages do): one layer only
        dispatcher = cls(module, compile_kwargs, lambda: plain, module._call_impl)
        dispatcher._call_traced = False
        # nn.Module drops _compiled_call_impl when pickled or copied, so a copy
        # is what plain torch makes: an uncompiled module.
        module._compiled_call_impl = dispatcher.call
        _instances.attach(module, dispatcher)

    # The call path ----------------------------------------------------------------------

    @property
    def woven(self) -> bool:
        return self._applied is not None

    def ensure_decided(self) -> bool:
        """Plan (or re-plan, when the module tree changed) before running; True if it planned now."""
        if self._generation == _run.generation and self._pending is None:
            return False
        with self._lock:
            if self._pending is not None:
                self._apply_pending()
            generation = _run.generation
            if generation == self._generation:
                return False
            fingerprint = _fingerprint(self.target)
            self._generation = generation
            if fingerprint == self._fingerprint:
                return False
            self._decide(fingerprint)
            return True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call(*args, **kwargs)

    def _make_call(self) -> Callable[..., Any]:
        """The compiled forward as a plain function, closed over this dispatcher (``self.call``).

        What torch stores behind a compiled module (``OptimizedModule.forward``,
        ``module._compiled_call_impl``) is a function, and code that looks there
        goes by it: TorchScript skips a function it cannot script, but types any
        other object from ``nn.Module``'s annotation and fails. A closure costs no
        more per call than the dispatcher's own ``__call__``.
        """
        dispatcher = self

        def call(*args: Any, **kwargs: Any) -> Any:
            if not dispatcher.ensure_decided() and dispatcher._called and _run.summary_pending:
                summary.next_call(dispatcher)  # called again: every block has planned; log the one summary
            dispatcher._called = True
            if dispatcher._applied is not None:
                if dispatcher._trial:
                    return dispatcher._first_woven_call(args, kwargs)
                return dispatcher._eager(*args, **kwargs)
            plain = dispatcher._plain
            if plain is None:
                with dispatcher._lock:
                    if dispatcher._plain is None:
                        dispatcher._plain = dispatcher._make_plain()
                    plain = dispatcher._plain
            if not dispatcher._watch_first_call:
                return plain(*args, **kwargs)
            with dispatcher._lock:
                watching, dispatcher._watch_first_call = dispatcher._watch_first_call, False
            if not watching:
                return plain(*args, **kwargs)
            return dispatcher._watched(plain, args, kwargs)

        return call

    def _watched(self, call: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Run a first call listening for dynamo's AC fallback; on one, re-plan around the break."""
        with counting.FallbackCounter() as watch, learned_breaks.BreakWatch() as where:
            out = call(*args, **kwargs)
        if watch.count:
            self._on_hidden_fallback(where.stacks)
            report.on_woven_around(watch.count)
        return out

    def _first_woven_call(self, args: tuple, kwargs: dict) -> Any:
        """The woven regions compile now, in a call that runs once, whatever fails.

        Never again on another path: the forward's side effects, its RNG draws
        and, under FSDP, its collectives (on this rank only) would happen twice.
        A failure of autoweave's own degrades where it happens, in this call: a
        graph the backend fails on runs eager (``GraphGuard``), a frame dynamo
        cannot convert runs eager from then on (``frames_fail_open``), the rest
        stays compiled. An exception that still escapes is the model's own (a
        shape error, a raise in its forward: eager raised it, as plain torch
        would): it propagates untouched, and the next call is a first call again.

        Also the second safety net: a region compiled under a pushed-down
        checkpoint may still hold a break nobody located yet (a second one in
        the same block); dynamo's fallback message then re-plans around it too.
        """
        allowed = self._allowed_breaks()
        with frames_fail_open() as failed:
            try:
                if allowed is None:
                    out = self._watched(self._eager, args, kwargs)
                else:
                    with graph_breaks.recording_graph_breaks() as seen:
                        out = self._watched(self._eager, args, kwargs)
            except BaseException:
                failed.compile_again()  # dynamo skipped them on the model's error: compile them next call
                raise
        if allowed is not None:
            self._check_fullgraph(seen, allowed)
        if failed.errors:
            self._on_failed_frames(failed)
        self._trial = False
        return out

    def _on_failed_frames(self, failed: FailedFrames) -> None:
        """The first call ran, some frame eager in place of its compile: autoweave's failure, told once."""
        name = summary.name_of(self)
        for exc, code in failed.errors:
            logger.debug(
                "%s: dynamo could not compile %s", name, getattr(code, "co_name", "a frame"), exc_info=exc
            )
        if _strict():
            failed.compile_again()
            raise AutoweaveError(
                f"autoweave: dynamo could not compile {failed.describe()} of the woven regions of {name} "
                "at their first call"
            ) from failed.errors[0][0]
        warn_each(
            f"first-call:{id(self)}",
            f"[region-eager] dynamo could not compile {failed.describe()} of the woven regions of {name} "
            "at their first call; it runs eager from now on, the rest stays compiled. "
            "Set AUTOWEAVE_STRICT=1 to raise, AUTOWEAVE_LOG_LEVEL=debug for the traceback.",
        )

    def _allowed_breaks(self) -> set[str] | None:
        """Under ``fullgraph=True`` with a region that splits: the lines where a break is allowed.

        Those are the calls of the boundaries autoweave compiles around; None
        when nothing needs checking.
        """
        plan = self.plan
        if plan is None or not plan.fullgraph or not any(d.splits for d in plan.decisions):
            return None
        return {source.call for _, source in plan.sources if source.call}

    def _check_fullgraph(self, seen: list[Any], allowed: set[str]) -> None:
        """``fullgraph=True``: a break anywhere but at a boundary raises, as plain torch would."""
        unexpected = [site for site in seen if site.site not in allowed]
        if not unexpected:
            return
        with self._lock:
            plan = self.plan
            self.release()
            self.fell_back = True  # plain fullgraph compile from now on: it raises at every call
            if plan is not None:
                self.plan = plan.plain_instead("fullgraph=True and a graph break outside the boundaries")
                summary.record_plan(self, self.plan, plain_label=report.plain_label(self.target))
        first = unexpected[0]
        raise _compat.fullgraph_break(
            f"fullgraph=True: graph break at {first.site} ({first.reason or 'see TORCH_LOGS=graph_breaks'}); "
            "autoweave compiles around boundaries only"
            + (f" (here: {', '.join(sorted(allowed))})" if allowed else "")
        )

    def _mode_and_strategy(self) -> tuple[str, str]:
        """The weave mode and AC strategy for this target: ``set_mode`` first, then the settings."""
        return _settings.mode_and_strategy(self.target)

    def _decide(self, fingerprint: tuple) -> None:
        self.release()
        self.fell_back = False
        mode, strategy = self._mode_and_strategy()
        with guard(f"planning {type(self.target).__name__}") as failed:
            self._apply(self._plan(**{"mode": mode, "strategy": strategy, **self._learned}))
        if failed:
            self.plan = None
            self._applied = None
        # Compiled plain, but a checkpoint is traced: any graph break under it
        # (a boundary whose checkpoint hides in code, a data-dependent op, a
        # print) would make dynamo run it eager. Watch the first call for
        # dynamo's fallback message and weave around the break if it appears.
        self._watch_first_call = (
            self._applied is None
            and self.plan is not None
            and mode == "auto"
            and (
                bool(self.plan.boundaries)
                or planner.traces_checkpoint(self.target, call_traced=self._call_traced)
            )
        )
        self._fingerprint = fingerprint

    def _plan(self, **options: Any) -> planner.Plan:
        """The planner's answer for this target now: one call, whatever asks (first call or re-plan).

        ``options`` are the mode and strategy, and what a fallback taught
        (``breaks``, a forced mode/strategy); what this process learned since
        (other blocks' breaks) joins this block's own.
        """
        outer = self.outer() if self.outer is not None else None
        options["breaks"] = {**learned_breaks.known(self.target), **options.get("breaks", {})}
        options["measured"] = memory.known(self.target)
        return planner.plan(
            self.target,
            fullgraph=bool(self.compile_kwargs.get("fullgraph")),
            outer_ac=planner.checkpoint_spec(outer) if outer is not None else None,
            call_traced=self._call_traced,
            **options,
        )

    def _apply(self, plan: planner.Plan) -> None:
        self.plan = plan
        if plan.woven:
            _install_recompile_filter()
            self._applied = apply.apply_plan(
                planner.unwrap(self.target),
                plan,
                _compile_function,
                self.compile_kwargs,
                instrument=report.instrument,
            )
            self._trial = True
        self.skip_outer_checkpoint = plan.outer_push_down is not None and self._applied is not None
        logger.debug("%s: %s", plan.root_type, plan.headline())
        summary.record_plan(self, plan, plain_label=report.plain_label(self.target))

    def _on_hidden_fallback(self, stacks: list[tuple[str, list[Any]]]) -> None:
        with self._lock, guard(f"re-planning {type(self.target).__name__}"):
            target = planner.unwrap(self.target)
            located = learned_breaks.locate(target, stacks)
            spec = planner.checkpoint_spec(target)
            if not located and spec is not None:
                # No location from dynamo: the wrapped block breaks somewhere; hoist
                # (or push-down) around it still compiles all but the break.
                located = {
                    id(target._checkpoint_wrapped_module): "a graph break inside (dynamo gave no location)"
                }
            mode, strategy = self._mode_and_strategy()
            learned_breaks.learn(target, located)
            learned: dict[str, Any] = {"breaks": {**self._learned.get("breaks", {}), **located}}
            plan = self._plan(mode=mode, strategy=strategy, **learned)
            if not plan.woven:
                # The checkpoint is in code autoweave could not read (the target's
                # own forward): weave its children one by one, around that code.
                learned.update(mode="always", strategy="siblings")
                plan = self._plan(**learned)
            self._learned = learned
            logger.info(
                "%s: dynamo ran a checkpointed region eager at the first call (%s); woven from the next call on",
                summary.name_of(self),
                "; ".join(sorted(set(located.values()))) or "location unknown",
            )
            # Applied at the next call, not now: this call's backward will
            # recompute its checkpoints through the modules as they ran.
            self._pending = plan
        # Blocks running the same code met the same break, silently (the
        # fallback is cached for the wrapper's code): each re-plans at its next call.
        for other in list(_run.live):
            if other is not self:
                other._fingerprint = None
        tree_changes.bump()
        # That cached fallback also answers *other* modules sharing the code whose
        # guards it passes (a dense block behind the same CheckpointWrapper.forward
        # would run eager from then on): drop the cache of the code it was traced on.
        with guard("clearing dynamo's cached fallback"):
            _forget_traced_code(self.target)

    def _apply_pending(self) -> None:
        with self._lock, guard(f"weaving {type(self.target).__name__}") as failed:
            plan, self._pending = self._pending, None
            if plan is not None:
                self.release()
                self._apply(plan)
        if failed:
            self._applied = None

    def release(self) -> None:
        """Undo what the current plan installed (before a re-plan, or a fallback)."""
        with self._lock:
            if self._applied is not None:
                self._applied.revert()
                self._applied = None
            self._trial = False
            self.skip_outer_checkpoint = False


def _forget_traced_code(target: nn.Module) -> None:
    codes = set()
    for module in target.modules():
        for cls in type(module).__mro__:
            for name in ("forward", "__call__"):
                fn = cls.__dict__.get(name)
                code = getattr(fn, "__code__", None)
                if code is not None and fn is not nn.Module.__call__:
                    codes.add(code)
    for code in codes:
        _compat.reset_code(code)


def _rebuild_copy(original: nn.Module, duplicate: nn.Module) -> None:
    """``copy.deepcopy`` of a compiled module: the copy gets a dispatcher of its own."""
    dispatcher = _instances.dispatcher_of(original)
    if dispatcher is None or not hasattr(duplicate, "_orig_mod"):
        return
    with guard(f"weaving a copy of {type(dispatcher.target).__name__}"):
        _Dispatcher.attach_to_optimized(duplicate, dict(dispatcher.compile_kwargs))


def dispatcher_of(module: nn.Module) -> _Dispatcher | None:
    """The autoweave dispatcher behind ``torch.compile(module)`` or ``module.compile()``."""
    return _instances.dispatcher_of(module)


def set_mode(module: nn.Module, mode: str | None = None, *, strategy: str | None = None) -> nn.Module:
    """Per-module override of ``AUTOWEAVE_MODE`` / ``AUTOWEAVE_STRATEGY``; returns the module."""
    if mode is not None:
        _settings.check_choice("mode", mode, _settings.MODES)
    if strategy is not None:
        _settings.check_choice("strategy", strategy, _settings.STRATEGIES)
    target = planner.unwrap(module)
    for obj in {id(module): module, id(target): target}.values():
        if mode is not None:
            object.__setattr__(obj, _settings.MODE_ATTR, mode)
        if strategy is not None:
            object.__setattr__(obj, _settings.STRATEGY_ATTR, strategy)
    tree_changes.bump()
    return module


__all__ = [
    "dispatcher_of",
    "set_mode",
]
