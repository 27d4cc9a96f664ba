"""One fail-open guard for bootstrap, hooks, planning and applying.

On an exception the caller falls back to what plain torch would do. The user
sees one warning per process on stderr (the logger may be silent, and a broken
run must not be); the traceback goes to the logger at debug level. Strict mode
re-raises instead.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from autoweave import _settings
from autoweave._log import logger, rank
from autoweave._state import run

_lock = threading.Lock()


class AutoweaveError(RuntimeError):
    """Raised in strict mode when autoweave itself fails."""


def _strict() -> bool:
    return _settings.current().strict


def warn_once(message: str) -> None:
    """Write ``message`` to stderr unless a fallback warning was already written."""
    with _lock:
        if run.warned:
            return
        run.warned = True
    try:
        sys.stderr.write(f"autoweave[rank{rank()}]: {message}\n")
    except Exception:  # a closed stderr must not turn a warning into a crash
        pass


@contextmanager
def guard(what: str, *, fallback: str = "running as plain torch would") -> Iterator[list[BaseException]]:
    """Run a block; on failure record it, warn once, and let the caller fall back.

    Yields a list that holds the exception when one was swallowed, so the caller
    can tell whether to take its fallback path.
    """
    caught: list[BaseException] = []
    try:
        yield caught
    except Exception as exc:
        if _strict():
            raise AutoweaveError(f"autoweave failed while {what}: {exc}") from exc
        caught.append(exc)
        logger.debug("autoweave failed while %s", what, exc_info=True)
        warn_once(
            f"[internal-error] failed while {what}: {type(exc).__name__}: {exc}; "
            f"{fallback}. Set AUTOWEAVE_STRICT=1 to raise, AUTOWEAVE_LOG_LEVEL=debug for the traceback."
        )


def warn_each(key: str, message: str) -> None:
    """Write ``message`` to stderr once per ``key`` (e.g. once per module that fell back)."""
    with _lock:
        if key in run.warned_keys:
            return
        run.warned_keys.add(key)
    logger.debug("%s", message)
    try:
        sys.stderr.write(f"autoweave[rank{rank()}]: {message}\n")
    except Exception:  # a closed stderr must not turn a warning into a crash
        pass
