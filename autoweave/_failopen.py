"""One fail-open guard for bootstrap, hooks, planning, applying and compiling.

On an exception the caller falls back to what plain torch would do. The user
sees one warning per process on stderr (the logger may be silent, and a broken
run must not be); the traceback goes to the logger at debug level. Strict mode
re-raises instead.

What fails while a forward runs (a woven region's compile) degrades where it
failed, in that call: never by running the forward again, which would repeat
its side effects, its RNG draws and, under FSDP, its collectives on one rank only.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from autoweave import _compat, _settings, _taps
from autoweave._compat.log_strings import WontConvert
from autoweave._log import logger, rank
from autoweave._state import run

_lock = threading.Lock()


class AutoweaveError(RuntimeError):
    """Raised in strict mode when autoweave itself fails."""


def _strict() -> bool:
    return _settings.current().strict


def swallowed(slug: str, key: str, message: str, exc: BaseException, *, quiet: bool = False) -> None:
    """The one fail-open policy: count what was swallowed, say it once per ``key``, or raise (strict).

    Every place autoweave degrades instead of failing (``guard``, a graph, a
    piece, a first call's frames) comes here: the count per slug goes into the
    report; the traceback goes to the logger at debug level; stderr gets one
    warning per key with its slug (README lists them); ``AUTOWEAVE_STRICT=1``
    raises ``AutoweaveError`` from the original instead. ``quiet``: counted and
    logged, not written to stderr (what fails is only an observation: the plan
    summary, the structured trace, a graph-break place).
    """
    with _lock:
        run.swallowed[slug] = run.swallowed.get(slug, 0) + 1
    if _strict():
        raise AutoweaveError(f"autoweave [{slug}]: {message}") from exc
    logger.debug("[%s] %s", slug, message, exc_info=exc)
    if not quiet:
        warn_each(
            key,
            f"[{slug}] {message}. Set AUTOWEAVE_STRICT=1 to raise, AUTOWEAVE_LOG_LEVEL=debug for the traceback.",
        )


@contextmanager
def guard(
    what: str, *, fallback: str = "running as plain torch would", quiet: bool = False
) -> Iterator[list[BaseException]]:
    """Run a block; on failure record it, warn once, and let the caller fall back.

    Yields a list that holds the exception when one was swallowed, so the caller
    can tell whether to take its fallback path. Internal errors are told once per
    process (the first one is the one to report; later ones are often its echo).
    """
    caught: list[BaseException] = []
    try:
        yield caught
    except Exception as exc:
        caught.append(exc)
        message = f"failed while {what}: {type(exc).__name__}: {exc}; {fallback}"
        swallowed("internal-error", "internal-error", message, exc, quiet=quiet)


def warn_each(key: str, message: str) -> bool:
    """Write ``message`` to stderr once per ``key`` (e.g. once per module that fell back); True the time it does."""
    with _lock:
        if key in run.warned_keys:
            return False
        run.warned_keys.add(key)
    logger.debug("%s", message)
    try:
        sys.stderr.write(f"autoweave[rank{rank()}]: {message}\n")
    except Exception:  # a closed stderr must not turn a warning into a crash
        pass
    return True


def first_line(exc: BaseException) -> str:
    """``Type: first line`` of an error; a line ending in ':' (dynamo's "backend='x' raised:") runs on."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    for line in lines[1:]:
        if not text.endswith(":"):
            break
        text = f"{text} {line}"
    text = text[:240]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# Set on what a backend returns for a graph that runs eager instead of compiled (a piece under
# its checkpoint, say): the report then counts that graph as eager, with the reason.
RAN_EAGER = "_autoweave_runs_eager"


def runs_eager(fn: Any, why: str) -> Any:
    """Mark ``fn``, returned by a backend in place of a compiled graph, as running eager (and why)."""
    try:
        setattr(fn, RAN_EAGER, why)
    except (AttributeError, TypeError):  # a bound method, a builtin: cannot carry the mark
        pass
    return fn


class FailedFrames:
    """The frames dynamo could not convert during a first call, each run eager instead."""

    def __init__(self) -> None:
        self.errors: list[tuple[BaseException, Any]] = []  # (exception, the frame's code or None)

    def compile_again(self) -> None:
        """Dynamo skips a frame it failed on from then on: have each compiled at its next call."""
        for _, code in self.errors:
            if code is not None:
                _compat.dynamo.compile_again(code)

    def describe(self) -> str:
        """The first failure, for a warning: the frame and the first line of its error."""
        exc, code = self.errors[0]
        where = (
            f"`{code.co_name}` ({code.co_filename}:{code.co_firstlineno})" if code is not None else "a frame"
        )
        return f"{where} ({first_line(exc)})"


@contextmanager
def frames_fail_open() -> Iterator[FailedFrames]:
    """While inside, a frame dynamo fails to convert runs eager and is recorded, not raised.

    Dynamo converts a frame before running it, so running that frame eager (with the
    frames it calls) repeats nothing; the rest of the call stays compiled. The caller decides,
    once the call is over, whose failure it was: an exception that still
    escaped is the model's own (eager raised it too), so the frames are
    compiled again next time; a call that succeeded hit one of autoweave's.
    """
    failed = FailedFrames()
    with _compat.dynamo.suppressing_errors() as suppressing:
        if not suppressing:
            yield failed
            return
        thread = threading.get_ident()

        def on_error(message: WontConvert) -> bool:
            # dynamo's warning for this thread's frames becomes the record; another
            # thread's is left to dynamo (the config is process-wide).
            if message.thread not in (thread, None):  # None: logging.logThreads is off
                return False
            failed.errors.append((message.error, _compat.dynamo.converting_code()))
            # Eager all the way down from this call on: the recompute then runs what the forward ran.
            _compat.dynamo.skip_with_callees(message.error)
            return True

        with _taps.listening(WontConvert, on_error):
            yield failed
