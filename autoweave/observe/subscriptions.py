"""Who listens to the dispatchers: the observers subscribe when autoweave starts.

The dispatchers publish their moves, plans and fallbacks (``autoweave._events``);
the plan summary records each plan and logs itself when the next step begins,
the report and the structured trace read each recorded plan, and the report
counts fallbacks woven around and measures one call per module. Each
subscription, the report and the exit hook is an install of its own
(``autoweave._installs``): ``disable()`` does first what exit would have done
(the pending plan summary, the report written and summarised), then takes
every listener off.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable
from typing import Any

from autoweave import _events, _installs
from autoweave.observe import report, report_exit, summary, trace

# (topic, listener, install key): what each observer listens to.
_SUBSCRIPTIONS: tuple[tuple[str, Callable[..., None], str], ...] = (
    (_events.PLANNED, summary.on_planned, "plan listener: the plan summary records each plan"),
    (_events.CALLED_AGAIN, summary.on_called_again, "call listener: the plan summary at the next step"),
    (_events.PLAN_RECORDED, report.on_plan, "plan listener: the report names its regions"),
    (_events.PLAN_RECORDED, trace.emit_plan, "plan listener: TORCH_TRACE writes each plan"),
    (_events.WOVEN_AROUND, report.on_woven_around, "fallback listener: the report counts those woven around"),
    (_events.MOVED, report.on_move, "move listener: the report measures one call of each module"),
    (_events.AC_KEPT, report.on_ac_kept, "limit listener: the report measures a block back under its AC"),
)


def install(settings: Any) -> None:
    """Called when the patches load: the listeners, the exit hook, and the report when asked for."""
    for topic, listener, key in _SUBSCRIPTIONS:
        _installs.install(key, lambda topic=topic, listener=listener: _events.subscribe(topic, listener))
    if settings.report:
        report.start(settings.report)
    _installs.install("exit hook: the plan summary and the report", _register_exit)


def _register_exit() -> Callable[[], None]:
    atexit.register(report_exit.at_exit)

    def undo() -> None:
        atexit.unregister(report_exit.at_exit)
        report_exit.at_exit()  # what exit would have done, now: after disable() nothing is left to do it

    return undo
