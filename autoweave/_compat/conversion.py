"""Failing open inside dynamo: a graph or a frame that fails to compile runs eager, in the same call.

What torch's ``torch._dynamo.config.suppress_errors`` does, scoped to autoweave's
regions (see ``autoweave._failopen``): a graph the backend fails on, or a frame
dynamo fails to convert, runs eager instead of raising. Dynamo converts a frame
before running it, so running that frame eager runs nothing twice. The warning
dynamo logs for such a frame is read in ``log_strings`` (``WontConvert``).

Torch range: ``suppress_errors``, ``ConvertFrame.__call__(frame, ...)`` and
``set_code_exec_strategy`` as on 2.11-2.15 (``version.self_check`` probes them).
torch has no per-region ``suppress_errors`` and no public way to undo the skip
it puts on a failed frame; no upstream issue asks for either that we found.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from autoweave._compat.dynamo import reset_code
from autoweave._compat.lookup import UnsupportedTorch, find, find_optional


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
        exc_type = find_optional(path)
        if exc_type is not None:
            found.append(exc_type)
    try:
        found.extend(find("torch._dynamo.exc.exceptions_allowed_to_be_fallback"))
    except (UnsupportedTorch, TypeError):
        pass
    return tuple(found)


@functools.cache
def convert_frame_call_code() -> Any:
    """The code of dynamo's ``ConvertFrame.__call__`` (None where it moved)."""
    try:
        from torch._dynamo import convert_frame

        return inspect.unwrap(convert_frame.ConvertFrame.__call__).__code__
    except (ImportError, AttributeError):
        return None


def converting_code() -> Any:
    """The code of the frame dynamo's ``ConvertFrame.__call__`` (up the stack) is converting, or None."""
    target = convert_frame_call_code()
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is target:
            return getattr(frame.f_locals.get("frame"), "f_code", None)
        frame = frame.f_back
    return None


@contextmanager
def suppressing_errors() -> Iterator[bool]:
    """While inside, dynamo runs a frame it fails to convert eager (``suppress_errors``); yields True.

    Yields False, changing nothing, where it cannot be done: on a torch without
    these names, or when ``fail_on_recompile_limit_hit`` is set (torch rejects
    the two together). As torch does, dynamo skips such code from then on
    (``compile_again`` undoes it). The config is process-wide: another thread
    compiling meanwhile is suppressed too.
    """
    try:
        import torch._dynamo.config as config
    except ImportError:
        yield False
        return
    if convert_frame_call_code() is None or getattr(config, "fail_on_recompile_limit_hit", False):
        yield False
        return
    with config.patch(suppress_errors=True):
        yield True


def compile_again(code: Any) -> None:
    """Undo the skip dynamo put on ``code`` when it suppressed an error there: its next call compiles."""
    try:
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
    except ImportError:
        reset_code(code)
        return
    set_code_exec_strategy(code, FrameExecStrategy(FrameAction.DEFAULT, FrameAction.DEFAULT))
