"""A woven module's first call, and what a fallback seen there teaches.

The dispatcher's (``dispatchers._Dispatcher``) life after a plan weaves: the
regions compile in one call that runs once whatever fails (``_first_woven_call``),
listening for dynamo's AC fallback on every rank (``_watched``, the ranks agreeing
through ``plan_inputs``); a break seen there is learned and planned around from the
next call (``_on_hidden_fallback``), or, where the plan already knows it, kept as plain
torch keeps it. Under ``fullgraph=True`` a break anywhere but at a boundary raises.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch.nn as nn

from autoweave import _compat, _events
from autoweave._compat.log_strings import FallbackBreak
from autoweave._failopen import FailedFrames, _strict, frames_fail_open, guard, swallowed
from autoweave._log import logger
from autoweave._state import run as _run
from autoweave.dispatch import plan_inputs
from autoweave.dispatch.states import State, Why
from autoweave.planning import boundaries, planner
from autoweave.planning.learned import learn_breaks, locate
from autoweave.sense import counting, graph_breaks, names


class FirstCall:
    """The first woven call and the fallback it may see: the part of ``_Dispatcher`` that learns."""

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
        name = names.name_of(self)
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
                names.name_of(self),
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
                names.name_of(self),
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


def _forget_traced_code(target: nn.Module) -> None:
    codes = {
        code
        for module in target.modules()
        for cls in type(module).__mro__
        for fn in (cls.__dict__.get("forward"), cls.__dict__.get("__call__"))
        if (code := getattr(fn, "__code__", None)) is not None and fn is not nn.Module.__call__
    }
    _run.codes_reset = True
    for code in codes:
        _compat.dynamo.reset_code(code)
