"""``TORCH_TRACE=<dir>``: autoweave's plans and woven regions in torch's structured trace (read by tlparse).

Two artifacts, both JSON:

* ``autoweave_plan``, one per plan, when the plan is made. A plan is made at the
  compiled module's first call, before any of its regions compile, so it carries
  no compile id (tlparse lists it with the process-wide artifacts) unless it is
  made inside another compile.
* ``autoweave_region``, at each dynamo compile of a woven region's code (its
  first compile, recompiles, and the resume functions dynamo makes at a graph
  break inside it): emitted from dynamo's compile-start callback, inside the
  compile's context, so it lands on that compile's page, next to the graphs.

Nothing is registered or emitted unless a structured trace is being written.

Also here: dynamo's compile callbacks for autoweave's listeners, kept across
``torch._dynamo.reset()``. The run report (``observe.report``) and the
structured trace hear of every compile through dynamo's compile start/end
callbacks (``torch._dynamo.callback.callback_handler``). ``torch._dynamo.reset()``
and ``torch.compiler.reset()``, which frameworks call between train and eval,
clear that registry (every torch autoweave supports), so every later compile
went unheard. ``listen`` registers callbacks and, while autoweave is on, keeps
the registry's ``clear`` wrapped (an install, with its undo): right after a
clear, whoever asked is registered again. Wrapping ``clear`` rather than the
reset functions also covers a ``reset`` imported by name before autoweave was on.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from autoweave import _compat, _installs
from autoweave._failopen import guard
from autoweave._log import logger
from autoweave._state import run
from autoweave.observe import summary
from autoweave.planning import sources
from autoweave.sense import names

PLAN_ARTIFACT = "autoweave_plan"
REGION_ARTIFACT = "autoweave_region"
# The install (``autoweave._installs``) of the compile-start callback that writes each region.
_REGION_CALLBACK = "dynamo compile-start callback: TORCH_TRACE writes each woven region"

# What each region's artifact says lives on ``_state.run.trace_regions``.
_lock = threading.Lock()


def enabled() -> bool:
    """Is torch writing a structured trace (``TORCH_TRACE``, ``TORCH_DTRACE``, ``TORCH_COMPILE_DEBUG=1``)?"""
    return bool(
        os.environ.get("TORCH_TRACE")
        or os.environ.get("TORCH_DTRACE")
        or os.environ.get("TORCH_COMPILE_DEBUG", "0") == "1"
    )


def plan_payload(entry: summary.Entry) -> dict[str, Any]:
    """A recorded plan as the ``autoweave_plan`` artifact shows it."""
    plan = entry.plan
    return {
        **entry.record(summary.format_plan(plan, name=entry.full_name, type_name=entry.type_name)),
        "boundaries": [
            {
                "path": names.join_path(entry.full_name, path),
                "kind": kind,
                "source": sources.source_dict(plan, path),
            }
            for path, kind in plan.boundaries
        ],
    }


def emit_plan(entry: summary.Entry) -> None:
    """A ``plan_log`` listener: write the plan, remember its regions for their compiles. Never raises."""
    if not enabled():
        return
    with guard(f"writing the plan of {entry.shown} to the structured trace", quiet=True):
        payload = plan_payload(entry)
        with _lock:
            for decision in payload["decisions"]:
                if (label := decision["region"]) is None:
                    continue
                region = run.trace_regions.setdefault(label, {"label": label, "modules": [], "decisions": []})
                if decision["path"] not in region["modules"]:
                    region["modules"].append(decision["path"])
                    region["decisions"].append(decision)
        _installs.install(_REGION_CALLBACK, lambda: listen(start=_on_compile_start))
        _compat.dynamo.trace_structured(PLAN_ARTIFACT, payload)


def emit_region(label: str, *, code_name: str) -> None:
    """Write what autoweave knows of region ``label``; called while dynamo compiles its code."""
    with _lock:
        known = run.trace_regions.get(label) or {"label": label, "modules": [], "decisions": []}
        payload = {**known, "code": code_name, "resume": code_name != label}
    _compat.dynamo.trace_structured(REGION_ARTIFACT, payload)


def region_label(code_name: str) -> str | None:
    """The woven region a code object belongs to (resume functions included), or None."""
    code_name = _compat.dynamo.resumed_name(code_name)
    with _lock:
        return code_name if code_name in run.trace_regions else None


def _on_compile_start(args: Any = None, *_: Any) -> None:
    # Runs inside dynamo's compile context: trace_structured attaches its compile id.
    with guard("writing a region to the structured trace", quiet=True):
        code = _compat.dynamo.code_being_compiled()
        label = region_label(code.co_name) if code is not None else None
        if label is not None:
            emit_region(label, code_name=code.co_name)


Callback = Callable[..., None]
Undo = Callable[[], None]

KEEP = "dynamo's compile callbacks registered again after torch._dynamo.reset()"

_callbacks_lock = threading.Lock()
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
    with _callbacks_lock:
        _listening.extend(added)

    def attach(_module: Any = None) -> None:
        handler = _compat.dynamo.compile_callbacks()
        if handler is None:
            return
        with _callbacks_lock:
            for entry in added:
                if entry in _listening:  # not undone meanwhile
                    _register(handler, *entry)
        _installs.install(KEEP, lambda: _keep_across_resets(handler))

    _installs.register(_compat.dynamo.COMPILE_CALLBACKS_MODULE, attach)

    def undo() -> None:
        _installs.unregister(_compat.dynamo.COMPILE_CALLBACKS_MODULE, attach)
        handler = (
            _compat.dynamo.compile_callbacks()
            if _compat.dynamo.COMPILE_CALLBACKS_MODULE in sys.modules
            else None
        )
        with _callbacks_lock:
            for kind, fn in added:
                if (kind, fn) in _listening:
                    _listening.remove((kind, fn))
                # Not when a reset has taken it already.
                if handler is not None and fn in getattr(handler, f"{kind}_callbacks"):
                    getattr(handler, f"remove_{kind}_callback")(fn)

    return undo


def _register(handler: Any, kind: str, fn: Callback) -> None:
    getattr(handler, f"register_{kind}_callback")(fn)


def _keep_across_resets(handler: Any) -> Undo | None:
    def make(clear: Callable[[], None], on: Callable[[], bool]) -> Callable[[], None]:
        def clear_then_listen() -> None:
            try:
                clear()  # raises after clearing when a compile is pending: registered again all the same
            finally:
                with _callbacks_lock:
                    for kind, fn in _listening if on() else ():
                        _register(handler, kind, fn)

        return clear_then_listen

    try:  # on the instance: every caller's reference to it
        return _installs.patch(handler, "clear", make)
    except (AttributeError, TypeError) as exc:  # a registry with slots: callbacks end at a reset
        logger.debug("dynamo's compile callbacks are not kept across resets (%s)", exc)
        return None
