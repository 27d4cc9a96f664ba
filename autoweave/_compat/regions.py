"""A woven region's frames in dynamo's cache: the order of lookups, the recompile limit kept
at the region's entry, the steady-state watchdog, and whether a call would convert a frame.

A block under an eager checkpoint runs its compiled code twice, in forward and in recompute,
and both must run the same graph; dynamo decides per frame and per call. Torch range: the
cache entries and guard managers as on 2.11-2.15 (``backends.cache_entries``), the LRU switch
``torch._C._dynamo.eval_frame._set_lru_cache`` (without it nothing is reordered) and
``skip_nnmodule_hook_guards`` (``version.self_check`` probes it). TODO(pytorch#166926): most
of this goes when a checkpoint's recompute pins its forward's graph.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext, suppress
from typing import Any

from autoweave import _installs
from autoweave._compat import backends
from autoweave._compat.backends import _cache_entry_list, cache_entries
from autoweave._compat.checkpoints import eager_checkpoint_frame as _eager_checkpoint_frame
from autoweave._compat.dynamo import (
    TRACE_AS,
    disabled_original,
    entries_made,
    fails_on_recompile,
    misses_decided,
    nested_breaks,
    outside_dynamo,
    recompiles_run_eager,
    skip_own_frame,
)
from autoweave._compat.lookup import find_optional, need

_DYNAMO_CONFIG = need("torch._dynamo.config", required=False)


class _InsertionOrder:
    """Counts the woven calls running, so dynamo's LRU reordering is off exactly while any runs.

    While any runs, dynamo also guards the hooks of the modules it inlines
    (``skip_nnmodule_hook_guards`` off; torch's default is on): a function shared by every
    block of a class (a helper method with a break inside, ``self.ffn(x)``, converted as a
    frame of its own after the break) otherwise keeps the graph it compiled for the first
    block, and a block whose submodule has a hook of its own runs it without the hook (issue 41).
    Guarded, each hook set gets an entry of its own; equal blocks still share one.
    """

    def __init__(self, set_lru: Callable[[bool], None]) -> None:
        self._set_lru = set_lru
        self._running = 0
        self._guard_hooks: Callable[[], Any] | None = None  # undoes the hook guards, while woven calls run
        self._lock = threading.Lock()  # the flag is process-wide: threads share one count

    def __enter__(self) -> None:
        with self._lock:
            if self._running == 0:
                self._set_lru(False)
                config = sys.modules.get(_DYNAMO_CONFIG)
                if getattr(config, _HOOK_GUARDS, None):  # put back as the calls end, unless set since
                    self._guard_hooks = _installs.patch(config, _HOOK_GUARDS, lambda skipped, on: False)
            self._running += 1

    def __exit__(self, *exc_info: object) -> None:
        with self._lock:
            self._running -= 1
            if self._running == 0:
                self._set_lru(True)
                if self._guard_hooks is not None:
                    self._guard_hooks()
                    self._guard_hooks = None


_HOOK_GUARDS = "skip_nnmodule_hook_guards"
need(f"{_DYNAMO_CONFIG}.{_HOOK_GUARDS}")
_SET_LRU_CACHE = need("torch._C._dynamo.eval_frame._set_lru_cache", required=False)


@functools.cache
def _insertion_order() -> _InsertionOrder | None:
    set_lru = find_optional(_SET_LRU_CACHE)
    return None if set_lru is None else _InsertionOrder(set_lru)


def _no_entry_at_limit(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], limit: int | None
) -> bool:
    """Would dynamo find no cache entry of ``fn``'s code for this call, with the code at its recompile limit?

    Answered as dynamo would before running the frame: the entries' guards
    checked against the frame's locals (the bound arguments, the closure's
    cells). Any doubt (a torch without these names, an argument that does not
    bind) answers False: the call then goes to dynamo as before.
    """
    entries = cache_entries(fn.__code__)
    if not entries:
        return False
    try:
        if limit is None:
            import torch._dynamo.config as config

            limit = config.recompile_limit
        if len(entries) < limit:
            return False
    except Exception:  # a config these names do not read: as before
        return False
    return _none_fits(fn, entries, args, kwargs)


def would_convert(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Would dynamo convert ``fn``'s frame for this call (compile it first, or again)? Doubt answers False.

    A code with no entry yet is converted at its first call, where dynamo's entries can be read.
    """
    entries = cache_entries(fn.__code__)
    if not entries:
        return _cache_entry_list() is not None
    return _none_fits(fn, entries, args, kwargs)


def recompile_refused(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Would this call of ``fn`` recompile its frame (entries there, none fits)? Doubt answers False."""
    entries = cache_entries(fn.__code__)
    return bool(entries) and _none_fits(fn, entries, args, kwargs)


def _none_fits(
    fn: Callable[..., Any], entries: list[Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> bool:
    """Does no entry's guard fit this call of ``fn`` (checked against the locals its frame would have)?"""
    try:
        bound = inspect.signature(fn, follow_wrapped=False).bind(*args, **kwargs)
        bound.apply_defaults()
        f_locals = dict(bound.arguments)
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=False):
            f_locals[name] = cell.cell_contents
        return not any(entry.guard_manager.check(f_locals) for entry in entries)
    except Exception:  # an entry or argument these names do not read: as before
        return False


# The frames dynamo converts while a woven call runs, beyond the region's own and its resume
# frames: a helper the region calls at a break (``self._at(h)``, shared by every block of the
# class), converted as a frame of its own. Its cache holds the entries of every region that
# reaches it, one per unequal backend (BACKEND_MATCH), so it reaches the recompile limit with
# the others' entries. Per thread, the sets of the woven calls running, innermost last.
_running = threading.local()
_TRANSLATOR = need("torch._dynamo.symbolic_convert.InstructionTranslator", required=False)


def note_converted() -> None:
    """Told by a woven region's backend as dynamo hands it a graph: the frame being converted is the running region's."""
    running = getattr(_running, "frames", None)
    translator = find_optional(_TRANSLATOR) if running else None
    with suppress(Exception):  # no translator running, or a torch that moved it: nothing noted
        running[-1].add(translator.current_tx().f_code)


@contextmanager
def _noting(frames: set[Any]) -> Iterator[None]:
    running = _running.__dict__.setdefault("frames", [])
    running.append(frames)
    try:
        yield
    finally:
        running.pop()


def _helpers_at_limit(frames: set[Any], walked: list[tuple[str, int]], mine: Any, limit: int) -> list[str]:
    """The helper frames in ``frames`` at the limit for this region, whose backend is ``mine``.

    A helper's cache holds the entries of every region that reaches it. At the limit, a region
    that holds none of them would need a new one (dynamo would refuse it, and run the frame eager
    from then on, in whichever region's forward or recompute came next); one whose own entries
    reached the limit recompiles it for itself. A region holding some of them finds its own.
    """
    names = {name for name, _ in walked}
    at = []
    for code in tuple(frames):
        if code.co_name in names:  # one of the region's own frames: counted by the walk
            continue
        entries = cache_entries(code)
        own = sum(getattr(e, "backend", None) == mine for e in entries)
        if len(entries) >= limit and (own == 0 or own >= limit):
            at.append(code.co_name)
    return at


# Attribute on a region's ``lookups_in_order`` function: would dynamo convert its first frame for a call?
_WOULD_CONVERT = "_autoweave_would_convert"


def region_would_convert(forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Would the region behind an installed ``forward`` have its first frame converted by this call?

    ``forward`` as a plan installs it: the region's function, maybe bound to the block
    (``functools.partial``) and ``torch.compiler.disable``d. Anything else (no region, a
    block moving between regions) answers False.
    """
    bound: tuple[Any, ...] = ()
    for _ in range(4):
        if (original := disabled_original(forward)) is not None:
            forward = original
        elif isinstance(forward, functools.partial):
            bound, kwargs = (*forward.args, *bound), {**forward.keywords, **kwargs}
            forward = forward.func
        else:
            break
    asks = getattr(forward, _WOULD_CONVERT, None)
    return asks is not None and bool(asks((*bound, *args), kwargs))


# Consecutive calls of a woven region under an eager checkpoint that each compiled something,
# after which it runs eager (the steady-state watchdog in ``lookups_in_order``). Warm-up compiles
# at most twice in a row (a first graph, then one with a length made dynamic).
STORM_CALLS = 3
_regions_settled = [0]  # woven regions the steady-state watchdog settled, in this process


def regions_settled() -> int:
    """How many woven regions the steady-state watchdog settled: a module's watchdog leaves those storms to them."""
    return _regions_settled[0]


_raised_from: list[int] = []  # the user's recompile limit, while woven calls run with it raised
_LIMIT_HEADROOM = 64  # entries a region's frames may take past the limit while its calls in flight finish


def user_recompile_limit(given: int | None = None) -> int:
    """The recompile limit that counts: ``given`` (the compile's own), else dynamo's as the user set it."""
    if given is not None:
        return given
    if _raised_from:
        return _raised_from[0]
    import torch._dynamo.config as config

    return config.recompile_limit


def with_headroom(compile_kwargs: dict[str, Any]) -> dict[str, Any]:
    """A region's compile kwargs, a ``recompile_limit=`` of its own raised as ``_limit_raised`` raises dynamo's.

    torch 2.13+ takes a limit per ``torch.compile`` call, which dynamo checks in place of its
    config's: left as given, a frame of the region reaches it mid-call (``CheckpointError``
    under a hook that appends to a list, limit 1). The user's limit is kept at the entry
    (``lookups_in_order``'s ``recompile_limit``).
    """
    limit = compile_kwargs.get("recompile_limit")
    if not isinstance(limit, int) or isinstance(limit, bool):
        return compile_kwargs
    return {**compile_kwargs, "recompile_limit": limit + _LIMIT_HEADROOM}


@contextmanager
def _limit_raised() -> Iterator[None]:
    """dynamo's recompile limit raised by ``_LIMIT_HEADROOM`` while a woven call runs (process-wide).

    A compile's own ``recompile_limit=`` is raised where the region is compiled (``with_headroom``).
    """
    import torch._dynamo.config as config

    if _raised_from:  # an outer woven call raised it already
        yield
        return
    _raised_from.append(config.recompile_limit)
    try:
        with config.patch(recompile_limit=_raised_from[0] + _LIMIT_HEADROOM):
            yield
    finally:
        _raised_from.clear()


def lookups_in_order(
    compiled: Callable[..., Any],
    inputs: Callable[[tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]]] | None = None,
    *,
    eager: Callable[..., Any] | None = None,
    converted: Callable[..., Any] | None = None,
    recompile_limit: int | None = None,
    on_limit: Callable[[str, bool, bool, bool], None] | None = None,
    on_refused: Callable[[], None] | None = None,
    on_failure: Callable[[BaseException], None] | None = None,
    state: Any = None,
    nested: bool = False,
) -> Callable[..., Any]:
    """``compiled`` with dynamo's cache entries looked up in the order they were made.

    ``inputs`` (optional) maps each call's arguments first: the forward and
    the recompute must also present inputs that meet the same guards
    (``checkpoints.as_recompute_sees``).

    A block under an eager checkpoint runs its compiled code twice, in forward
    and in recompute, and both must run the same graph. By default dynamo moves
    the entry a lookup hits to the front, and a recompile puts the new entry in
    front: blocks of one kind that differ in a value (``self._scale``, a float
    argument) recompile the shared code with that value dynamic while a block
    before them still waits for its recompute, which then picks the new dynamic
    entry and saves other tensors (``CheckpointError``; plain torch runs such
    blocks eager and trains). With the reordering off a lookup takes the first
    entry that matches in the order they were made, and later entries never
    precede it, so a recompute finds the entry its forward ran.
    TODO(pytorch#166926): drop when a checkpoint's recompute pins its forward's
    graph; torch 2.11-2.15 have the switch, not the pinning. Older: unchanged.
    The switch is process-wide with no getter: it is off only while a woven
    call runs (its resume functions and its recompute included) and torch's
    default comes back after the last one returns.

    ``eager`` (the function ``compiled`` compiles; ``converted``, the one of
    its frames dynamo converts first, if another): once any frame of the
    region (that one, a function dynamo resumes it with after a break, or a
    helper it calls at a break, ``_helpers_at_limit``) holds as many entries as
    the recompile limit (``recompile_limit``, else dynamo's), the region runs
    ``eager`` with dynamo off below it, telling ``on_limit`` the frame's name
    and True; when only that first frame is there, only a call none of its
    entries' guards fits (False). Under an eager checkpoint this is decided at
    the region's first call in the checkpoint's forward, before its graphs
    record anything there, and kept for that checkpoint's recompute: the
    forward and its recompute run the same code. Left to dynamo, the frame at
    the limit runs eager in whichever of the two reaches it (a resume frame
    guarded on ``self.calls`` needs a new entry in each), the other its graph:
    other saved tensors (``CheckpointError``) or silently other gradients
    (issue 41). So while any woven call runs compiled (one with no recompute
    of its own too: a helper it shares with a region under an eager checkpoint
    would reach the limit there, between that region's forward and recompute),
    dynamo's own limit is raised (``_limit_raised``): the limit is kept here,
    at the entry, not mid-call.

    Under ``set_stance("fail_on_recompile")``, a frame of the region (first,
    resumed or called) that fits none of its entries runs eager for the call,
    compiling nothing (``recompiles_run_eager``), where dynamo would raise. The
    region exists because autoweave wove its module, which plain torch runs
    eager: a block whose checkpoint falls back, or the glue of a whole-model
    compile whose loop over such blocks breaks (dynamo then skips the frame).
    A plain compile (no region) raises as the user asked. ``on_refused`` is told
    when the region's first frame, holding entries, fits none of them (a recompile
    refused: that call runs eager). ``on_failure`` is told when the entry decision
    itself raises (it may raise again, strict mode): that call and every one after
    run ``eager``, the recompute of a forward decided before as that forward ran.

    ``state`` (``weave.guarded_state.GuardedState``, built from the first frame's
    function): notes, at the forward's decision, the guarded scalars the forward may
    change, and presents them to the recompute.
    """
    order = _insertion_order()
    if order is None and inputs is None:
        return compiled
    if inputs is not None:
        # Never converted by a compile whose frame calls the block (a fullgraph checkpoint
        # wrapper's): autoweave's own code, eager as in_order's own frame is.
        inputs = outside_dynamo(inputs, traced_as=inputs)
    uncompiled = at_limit = frame_fn = None
    converted_here: set[Any] = set()  # helper frames converted in its calls (``note_converted``)
    if eager is not None:
        uncompiled = outside_dynamo(eager, traced_as=eager)
        frame_fn = converted or eager
        state = None if state is None else state(frame_fn, converted_here)
        # Decided once per checkpoint, at the region's first call in its forward (before
        # its graphs record anything there), and found again by its recompute.
        decided: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
        noted: weakref.WeakKeyDictionary[Any, Any] = (
            weakref.WeakKeyDictionary()
        )  # per checkpoint: its forward's
        # The steady-state watchdog: per block the region runs, its calls in a row (a forward
        # and its recompute, one cycle) that made dynamo make an entry. Per block, not per
        # region: blocks guarded on their identity each make entries at their first calls, and
        # counted together a region of three looked like a storm in warm-up (accelerate 1.15).
        # Blocks of one kind that share a counter's values are caught by the one that makes
        # the entry each step (fuzzer seed 18560); settled, the whole region is.
        import torch.nn as nn

        streak: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()  # closed cycles
        made_in: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()  # the open one
        decided_at: weakref.WeakKeyDictionary[Any, tuple[dict[str, int], dict[str, int]]] = (
            weakref.WeakKeyDictionary()
        )
        storm: list[str] = []  # the frame that recompiled at every call, once the region settled
        backend = functools.cache(lambda: backends.compile_wrapper_of(compiled))

        def sharer(args: tuple[Any, ...]) -> Any:
            return next((a for a in args if isinstance(a, nn.Module)), frame_fn)

        failed: list[bool] = []  # the entry decision itself failed once: eager from then on

        def runs_eager(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bool, Any, bool]:
            # A failure of the decision's own (a torch whose cache reads another way) must not
            # reach the user's step: the region runs eager from then on, the recompute of a
            # forward decided before it as that forward ran (``decided``, read first).
            try:
                return decide(args, kwargs)
            except Exception as exc:
                if on_failure is None:
                    raise
                failed.append(True)
                on_failure(exc)  # one warning, or raises in strict mode
                return True, None, False

        def decide(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bool, Any, bool]:
            # (_, None, _): not under an eager checkpoint, no recompute to match: decided per call.
            # (_, frame, True): the checkpoint's forward decided already: this is its recompute.
            found = _eager_checkpoint_frame()
            frame = None if found is None else found[0]
            with suppress(TypeError):  # a frame that takes no weak reference: decided per call
                if frame is not None and frame in decided:
                    return decided[frame], frame, True
            # Any frame of the region: its own, one dynamo resumes after a break in it, or a helper
            # it calls at a break (``converted_here``). Only the first frame's guards can be read
            # before the call: if it alone is at the limit, a call that fits one of its entries
            # still runs the graphs.
            if failed:
                return True, frame, False
            if storm:  # settled by the watchdog: every call from then on
                eager = every = True
            else:
                limit = user_recompile_limit(recompile_limit)
                counts = backends.entry_counts(frame_fn)  # one walk of the region's frames
                at = [name for name, n in counts if n >= limit]
                if converted_here:
                    at += _helpers_at_limit(converted_here, counts, backend(), limit)
                every = bool(at) and at != [frame_fn.__code__.co_name]
                eager = every or (bool(at) and _no_entry_at_limit(frame_fn, args, kwargs, limit))
            if eager and on_limit is not None:  # settled by the watchdog, or at the limit
                on_limit(storm[0] if storm else at[-1], every, bool(storm), frame is not None)
            if frame is None:  # no recompute to match and no watchdog: this call alone
                return eager, None, False
            if not eager:
                with suppress(TypeError):  # this decision's counts, and the one's before
                    block = sharer(args)
                    decided_at[block] = (decided_at.get(block, ({}, {}))[1], dict(counts))
                if state is not None:
                    with suppress(TypeError):
                        noted[frame] = state.note(
                            (*args, *kwargs.values()), sum(n for _, n in counts), entries_made()
                        )
            with suppress(TypeError):
                decided[frame] = eager
            return eager, frame, False

        def recompute(frame: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            # The recompute meets the guarded scalars its forward saw (``state``): a forward that
            # bumped ``self.calls`` no longer sends it to a graph of its own (fuzzer seed 10090).
            restore = None if state is None else state.present(noted.pop(frame, []), entries_made())
            before = entries_made()
            try:
                return compiled(*args, **kwargs)
            finally:
                if restore is not None:
                    restore()
                if entries_made() != before:  # in its forward's cycle (seed 20138)
                    watch(sharer(args), True)

        def watch(block: Any, made: bool, opens: bool = False) -> None:
            # A forward opens its block's cycle (closing the one before), its recompute joins
            # it. A block that made an entry in each of its last STORM_CALLS cycles (an int
            # attribute bumped per call, a hook's list one longer at each recompute) would
            # recompile up to the limit, step after step, where plain torch runs it eager under
            # its checkpoint and compiles nothing: every block of the region runs eager from
            # its next forward (one that stops compiling hands the new values to the next block
            # called: seed 18560), settled as this call returns, before a module's watchdog
            # (which would settle coarser, into plain torch.compile) reads it. A recompute runs
            # what its forward ran.
            with suppress(TypeError):
                if opens:
                    closed = made_in.pop(block, None)
                    if closed is not None:
                        streak[block] = streak.get(block, 0) + 1 if closed else 0
                elif made_in.get(block, True):
                    return  # this cycle counted already (or none is open)
                made_in[block] = made
                if made and not storm and streak.get(block, 0) + 1 >= STORM_CALLS:
                    was = decided_at.get(block, ({}, {}))[0]  # named: the last frame that grew since
                    grew = [name for name, n in backends.entry_counts(frame_fn) if n > was.get(name, 0)]
                    storm.append(grew[-1] if grew else frame_fn.__code__.co_name)
                    _regions_settled[0] += 1

        def forward(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            before = entries_made()
            out = compiled(*args, **kwargs)
            watch(sharer(args), entries_made() != before, opens=True)
            return out

        # Not under an eager checkpoint (pieces, glue) there are no cycles to watch. A call that
        # made an entry and then fits none of its first frame's entries changed, itself, what
        # dynamo guards on (``self.calls += 1``): the next call compiles again. Two such calls in
        # a row, of any block of the region, settle it (fuzzer seed 39271: 3 recompiles of one
        # frame by the third call, where plain torch ran the checkpointed blocks eager). State
        # set once at a block's first call (a lazy buffer) strikes once: the next call fits.
        # Counted in a row per region and per block: blocks that share a counter's values
        # alternate, the one called first making the entry each step that the others then fit
        # (fuzzer seed 41297, whose module watchdog otherwise settled it into plain compile).
        strikes = [0]
        struck: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()

        def alone(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            # Settled (``storm``), the region never gets here: its entry runs it eager.
            before = entries_made()
            out = compiled(*args, **kwargs)
            if entries_made() == before or not recompile_refused(frame_fn, args, kwargs):
                strikes[0] = 0
                if struck:  # the common call pays no lookup: no block has struck
                    with suppress(TypeError):
                        struck.pop(sharer(args), None)
                return out
            strikes[0] += 1
            mine = 0
            with suppress(TypeError):
                block = sharer(args)
                mine = struck[block] = struck.get(block, 0) + 1
            if max(strikes[0], mine) >= 2:
                storm.append(frame_fn.__code__.co_name)
                _regions_settled[0] += 1
            return out

        # Per checkpoint, under ``fail_on_recompile``: the code of each frame its forward ran
        # eager, none of its entries fitting. Its recompute runs those eager too, and compiles
        # a frame its forward ran compiled that now fits none (a traced hook's list one longer:
        # fuzzer seed 10638); eager there, it would save other tensors than its forward did.
        ran_eager: weakref.WeakKeyDictionary[Any, set[Any]] = weakref.WeakKeyDictionary()

        def under_the_stance(frame: Any, again: bool) -> Any:
            if frame is None:
                return recompiles_run_eager()
            refused: set[Any] = set()
            if again:
                with suppress(TypeError):
                    refused = ran_eager.pop(frame, refused)
                return misses_decided(lambda code: code not in refused)
            with suppress(TypeError):
                ran_eager[frame] = refused

            def noted(code: Any) -> bool:
                refused.add(code)
                return False  # the forward compiles nothing under the stance

            return misses_decided(noted)

        at_limit = outside_dynamo(runs_eager, traced_as=runs_eager)
        recompute_in_order = outside_dynamo(recompute, traced_as=recompute)
        forward_in_order = outside_dynamo(forward, traced_as=forward)
        alone_in_order = outside_dynamo(alone, traced_as=alone)

    breaks = nested_breaks if nested else nullcontext  # ``nested``: a unit's hooks resume inside its call

    def in_order(*args: Any, **kwargs: Any) -> Any:
        if inputs is not None:
            args, kwargs = inputs(args, kwargs)
        eager, frame, again = (None, None, False) if at_limit is None else at_limit(args, kwargs)
        if eager:
            return uncompiled(*args, **kwargs)
        # Under ``fail_on_recompile`` a frame of the region that fits none of its graphs (a
        # block frozen after warm-up fails their requires_grad guards) runs eager, not raise:
        # plain torch runs the module eager, never compiling it (issue 41, item 5).
        stance: Any = nullcontext()
        if fails_on_recompile():
            stance = recompiles_run_eager() if at_limit is None else under_the_stance(frame, again)
            first = frame_fn or getattr(compiled, "__wrapped__", None)  # the function it compiles
            if on_refused is not None and callable(first) and recompile_refused(first, args, kwargs):
                on_refused()
        if eager is not None:
            # The limit is kept at the region's entry (above); inside, no frame may reach
            # dynamo's, which would run that frame eager in the forward or in the recompute
            # alone (a recompute often needs an entry its forward did not). Nor in a region
            # with no recompute of its own (pieces): a helper frame it shares with a region
            # under an eager checkpoint would run eager, or another backend's graph, in that
            # region's recompute after its forward ran the graph (fuzzer seed 32442).
            with order or nullcontext(), _limit_raised(), stance, _noting(converted_here), breaks():
                if again:
                    return recompute_in_order(frame, args, kwargs)
                if frame is None:  # not under an eager checkpoint: no recompute, no cycles
                    return alone_in_order(args, kwargs)
                return forward_in_order(args, kwargs)
        with order or nullcontext(), stance, breaks():
            return compiled(*args, **kwargs)

    functools.update_wrapper(in_order, compiled)
    if eager is not None:
        # Asked before the call by what must decide first (a pieces block's checkpoint).
        setattr(
            in_order, _WOULD_CONVERT, lambda args, kwargs: would_convert(converted or eager, args, kwargs)
        )
    # A trace that meets it (an outer compile inlining the block) traces the compiled
    # function as it would meet it in plain torch; dynamo never converts its own frame.
    setattr(in_order, TRACE_AS, getattr(compiled, TRACE_AS, compiled))
    skip_own_frame(in_order)
    return in_order
