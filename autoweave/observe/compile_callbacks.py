"""dynamo's compile callbacks for autoweave's listeners, kept across ``torch._dynamo.reset()``.

The run report (``report_stats``) and the structured trace (``trace``) hear of
every compile through dynamo's compile start/end callbacks
(``torch._dynamo.callback.callback_handler``). ``torch._dynamo.reset()`` and
``torch.compiler.reset()``, which frameworks call between train and eval, clear
that registry (every torch autoweave supports), so every later compile went
unheard. ``listen`` registers callbacks and, while autoweave is on, keeps the
registry's ``clear`` wrapped (an install, with its undo): right after a clear,
whoever asked is registered again. Wrapping ``clear`` rather than the reset
functions also covers a ``reset`` imported by name before autoweave was on.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

from autoweave import _compat, _importhook, _installs
from autoweave._log import logger

Callback = Callable[..., None]
Undo = Callable[[], None]

KEEP = "dynamo's compile callbacks registered again after torch._dynamo.reset()"

_lock = threading.Lock()
# (kind, callback), kind "start" or "end", in the order they were registered.
_listening: list[tuple[str, Callback]] = []


def listen(start: Callback | None = None, end: Callback | None = None) -> Undo:
    """Register ``start``/``end`` with dynamo's compile callbacks, across resets; returns the undo.

    Registered once dynamo's callback module is imported (at once if it is): nothing
    compiles before, and importing dynamo here would cost every process that imports
    torch and never compiles 1.6 s of CPU. Where this torch has no callback registry,
    nothing is registered.
    """
    added = [(kind, fn) for kind, fn in (("start", start), ("end", end)) if fn is not None]
    with _lock:
        _listening.extend(added)

    def attach(_module: Any = None) -> None:
        handler = _compat.dynamo.compile_callbacks()
        if handler is None:
            return
        with _lock:
            for entry in added:
                if entry in _listening:  # not undone meanwhile
                    _register(handler, *entry)
        _installs.install(KEEP, lambda: _keep_across_resets(handler))

    _importhook.register(_compat.dynamo.COMPILE_CALLBACKS_MODULE, attach)

    def undo() -> None:
        _importhook.unregister(_compat.dynamo.COMPILE_CALLBACKS_MODULE, attach)
        handler = (
            _compat.dynamo.compile_callbacks()
            if _compat.dynamo.COMPILE_CALLBACKS_MODULE in sys.modules
            else None
        )
        with _lock:
            for entry in added:
                if entry in _listening:
                    _listening.remove(entry)
                if handler is not None:
                    _unregister(handler, *entry)

    return undo


def _register(handler: Any, kind: str, fn: Callback) -> None:
    getattr(handler, f"register_{kind}_callback")(fn)


def _unregister(handler: Any, kind: str, fn: Callback) -> None:
    if fn in getattr(handler, f"{kind}_callbacks"):  # a reset may have taken it already
        getattr(handler, f"remove_{kind}_callback")(fn)


def _keep_across_resets(handler: Any) -> Undo | None:
    clear = handler.clear

    def clear_then_listen() -> None:
        try:
            clear()  # raises after clearing when a compile is pending: registered again all the same
        finally:
            with _lock:
                for kind, fn in _listening:
                    _register(handler, kind, fn)

    try:
        handler.clear = clear_then_listen  # on the instance: every caller's reference to it
    except (AttributeError, TypeError) as exc:  # a registry with slots: callbacks end at a reset
        logger.debug("dynamo's compile callbacks are not kept across resets (%s)", exc)
        return None

    def undo() -> None:
        if handler.__dict__.get("clear") is clear_then_listen:  # someone else's wrapper on top: theirs
            del handler.clear

    return undo
