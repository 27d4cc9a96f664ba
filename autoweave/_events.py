"""What the dispatchers publish, and who listens: a tiny publish/subscribe below every layer.

The dispatcher (``dispatch/``) is the hub of a compiled module's life, yet the
observers (``observe/``: the plan summary, the report, the structured trace)
sit below it and must not be called from inside its state machine: the
machine only moves, and says so here. Observers subscribe when they start,
each subscription with its undo (an install of ``_installs``, or the report's
collector, itself an install, for its own), so ``disable()`` leaves no listener
behind.

A listener that raises is autoweave's own failure in an observation: counted
and logged (``_failopen.guard``, quiet), never in the way of what runs.

Topics and what each publishes (positional arguments):

- ``MOVED``: ``(dispatcher, state, why)``, after every move of a dispatcher's
  state machine; ``state`` and ``why`` are the values of its ``State`` and ``Why``.
- ``PLANNED``: ``(dispatcher, plan)``, a plan was applied (or given up for plain).
- ``CALLED_AGAIN``: ``(dispatcher,)``, a planned module was called again while a
  plan summary waits (the next step began).
- ``WOVEN_AROUND``: ``(dispatcher, fallbacks)``, a first call fell back to eager
  ``fallbacks`` times and the dispatcher re-planned around the break.
- ``PLAN_RECORDED``: ``(entry,)``, the plan summary recorded a plan (``observe.summary.Entry``).
- ``GRAPH_COMPILED``: ``(graph,)``, a woven region's backend compiled (or ran eager) one graph
  dynamo handed it (``weave.pieces.CompiledGraph``); published only while someone listens.
- ``PLAIN_COMPILED``: ``(module, compiled)``, ``torch.compile`` (or ``module.compile()``) made
  ``compiled`` of ``module``, before any dispatcher exists; published only while someone listens.
- ``AT_LIMIT``: ``(label,)``, a woven region is at dynamo's recompile limit and runs eager
  (under its checkpoint, if it has one) the calls none of its graphs fits
  (``_compat.regions.lookups_in_order``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from autoweave._failopen import guard

MOVED = "moved"
PLANNED = "planned"
CALLED_AGAIN = "called-again"
WOVEN_AROUND = "woven-around"
PLAN_RECORDED = "plan-recorded"
AT_LIMIT = "at-limit"
GRAPH_COMPILED = "graph-compiled"
PLAIN_COMPILED = "plain-compiled"

# The state values a ``MOVED`` listener compares with (``dispatch.dispatchers.State``).
PLAIN = "plain"
WOVEN = "woven"

_lock = threading.Lock()
# topic -> its listeners, in subscription order. Replaced, never mutated, so
# ``publish`` reads it without the lock.
_listeners: dict[str, tuple[Callable[..., None], ...]] = {}


def subscribe(topic: str, listener: Callable[..., None]) -> Callable[[], None]:
    """Call ``listener(*args)`` for every ``publish(topic, *args)`` from now on; returns the undo.

    Subscribing the same listener twice is harmless (it is called once).
    """
    with _lock:
        current = _listeners.get(topic, ())
        if listener not in current:
            _listeners[topic] = (*current, listener)
    return lambda: unsubscribe(topic, listener)


def unsubscribe(topic: str, listener: Callable[..., None]) -> None:
    with _lock:
        _listeners[topic] = tuple(fn for fn in _listeners.get(topic, ()) if fn != listener)


def listened(topic: str) -> bool:
    """Does anyone listen to ``topic`` (a publisher skips measuring what no one reads)?"""
    return bool(_listeners.get(topic))


def publish(topic: str, *args: Any) -> None:
    """Tell every listener of ``topic``, in subscription order. Never raises (strict mode aside)."""
    for listener in _listeners.get(topic, ()):
        with guard(f"telling {getattr(listener, '__qualname__', listener)} of {topic!r}", quiet=True):
            listener(*args)
