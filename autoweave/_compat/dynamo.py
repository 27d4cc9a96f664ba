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
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

from autoweave._compat.lookup import UnsupportedTorch, find, find_optional, need, need_source, torch_version

_DYNAMO = need("torch._dynamo", required=False)
_UTILS = need("torch._dynamo.utils", required=False)
_COUNTERS = need("torch._dynamo.utils.counters")
_EVAL_FRAME = need("torch._dynamo.eval_frame", required=False)
_EXC = need("torch._dynamo.exc", required=False)
# Read from the C module, these cost no ``import torch._dynamo`` (1.6 s of CPU), which a
# process that never compiles must not pay.
_C_FRAME = need("torch._C._dynamo.eval_frame", required=False)


def dynamo_counters() -> dict[str, Any]:
    """dynamo's process-wide counters (``stats``, ``graph_break``...); {} when they moved.

    {} too while dynamo is not imported: nothing compiled, and reading them must not import it.
    """
    counters = find_optional(_COUNTERS) if _UTILS in sys.modules else None
    return {} if counters is None else counters


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
    """``torch._logging._internal`` when it has what ``sense.graph_breaks`` uses, else None."""
    internal = find_optional(_LOGGING_INTERNAL)  # None has none of the names: None
    needed = ("log_registry", "register_log", "_is_torch_handler", "_setup_handlers")
    return internal if all(hasattr(internal, name) for name in needed) else None


_LOGGING_INTERNAL = need(
    "torch._logging._internal", what="torch._logging._internal (log registry)", probe=torch_logging_internal
)


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
    skip_code = find_optional(_SKIP_CODE)
    if skip_code is None:
        return False
    skip_code(code)
    return True


_SKIP_CODE = need("torch._dynamo.eval_frame.skip_code", required=False)
# dynamo's ``skip_code`` is these three C names.
EXEC_STRATEGY = tuple(
    need(f"{_C_FRAME}.{name}") for name in ("set_code_exec_strategy", "_FrameExecStrategy", "_FrameAction")
)


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
    utils = sys.modules.get(_UTILS)
    if utils is None:
        return 0
    built = getattr(utils, "compilation_time_metrics", {}).get("build_guards", ())
    return int(utils.counters["stats"]["unique_graphs"]) + len(built)


need("torch._dynamo.utils.compilation_time_metrics")
# The dispatcher's watchdog counts entries by their guard builds.
need_source("dynamo's 'build_guards' timing", "torch._dynamo.convert_frame", '"build_guards"')
need_source("dynamo's per-error 'frame_exec_strategy'", _EXC, "frame_exec_strategy")


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


_DISABLE = need("torch._dynamo.disable")


def disable(fn: Any, *, recursive: bool) -> Any:
    return find(_DISABLE)(fn, recursive=recursive)


_UNSUPPORTED = need("torch._dynamo.exc.Unsupported")


@functools.cache
def _fullgraph_break_class() -> type:
    base = find(_UNSUPPORTED)

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
# Nested graph breaks: a break inside a call dynamo traced into resumes there, in the callee,
# instead of breaking the caller at the call. dynamo's own test case turns them on for every
# test from 2.13 (its default stays off); 2.11-2.12 opt in per test class only.
_CONFIG = need("torch._dynamo.config", required=False)
_NESTED_BREAKS_FROM = (2, 13)


@functools.cache
def nested_breaks_supported() -> bool:
    """Does this torch resume a break inside the call it is in (``nested_graph_breaks``), as tested?"""
    import torch

    config = find_optional(_CONFIG)
    try:
        version = torch_version(torch.__version__)
    except UnsupportedTorch:
        return False
    return config is not None and hasattr(config, "nested_graph_breaks") and version >= _NESTED_BREAKS_FROM


@contextmanager
def nested_breaks() -> Iterator[None]:
    """Nested graph breaks on while inside (process-wide, as dynamo's config is)."""
    config = find_optional(_CONFIG)
    if config is None or config.nested_graph_breaks:
        yield
        return
    with config.patch(nested_graph_breaks=True):
        yield


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
    from autoweave import _installs

    module = _eval_frame()
    prior = getattr(module, "_stance", None)
    if getattr(prior, "stance", None) != FAIL_STANCE or not dataclasses.is_dataclass(prior):
        yield
        return
    undo = _installs.patch(
        module, "_stance", lambda user, _on: dataclasses.replace(user, stance=_RUN_ONLY_STANCE)
    )
    try:
        yield
    finally:
        undo()


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
    from autoweave import _installs

    module = _eval_frame()
    once = _eager_once()
    if not fails_on_recompile() or getattr(module, "_callback_from_stance", None) is None or once is None:
        with recompiles_run_eager():
            yield
        return

    def deciding(from_stance: Callable[[Any], Any], _on: Callable[[], bool]) -> Callable[[Any], Any]:
        def callback_from_stance(callback: Any) -> Any:
            if callback in (False, None) or not fails_on_recompile():
                return from_stance(callback)

            def on_miss(frame: Any, *args: Any, **kwargs: Any) -> Any:
                return callback(frame, *args, **kwargs) if compiles(frame.f_code) else once

            on_miss._torchdynamo_orig_backend = callback  # type: ignore[attr-defined]
            return on_miss

        return callback_from_stance

    undo = _installs.patch(module, "_callback_from_stance", deciding)
    try:
        yield
    finally:
        undo()


_TYPES = need("torch._dynamo.types", required=False)


@functools.cache
def _eager_once() -> Any:
    """A callback's answer that runs the frame eager for this call alone (the frames it calls as the
    callback says, nothing kept for its code); None where torch lacks these types."""
    types_ = find_optional(_TYPES)
    strategy, action = getattr(types_, "FrameExecStrategy", None), getattr(types_, "FrameAction", None)
    returned = getattr(types_, "ConvertFrameReturn", None)
    if None in (strategy, action, returned):
        return None
    return returned(frame_exec_strategy=strategy(action.DEFAULT, action.DEFAULT), apply_to_code=False)


@functools.cache
def _eval_frame() -> Any:
    # Asked on every call of a pieces block (``weave.apply``): the module once, its stance each time.
    return find_optional(_EVAL_FRAME)


COMPILE_CALLBACKS_MODULE = need("torch._dynamo.callback", required=False)
_CALLBACK_HANDLER = need(f"{COMPILE_CALLBACKS_MODULE}.callback_handler")


def compile_callbacks() -> Any:
    """dynamo's compile start/end callback registry, or None where torch lacks it (imports dynamo)."""
    return find_optional(_CALLBACK_HANDLER)


def callback_compile(args: Any) -> tuple[str, str]:
    """What a compile callback's argument says: its trigger's name (``DYNAMO`` by default) and its compile id."""
    trigger = getattr(getattr(args, "callback_trigger", None), "name", "DYNAMO")
    return trigger, str(getattr(args, "compile_id", ""))


_RESET_CODE = need("torch._dynamo.reset_code")


def reset_code(code: Any) -> bool:
    """Drop dynamo's cache entries for one code object (its next call recompiles); False if unsupported."""
    reset = find_optional(_RESET_CODE)
    if reset is None:
        return False
    reset(code)
    return True


@functools.cache
def dynamo_compile_code() -> Any:
    """The code of ``torch._dynamo.convert_frame._compile`` (None where it moved)."""
    return getattr(inspect.unwrap(find_optional(_COMPILE)), "__code__", None)


def _compile_takes_code() -> bool:
    code = dynamo_compile_code()
    return code is not None and "code" in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]


_COMPILE = need(
    "torch._dynamo.convert_frame._compile",
    what="torch._dynamo.convert_frame._compile(code, ...)",
    probe=_compile_takes_code,
)


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


# What dynamo traces in place of a function it meets while tracing (torch 2.1+, every torch in
# TESTED_TORCH; torch/_dynamo/eval_frame.py sets it on each compiled callable, and
# variables/builder.py reads it before any other rule for a function).
TRACE_AS = "_torchdynamo_inline"
need_source(f"dynamo's inline hook {TRACE_AS!r}", _EVAL_FRAME, TRACE_AS)
# What marks a ``torch._dynamo.disable``d function to a trace (a graph break at its call).
DISABLED = "_torchdynamo_disable"


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


_EVAL_FRAME_CALLBACK = need(f"{_C_FRAME}.get_eval_frame_callback", required=False)


def outside_dynamo(fn: Callable[..., Any], *, traced_as: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run with dynamo's frame evaluation off; a trace that meets it traces ``traced_as``.

    Run: as ``torch.compiler.disable`` runs a function. When an outer compile
    breaks its graph at this call, dynamo would otherwise convert every frame
    ``fn`` runs (autoweave's own code) under the outer compile; compiled
    callables inside set their own compile, as plain torch's do.
    Traced: an outer compile inlining this call meets ``traced_as`` (what plain
    torch.compile made) instead, never ``fn``, and no graph break.
    """
    current_callback = find_optional(_EVAL_FRAME_CALLBACK)
    disabled: list[Callable[..., Any]] = []
    # Made once dynamo is imported (at once if it is): this may run when torch is imported,
    # in processes that never compile, and making it imports dynamo (1.6 s of CPU).
    _when_dynamo_imported(lambda: disabled.append(disable(fn, recursive=True)))

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
        wrapper = disable(fn, recursive=True)  # where torch lacks either name: always off
        setattr(wrapper, DISABLED, False)
    else:
        functools.update_wrapper(wrapper, fn)
        del wrapper.__wrapped__  # nothing may unwrap it to ``fn``: a trace meets ``traced_as``
    setattr(wrapper, TRACE_AS, traced_as)
    return wrapper


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
    found: list[type[BaseException]] = [IndexError]
    found += [t for t in map(find_optional, _HANDLED_ERRORS) if t is not None]
    with suppress(UnsupportedTorch, TypeError):
        found.extend(find(_FALLBACK_ERRORS))
    return tuple(found)


_HANDLED_ERRORS = tuple(
    need(f"{_EXC}.{name}", required=False) for name in ("RestartAnalysis", "SkipFrame", "ShortenTraceback")
)
_FALLBACK_ERRORS = need(f"{_EXC}.exceptions_allowed_to_be_fallback", required=False)
_BACKEND_FAILED = need(f"{_EXC}.BackendCompilerFailed", required=False)


def backend_failed() -> tuple[type[BaseException], ...]:
    """A backend's own compile failure, as dynamo's backends raise it (inductor: ``InductorError``)."""
    found = find_optional(_BACKEND_FAILED)
    return () if found is None else (found,)


@functools.cache
def convert_frame_call_code() -> Any:
    """The code of dynamo's ``ConvertFrame.__call__`` (None where it moved)."""
    convert_frame = find_optional(_CONVERT_FRAME)
    call = None if convert_frame is None else inspect.unwrap(convert_frame.__call__)
    return getattr(call, "__code__", None)


def _call_takes_frame() -> bool:
    code = convert_frame_call_code()
    return code is not None and "frame" in code.co_varnames[: code.co_argcount]


_CONVERT_FRAME = need(
    "torch._dynamo.convert_frame.ConvertFrame",
    what="torch._dynamo.convert_frame.ConvertFrame.__call__(frame, ...)",
    probe=_call_takes_frame,
)


def converting_code() -> Any:
    """The code of the frame dynamo's ``ConvertFrame.__call__`` (up the stack) is converting, or None."""
    frame = _frame_running(convert_frame_call_code())
    return None if frame is None else getattr(frame.f_locals.get("frame"), "f_code", None)


_CONFIG = need("torch._dynamo.config", required=False)
need(f"{_CONFIG}.suppress_errors")


@contextmanager
def suppressing_errors() -> Iterator[bool]:
    """While inside, dynamo runs a frame it fails to convert eager (``suppress_errors``); yields True.

    Yields False, changing nothing, where it cannot be done: on a torch without
    these names, or when ``fail_on_recompile_limit_hit`` is set (torch rejects
    the two together). As torch does, dynamo skips such code from then on
    (``compile_again`` undoes it). The config is process-wide: another thread
    compiling meanwhile is suppressed too.
    """
    config = find_optional(_CONFIG)
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
