"""The report's autograd measure: one steady call of each compiled module, read from autograd's record.

When a dispatcher starts running its woven regions, or plain torch.compile,
the report (when collecting) asks it to hand over one later call
(``observe_next_call``): the forward GEMMs that call left in the autograd graph
outside compiled graphs (``counting.autograd_gemms``) are what ran eager.
The measure marks where autograd's graph stood, lets the call run untouched,
and reads what was added; calls without grad pass to the next, and so do calls
made while ``torch.compiler.set_stance`` makes compiled code run eager (an eval
or debug step under ``force_eager``): what they run is not the steady state.
When only such calls came, the report says the module was not measured. Later
calls pay nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from autoweave import _compat, _events
from autoweave.observe import counting, report


def on_move(dispatcher: Any, state: str, why: str) -> None:
    """``_events.MOVED``: measure one steady call of what the dispatcher runs from now on."""
    if not report.active():
        return
    if state == _events.WOVEN:
        dispatcher.observe_next_call(_measuring(id(dispatcher)))
    elif state == _events.PLAIN:
        # Plain torch.compile compiles at its first call: the one after it is steady.
        dispatcher.observe_next_call(_measuring(id(dispatcher)), skip=1)


def on_ac_kept(dispatcher: Any) -> None:
    """``_events.AC_KEPT``: blocks now run eager under their checkpoint; measure the next call again."""
    if report.active() and dispatcher.state.value == _events.WOVEN:
        dispatcher.observe_next_call(_measuring(id(dispatcher)))


def _measuring(key: int) -> Callable[[], Callable[[Any], None] | None]:
    def before() -> Callable[[Any], None] | None:
        stance = _compat.dynamo.eager_stance()
        if stance is not None:  # runs eager by the user's choice: the next call is measured
            report.record_unmeasured(key, stance)
            return None
        since = counting.autograd_mark()  # None without grad: the next call is measured
        if since is None:
            return None

        def after(out: Any) -> None:
            found = counting.autograd_gemms(out, since)
            if found is not None:
                report.record_gemms(key, found)  # the plan entry's key (summary.keyed_entries)

        return after

    return before
