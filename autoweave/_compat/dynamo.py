"""dynamo's private machinery autoweave calls, and failing open inside dynamo.

The machinery: counters, callbacks, code resets, the compile in progress. Torch
range: 2.11-2.15 (``version.TESTED_TORCH``); ``version.self_check`` probes each
on a newer torch; none has a public equivalent. Why autoweave needs them at all:
a graph break inside a checkpointed region makes dynamo run the whole region
eager (pytorch#139989; most of this goes when dynamo compiles around such a
break itself).

Failing open inside dynamo: a graph or a frame that fails to compile runs eager,
in the same call. This is what torch's ``torch._dynamo.config.suppress_errors``
does, scoped to autoweave's regions (see ``autoweave._failopen``): a graph the
backend fails on, or a frame dynamo fails to convert, runs eager instead of
raising. Dynamo converts a frame before running it, so running that frame eager
runs nothing twice. The warning dynamo logs for such a frame is read in
``log_strings`` (``WontConvert``).

Torch range of failing open: ``suppress_errors``, ``ConvertFrame.__call__(frame,
...)`` and ``set_code_exec_strategy`` as on 2.11-2.15 (``version.self_check``
probes them). torch has no per-region ``suppress_errors`` and no public way to
undo the skip it puts on a failed frame; no upstream issue asks for either that
we found.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext, suppress
from typing import Any

from autoweave._compat import backends
from autoweave._compat.backends import _cache_entry_list, cache_entries
from autoweave._compat.checkpoints import eager_checkpoint_frame as _eager_checkpoint_frame
from autoweave._compat.lookup import UnsupportedTorch, find, find_optional


def dynamo_counters() -> dict[str, Any]:
    """dynamo's process-wide counters (``stats``, ``graph_break``...); {} when they moved.

    {} too while dynamo is not imported: nothing compiled, and reading them must not import it.
    """
    if "torch._dynamo.utils" not in sys.modules:
        return {}
    try:
        from torch._dynamo.utils import counters
    except Exception:  # pragma: no cover - private counters moved
        return {}
    return counters


def trace_structured(name: str, payload: Any) -> None:
    """One JSON artifact in TORCH_TRACE's structured log (tlparse shows it)."""
    import torch._logging

    torch._logging.trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": "json"},
        payload_fn=lambda: payload,
        # Plans are made outside any compile: no stack dump for a missing compile id.
        expect_trace_id=False,
    )


@functools.cache
def torch_logging_internal() -> Any:
    """``torch._logging._internal`` when it has what ``observe.graph_breaks`` uses, else None."""
    internal = find_optional("torch._logging._internal")  # None has none of the names: None
    needed = ("log_registry", "register_log", "_is_torch_handler", "_setup_handlers")
    return internal if all(hasattr(internal, name) for name in needed) else None


def is_torch_log_handler(handler: Any) -> bool:
    """Is ``handler`` one torch's logging set up (``TORCH_LOGS``)?"""
    internal = torch_logging_internal()
    return internal is not None and bool(internal._is_torch_handler(handler))


def add_torch_log_handlers(logger: Any, file: str | None) -> None:
    """torch's own handlers on ``logger``: stderr, and ``file`` (``TORCH_LOGS_OUT``) when named."""
    import logging

    internal = torch_logging_internal()
    # torch 2.14 writes to whatever sys.stderr is now (_StderrHandler); 2.13 a StreamHandler.
    internal._setup_handlers(getattr(internal, "_StderrHandler", logging.StreamHandler), logger)
    if file:
        internal._setup_handlers(lambda: logging.FileHandler(file), logger)


def dynamo_disabled(fn: Any) -> bool:
    """True when ``fn`` was wrapped by ``torch.compiler.disable``/``torch._dynamo.disable``."""
    for _ in range(8):  # once ``fn`` is None every read below is None: False
        if getattr(fn, "_torchdynamo_disable", False):
            return True
        fn = getattr(fn, "__wrapped__", None) or getattr(fn, "__func__", None)
    return False


def disabled_original(fn: Any) -> Any:
    """The function ``torch.compiler.disable`` wrapped to make ``fn`` (None: ``fn`` is not such a wrapper)."""
    return getattr(fn, "__wrapped__", None) if getattr(fn, "_torchdynamo_disable", False) else None


def skip_own_frame(fn: Any) -> bool:
    """Make dynamo run ``fn``'s own frames eagerly and compile the frames it calls (False: not on this torch).

    What ``torch.compiler.disable(fn, recursive=False)`` does to ``fn``'s code, without
    the wrapper that makes an enclosing trace break at its call: only for code
    autoweave owns (a region's copy), never a user's shared code object.
    """
    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    if _set_exec_strategy(code, skip=True):
        return True
    skip_code = find_optional("torch._dynamo.eval_frame.skip_code")
    if skip_code is None:
        return False
    skip_code(code)
    return True


_C_FRAME = "torch._C._dynamo.eval_frame."
# dynamo's ``skip_code`` is these three C names: read from the C module, they cost no
# ``import torch._dynamo`` (1.6 s of CPU), which a process that never compiles must not pay.
EXEC_STRATEGY = tuple(_C_FRAME + n for n in ("set_code_exec_strategy", "_FrameExecStrategy", "_FrameAction"))


def _set_exec_strategy(code: Any, *, skip: bool) -> bool:
    # dynamo skips ``code``'s own frames (``skip``) or converts them again; False: not on this torch.
    set_strategy, strategy, action = (find_optional(path) for path in EXEC_STRATEGY)
    if set_strategy is None or strategy is None or action is None:
        return False
    set_strategy(code, strategy(action.SKIP if skip else action.DEFAULT, action.DEFAULT))
    return True


def entries_made() -> int:
    """A count that grows whenever dynamo makes a cache entry (0 before dynamo is imported).

    Guards built (one per entry, with or without a graph) plus graphs compiled (what is left
    where a torch names its guard-building step otherwise). Not the frames converted: a
    conversion that ends in a skip makes no entry (a woven pieces region converts at a length
    its entries do not fit and runs the one that does, ``test_dynamic_shapes``); a frame whose
    only work is ``self.calls += 1`` compiles no graph but makes an entry, guarded on the new
    value, at every call (fuzzer seed 6099).
    """
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0
    built = getattr(utils, "compilation_time_metrics", {}).get("build_guards", ())
    return int(utils.counters["stats"]["unique_graphs"]) + len(built)


def skip_with_callees(error: BaseException) -> bool:
    """Have dynamo, which is suppressing ``error``, run its frame and every frame it calls eager.

    Set on the error while dynamo logs it, before it reads ``frame_exec_strategy`` back
    (``convert_frame``): this call and every later one then run that code eager all the way
    down. Dynamo's own skip covers the failed frame only, and the frames it calls are converted
    again: compiled in the forward, and in the recompute some of them eager (a frame the forward
    never reached), so the two differ (``CheckpointError``). False: not on this torch.
    """
    _, strategy, action = (find_optional(path) for path in EXEC_STRATEGY)
    if strategy is None or action is None or not hasattr(error, "frame_exec_strategy"):
        return False
    error.frame_exec_strategy = strategy(action.SKIP, action.SKIP)  # type: ignore[attr-defined]
    return True


def disable(fn: Any, *, recursive: bool) -> Any:
    import torch

    return torch._dynamo.disable(fn, recursive=recursive)


@functools.cache
def _fullgraph_break_class() -> type:
    base = find("torch._dynamo.exc.Unsupported")

    class FullgraphBreak(base):  # type: ignore[misc, valid-type]
        """``fullgraph=True`` and a graph break autoweave does not compile around."""

    return FullgraphBreak


def fullgraph_break(message: str) -> BaseException:
    """The error ``fullgraph=True`` raises for a break: dynamo's ``Unsupported`` (a subclass)."""
    try:
        return _fullgraph_break_class()(message)
    except Exception:  # a torch whose Unsupported takes other arguments
        return RuntimeError(message)


# The stances of ``torch.compiler.set_stance`` under which a compiled function runs eager: every
# call (``force_eager``), or wherever its cached graphs do not fit (``eager_on_recompile``).
EAGER_STANCES = frozenset({"force_eager", "eager_on_recompile"})


def eager_stance() -> str | None:
    """The stance set now when it makes compiled code run eager (``EAGER_STANCES``), else None.

    torch has no public getter for the stance ``torch.compiler.set_stance`` sets (2.6+ keep
    it in ``torch._dynamo.eval_frame._stance``, a ``DynamoStance``, through 2.15); read
    afresh each time, since ``set_stance`` rebinds it. None where torch lacks it.
    """
    stance = getattr(getattr(_eval_frame(), "_stance", None), "stance", None)
    return stance if stance in EAGER_STANCES else None


# The stance under which dynamo raises for any frame it would convert (compile or recompile).
FAIL_STANCE = "fail_on_recompile"
# The stance under which such a frame runs eager instead, nothing compiled: dynamo's run-only mode.
_RUN_ONLY_STANCE = "eager_on_recompile"


def fails_on_recompile() -> bool:
    """Is ``torch.compiler.set_stance("fail_on_recompile")`` in force (read as ``eager_stance`` reads)?"""
    return getattr(getattr(_eval_frame(), "_stance", None), "stance", None) == FAIL_STANCE


@contextmanager
def recompiles_run_eager() -> Iterator[None]:
    """Under ``fail_on_recompile``, a frame dynamo would convert runs eager instead of raising.

    For the calls inside only: the stance becomes ``eager_on_recompile`` (its other
    fields kept), which runs every frame whose cache entries fit compiled and every
    other frame eager, compiling nothing; the user's stance comes back after. Set on
    the module's ``_stance`` rather than through ``set_stance``, which refuses inside
    a compiled function's extent (an eager region called from a graph break): each
    compiled function reads the stance as it is entered, so the frames below see it.
    Where torch keeps no such dataclass, nothing changes.
    """
    module = _eval_frame()
    prior = getattr(module, "_stance", None)
    if getattr(prior, "stance", None) != FAIL_STANCE or not dataclasses.is_dataclass(prior):
        yield
        return
    module._stance = dataclasses.replace(prior, stance=_RUN_ONLY_STANCE)
    try:
        yield
    finally:
        module._stance = prior


@contextmanager
def misses_decided(compiles: Callable[[Any], bool]) -> Iterator[None]:
    """Under ``fail_on_recompile``, each frame that fits none of its entries compiles or runs eager, as ``compiles`` says.

    ``compiles(code)`` is asked once per miss: True converts the frame as the default
    stance would; False runs it eager for that call alone, compiling nothing (what
    ``recompiles_run_eager`` does for every miss). The compiled functions entered
    inside take their callback from the stance (``_callback_from_stance``, read as
    each is entered, 2.6+ through 2.15): for these calls it wraps theirs, keeping
    its backend identity (a cache entry is looked up by backend). Where torch keeps
    none of this, ``recompiles_run_eager``.
    """
    module = _eval_frame()
    from_stance = getattr(module, "_callback_from_stance", None)
    once = _eager_once()
    if not fails_on_recompile() or from_stance is None or once is None:
        with recompiles_run_eager():
            yield
        return

    def callback_from_stance(callback: Any) -> Any:
        if callback in (False, None) or not fails_on_recompile():
            return from_stance(callback)

        def on_miss(frame: Any, *args: Any, **kwargs: Any) -> Any:
            return callback(frame, *args, **kwargs) if compiles(frame.f_code) else once

        on_miss._torchdynamo_orig_backend = callback  # type: ignore[attr-defined]
        return on_miss

    module._callback_from_stance = callback_from_stance
    try:
        yield
    finally:
        module._callback_from_stance = from_stance


@functools.cache
def _eager_once() -> Any:
    """A callback's answer that runs the frame eager for this call alone (the frames it calls as the
    callback says, nothing kept for its code); None where torch lacks these types."""
    types_ = find_optional("torch._dynamo.types")
    strategy, action = getattr(types_, "FrameExecStrategy", None), getattr(types_, "FrameAction", None)
    returned = getattr(types_, "ConvertFrameReturn", None)
    if None in (strategy, action, returned):
        return None
    return returned(frame_exec_strategy=strategy(action.DEFAULT, action.DEFAULT), apply_to_code=False)


@functools.cache
def _eval_frame() -> Any:
    # Asked on every call of a pieces block (``weave.apply``): the module once, its stance each time.
    return find_optional("torch._dynamo.eval_frame")


COMPILE_CALLBACKS_MODULE = "torch._dynamo.callback"


def compile_callbacks() -> Any:
    """dynamo's compile start/end callback registry, or None where torch lacks it (imports dynamo)."""
    return find_optional(f"{COMPILE_CALLBACKS_MODULE}.callback_handler")


def reset_code(code: Any) -> bool:
    """Drop dynamo's cache entries for one code object (its next call recompiles); False if unsupported."""
    reset = find_optional("torch._dynamo.reset_code")
    if reset is None:
        return False
    reset(code)
    return True


@functools.cache
def dynamo_compile_code() -> Any:
    """The code of ``torch._dynamo.convert_frame._compile`` (None where it moved)."""
    return getattr(inspect.unwrap(find_optional("torch._dynamo.convert_frame._compile")), "__code__", None)


def code_being_compiled() -> Any:
    """The code object dynamo is compiling now (the ``code`` argument of its ``_compile``), or None.

    dynamo's compile-start callbacks are told the compile id, not the frame; the
    frame is an argument of ``torch._dynamo.convert_frame._compile``, up the stack.
    """
    return compile_in_progress()[0]


def compile_in_progress() -> tuple[Any, Any]:
    """(code, backend) of the compile dynamo is running now (``_compile``'s ``code`` and ``compiler_fn``).

    (None, None) outside a compile or where ``_compile`` moved. The backend is
    as dynamo holds it (wrapped by torch: see ``backends_within``).
    """
    frame = _frame_running(dynamo_compile_code())
    if frame is None:
        return None, None
    code = frame.f_locals.get("code")
    return (code if isinstance(code, types.CodeType) else None), frame.f_locals.get("compiler_fn")


def _frame_running(target: Any) -> types.FrameType | None:
    # The innermost frame up the stack running code ``target``; None if none (or ``target`` is None).
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not target:
        frame = frame.f_back
    return frame


# Where torch's wrappers of a backend keep the one they wrap: ``WrapBackendDebug`` and
# ``_TorchCompileWrapper`` (``_torchdynamo_orig_backend``, ``compiler_fn``), autoweave's own
# (``inner``), a ``functools.partial`` (``func``).
_WRAPPED_BACKEND = ("_torchdynamo_orig_backend", "compiler_fn", "inner", "func")


def backends_within(backend: Any, depth: int = 8) -> Iterator[Any]:
    """``backend`` and every backend it wraps, outermost first."""
    seen: set[int] = set()
    while backend is not None and depth > 0 and id(backend) not in seen:
        yield backend
        seen.add(id(backend))
        depth -= 1
        backend = next(
            (inner for name in _WRAPPED_BACKEND if (inner := getattr(backend, name, None)) is not None),
            None,
        )


def compile_wrapper_of(compiled: Any) -> Any:
    """The backend object ``torch.compile`` built for ``compiled`` (a module or a function it returned), or None.

    It is what dynamo hands each graph of that compile (through its own wrappers:
    ``backends_within``), and a fresh one at every ``torch.compile``. An
    ``OptimizedModule`` holds its compile context (``dynamo_ctx``); a compiled
    function holds it only in the closure of the ``get_compiler_config`` torch
    sets on it (2.11-2.15).
    """
    ctx = getattr(compiled, "dynamo_ctx", None)
    if ctx is None:
        cells = getattr(getattr(compiled, "get_compiler_config", None), "__closure__", None) or ()
        ctx = next((c.cell_contents for c in cells if hasattr(c.cell_contents, "callback")), None)
    wrappers = tuple(filter(None, map(find_optional, _COMPILE_WRAPPERS)))
    within = backends_within(getattr(ctx, "callback", None))
    return next((b for b in within if isinstance(b, wrappers)), None)  # isinstance(b, ()) is False


_COMPILE_WRAPPERS = ("torch._TorchCompileWrapper", "torch._TorchCompileInductorWrapper")


# Handing a graph to its backend: dynamo's compile callbacks carry a compile id, never the
# graph, and a wrapper around the backend would change the compile it watches (the wrapped
# backend answers ``get_compiler_config`` and ``isinstance`` otherwise). So the one place
# dynamo hands a backend its graph, ``OutputGraph.call_user_compiler(self, gm,
# example_inputs)`` (2.11-2.15; ``self.compiler_fn`` is the backend), is wrapped while
# someone listens. No upstream issue asks for a public graph callback that we found.
HANDOFF_MODULE = "torch._dynamo.output_graph"
_HANDOFF = "call_user_compiler"


def listen_to_graphs(listener: Callable[[Any, Any], Any]) -> Callable[[], None]:
    """``listener(backend, gm)`` as dynamo hands ``backend`` a graph ``gm``; returns the undo.

    What the listener returns, if not None, is called with the backend's result and
    the seconds it took. Neither may raise: they run inside the user's compile.
    dynamo's hand-off is wrapped once its module is imported (importing it here
    would import dynamo); the undo unwraps it, or, where someone wrapped it since,
    leaves it calling straight through.
    """
    from autoweave import _installs

    undos: list[Callable[[], None]] = []

    def wrap(module: Any) -> None:
        owner = module.OutputGraph
        original = vars(owner).get(_HANDOFF)
        if original is None or undos:
            return

        @functools.wraps(original)
        def call_user_compiler(self: Any, gm: Any, example_inputs: Any) -> Any:
            after = listener(self.compiler_fn, gm) if undos else None
            start = time.perf_counter()
            compiled = original(self, gm, example_inputs)
            if after is not None:
                after(compiled, time.perf_counter() - start)
            return compiled

        def unwrap() -> None:
            if vars(owner).get(_HANDOFF) is call_user_compiler:  # nobody wrapped it since
                setattr(owner, _HANDOFF, original)

        setattr(owner, _HANDOFF, call_user_compiler)
        undos.append(unwrap)

    _installs.register(HANDOFF_MODULE, wrap)

    def undo() -> None:
        _installs.unregister(HANDOFF_MODULE, wrap)
        while undos:
            undos.pop()()

    return undo


# What dynamo traces in place of a function it meets while tracing (torch 2.1+, every torch in
# TESTED_TORCH; torch/_dynamo/eval_frame.py sets it on each compiled callable, and
# variables/builder.py reads it before any other rule for a function).
TRACE_AS = "_torchdynamo_inline"
# What marks a ``torch._dynamo.disable``d function to a trace (a graph break at its call).
DISABLED = "_torchdynamo_disable"


_DYNAMO = "torch._dynamo"
_waiting_for_dynamo: list[Callable[[], None]] = []
_waiting_lock = threading.Lock()


def _when_dynamo_imported(then: Callable[[], None]) -> None:
    """Run ``then`` once dynamo is imported: now if it is, else right after its import (one hook for all)."""
    from autoweave import _installs

    with _waiting_lock:
        _waiting_for_dynamo.append(then)
    _installs.register(_DYNAMO, _run_waiting)  # one hook for the process (a second register is a no-op)
    dynamo = sys.modules.get(_DYNAMO)
    if dynamo is not None and not getattr(getattr(dynamo, "__spec__", None), "_initializing", False):
        _run_waiting()


def _run_waiting(_module: Any = None) -> None:
    with _waiting_lock:
        waiting = list(_waiting_for_dynamo)
        _waiting_for_dynamo.clear()
    for then in waiting:
        then()


def outside_dynamo(fn: Callable[..., Any], *, traced_as: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run with dynamo's frame evaluation off; a trace that meets it traces ``traced_as``.

    Run: as ``torch.compiler.disable`` runs a function. When an outer compile
    breaks its graph at this call, dynamo would otherwise convert every frame
    ``fn`` runs (autoweave's own code) under the outer compile; compiled
    callables inside set their own compile, as plain torch's do.
    Traced: an outer compile inlining this call meets ``traced_as`` (what plain
    torch.compile made) instead, never ``fn``, and no graph break.
    """
    import torch

    current_callback = find_optional("torch._C._dynamo.eval_frame.get_eval_frame_callback")
    disabled: list[Callable[..., Any]] = []
    # Made once dynamo is imported (at once if it is): this may run when torch is imported,
    # in processes that never compile, and making it imports dynamo (1.6 s of CPU).
    _when_dynamo_imported(lambda: disabled.append(torch._dynamo.disable(fn, recursive=True)))

    # Called from eager code (every step's call) no frame evaluation is set, and turning
    # it off costs two eval-frame swaps a call: fn runs as it is. Only under a compile
    # that runs this call (one that breaks its graph here) is it turned off. Dynamo never
    # converts the wrapper's own frame (``skip_own_frame``), only what it calls, and that
    # is where the disabled ``fn`` takes over.
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if current_callback() is None:
            return fn(*args, **kwargs)
        if not disabled:  # the hook was taken away (``autoweave.disable()``) before dynamo's import
            _run_waiting()
        return disabled[0](*args, **kwargs)

    if current_callback is None or not skip_own_frame(wrapper):
        wrapper = torch._dynamo.disable(fn, recursive=True)  # where torch lacks either name: always off
        setattr(wrapper, DISABLED, False)
    else:
        functools.update_wrapper(wrapper, fn)
        del wrapper.__wrapped__  # nothing may unwrap it to ``fn``: a trace meets ``traced_as``
    setattr(wrapper, TRACE_AS, traced_as)
    return wrapper


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
        self._skipped_hooks: Any = None  # the user's setting, while woven calls run
        self._lock = threading.Lock()  # the flag is process-wide: threads share one count

    def __enter__(self) -> None:
        with self._lock:
            if self._running == 0:
                self._set_lru(False)
                config = sys.modules.get("torch._dynamo.config")
                self._skipped_hooks = getattr(config, _HOOK_GUARDS, None)
                if self._skipped_hooks:
                    setattr(config, _HOOK_GUARDS, False)
            self._running += 1

    def __exit__(self, *exc_info: object) -> None:
        with self._lock:
            self._running -= 1
            if self._running == 0:
                self._set_lru(True)
                if self._skipped_hooks:
                    setattr(sys.modules["torch._dynamo.config"], _HOOK_GUARDS, self._skipped_hooks)
                    self._skipped_hooks = None


_HOOK_GUARDS = "skip_nnmodule_hook_guards"


@functools.cache
def _insertion_order() -> _InsertionOrder | None:
    set_lru = find_optional("torch._C._dynamo.eval_frame._set_lru_cache")
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


@contextmanager
def _limit_raised() -> Iterator[None]:
    """dynamo's recompile limit raised by ``_LIMIT_HEADROOM`` while a woven call runs (process-wide).

    A compile given its own ``recompile_limit=`` patches over it while it converts.
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
    on_limit: Callable[[str, bool, bool], None] | None = None,
    on_refused: Callable[[], None] | None = None,
    state: Any = None,
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
    its frames dynamo converts first, if another): under an eager checkpoint,
    once any frame of the region (that one, or a function dynamo resumes it
    with after a break) holds as many entries as the recompile limit
    (``recompile_limit``, else dynamo's), the region runs ``eager`` with dynamo
    off below it, telling ``on_limit`` the frame's name and True; when only that
    first frame is there, only a call none of its entries' guards fits (False). Decided at the
    region's first call in a checkpoint's forward, before its graphs record
    anything there, and kept for that checkpoint's recompute: the forward and
    its recompute run the same code. Left to dynamo, the frame at the limit runs
    eager in whichever of the two reaches it (a resume frame guarded on
    ``self.calls`` needs a new entry in each), the other its graph: other
    saved tensors (``CheckpointError``) or silently other gradients (issue 41).
    So while such a call runs compiled, dynamo's own limit is raised
    (``_limit_raised``): the limit is kept here, at the entry, not mid-call.

    Under ``set_stance("fail_on_recompile")``, a frame of the region (first,
    resumed or called) that fits none of its entries runs eager for the call,
    compiling nothing (``recompiles_run_eager``), where dynamo would raise. The
    region exists because autoweave wove its module, which plain torch runs
    eager: a block whose checkpoint falls back, or the glue of a whole-model
    compile whose loop over such blocks breaks (dynamo then skips the frame).
    A plain compile (no region) raises as the user asked. ``on_refused`` is told
    when the region's first frame, holding entries, fits none of them (a recompile
    refused: that call runs eager).

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
    if eager is not None:
        uncompiled = outside_dynamo(eager, traced_as=eager)
        frame_fn = converted or eager
        state = None if state is None else state(frame_fn)
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

        def sharer(args: tuple[Any, ...]) -> Any:
            return next((a for a in args if isinstance(a, nn.Module)), frame_fn)

        def runs_eager(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bool | None, Any, bool]:
            # (None, None, _): not under an eager checkpoint, no recompute to match: dynamo decides.
            # (_, frame, True): the checkpoint's forward decided already: this is its recompute.
            found = _eager_checkpoint_frame()
            if found is None:
                return None, None, False
            frame, _ = found
            with suppress(TypeError):  # a frame that takes no weak reference: decided per call
                if frame in decided:
                    return decided[frame], frame, True
            # Any frame of the region: its own, or one dynamo resumes after a break in it. Only
            # the first frame's guards can be read before the call: if it alone is at the limit,
            # a call that fits one of its entries still runs the graphs.
            if storm:  # settled by the watchdog: every call from then on
                eager = every = True
            else:
                limit = user_recompile_limit(recompile_limit)
                counts = backends.entry_counts(frame_fn)  # one walk of the region's frames
                at = [name for name, n in counts if n >= limit]
                every = bool(at) and at != [frame_fn.__code__.co_name]
                eager = every or (bool(at) and _no_entry_at_limit(frame_fn, args, kwargs, limit))
            if not eager:
                with suppress(TypeError):  # this decision's counts, and the one's before
                    block = sharer(args)
                    decided_at[block] = (decided_at.get(block, ({}, {}))[1], dict(counts))
                if state is not None:
                    with suppress(TypeError):
                        noted[frame] = state.note(
                            (*args, *kwargs.values()), sum(n for _, n in counts), entries_made()
                        )
            if eager and on_limit is not None:
                on_limit(storm[0] if storm else at[-1], every, bool(storm))
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
            # alone (a recompute often needs an entry its forward did not).
            with order or nullcontext(), _limit_raised(), stance:
                if again:
                    return recompute_in_order(frame, args, kwargs)
                if frame is None:  # not under an eager checkpoint: no recompute, no watchdog
                    return compiled(*args, **kwargs)
                return forward_in_order(args, kwargs)
        with order or nullcontext(), stance:
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


# The name dynamo gives a function that resumes a frame after a graph break (resume_execution.py;
# the same on every torch in TESTED_TORCH): ``torch_dynamo_resume_in_<name>_at_<line>``.
_RESUME_NAME = re.compile(r"^torch_dynamo_resume_in_(.+)_at_\d+$")


def resumed_name(code_name: str, *, levels: int = 8) -> str:
    """The frame a resume function continues (through ``levels`` resumes of resumes); else ``code_name``."""
    for _ in range(levels):
        match = _RESUME_NAME.match(code_name)
        if match is None:
            break
        code_name = match.group(1)
    return code_name


@functools.cache
def backend_errors_dynamo_handles() -> tuple[type[BaseException], ...]:
    """What a backend may raise that dynamo acts on itself: a fail-open backend lets these through.

    ``OutputGraph.call_user_compiler`` re-raises a restart, a skip, a failure
    it already reported and ``IndexError`` (a dim out of range: the user's
    error, raised as such), and turns the fake-tensor exceptions in
    ``exceptions_allowed_to_be_fallback`` into a graph break.
    """
    names = ("RestartAnalysis", "SkipFrame", "ShortenTraceback")
    found: list[type[BaseException]] = [IndexError]
    found += [t for t in (find_optional(f"torch._dynamo.exc.{name}") for name in names) if t is not None]
    with suppress(UnsupportedTorch, TypeError):
        found.extend(find("torch._dynamo.exc.exceptions_allowed_to_be_fallback"))
    return tuple(found)


def backend_failed() -> tuple[type[BaseException], ...]:
    """A backend's own compile failure, as dynamo's backends raise it (inductor: ``InductorError``)."""
    found = find_optional("torch._dynamo.exc.BackendCompilerFailed")
    return () if found is None else (found,)


@functools.cache
def convert_frame_call_code() -> Any:
    """The code of dynamo's ``ConvertFrame.__call__`` (None where it moved)."""
    convert_frame = find_optional("torch._dynamo.convert_frame.ConvertFrame")
    call = None if convert_frame is None else inspect.unwrap(convert_frame.__call__)
    return getattr(call, "__code__", None)


def converting_code() -> Any:
    """The code of the frame dynamo's ``ConvertFrame.__call__`` (up the stack) is converting, or None."""
    frame = _frame_running(convert_frame_call_code())
    return None if frame is None else getattr(frame.f_locals.get("frame"), "f_code", None)


@contextmanager
def suppressing_errors() -> Iterator[bool]:
    """While inside, dynamo runs a frame it fails to convert eager (``suppress_errors``); yields True.

    Yields False, changing nothing, where it cannot be done: on a torch without
    these names, or when ``fail_on_recompile_limit_hit`` is set (torch rejects
    the two together). As torch does, dynamo skips such code from then on
    (``compile_again`` undoes it). The config is process-wide: another thread
    compiling meanwhile is suppressed too.
    """
    config = find_optional("torch._dynamo.config")
    if (
        config is None
        or convert_frame_call_code() is None
        or getattr(config, "fail_on_recompile_limit_hit", False)
    ):
        yield False
        return
    with config.patch(suppress_errors=True):
        yield True


def compile_again(code: Any) -> None:
    """Undo the skip dynamo put on ``code`` when it suppressed an error there: its next call compiles."""
    if not _set_exec_strategy(code, skip=False):
        reset_code(code)
