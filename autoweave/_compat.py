"""Private torch names, looked up once and behind guards.

torch moves private names between releases; every one autoweave touches is
resolved here so an unsupported torch gives one clear message instead of a
traceback deep inside a patch.
"""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any

SUPPORTED_TORCH = ((2, 11), (2, 14))  # inclusive range of (major, minor)


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


def check_torch_version(raw: str | None = None) -> None:
    """Raise ``UnsupportedTorch`` with the accepted range when torch is outside it."""
    version = torch_version(raw)
    low, high = SUPPORTED_TORCH
    if not low <= version <= high:
        found = raw
        if found is None:
            import torch

            found = torch.__version__
        raise UnsupportedTorch(
            f"torch {found} is not supported (autoweave supports torch "
            f"{low[0]}.{low[1]} to {high[0]}.{high[1]}); staying off. "
            "Install a supported torch or unset AUTOWEAVE."
        )


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


@functools.cache
def optimized_module() -> type:
    return _first("torch._dynamo.eval_frame.OptimizedModule")


@functools.cache
def checkpoint_wrapper_class() -> type:
    return _first("torch.distributed.algorithms._checkpoint.checkpoint_wrapper.CheckpointWrapper")


@functools.cache
def fsdp2_module() -> type | None:
    try:
        return _first(
            "torch.distributed.fsdp.FSDPModule",
            "torch.distributed._composable.fsdp.FSDPModule",
        )
    except UnsupportedTorch:
        return None  # torch built without distributed


@functools.cache
def fsdp1_module() -> type | None:
    try:
        return _first("torch.distributed.fsdp.FullyShardedDataParallel")
    except UnsupportedTorch:
        return None


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
    try:
        return _first("torch._dynamo.callback.callback_handler")
    except UnsupportedTorch:
        return None


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
