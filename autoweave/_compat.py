"""Private torch names, looked up once and behind guards.

torch moves private names between releases; every one autoweave touches is
resolved here so an unsupported torch gives one clear message instead of a
traceback deep inside a patch (tests/unit/test_layers.py keeps them here).

What would make most of this module unnecessary upstream:

- a graph break inside a checkpointed region makes dynamo run the whole region
  eager: pytorch/pytorch#139989 (PR #193143, open when last looked at,
  proposes compiling ``ac(compile(f))`` instead; reviewers note it does not
  hold for selective AC);
- FSDP2's hooks are ``torch._dynamo.disable``d unconditionally since
  pytorch/pytorch PR #174863; custom-op hooks that dynamo could keep in the graph were tried in
  PR #181924 (closed);
- ``backend="eager"`` ignores a traced checkpoint: pytorch/pytorch#160773.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

# The torch releases autoweave is tested on, inclusive, as (major, minor). An older
# torch turns it off. A newer one is checked name by name at start-up
# (``self_check``): it turns on when everything below is there (with one notice
# naming the untested version), and stays off naming what is missing otherwise.
# ``AUTOWEAVE_UNTESTED_TORCH=off`` keeps the strict behaviour (off on any newer torch).
TESTED_TORCH = ((2, 11), (2, 15))


class UnsupportedTorch(RuntimeError):
    """The installed torch lacks something autoweave needs."""


def torch_version(raw: str | None = None) -> tuple[int, int]:
    if raw is None:
        import torch

        raw = torch.__version__
    match = re.match(r"(\d+)\.(\d+)", str(raw))
    if not match:
        raise UnsupportedTorch(f"cannot read torch version {raw!r}")
    return int(match.group(1)), int(match.group(2))


def _tested() -> str:
    low, high = TESTED_TORCH
    return f"{low[0]}.{low[1]} to {high[0]}.{high[1]}"


@dataclass(frozen=True)
class TorchSupport:
    """What autoweave makes of the installed torch (``torch_support``)."""

    version: str
    on: bool
    untested: bool  # newer than the newest tested release
    missing: tuple[str, ...] = ()  # what ``self_check`` did not find (untested torch only)
    message: str = ""  # the one line to tell the user; empty for a tested torch

    @property
    def tag(self) -> str:
        return "untested-torch" if self.on else "unsupported-torch"


def torch_support(
    raw: str | None = None, *, untested: str = "check", check: Callable[[], list[str]] | None = None
) -> TorchSupport:
    """Decide whether autoweave runs on torch ``raw`` (default: the installed one).

    ``untested`` is the ``AUTOWEAVE_UNTESTED_TORCH`` policy: ``check`` (run
    ``check``, default ``self_check``, on a torch newer than tested) or ``off``.
    """
    if raw is None:
        import torch

        raw = str(torch.__version__)
    version = torch_version(raw)
    low, high = TESTED_TORCH
    if version < low:
        return TorchSupport(
            raw,
            on=False,
            untested=False,
            message=f"torch {raw} is not supported (autoweave supports torch {_tested()}); staying off. "
            f"Install torch>={low[0]}.{low[1]} or unset AUTOWEAVE.",
        )
    if version <= high:
        return TorchSupport(raw, on=True, untested=False)
    newest = f"{high[0]}.{high[1]}"
    if untested == "off":
        return TorchSupport(
            raw,
            on=False,
            untested=True,
            message=f"torch {raw} is newer than the newest tested ({newest}) and "
            "AUTOWEAVE_UNTESTED_TORCH=off; staying off. Unset AUTOWEAVE_UNTESTED_TORCH to let autoweave "
            "check what it needs from this torch, or install a tested torch.",
        )
    missing = tuple((check or _self_check_once)())
    if missing:
        return TorchSupport(
            raw,
            on=False,
            untested=True,
            missing=missing,
            message=f"torch {raw} is newer than the newest tested ({newest}) and lacks what autoweave "
            f"needs: {', '.join(missing)}; staying off, torch runs unpatched. "
            f"Install a tested torch ({_tested()}) or unset AUTOWEAVE.",
        )
    return TorchSupport(
        raw,
        on=True,
        untested=True,
        message=f"torch {raw} is newer than the newest tested ({newest}); everything autoweave needs from "
        "it is there, so autoweave is on. AUTOWEAVE_UNTESTED_TORCH=off keeps it off on untested torch.",
    )


def check_torch_version(raw: str | None = None, *, untested: str = "check") -> TorchSupport:
    """``torch_support``, raising ``UnsupportedTorch`` (with the message) when autoweave must stay off."""
    support = torch_support(raw, untested=untested)
    if not support.on:
        raise UnsupportedTorch(support.message)
    return support


def _first(*paths: str) -> Any:
    import importlib

    errors = []
    for path in paths:
        module_name, _, attr = path.rpartition(".")
        try:
            return getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            errors.append(f"{path}: {exc}")
    raise UnsupportedTorch("none of these torch names exist: " + "; ".join(errors))


def _optional(*paths: str) -> Any:
    """``_first``, or None where this torch has none of them (a name autoweave can do without)."""
    try:
        return _first(*paths)
    except UnsupportedTorch:
        return None


@functools.cache
def optimized_module() -> type:
    return _first("torch._dynamo.eval_frame.OptimizedModule")


@functools.cache
def checkpoint_wrapper_class() -> type:
    return _first("torch.distributed.algorithms._checkpoint.checkpoint_wrapper.CheckpointWrapper")


@functools.cache
def fsdp2_module() -> type | None:
    # None: torch built without distributed.
    return _optional("torch.distributed.fsdp.FSDPModule", "torch.distributed._composable.fsdp.FSDPModule")


@functools.cache
def fsdp1_module() -> type | None:
    return _optional("torch.distributed.fsdp.FullyShardedDataParallel")


# -- private attributes of torch's wrapper modules ---------------------------------------
# The same names on every torch in TESTED_TORCH (2.11-2.15), and long before. None has a
# public accessor upstream, and no upstream issue asks for one that we found: each would
# become unnecessary with a public accessor; self_check probes them on a newer torch.

# OptimizedModule (torch/_dynamo/eval_frame.py): the module torch.compile wrapped.
COMPILED_INNER = "_orig_mod"
# nn.Module.compile stores its compiled ``_call_impl`` here (torch 2.2+; torch/nn/modules/module.py).
COMPILED_CALL = "_compiled_call_impl"
# CheckpointWrapper (torch/distributed/algorithms/_checkpoint/checkpoint_wrapper.py): the wrapped
# module and the checkpoint function it calls (a functools.partial of torch.utils.checkpoint).
CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module"
CHECKPOINT_FN = "checkpoint_fn"
# FSDP1's wrapper (torch/distributed/fsdp/fully_sharded_data_parallel.py).
FSDP1_WRAPPED = "_fsdp_wrapped_module"
# torch's wrappers whose child is the user's module, looked through for messages and plans.
WRAPPED_CHILD_ATTRS = (CHECKPOINT_WRAPPED, FSDP1_WRAPPED, COMPILED_INNER)


def compiled_inner(optimized: Any) -> Any:
    """The module ``torch.compile`` wrapped in ``optimized`` (an OptimizedModule)."""
    return getattr(optimized, COMPILED_INNER)


def compiled_call(module: Any) -> Any:
    """What ``module.compile()`` installed (None if it was not compiled in place)."""
    return getattr(module, COMPILED_CALL, None)


def set_compiled_call(module: Any, call: Any) -> None:
    """Install ``call`` where ``module.compile()`` puts the compiled ``_call_impl``."""
    setattr(module, COMPILED_CALL, call)


def checkpoint_wrapped(wrapper: Any) -> Any:
    """The module a ``CheckpointWrapper`` wraps."""
    return getattr(wrapper, CHECKPOINT_WRAPPED)


def checkpoint_fn(wrapper: Any) -> Any:
    """The checkpoint function a ``CheckpointWrapper`` calls (a partial of torch.utils.checkpoint)."""
    return getattr(wrapper, CHECKPOINT_FN, None)


def set_checkpoint_fn(wrapper: Any, fn: Any) -> None:
    setattr(wrapper, CHECKPOINT_FN, fn)


def wrapped_child(module: Any) -> Any:
    """The child a torch wrapper (CheckpointWrapper, FSDP1, OptimizedModule) wraps; None if not one."""
    children = getattr(module, "_modules", None) or {}
    return next((children[a] for a in WRAPPED_CHILD_ATTRS if a in children), None)


def children_of(module: Any) -> dict[str, Any]:
    """``module``'s registered children, the dict nn.Module keeps them in (no copy, no property run)."""
    return module.__dict__.get("_modules", {})


# nn.Module's own stores for children, parameters and buffers (read without running
# ``__getattr__``): the same on every torch since 1.0.
MODULE_STORES = ("_modules", "_parameters", "_buffers")


def forward_hook_dicts(module: Any) -> tuple[dict[int, Any], dict[int, Any]]:
    """``module``'s forward pre-hooks and forward hooks (nn.Module has no public way to list them)."""
    return module._forward_pre_hooks, module._forward_hooks


def call_impl(module: Any) -> Any:
    """``module._call_impl``, what ``nn.Module.compile`` compiles (torch 2.2+)."""
    return module._call_impl


# What dynamo traces in place of a function it meets while tracing (torch 2.1+, every torch in
# TESTED_TORCH; torch/_dynamo/eval_frame.py sets it on each compiled callable, and
# variables/builder.py reads it before any other rule for a function).
TRACE_AS = "_torchdynamo_inline"
# What marks a ``torch._dynamo.disable``d function to a trace (a graph break at its call).
DISABLED = "_torchdynamo_disable"


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

    wrapper = torch._dynamo.disable(fn, recursive=True)
    setattr(wrapper, DISABLED, False)
    setattr(wrapper, TRACE_AS, traced_as)
    return wrapper


def dynamo_counters() -> dict[str, Any]:
    """dynamo's process-wide counters (``stats``, ``graph_break``...); {} when they moved."""
    try:
        from torch._dynamo.utils import counters
    except Exception:  # pragma: no cover - private counters moved
        return {}
    return counters


def lookup_backend(backend: Any) -> Any:
    """A backend by name, as torch.compile resolves it (``aot_eager`` -> its callable)."""
    from torch._dynamo.backends.registry import lookup_backend as lookup

    return lookup(backend)


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


CHECKPOINT_WRAPPER_MODULE = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"


def checkpoint_wrapper_module() -> Any:
    """The module that defines ``checkpoint_wrapper`` (a private package path, torch 1.12 to today)."""
    import importlib

    return importlib.import_module(CHECKPOINT_WRAPPER_MODULE)


def dynamo_disabled(fn: Any) -> bool:
    """True when ``fn`` was wrapped by ``torch.compiler.disable``/``torch._dynamo.disable``."""
    seen = 0
    while fn is not None and seen < 8:
        if getattr(fn, "_torchdynamo_disable", False):
            return True
        fn = getattr(fn, "__wrapped__", None) or getattr(fn, "__func__", None)
        seen += 1
    return False


@functools.cache
def tag_activation_checkpoint() -> Any:
    """torch's checkpoint operator for compiled graphs: what dynamo emits for a traced ``checkpoint``."""
    return _first("torch._higher_order_ops.wrap.tag_activation_checkpoint")


@functools.cache
def _fullgraph_break_class() -> type:
    base = _first("torch._dynamo.exc.Unsupported")

    class FullgraphBreak(base):  # type: ignore[misc, valid-type]
        """``fullgraph=True`` and a graph break autoweave does not compile around."""

    return FullgraphBreak


def fullgraph_break(message: str) -> BaseException:
    """The error ``fullgraph=True`` raises for a break: dynamo's ``Unsupported`` (a subclass)."""
    try:
        return _fullgraph_break_class()(message)
    except Exception:  # a torch whose Unsupported takes other arguments
        return RuntimeError(message)


def disable(fn: Any, *, recursive: bool) -> Any:
    import torch

    return torch._dynamo.disable(fn, recursive=recursive)


def compile_backend(
    backend: Any, mode: str | None, options: dict | None, dynamic: Any, name: str | None
) -> Any:
    """The backend callable ``torch.compile(..., backend=, mode=, options=)`` would build.

    Lets the report wrap it (to count graphs) and hand ``torch.compile`` the
    wrapper with ``mode``/``options`` removed, compiling exactly the same way.
    """
    import torch

    if mode is None and options is None:
        mode = "default"
    if backend is None or backend == "inductor":
        wrapper = getattr(torch, "_TorchCompileInductorWrapper", None)
        if wrapper is None:
            raise UnsupportedTorch("torch._TorchCompileInductorWrapper is missing")
        try:
            return wrapper(mode, options, dynamic, name)
        except TypeError:  # torch before the `name` argument
            return wrapper(mode, options, dynamic)
    wrapper = getattr(torch, "_TorchCompileWrapper", None)
    if wrapper is None:
        raise UnsupportedTorch("torch._TorchCompileWrapper is missing")
    return wrapper(backend, mode, options, dynamic)


class BackendWrapper:
    """A backend around ``inner`` that dynamo treats as ``inner``: same name, equal when it is.

    dynamo matches a frame's cached graphs to the current backend with ``==``;
    torch builds a fresh ``_TorchCompileWrapper`` at every ``torch.compile`` and
    shares graphs because equal ones compare equal. A wrapper per compile that
    compared unequal would make identical layers compiled one by one recompile
    their shared code until the recompile limit, then run eager.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        # torch.compile names its wrapper after this (``compiler_name``), and dynamo
        # treats a registered name as a built-in backend: keep the inner one's.
        self.__name__ = str(getattr(inner, "compiler_name", None) or getattr(inner, "__name__", "backend"))

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and bool(self.inner == other.inner)  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(type(self.inner))  # equal wrappers wrap equal backends, of one type

    def reset(self) -> None:
        reset = getattr(self.inner, "reset", None)
        if reset is not None:
            reset()

    @property
    def _dynamo_backend_init(self) -> Any:
        # torch 2.15+: a backend's no-argument set-up hook, which dynamo reads off the
        # backend at torch.compile() (``getattr(backend, "_dynamo_backend_init", None)``);
        # torch's own wrapper forwards it the same way. Hidden, a wrapped backend would
        # skip its set-up whenever autoweave (or its report) wraps it.
        return getattr(self.inner, "_dynamo_backend_init", None)


def wrap_backend(kwargs: dict[str, Any], wrap: Any) -> dict[str, Any]:
    """``torch.compile`` kwargs whose backend is ``wrap(the callable torch would build)``.

    ``backend``, ``mode`` and ``options`` become that one callable (options
    dynamo reads itself, ``guard_filter_fn``, stay), so compiling through the
    wrapper compiles exactly as asked. AOTInductor options are not rebuilt:
    ``UnsupportedTorch``.
    """
    options = kwargs.get("options")
    if isinstance(options, dict) and options.get("use_aoti"):
        raise UnsupportedTorch("AOTInductor compile options cannot be wrapped")
    kept = dict(options) if isinstance(options, dict) else None
    guard_filter_fn = kept.pop("guard_filter_fn", None) if kept else None
    inner = compile_backend(
        kwargs.get("backend", "inductor"), kwargs.get("mode"), kept, kwargs.get("dynamic"), kwargs.get("name")
    )
    out = {k: v for k, v in kwargs.items() if k not in ("backend", "mode", "options")}
    out["backend"] = wrap(inner)
    if guard_filter_fn is not None:
        out["options"] = {"guard_filter_fn": guard_filter_fn}
    return out


def compile_callbacks() -> Any:
    """dynamo's compile start/end callback registry, or None where torch lacks it."""
    return _optional("torch._dynamo.callback.callback_handler")


# Where FSDP2's per-unit state class lives (its ``init`` runs once per ``fully_shard`` call).
FSDP2_STATE_MODULES = (
    "torch.distributed.fsdp._fully_shard._fsdp_state",
    "torch.distributed._composable.fsdp._fsdp_state",
)


def register_module_registration_hook(hook: Any) -> Any:
    """torch's global hook on every submodule registration; returns its handle (None if missing)."""
    import torch.nn.modules.module as module_mod

    register = getattr(module_mod, "register_module_module_registration_hook", None)
    return None if register is None else register(hook)


def reset_code(code: Any) -> bool:
    """Drop dynamo's cache entries for one code object (its next call recompiles); False if unsupported."""
    try:
        import torch._dynamo

        reset = torch._dynamo.reset_code
    except (ImportError, AttributeError):
        return False
    reset(code)
    return True


@functools.cache
def torch_logging_internal() -> Any:
    """``torch._logging._internal`` when it has what ``_torchlogs`` uses, else None."""
    import importlib

    try:
        internal = importlib.import_module("torch._logging._internal")
    except ImportError:
        return None
    needed = ("log_registry", "register_log", "_is_torch_handler", "_setup_handlers")
    return internal if all(hasattr(internal, name) for name in needed) else None


@functools.cache
def _dynamo_compile_code() -> Any:
    try:
        from torch._dynamo import convert_frame

        return inspect.unwrap(convert_frame._compile).__code__
    except (ImportError, AttributeError):
        return None


def code_being_compiled() -> Any:
    """The code object dynamo is compiling now (the ``code`` argument of its ``_compile``), or None.

    dynamo's compile-start callbacks are told the compile id, not the frame; the
    frame is an argument of ``torch._dynamo.convert_frame._compile``, up the stack.
    """
    import sys
    import types

    target = _dynamo_compile_code()
    if target is None:
        return None
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is target:
            code = frame.f_locals.get("code")
            return code if isinstance(code, types.CodeType) else None
        frame = frame.f_back
    return None


# The name dynamo gives a function that resumes a frame after a graph break (resume_execution.py;
# the same on every torch in TESTED_TORCH): ``torch_dynamo_resume_in_<name>_at_<line>``.
_RESUME_NAME = re.compile(r"^torch_dynamo_resume_in_(.+)_at_\d+$")


def resumed_name(code_name: str) -> str:
    """The name of the frame a resume function continues (through resumes of resumes); else ``code_name``."""
    for _ in range(8):
        match = _RESUME_NAME.match(code_name)
        if match is None:
            break
        code_name = match.group(1)
    return code_name


# -- failing open inside dynamo -----------------------------------------------------------
#
# What torch's ``torch._dynamo.config.suppress_errors`` does, scoped to autoweave's
# regions (see ``_failopen``): a graph the backend fails on, or a frame dynamo
# fails to convert, runs eager in the same call instead of raising. Dynamo
# converts a frame before running it, so running that frame eager runs nothing twice.

# dynamo's warning when it suppressed an error and runs the frame eager
# (``format_error_msg`` in torch/_dynamo/exc.py, logged by ``ConvertFrame.__call__``).
CONVERT_FRAME_LOGGER = "torch._dynamo.convert_frame"
SUPPRESSED_NEEDLE = "WON'T CONVERT"


@functools.cache
def backend_errors_dynamo_handles() -> tuple[type[BaseException], ...]:
    """What a backend may raise that dynamo acts on itself: a fail-open backend lets these through.

    ``OutputGraph.call_user_compiler`` re-raises a restart, a skip, a failure
    it already reported and ``IndexError`` (a dim out of range: the user's
    error, raised as such), and turns the fake-tensor exceptions in
    ``exceptions_allowed_to_be_fallback`` into a graph break.
    """
    found: list[type[BaseException]] = [IndexError]
    for path in (
        "torch._dynamo.exc.RestartAnalysis",
        "torch._dynamo.exc.SkipFrame",
        "torch._dynamo.exc.ShortenTraceback",
    ):
        exc_type = _optional(path)
        if exc_type is not None:
            found.append(exc_type)
    try:
        found.extend(_first("torch._dynamo.exc.exceptions_allowed_to_be_fallback"))
    except (UnsupportedTorch, TypeError):
        pass
    return tuple(found)


@functools.cache
def _convert_frame_call_code() -> Any:
    try:
        from torch._dynamo import convert_frame

        return inspect.unwrap(convert_frame.ConvertFrame.__call__).__code__
    except (ImportError, AttributeError):
        return None


def _converting_code() -> Any:
    """The code of the frame dynamo's ``ConvertFrame.__call__`` (up the stack) is converting, or None."""
    import sys

    target = _convert_frame_call_code()
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is target:
            return getattr(frame.f_locals.get("frame"), "f_code", None)
        frame = frame.f_back
    return None


class _SuppressedErrors(logging.Filter):
    """On dynamo's convert-frame logger: this thread's suppressed errors go to a callback, not the log.

    Records the logger would not have shown (we may have lowered its level to
    hear the warning) are dropped; everything else passes.
    """

    def __init__(self, on_error: Callable[[BaseException, Any], None], shown: int) -> None:
        super().__init__()
        self._on_error = on_error
        self._shown = shown
        self._thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        if (
            record.thread in (self._thread, None)  # None: logging.logThreads is off
            and record.levelno == logging.WARNING
            and record.exc_info
            and record.exc_info[1] is not None
            and SUPPRESSED_NEEDLE in str(record.msg)
        ):
            self._on_error(record.exc_info[1], _converting_code())
            return False
        return record.levelno >= self._shown


@contextmanager
def suppressing_conversion_errors(on_error: Callable[[BaseException, Any], None]) -> Iterator[bool]:
    """While inside, a frame dynamo fails to convert runs eager, told to ``on_error(exc, code)``.

    torch's own ``suppress_errors`` (which, as torch does, makes dynamo skip
    that code from then on; ``compile_again`` undoes it), with dynamo's warning
    for this thread's frames replaced by the callback. Yields False, changing
    nothing, where it cannot be done: on a torch without these names, or when
    ``fail_on_recompile_limit_hit`` is set (torch rejects the two together).
    The config is process-wide: another thread compiling meanwhile is suppressed too.
    """
    try:
        import torch._dynamo.config as config
    except ImportError:
        yield False
        return
    if _convert_frame_call_code() is None or getattr(config, "fail_on_recompile_limit_hit", False):
        yield False
        return
    log = logging.getLogger(CONVERT_FRAME_LOGGER)
    shown, level = log.getEffectiveLevel(), log.level
    listener = _SuppressedErrors(on_error, shown)
    log.addFilter(listener)
    if shown > logging.WARNING:
        log.setLevel(logging.WARNING)  # to hear the warning; the filter drops what was hidden
    try:
        with config.patch(suppress_errors=True):
            yield True
    finally:
        log.removeFilter(listener)
        if shown > logging.WARNING and log.level == logging.WARNING:
            log.setLevel(level)


def compile_again(code: Any) -> None:
    """Undo the skip dynamo put on ``code`` when it suppressed an error there: its next call compiles."""
    try:
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
    except ImportError:
        reset_code(code)
        return
    set_code_exec_strategy(code, FrameExecStrategy(FrameAction.DEFAULT, FrameAction.DEFAULT))


# -- dynamo's log signals -----------------------------------------------------------------
#
# dynamo tells what autoweave must react to only in log records; each string is
# matched against what torch 2.11-2.15 log. No public API carries these yet: a
# structured "region fell back" event would retire them (pytorch/pytorch#135816
# tracks checkpointed regions falling back to eager).

# "<checkpoint> ... will fall back to eager-mode PyTorch": a traced checkpoint gave up.
FALLBACK_LOGGER = "torch._dynamo.variables.higher_order_ops"
FALLBACK_NEEDLE = "fall back to eager-mode PyTorch"
# dynamo's warning when a frame's cache is full and it runs eager from then on.
RECOMPILE_LIMIT_LOGGER = "torch._dynamo.convert_frame"
RECOMPILE_LIMIT_NEEDLE = "hit config."
# dynamo's graph-break artifact logger (``getArtifactLogger(__name__, "graph_breaks")``
# in torch/_dynamo/symbolic_convert.py); one record per graph break, with the user stack.
GRAPH_BREAK_LOGGER = "torch._dynamo.symbolic_convert.__graph_breaks"
# The note dynamo adds to a break raised inside a checkpoint's body.
HOP_CHECKPOINT_NOTE = "Higher Order Operator: torch.utils.checkpoint"
# The metadata key on a checkpoint body's GraphModule that carries the selective-AC policy,
# read by ``tag_activation_checkpoint``'s implementation (torch/_higher_order_ops/wrap.py).
CHECKPOINT_CONTEXT_FN_KEY = "_checkpoint_context_fn"


# -- what autoweave needs from torch, checked on a torch newer than tested ---------------


def _source_has(module_name: str, *needles: str) -> bool:
    import importlib

    module = importlib.import_module(module_name)
    text = inspect.getsource(module)
    return all(needle in text for needle in needles)


def _init_names(cls: type, *names: str) -> bool:
    """Do the ``__init__``s of ``cls`` and its bases set (or read) every attribute in ``names``?"""
    seen: set[str] = set()
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        code = getattr(inspect.unwrap(init), "__code__", None) if init is not None else None
        if code is not None:
            seen.update(code.co_names)
    return all(name in seen for name in names)


def _fsdp2_state() -> bool:
    import importlib

    for name in FSDP2_STATE_MODULES:
        try:
            state = importlib.import_module(name).FSDPState
        except (ImportError, AttributeError):
            continue
        return all(callable(getattr(state, attr, None)) for attr in ("init", "_pre_forward", "_post_forward"))
    return False


def _compile_code_argument() -> bool:
    code = _dynamo_compile_code()
    return code is not None and "code" in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]


def _needs() -> tuple[tuple[str, Callable[[], Any]], ...]:
    """(what, probe) for every torch name autoweave relies on; a probe is truthy when it is there."""
    import torch

    def has(path: str) -> Callable[[], bool]:
        return lambda: _first(path) is not None

    return (
        ("torch._dynamo.eval_frame.OptimizedModule", optimized_module),
        ("OptimizedModule._orig_mod", lambda: _init_names(optimized_module(), "_orig_mod")),
        ("torch.nn.Module._compiled_call_impl", lambda: "_compiled_call_impl" in vars(torch.nn.Module)),
        (f"dynamo's inline hook {TRACE_AS!r}", lambda: _source_has("torch._dynamo.eval_frame", TRACE_AS)),
        (
            "torch.nn.Module._forward_pre_hooks/_forward_hooks",
            lambda: {"_forward_pre_hooks", "_forward_hooks"} <= set(vars(torch.nn.Module())),
        ),
        ("CheckpointWrapper", checkpoint_wrapper_class),
        (
            "CheckpointWrapper._checkpoint_wrapped_module/checkpoint_fn",
            lambda: _init_names(checkpoint_wrapper_class(), "_checkpoint_wrapped_module", "checkpoint_fn"),
        ),
        ("torch._higher_order_ops.wrap.tag_activation_checkpoint", tag_activation_checkpoint),
        (
            f"the checkpoint operator's {CHECKPOINT_CONTEXT_FN_KEY!r} key",
            lambda: _source_has("torch._higher_order_ops.wrap", CHECKPOINT_CONTEXT_FN_KEY),
        ),
        ("torch._dynamo.exc.Unsupported", has("torch._dynamo.exc.Unsupported")),
        ("torch._dynamo.disable", has("torch._dynamo.disable")),
        ("torch._dynamo.reset_code", has("torch._dynamo.reset_code")),
        ("torch._dynamo.utils.counters", has("torch._dynamo.utils.counters")),
        (
            "torch._dynamo.backends.registry.lookup_backend",
            has("torch._dynamo.backends.registry.lookup_backend"),
        ),
        ("torch._TorchCompileInductorWrapper", has("torch._TorchCompileInductorWrapper")),
        ("torch._TorchCompileWrapper", has("torch._TorchCompileWrapper")),
        ("torch._dynamo.callback.callback_handler", has("torch._dynamo.callback.callback_handler")),
        ("torch._dynamo.convert_frame._compile(code, ...)", _compile_code_argument),
        (
            "torch.nn.modules.module.register_module_module_registration_hook",
            has("torch.nn.modules.module.register_module_module_registration_hook"),
        ),
        ("FSDP2's FSDPState.init/_pre_forward/_post_forward", _fsdp2_state),
        ("torch._logging._internal (log registry)", torch_logging_internal),
        (
            f"dynamo's fallback message {FALLBACK_NEEDLE!r}",
            lambda: _source_has("torch._dynamo.variables.higher_order_ops", FALLBACK_NEEDLE),
        ),
        (
            f"dynamo's recompile-limit message {RECOMPILE_LIMIT_NEEDLE!r}",
            lambda: _source_has("torch._dynamo.convert_frame", RECOMPILE_LIMIT_NEEDLE),
        ),
        (
            "dynamo's graph_breaks log artifact",
            lambda: _source_has("torch._dynamo.symbolic_convert", '"graph_breaks"'),
        ),
        (
            "torch._dynamo.config.suppress_errors",
            lambda: hasattr(_first("torch._dynamo.config"), "suppress_errors"),
        ),
        ("torch._dynamo.convert_frame.ConvertFrame.__call__(frame, ...)", _convert_frame_argument),
        (
            f"dynamo's suppressed-error message {SUPPRESSED_NEEDLE!r}",
            lambda: _source_has("torch._dynamo.exc", SUPPRESSED_NEEDLE),
        ),
        ("torch._C._dynamo.eval_frame.set_code_exec_strategy", _code_exec_strategy),
    )


def _convert_frame_argument() -> bool:
    code = _convert_frame_call_code()
    return code is not None and "frame" in code.co_varnames[: code.co_argcount]


def _code_exec_strategy() -> bool:
    from torch._C._dynamo.eval_frame import set_code_exec_strategy  # noqa: F401
    from torch._dynamo.types import FrameAction, FrameExecStrategy  # noqa: F401

    return True


def _self_check_once() -> list[str]:
    # The installed torch does not change within a process; the check imports dynamo.
    global _self_check_result
    if _self_check_result is None:
        _self_check_result = self_check()
    return list(_self_check_result)


_self_check_result: list[str] | None = None


def self_check() -> list[str]:
    """What autoweave needs from the installed torch and cannot find (empty: all there).

    Run on a torch newer than ``TESTED_TORCH`` before anything is patched: a
    release that moved one of these names leaves autoweave off, naming it,
    instead of failing deep inside a patch.
    """
    missing = []
    for what, probe in _needs():
        try:
            ok = probe()
        except Exception:  # a moved module, a changed signature: that name is missing
            ok = False
        if not ok:
            missing.append(what)
    return missing


@functools.cache
def checkpointed_function_class() -> type | None:
    """torch 2.15+'s ``checkpoint(**options)(fn)`` result class, or None on an older torch.

    Private: the decorator form returns it and nothing public names it. Needed until
    dynamo traces it as its checkpoint operator.
    """
    return _optional("torch.utils.checkpoint._CheckpointedFunction")


# -- activation memory: saved-tensor hooks, the SAC policy, fake tensors ---------------------


def saved_tensors_hooks_active() -> bool:
    """Are saved-tensor hooks in force here (a user's, or an eager checkpoint's around this call)?

    A measure that installs its own would shadow them: autoweave then does not measure.
    """
    import torch

    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return True  # cannot tell: assume so, and do not measure
    try:
        return top(True) is not None
    except TypeError:  # an older signature, without the tracing flag
        return top() is not None


@functools.cache
def _sac_forward_mode() -> type | None:
    return _optional("torch.utils.checkpoint._CachingTorchDispatchMode")


def observe_sac_policy(contexts: Any, observe: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    """Swap the policy of torch's SAC forward context in ``contexts`` for ``observe(policy)``.

    ``contexts`` is what a ``context_fn`` returned, ``(forward, recompute)``;
    only the forward one (``create_selective_checkpoint_contexts``'s caching
    mode, whose ``policy_fn`` it calls for every op) is changed, so the
    recompute context decides as before. False when it is not torch's.
    """
    mode_cls = _sac_forward_mode()
    forward = contexts[0] if isinstance(contexts, tuple) and contexts else None
    if (
        mode_cls is None
        or not isinstance(forward, mode_cls)
        or not callable(getattr(forward, "policy_fn", None))
    ):
        return False
    forward.policy_fn = observe(forward.policy_fn)
    return True


def in_backward() -> bool:
    """Is this code running inside autograd's backward (a checkpoint's recompute, say)?"""
    import torch

    current = getattr(torch._C, "_current_graph_task_id", None)
    try:
        return current is not None and int(current()) != -1
    except Exception:
        return False


def next_autograd_sequence_nr() -> int | None:
    """The number autograd gives the next node it creates (no op is run to learn it); None if unknown."""
    import torch

    peek = getattr(torch._C._autograd, "_get_sequence_nr", None)
    if peek is None:
        return None
    try:
        return int(peek())
    except Exception:
        return None


def autograd_sequence_nr(node: Any) -> int | None:
    """The creation number autograd gave ``node`` (per thread, increasing); None where it cannot be read."""
    try:
        return int(node._sequence_nr())
    except Exception:
        return None


def is_dispatch_mode(value: Any) -> bool:
    """Is ``value`` a ``TorchDispatchMode`` (what a traced checkpoint needs its ``context_fn`` to return)?"""
    mode_cls = _optional("torch.utils._python_dispatch.TorchDispatchMode")
    return mode_cls is not None and isinstance(value, mode_cls)


def selective_contexts_factory() -> Any:
    """torch's ``create_selective_checkpoint_contexts`` (None on a torch without it)."""
    return _optional("torch.utils.checkpoint.create_selective_checkpoint_contexts")


def fake_tensor_mode() -> Any:
    """A fresh ``FakeTensorMode`` of autoweave's own (no shape env: static shapes), for inspecting a graph.

    A real tensor a graph holds as a constant is made fake when an op meets it.
    """
    return _first("torch._subclasses.fake_tensor.FakeTensorMode")(allow_non_fake_inputs=True)


def storage_key(tensor: Any) -> Any:
    """What identifies ``tensor``'s storage (shared by its views), fake tensors included; None if none."""
    try:
        return tensor.untyped_storage()._cdata
    except Exception:  # a subclass without one storage (a DTensor), a sparse tensor
        return None


def returns_fresh_storage(op: Any, index: int) -> bool:
    """Does output ``index`` of aten op ``op`` have storage of its own (no view of, or write into, an input)?"""
    try:
        returns = op._schema.returns
        return returns[index].alias_info is None if index < len(returns) else True
    except AttributeError:  # not an OpOverload (a higher-order operator)
        return True


def size_hint(value: Any) -> int | None:
    """An int for a size, a symbolic one read from its hint (never guarded on); None if it has none."""
    if isinstance(value, int):
        return value
    hint = getattr(getattr(value, "node", None), "hint", None)
    return int(hint) if isinstance(hint, int) else None


def is_fake(tensor: Any) -> bool:
    """Is ``tensor`` a fake tensor (dynamo's or AOTAutograd's tracing, or autoweave's own inspection)?"""
    try:
        return bool(_first("torch._subclasses.fake_tensor.is_fake")(tensor))
    except UnsupportedTorch:
        return False
