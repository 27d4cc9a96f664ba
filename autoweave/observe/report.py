"""The run report (``AUTOWEAVE_REPORT=path.json``, ``{rank}`` for one file per rank): collecting.

``start`` installs a collector (``report_stats._Stats``) and ``stop`` takes it
off and returns its snapshot. While it runs, woven regions' backends tell it
each graph they compile (``_events.GRAPH_COMPILED``) and plain
compiles are counted by a wrapper (``plain_kwargs``): graphs, ops, compile time,
recompiles, per region. The collector also listens to
the dispatchers (``autoweave._events``, wired by ``observe.subscriptions``):
recorded plans name its regions, first-call fallbacks woven around are
counted, and ``observe.report`` measures one steady call of each module.
Writing it at exit, with rank 0's one-screen summary, is ``observe.report_exit``.

The report's autograd measure: one steady call of each compiled module, read from autograd's record.

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

import threading
import time
from collections.abc import Callable
from typing import Any

from autoweave import _compat, _events, _installs
from autoweave._failopen import RAN_EAGER
from autoweave._log import logger
from autoweave._state import run
from autoweave.observe import counting, summary
from autoweave.observe.report_stats import _Stats
from autoweave.weave.region_backend import CompiledGraph, graph_name, ops_in

# -- counting what compiled -----------------------------------------------------------------


class _CountingPlain(_compat.backends.BackendWrapper):
    """A plain compile's backend while reporting (a woven region's tells the report itself).

    One wrapper per compile, so the counts go to its label; yet two compare equal
    when the backends they wrap do (``BackendWrapper``): per-layer compiles of one
    block share its graphs with the report on, as without it (unequal wrappers made
    each layer recompile the shared code up to the recompile limit, then run eager).
    A shared graph is counted once, under the label whose call compiled it.
    """

    def __init__(self, stats: _Stats, label: str, inner: Any) -> None:
        super().__init__(inner)
        # ``report_label``: the region a compile running on this backend counts under (``report_stats``).
        self._stats, self.report_label = stats, stats.region(label, "plain").label

    def __call__(self, gm: Any, example_inputs: Any) -> Any:
        ops, start = ops_in(gm), time.perf_counter()  # ops before the backend, which may rewrite gm
        compiled = self.inner(gm, example_inputs)
        seconds = time.perf_counter() - start
        graph = CompiledGraph(
            self.report_label, graph_name(gm), ops, getattr(compiled, RAN_EAGER, None), seconds
        )
        self._stats.on_graph(graph, kind="plain")
        return compiled


_stats: _Stats | None = None
_lock = threading.RLock()


def plain_label(module: Any) -> str | None:
    """The label under which a plain (not woven) compile of ``module`` is counted."""
    return run.plain_labels.get(module)


def active() -> bool:
    """Is the report collecting?"""
    return _stats is not None


def collector() -> _Stats | None:
    """What the report is collecting into now (None: it is not collecting)."""
    return _stats


def record_gemms(key: int, found: counting.AutogradGemms) -> None:
    """What one measured call of a module left in the autograd graph (``key``: its plan entry's)."""
    stats = _stats
    if stats is not None:
        with _lock:
            stats.gemms[key] = found


def record_unmeasured(key: int, stance: str) -> None:
    """A call of the module ``key`` passed unmeasured: ``torch.compiler.set_stance(stance)`` ran it eager."""
    stats = _stats
    if stats is not None:
        with _lock:
            stats.unmeasured[key] = stance


def on_woven_around(dispatcher: Any, fallbacks: int) -> None:
    """A first call fell back (``fallbacks`` messages); autoweave re-planned around the break."""
    if _stats is not None:
        with _lock:
            _stats.woven_around += fallbacks


def on_plan(entry: summary.Entry) -> None:
    """A recorded plan (``_events.PLAN_RECORDED``): name its regions in the report."""
    if _stats is not None:
        _stats.name_regions(entry)


# The report's install key (``autoweave._installs``): ``disable()`` stops the report.
REPORT = "run report (region-graph observer, dynamo's compile callbacks, recompile-limit filter)"


def start(path: str | None = None) -> None:
    """Start collecting (``AUTOWEAVE_REPORT`` does this at patch time); ``path`` is written at exit."""
    with _lock:
        if _stats is not None:
            if path is not None:
                _stats.path = path
            return
        _installs.install(REPORT, lambda: _start_collecting(path))


def _start_collecting(path: str | None) -> Callable[[], None]:
    global _stats
    stats = _Stats(path)
    stats.install()
    _stats = stats
    return lambda: stop()


def stop() -> dict[str, Any] | None:
    """Stop collecting; returns the final snapshot (tests, and ``at_exit``)."""
    global _stats
    with _lock:
        stats, _stats = _stats, None
        _installs.forget(REPORT)
    if stats is None:
        return None
    data = stats.snapshot()
    stats.uninstall()
    return data


def plain_kwargs(module: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Kwargs for the plain compile of ``module`` that autoweave routes: counted when reporting.

    The wrapper holds the very callable torch would build from ``backend``,
    ``mode`` and ``options``: compiling through it is compiling as asked.
    """
    stats = _stats
    if stats is None:
        return kwargs
    with _lock:
        run.plain_count += 1
        label = f"plain_{type(module).__name__}_{run.plain_count}"
    try:
        run.plain_labels[module] = label
    except TypeError:
        return kwargs
    try:
        return _compat.backends.wrap_backend(kwargs, lambda inner: _CountingPlain(stats, label, inner))
    except Exception as exc:  # AOTInductor options, a torch without the wrappers
        logger.debug("report: not counting %s (%s)", label, exc)
        return kwargs


def on_move(dispatcher: Any, state: str, why: str) -> None:
    """``_events.MOVED``: measure one steady call of what the dispatcher runs from now on."""
    if not active():
        return
    if state == _events.WOVEN:
        dispatcher.observe_next_call(_measuring(id(dispatcher)))
    elif state == _events.PLAIN:
        # Plain torch.compile compiles at its first call: the one after it is steady.
        dispatcher.observe_next_call(_measuring(id(dispatcher)), skip=1)


def on_ac_kept(dispatcher: Any) -> None:
    """``_events.AC_KEPT``: blocks now run eager under their checkpoint; measure the next call again."""
    if active() and dispatcher.state.value == _events.WOVEN:
        dispatcher.observe_next_call(_measuring(id(dispatcher)))


def _measuring(key: int) -> Callable[[], Callable[[Any], None] | None]:
    def before() -> Callable[[Any], None] | None:
        stance = _compat.dynamo.eager_stance()
        if stance is not None:  # runs eager by the user's choice: the next call is measured
            record_unmeasured(key, stance)
            return None
        since = counting.autograd_mark()  # None without grad: the next call is measured
        if since is None:
            return None

        def after(out: Any) -> None:
            found = counting.autograd_gemms(out, since)
            if found is not None:
                record_gemms(key, found)  # the plan entry's key (summary.keyed_entries)

        return after

    return before
