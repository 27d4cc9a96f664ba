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
5. ``_first_woven_call`` runs the regions' first call once, watching dynamo's fallback
   (``_watched``; ranks agree through ``dispatch.plan_inputs``), and enters WOVEN.
6. A fallback seen there re-plans (``_on_hidden_fallback``: LEARNED, applied at the next call).
7. Each move is an ``_events`` topic: ``observe.summary`` logs the plan summary at the next
   step, ``observe.report`` keeps the report, ``observe.trace`` writes
   TORCH_TRACE; ``observe.report_exit`` writes and summarises the report at exit.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

import torch
import torch.nn as nn

from autoweave import _compat, _events, _instances, _settings
from autoweave._compat.log_strings import FallbackBreak
from autoweave._failopen import (
    AutoweaveError,
    FailedFrames,
    _strict,
    frames_fail_open,
    guard,
    swallowed,
    warn_each,
)
from autoweave._log import logger
from autoweave._state import run as _run
from autoweave.dispatch import plan_inputs
from autoweave.dispatch.states import _RUNS_REGIONS, _TRANSITIONS, State, Why
from autoweave.observe import counting, graph_breaks, summary
from autoweave.planning import boundaries, planner
from autoweave.planning.learned import hoist_reason, learn_breaks, locate
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
        (name, type(m), getattr(m, boundaries.MARK, None), hoist_reason(m), apply.hooks_key(m))
        for name, m in modules
    )


class _Dispatcher:
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
        its own storm (``_compat.dynamo.lookups_in_order``: finer, its blocks eager under their
        checkpoints, as plain torch runs them) does not count (fuzzer seed 18560: settled here
        instead, plain torch.compile's frames compiled again after warm-up). Settled at the
        entry of a later forward, never between a forward and its recompute (which must run
        what the forward ran), as a re-plan is (``_on_hidden_fallback``).
        """
        # Not under ``fail_on_recompile``: plain torch.compile's frames, converted again once
        # settled, would raise there, and no woven region compiles under it (a call none of its
        # graphs fits runs eager), so the storm is over (fuzzer seed 8129).
        if (
            self._converting >= _compat.dynamo.STORM_CALLS
            and not _compat.checkpoints.in_backward()
            and not _compat.dynamo.fails_on_recompile()
        ):
            self._settle()
            return self.call(*args, **kwargs)
        before, settled = _compat.dynamo.entries_made(), _compat.dynamo.regions_settled()
        out = self._eager(*args, **kwargs)
        if not _compat.checkpoints.in_backward():  # a recompute is not a call of the forward
            made = _compat.dynamo.entries_made() != before
            # A storm a woven region settled in this call (into its blocks eager under their
            # checkpoints, as plain torch runs them) is over: not the module's to settle.
            made = made and _compat.dynamo.regions_settled() == settled
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
            f"[steady-state] {summary.name_of(self)}: dynamo compiled again at each of its last "
            f"{_compat.dynamo.STORM_CALLS} calls after warm-up (TORCH_LOGS=recompiles says which guard "
            "failed); it runs as plain torch.compile runs it from now on",
        )

    def _watched(self, call: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Run a first call listening for dynamo's AC fallback; on one on any rank, re-plan around the break.

        Every rank running the target agrees on what broke, at the end of this
        call, whether it saw a fallback or not (``agreement``): a break only one
        rank's data reached is planned around on every rank.
        """
        with counting.FallbackCounter() as watch:
            out = call(*args, **kwargs)
        located = self._agreed_breaks(watch.breaks if watch.count else None)
        if located is not None and self._on_hidden_fallback(located) and watch.count:
            _events.publish(_events.WOVEN_AROUND, self, watch.count)
        return out

    def _agree(self, flags: list[bool]) -> list[bool]:
        """Each flag, true if it is on any rank that runs this target (``plan_inputs.any_rank``)."""
        holder = self.holder()  # not ``or``: a module may define __len__
        return plan_inputs.any_rank(self.target if holder is None else holder, flags)

    def _agreed_breaks(self, breaks: list[FallbackBreak] | None) -> dict[int, str] | None:
        """The modules (by id) any rank saw break (None: no rank saw a fallback); ``breaks``: this rank's.

        A module only another rank located is planned around too, with a reason
        saying so (the flags go by position in the target's module tree, the
        same on every rank).
        """
        target = planner.unwrap(self.target)
        located: dict[int, str] = {}
        with guard(f"locating a graph break in {type(self.target).__name__}"):
            if breaks is not None:
                located = locate(target, breaks)
                if not located and planner.checkpoint_spec(target) is not None:
                    # No location from dynamo: the wrapped block breaks somewhere; hoist
                    # around it still compiles all but the break.
                    wrapped = _compat.modules.checkpoint_wrapped(target)
                    located = {id(wrapped): "a graph break inside (dynamo gave no location)"}
        modules = list(target.modules())
        *flags, fell_back = self._agree([id(m) in located for m in modules] + [breaks is not None])
        if not fell_back:
            return None
        elsewhere = "a graph break in its forward on another rank (its data took a path this rank's did not)"
        return {
            id(m): located.get(id(m), elsewhere) for m, broke in zip(modules, flags, strict=True) if broke
        }

    def _first_woven_call(self, args: tuple, kwargs: dict) -> Any:
        """The woven regions compile now, in a call that runs once, whatever fails.

        Never again on another path: the forward's side effects, its RNG draws
        and, under FSDP, its collectives (on this rank only) would happen twice.
        A failure of autoweave's own degrades where it happens, in this call: a
        graph the backend fails on runs eager (``RegionBackend``), a frame dynamo
        cannot convert runs eager from then on (``frames_fail_open``), the rest
        stays compiled. An exception that still escapes is the model's own (a
        shape error, a raise in its forward: eager raised it, as plain torch
        would): it propagates untouched, and the next call is a first call again.

        Also the second safety net: a region compiled under a pushed-down
        checkpoint may still hold a break nobody located yet (a second one in
        the same block); dynamo's fallback message then re-plans around it too.
        """
        allowed = self._allowed_breaks()
        recording = graph_breaks.recording_graph_breaks() if allowed is not None else contextlib.nullcontext()
        with frames_fail_open() as failed:
            try:
                with recording as seen:
                    out = self._watched(self._eager, args, kwargs)
            except BaseException:
                failed.compile_again()  # dynamo skipped them on the model's error: compile them next call
                raise
        if allowed is not None:
            self._check_fullgraph(seen, allowed)
        if failed.errors:
            self._on_failed_frames(failed)
        with self._lock:
            if self.state is State.TRIAL:  # not LEARNED: a fallback in this call re-planned it
                self._converting = 0
                self._enter(State.WOVEN, Why.COMPILED)
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
        swallowed(
            "region-eager",
            f"first-call:{id(self)}",
            f"dynamo could not compile {failed.describe()} of the woven regions of {name} "
            "at their first call; it runs eager from now on, the rest stays compiled",
            failed.errors[0][0],
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
            self._release()  # a plan a fallback in this call taught is given up with the rest
            # Plain fullgraph compile from now on: it raises at every call, as plain torch would.
            self._enter(State.GIVEN_UP, Why.FULLGRAPH_BREAK)
            if plan is not None:
                self.plan = plan.plain_instead("fullgraph=True and a graph break outside the boundaries")
                _events.publish(_events.PLANNED, self, self.plan)
        first = unexpected[0]
        raise _compat.dynamo.fullgraph_break(
            f"fullgraph=True: graph break at {first.site} ({first.reason or 'see TORCH_LOGS=graph_breaks'}); "
            "autoweave compiles around boundaries only"
            + (f" (here: {', '.join(sorted(allowed))})" if allowed else "")
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
                on_ac_kept=functools.partial(_events.publish, _events.AC_KEPT, self),
                agree=self._agree,
            )
        self.skip_outer_checkpoint = plan.outer_push_down is not None and self._applied is not None
        self._enter(State.TRIAL if self._applied is not None else State.PLAIN, why)
        logger.debug("%s: %s", plan.root_type, plan.headline())
        _events.publish(_events.PLANNED, self, plan)

    def _on_hidden_fallback(self, located: dict[int, str]) -> bool:
        """Dynamo ran a checkpointed region eager (on some rank): re-plan around ``located`` from the next call.

        False when there is nothing new to plan around (the fallback stays, as in plain torch).
        """
        known = self._learned.get("breaks")
        if known is not None and located.keys() <= known.keys():
            # The plan already knows every break this fallback names (woven around them, or
            # left plain where it cannot): a re-plan would make the same plan and fall back the
            # same way, and dropping dynamo's cache for the code would re-trace it at every step
            # (transformers <= 5.22 under a whole-model compile checkpoint around ``__call__``,
            # where the unit's hooks sit inside the checkpoint; per layer too, where dynamo names
            # no location and nothing new is ever located: fuzzer seed 17079). Learned once: the plan is kept,
            # and dynamo's cached fallback runs that checkpoint eager from now on, as plain torch does.
            logger.info(
                "%s: dynamo still runs a checkpointed region eager (%s), a break the plan cannot "
                "compile around; that region runs eager as in plain torch",
                summary.name_of(self),
                "; ".join(sorted(set(located.values()))) or "location unknown",
            )
            return False
        with self._lock, guard(f"re-planning {type(self.target).__name__}"):
            target = planner.unwrap(self.target)
            learn_breaks(target, located)
            learned: dict[str, Any] = {"breaks": {**self._learned.get("breaks", {}), **located}}
            plan = plan_inputs.plan(self.request(learned))
            if not plan.woven:
                # The checkpoint is in code autoweave could not read (the target's
                # own forward): weave its children one by one, around that code.
                learned.update(mode="always", children_one_by_one=True)
                plan = plan_inputs.plan(self.request(learned))
            self._learned = learned
            logger.info(
                "%s: dynamo ran a checkpointed region eager at the first call (%s); woven from the next call on",
                summary.name_of(self),
                "; ".join(sorted(set(located.values()))) or "location unknown",
            )
            # Applied at the next call, not now: this call's backward will
            # recompute its checkpoints through the modules as they ran.
            self._pending = plan
            self._enter(State.LEARNED, Why.FELL_BACK)
        # Blocks running the same code met the same break, silently (the
        # fallback is cached for the wrapper's code): each re-plans at its next call.
        for other in list(_run.live):
            if other is not self:
                other.read_tree_again()
        boundaries.bump()
        # That cached fallback also answers *other* modules sharing the code whose
        # guards it passes (a dense block behind the same CheckpointWrapper.forward
        # would run eager from then on): drop the cache of the code it was traced on.
        with guard("clearing dynamo's cached fallback"):
            _forget_traced_code(self.target)
        return True

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


def _forget_traced_code(target: nn.Module) -> None:
    codes = {
        code
        for module in target.modules()
        for cls in type(module).__mro__
        for fn in (cls.__dict__.get("forward"), cls.__dict__.get("__call__"))
        if (code := getattr(fn, "__code__", None)) is not None and fn is not nn.Module.__call__
    }
    for code in codes:
        _compat.dynamo.reset_code(code)


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
