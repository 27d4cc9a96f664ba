"""Which torch autoweave runs on: the tested range, and a name-by-name check of a newer torch.

An older torch turns autoweave off. A newer one is checked at start-up
(``self_check``): every private name and dynamo message the other ``_compat``
modules rely on is probed; autoweave turns on when everything is there (with one
notice naming the untested version) and stays off naming what is missing
otherwise. ``AUTOWEAVE_UNTESTED_TORCH=off`` keeps it off on any newer torch.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autoweave._compat import backends, checkpoints, dynamo, log_strings, modules
from autoweave._compat.lookup import UnsupportedTorch, find, find_optional

# The torch releases autoweave is tested on, inclusive, as (major, minor).
TESTED_TORCH = ((2, 11), (2, 15))


def torch_version(raw: str) -> tuple[int, int]:
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


def _init_names(cls: type, *names: str) -> bool:
    """Do the ``__init__``s of ``cls`` and its bases set (or read) every attribute in ``names``?"""
    seen: set[str] = set()
    for klass in cls.__mro__:
        code = getattr(inspect.unwrap(vars(klass).get("__init__")), "__code__", None)
        seen.update(code.co_names if code is not None else ())
    return set(names) <= seen


def _fsdp2_state() -> bool:
    state = find_optional(*(f"{name}.FSDPState" for name in modules.FSDP2_STATE_MODULES))
    return state is not None and all(
        callable(getattr(state, attr, None)) for attr in ("init", "_pre_forward", "_post_forward")
    )


def _compile_code_argument() -> bool:
    code = dynamo.dynamo_compile_code()
    return code is not None and "code" in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]


def _needs() -> tuple[tuple[str, Callable[[], Any]], ...]:
    """(what, probe) for every torch name autoweave relies on; a probe is truthy when it is there."""
    import torch

    def has(path: str) -> tuple[str, Callable[[], bool]]:
        # A row for a name that only has to exist: reported by its own path.
        return path, lambda: find(path) is not None

    def in_source(what: str, module_name: str, needle: str) -> tuple[str, Callable[[], bool]]:
        # A row for a string dynamo's code must hold (a hook's name, a message's wording).
        return what, lambda: needle in inspect.getsource(importlib.import_module(module_name))

    def message(kind: str, module_name: str, needle: str) -> tuple[str, Callable[[], bool]]:
        # A row for the wording of a dynamo message ``log_strings`` reads.
        return in_source(f"dynamo's {kind} message {needle!r}", module_name, needle)

    return (
        ("torch._dynamo.eval_frame.OptimizedModule", modules.optimized_module),
        (
            "OptimizedModule._orig_mod/dynamo_ctx",
            lambda: _init_names(modules.optimized_module(), "_orig_mod", "dynamo_ctx"),
        ),
        ("torch.nn.Module._compiled_call_impl", lambda: "_compiled_call_impl" in vars(torch.nn.Module)),
        in_source(f"dynamo's inline hook {dynamo.TRACE_AS!r}", "torch._dynamo.eval_frame", dynamo.TRACE_AS),
        (
            "torch.nn.Module._forward_pre_hooks/_forward_hooks",
            lambda: {"_forward_pre_hooks", "_forward_hooks"} <= set(vars(torch.nn.Module())),
        ),
        ("CheckpointWrapper", modules.checkpoint_wrapper_class),
        (
            "CheckpointWrapper._checkpoint_wrapped_module/checkpoint_fn",
            lambda: _init_names(
                modules.checkpoint_wrapper_class(), "_checkpoint_wrapped_module", "checkpoint_fn"
            ),
        ),
        ("torch._higher_order_ops.wrap.tag_activation_checkpoint", checkpoints.tag_activation_checkpoint),
        in_source(
            f"the checkpoint operator's {checkpoints.CHECKPOINT_CONTEXT_FN_KEY!r} key",
            "torch._higher_order_ops.wrap",
            checkpoints.CHECKPOINT_CONTEXT_FN_KEY,
        ),
        # What a checkpoint's recompute reads to find its forward (``checkpoints.eager_checkpoint_frame``).
        in_source("the recompute hook's 'target_frame_ref'", "torch.utils.checkpoint", "target_frame_ref"),
        has("torch._dynamo.exc.Unsupported"),
        has("torch._dynamo.disable"),
        has("torch._dynamo.reset_code"),
        has("torch._dynamo.utils.counters"),
        # The dispatcher's watchdog counts entries by their guard builds (``dynamo.entries_made``).
        in_source("dynamo's 'build_guards' timing", "torch._dynamo.convert_frame", '"build_guards"'),
        has("torch._dynamo.utils.compilation_time_metrics"),
        has("torch._dynamo.backends.registry.lookup_backend"),
        has("torch._TorchCompileInductorWrapper"),
        has("torch._TorchCompileWrapper"),
        has("torch._dynamo.callback.callback_handler"),
        ("torch._dynamo.convert_frame._compile(code, ...)", _compile_code_argument),
        (
            "torch._dynamo.output_graph.OutputGraph.call_user_compiler(self, gm, example_inputs)",
            _handoff_arguments,
        ),
        has("torch.nn.modules.module.register_module_module_registration_hook"),
        ("FSDP2's FSDPState.init/_pre_forward/_post_forward", _fsdp2_state),
        ("torch._logging._internal (log registry)", dynamo.torch_logging_internal),
        message("fallback", log_strings.FALLBACK_LOGGER, log_strings.FALLBACK_NEEDLE),
        message("recompile-limit", "torch._dynamo.convert_frame", log_strings.RECOMPILE_LIMIT_NEEDLE),
        in_source("dynamo's graph_breaks log artifact", "torch._dynamo.symbolic_convert", '"graph_breaks"'),
        has("torch._dynamo.config.suppress_errors"),
        # While woven calls run, hooks of inlined modules are guarded (``regions._InsertionOrder``).
        has("torch._dynamo.config.skip_nnmodule_hook_guards"),
        # A frame that fails at a woven first call runs eager with its callees (``skip_with_callees``).
        in_source("dynamo's per-error 'frame_exec_strategy'", "torch._dynamo.exc", "frame_exec_strategy"),
        ("torch._dynamo.convert_frame.ConvertFrame.__call__(frame, ...)", _convert_frame_argument),
        message("suppressed-error", "torch._dynamo.exc", log_strings.SUPPRESSED_NEEDLE),
        ("torch._C._dynamo.eval_frame.set_code_exec_strategy", lambda: list(map(find, dynamo.EXEC_STRATEGY))),
    )


def _convert_frame_argument() -> bool:
    code = dynamo.convert_frame_call_code()
    return code is not None and "frame" in code.co_varnames[: code.co_argcount]


def _handoff_arguments() -> bool:
    owner = find_optional(f"{backends.HANDOFF_MODULE}.OutputGraph")
    code = getattr(inspect.unwrap(getattr(owner, "call_user_compiler", None)), "__code__", None)
    return code is not None and code.co_varnames[:3] == ("self", "gm", "example_inputs")


@functools.cache
def _self_check_once() -> tuple[str, ...]:
    # The installed torch does not change within a process; the check imports dynamo.
    return tuple(self_check())


def self_check() -> list[str]:
    """What autoweave needs from the installed torch and cannot find (empty: all there).

    Run on a torch newer than ``TESTED_TORCH`` before anything is patched: a
    release that moved one of these names leaves autoweave off, naming it,
    instead of failing deep inside a patch.
    """
    return [what for what, probe in _needs() if not _passes(probe)]


def _passes(probe: Callable[[], Any]) -> bool:
    try:
        return bool(probe())
    except Exception:  # a moved module, a changed signature: that name is missing
        return False
