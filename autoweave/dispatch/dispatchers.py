"""The dispatcher behind each compiled module: a state machine that plans at the first forward.

``dispatch.routes`` attaches one to every module handed to ``torch.compile`` or
``module.compile()``; torch's compiled forward slot then holds the dispatcher's
``call``. At the first forward (and again when the module tree under it
changed) the dispatcher asks the planner for a plan, has ``weave.apply``
install it, and runs it: plain torch.compile, or the woven regions. Its life is
one ``State``, every move checked against ``_TRANSITIONS``: a move the table
forbids is refused in every mode (strict mode raises; otherwise one
``[internal-error]`` warning and the module runs plain torch.compile).

The machine only moves: each move, plan and fallback is published
(``autoweave._events``) and the observers (the plan summary, the report, the
structured trace) subscribe; nothing here calls them to notify.

The flow, one hop a line, from the user's compile to the report:

1. ``import torch`` runs ``startup.on_import``: ``dispatch.patches.apply_torch`` wraps
   ``torch.compile`` and ``nn.Module.compile``; ``observe.report_exit.install`` subscribes.
2. ``torch.compile(module)`` reaches ``dispatch.routes.route_compile`` (``module.compile()``:
   ``route_module_compile``), which attaches a ``_Dispatcher`` (``attach_to_optimized`` /
   ``attach_in_place``): torch's compiled forward slot now holds its ``call`` (``_make_call``).
3. The first forward: ``call`` -> ``ensure_decided`` -> ``_decide`` fingerprints the tree and
   asks the pure planner for a ``Plan`` (``request`` -> ``dispatch.plan_inputs.plan`` ->
   ``planning.planner.plan``).
4. ``_apply`` installs it (``weave.apply.apply_plan``: regions, their backends, pieces) and
   enters TRIAL, or PLAIN (then ``_watched`` runs plain torch.compile's first call).
5. ``_first_woven_call`` (``dispatch.first_call``) runs the regions' first call once, watching
   dynamo's fallback (``_watched``; ranks agree through ``dispatch.plan_inputs``), and enters WOVEN.
6. A fallback seen there re-plans (``_on_hidden_fallback``: LEARNED, applied at the next call).
7. Each move is an ``_events`` topic: ``observe.summary`` logs the plan summary at the next
   step, ``observe.report`` keeps the report, ``observe.trace`` writes
   TORCH_TRACE; ``observe.report_exit`` writes and summarises the report at exit.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

import torch
import torch.nn as nn

from autoweave import _compat, _events, _instances, _settings
from autoweave._failopen import (
    AutoweaveError,
    guard,
    swallowed,
    warn_each,
)
from autoweave._log import logger
from autoweave._state import run as _run
from autoweave.dispatch import plan_inputs
from autoweave.dispatch.first_call import FirstCall
from autoweave.dispatch.states import _RUNS_REGIONS, _TRANSITIONS, State, Why
from autoweave.planning import boundaries, kinds, planner
from autoweave.planning.learned import hoist_reason
from autoweave.sense import counting, names
from autoweave.weave import apply


def _compile_function(*args: Any, **kwargs: Any) -> Any:
    """torch.compile for a function: autoweave's wrapper, if on, passes functions straight through."""
    return torch.compile(*args, **kwargs)


# -- the deferred decision ----------------------------------------------------------------


def _fingerprint(target: nn.Module) -> tuple:
    modules = list(target.named_modules())
    boundaries.watch(m for _, m in modules)  # a registration into any of them moves the signal
    # A block measured holding more as pieces than eager SAC would is planned again (memory);
    # one whose hooks changed too: dynamo never sees a hook added after it traced (tree_watch).
    return tuple(
        (name, type(m), getattr(m, boundaries.MARK, None), hoist_reason(m), kinds.hooks_key(m))
        for name, m in modules
    )


class _Dispatcher(FirstCall):
    """Stands in for a compiled forward until the first call, then runs the plan.

    Its life is one ``State``; ``_enter`` is the only writer of ``state`` and
    runs under ``_lock``, checking the move against ``_TRANSITIONS``. The call
    path reads ``state`` once per call without the lock (one attribute read)
    and acts on what it read; anything that changes the state takes the lock
    and looks again.

    The per-call cost does not grow with the model: the module tree is re-read
    only when ``_state.run.generation`` moved since the last look (a submodule was
    registered, ``fully_shard`` ran, a mark changed), so a call is an integer
    comparison and the call of what the plan installed.
    """

    def __init__(
        self,
        target: nn.Module,
        compile_kwargs: dict[str, Any],
        plain: Callable[..., Any],
        eager: Callable[..., Any],
    ) -> None:
        self.target = target  # the module handed to compile (an AC wrapper, a block)
        # What compile returned (an OptimizedModule that fully_shard may wrap, or the target):
        # the ranks its parameters are sharded over are those that agree (``agreement``).
        self.holder: Callable[[], nn.Module | None] = weakref.ref(target)
        self.compile_kwargs = compile_kwargs
        self.state = State.UNPLANNED
        self.history: list[tuple[State, Why]] = []  # each move, for the debug log and tests
        self.plan: planner.Plan | None = None  # what runs (PLAIN/WATCHING/TRIAL/WOVEN/GIVEN_UP)
        self._pending: planner.Plan | None = None  # LEARNED: the plan for the next call
        self._applied: apply.Applied | None = None  # TRIAL/WOVEN: what the plan installed
        self._plain = plain  # what plain torch.compile made of the target
        self._eager = eager
        self._lock = threading.RLock()
        self._generation = -1  # _state.run.generation when the tree was last read
        self._fingerprint: tuple | None = None
        self._called = False
        self._converting = 0  # consecutive woven calls in which dynamo made a cache entry (the watchdog)
        self._outer: Callable[[], nn.Module | None] | None = None  # weakref to an enclosing AC wrapper
        self.skip_outer_checkpoint = False  # the enclosing wrapper's AC moved into the regions
        self._call_traced = True  # torch.compile(module) traces __call__; in-place compile does not
        # What a first-call fallback taught (modules that break, planning options): kept for re-plans.
        self._learned: dict[str, Any] = {}
        self._observed: set[str] = set()  # "_eager"/"_plain" while an observer waits on it
        self.call = self._make_call()  # what torch's compiled forward slot holds: see _make_call
        _run.live.add(self)

    def _enter(self, state: State, why: Why) -> None:
        """Move to ``state`` for ``why``: the one place the state changes (holding ``_lock``).

        A move ``_TRANSITIONS`` does not allow, or into a state that runs
        regions while none are installed, is refused: it is autoweave's own
        error, and a module must never run uncompiled for it (WOVEN without
        regions runs the forward eager, silently). Strict mode raises
        ``AutoweaveError`` and nothing moves; otherwise one ``[internal-error]``
        warning and the module runs what plain torch.compile makes of it.
        """
        with self._lock:
            if state not in _TRANSITIONS[self.state]:
                self._refuse(state, why, "its state machine does not allow that move")
            elif state in _RUNS_REGIONS and self._applied is None:
                self._refuse(state, why, "no compiled regions are installed")
            else:
                self._move(state, why)

    def _move(self, state: State, why: Why) -> None:
        logger.debug("%s: %s -> %s: %s", type(self.target).__name__, self.state.value, state.value, why.value)
        self.state = state
        self.history.append((state, why))
        _events.publish(_events.MOVED, self, state.value, why.value)

    def _refuse(self, state: State, why: Why, reason: str) -> None:
        move = f"{self.state.value} -> {state.value} ({why.value})"
        message = (
            f"the dispatcher of {type(self.target).__name__} refused the move {move}: {reason}; "
            "the module runs as plain torch.compile would"
        )
        # Strict mode raises here, before anything changed.
        swallowed("internal-error", "internal-error", message, AutoweaveError(f"autoweave: {message}"))
        self._release()
        if self.plan is not None and self.plan.woven:
            self.plan = self.plan.plain_instead(f"autoweave refused the move {move}")
            _events.publish(_events.PLANNED, self, self.plan)
        self._move(State.PLAIN, Why.REFUSED)

    def observe_next_call(self, before: Callable[[], Callable[[Any], None] | None], *, skip: int = 0) -> None:
        """Offer the next call of what runs now (plain or woven) to an observer, once.

        After ``skip`` calls, ``before()`` runs just before a call of the
        forward (not dynamo tracing it, not a checkpoint recomputing it) and
        returns ``None`` to pass (the next call is offered again) or
        ``after(out)``, called with that call's output; then observing ends and
        later calls cost nothing. Nothing else about the call changes. One
        observer at a time; in any other state than PLAIN or WOVEN, none.
        """
        with self._lock:
            attr = {State.WOVEN: "_eager", State.PLAIN: "_plain"}.get(self.state)
            if attr is None or attr in self._observed:
                return
            call = getattr(self, attr)
            left = [skip]

            def observed(*args: Any, **kwargs: Any) -> Any:
                after = None
                if (
                    self.__dict__.get(attr) is observed
                    and not torch.compiler.is_compiling()
                    and not _compat.checkpoints.in_backward()  # a checkpoint's recompute: not a call of the forward
                ):
                    if left[0] > 0:
                        left[0] -= 1
                    else:
                        after = before()
                        if after is not None:  # one call: a recompute inside runs what ran before
                            with self._lock:
                                setattr(self, attr, call)
                                self._observed.discard(attr)
                out = call(*args, **kwargs)
                if after is not None:
                    after(out)
                return out

            setattr(self, attr, observed)
            self._observed.add(attr)

    # How the dispatcher is put in place -------------------------------------------------

    @classmethod
    def attach_to_optimized(cls, optimized: nn.Module, compile_kwargs: dict[str, Any]) -> None:
        target = _compat.modules.compiled_inner(optimized)
        dispatcher = cls(target, compile_kwargs, optimized.forward, target.__call__)
        dispatcher.holder = weakref.ref(optimized)
        optimized.forward = dispatcher.call
        _instances.attach(optimized, dispatcher)
        # copy.deepcopy(optimized) rebuilds a plain OptimizedModule: weave the copy too.
        optimized.__dict__["__deepcopy__"] = _instances.CopyHook(optimized, _rebuild_copy)

    @classmethod
    def attach_in_place(
        cls, module: nn.Module, compile_kwargs: dict[str, Any], plain: Callable[..., Any]
    ) -> _Dispatcher:
        previous = _instances.dispatcher_of(module)
        if previous is not None:
            previous.retire()  # compiled twice (pipeline stages do): one layer only
        dispatcher = cls(module, compile_kwargs, plain, _compat.modules.call_impl(module))
        dispatcher._call_traced = False
        # nn.Module drops _compiled_call_impl when pickled or copied, so a copy
        # is what plain torch makes: an uncompiled module.
        _compat.modules.set_compiled_call(module, dispatcher.call)
        _instances.attach(module, dispatcher)
        return dispatcher

    # The call path ----------------------------------------------------------------------

    @property
    def woven(self) -> bool:
        return self._applied is not None

    def ensure_decided(self) -> bool:
        """Plan (or re-plan, when the module tree changed) before running; True if it planned now."""
        if self._generation == _run.generation and self.state is not State.LEARNED:
            return False
        with self._lock:
            if self.state is State.LEARNED:
                self._apply_learned()
            generation = _run.generation
            if generation == self._generation:
                return False
            fingerprint = _fingerprint(self.target)
            self._generation = generation
            if fingerprint == self._fingerprint:
                return False
            self._decide(fingerprint)
            return True

    def read_tree_again(self) -> None:
        """Plan again at the next call, as if the tree had changed (a block sharing its code learned a break)."""
        with self._lock:
            self._fingerprint = None

    def set_outer(self, wrapper: nn.Module | None) -> None:
        """The AC wrapper around the compiled module whose checkpoint a plan may move inside (None: none)."""
        with self._lock:
            self._outer = weakref.ref(wrapper) if wrapper is not None else None

    @property
    def outer(self) -> nn.Module | None:
        """The wrapper ``set_outer`` named (None: none, or it was freed)."""
        return self._outer() if self._outer is not None else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call(*args, **kwargs)

    def _make_call(self) -> Callable[..., Any]:
        """The compiled forward as a plain function, closed over this dispatcher (``self.call``).

        What torch stores behind a compiled module (``OptimizedModule.forward``,
        ``module._compiled_call_impl``) is a function, and code that looks there
        goes by it: TorchScript skips a function it cannot script, but types any
        other object from ``nn.Module``'s annotation and fails. A closure costs no
        more per call than the dispatcher's own ``__call__``; the wrapper that keeps
        dynamo out of it (``_compat.dynamo.outside_dynamo``) reads the eval-frame callback
        and, called from eager code, swaps nothing.
        """

        def call(*args: Any, **kwargs: Any) -> Any:
            if not self.ensure_decided() and self._called and _run.summary_pending:
                # Called again: every block has planned; the plan summary is logged now.
                _events.publish(_events.CALLED_AGAIN, self)
            self._called = True
            state = self.state
            if state is State.WOVEN:
                return self._woven_call(args, kwargs)
            if state is State.TRIAL:
                return self._first_woven_call(args, kwargs)
            if state is State.WATCHING:
                with self._lock:
                    watching = self.state is State.WATCHING
                    if watching:  # one call is watched, whichever thread gets here first
                        self._enter(State.PLAIN, Why.WATCHED)
                if watching:
                    return self._watched(self._plain, args, kwargs)
            if _run.codes_reset and _compat.dynamo.fails_on_recompile():
                # Plain torch holds the entries autoweave reset with a learned fallback: under
                # ``fail_on_recompile`` a frame they would have fitted runs eager, not raise
                # (fuzzer seed 39455: every block's ``__call__`` reset at step 0, compiled
                # again for one block at step 2, then refused for the next).
                with _compat.dynamo.recompiles_run_eager():
                    return self._plain(*args, **kwargs)
            return self._plain(*args, **kwargs)

        # Under an outer compile (the whole model over compiled blocks) dynamo sees what
        # plain torch.compile made, and never traces or converts the dispatcher's frames.
        return _compat.dynamo.outside_dynamo(call, traced_as=self._plain)

    def _woven_call(self, args: tuple, kwargs: dict) -> Any:
        """A call of the woven regions, watched for the steady state (the watchdog).

        After warm-up a woven module compiles nothing plain torch would not. One that still
        makes dynamo make a cache entry at each of ``STORM_CALLS`` calls in a row (an int
        attribute bumped per call, a hook appending to a list: a new guard value each time) would
        recompile up to the limit, step after step: it is settled into plain torch.compile's
        behaviour, with one warning naming it. A call in which one of its woven regions settled
        its own storm (``_compat.regions.lookups_in_order``: finer, its blocks eager under their
        checkpoints, as plain torch runs them) does not count (fuzzer seed 18560: settled here
        instead, plain torch.compile's frames compiled again after warm-up). Settled at the
        entry of a later forward, never between a forward and its recompute (which must run
        what the forward ran), as a re-plan is (``_on_hidden_fallback``).
        """
        # Not under ``fail_on_recompile``: plain torch.compile's frames, converted again once
        # settled, would raise there, and no woven region compiles under it (a call none of its
        # graphs fits runs eager), so the storm is over (fuzzer seed 8129).
        if (
            self._converting >= _compat.regions.STORM_CALLS
            and not _compat.checkpoints.in_backward()
            and not _compat.dynamo.fails_on_recompile()
        ):
            self._settle()
            return self.call(*args, **kwargs)
        before, settled = _compat.dynamo.entries_made(), _compat.regions.regions_settled()
        out = self._eager(*args, **kwargs)
        if not _compat.checkpoints.in_backward():  # a recompute is not a call of the forward
            made = _compat.dynamo.entries_made() != before
            # A storm a woven region settled in this call (into its blocks eager under their
            # checkpoints, as plain torch runs them) is over: not the module's to settle.
            made = made and _compat.regions.regions_settled() == settled
            self._converting = self._converting + 1 if made else 0
        return out

    def _settle(self) -> None:
        """The steady-state watchdog fired: plain torch.compile from the next call on."""
        with self._lock:
            if self.state is not State.WOVEN:
                return
            plan, why = self.plan, Why.STEADY_STATE
            self._release()
            self.plan = None if plan is None else plan.plain_instead(why.value)
            self._enter(State.PLAIN, why)
            _events.publish(_events.PLANNED, self, self.plan)
        warn_each(
            f"steady-state:{id(self)}",
            f"[steady-state] {names.name_of(self)}: dynamo compiled again at each of its last "
            f"{_compat.regions.STORM_CALLS} calls after warm-up (TORCH_LOGS=recompiles says which guard "
            "failed); it runs as plain torch.compile runs it from now on",
        )

    # Deciding ---------------------------------------------------------------------------

    def _decide(self, fingerprint: tuple) -> None:
        """Plan the target as it is now (the first call, or a changed tree) and enter what the plan says."""
        why = Why.PLANNED if self._fingerprint is None and not self.history else Why.TREE_CHANGED
        self._release()
        self._fingerprint = fingerprint
        if not _settings.current().enabled:
            # disable() ran after this module was compiled: what plain torch.compile does.
            self.plan = None
            self._enter(State.PLAIN, Why.OFF)
            return
        mode, _ = _settings.mode_and_strategy(self.target)  # ``set_mode`` first, then the settings
        with guard(f"planning {type(self.target).__name__}") as failed:
            self._apply(plan_inputs.plan(self.request()), why)
        if failed:
            self._release()
            self.plan = None
            self._enter(State.PLAIN, Why.FAILED)
            return
        # Compiled plain, but a checkpoint is traced: any graph break under it
        # (a boundary whose checkpoint hides in code, a data-dependent op, a
        # print) would make dynamo run it eager. Watch the first call for
        # dynamo's fallback message and weave around the break if it appears.
        if (
            self.state is State.PLAIN
            and self.plan is not None
            and mode == "auto"
            and (
                self.plan.boundaries or planner.traces_checkpoint(self.target, call_traced=self._call_traced)
            )
        ):
            self._enter(State.WATCHING, why)

    def request(self, taught: dict[str, Any] | None = None) -> plan_inputs.Request:
        """What this target's compile asks the planner for (``autoweave.plan()`` asks the same).

        ``taught``: what a fallback taught (``breaks``, a forced mode/strategy);
        by default, what the last one did. ``plan_inputs.plan`` answers it, one
        assembly whatever asks (first call or re-plan): what this process learned
        since (other blocks' breaks, memory verdicts) joins what was taught.
        """
        return plan_inputs.Request(
            self.target,
            fullgraph=bool(self.compile_kwargs.get("fullgraph")),
            outer=self.outer,
            call_traced=self._call_traced,
            taught=MappingProxyType(dict(self._learned if taught is None else taught)),
        )

    def _apply(self, plan: planner.Plan, why: Why) -> None:
        """Install ``plan`` and enter TRIAL (it weaves) or PLAIN (it does not)."""
        self.plan = plan
        if plan.woven:
            counting.warn_on_recompile_limit()
            self._applied = apply.apply_plan(
                planner.unwrap(self.target),
                plan,
                _compile_function,
                self.compile_kwargs,
                agree=self._agree,
            )
        self.skip_outer_checkpoint = plan.outer_push_down is not None and self._applied is not None
        self._enter(State.TRIAL if self._applied is not None else State.PLAIN, why)
        logger.debug("%s: %s", plan.root_type, plan.headline())
        _events.publish(_events.PLANNED, self, plan)

    def _apply_learned(self) -> None:
        with self._lock:
            plan, self._pending = self._pending, None
            self._release()
            if not _settings.current().enabled:
                self.plan = None  # disable() ran since the fallback taught this plan: plain torch.compile
                self._enter(State.PLAIN, Why.OFF)
                return
            with guard(f"weaving {type(self.target).__name__}") as failed:
                if plan is not None:
                    self._apply(plan, Why.APPLIED)
            if failed or plan is None:
                self._release()
                self._enter(State.PLAIN, Why.FAILED)

    def _release(self) -> None:
        """Undo what the current plan installed (before a re-plan, or a fallback).

        A plan a fallback taught for the next call (LEARNED) is dropped with it.
        """
        with self._lock:
            if self._applied is not None:
                self._applied.revert()
                self._applied = None
            self.skip_outer_checkpoint = False
            self._pending = None

    def retire(self) -> None:
        """The module was compiled again in place: undo this plan; the newer dispatcher takes over."""
        with self._lock:
            self._release()
            self._enter(State.PLAIN, Why.RELEASED)


def _rebuild_copy(original: nn.Module, duplicate: nn.Module) -> None:
    """``copy.deepcopy`` of a compiled module: the copy gets a dispatcher of its own."""
    dispatcher = _instances.dispatcher_of(original)
    if dispatcher is None or not hasattr(duplicate, _compat.modules.COMPILED_INNER):
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
    boundaries.bump()
    return module


__all__ = [
    "dispatcher_of",
    "set_mode",
]
