"""The run report (``AUTOWEAVE_REPORT=path.json``, ``{rank}`` for one file per rank): collecting.

``start`` installs a collector (``report_stats._Stats``) and ``stop`` takes it
off and returns its snapshot. While it runs, each region's compile goes
through a counting backend (``instrument``, ``plain_kwargs``): graphs, ops,
compile time, recompiles, counted per region. The collector also listens to
the dispatchers (``autoweave._events``, wired by ``observe.subscriptions``):
recorded plans name its regions, first-call fallbacks woven around are
counted, and ``observe.measure`` measures one steady call of each module.
Writing it at exit, with rank 0's one-screen summary, is ``observe.report_exit``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from autoweave import _compat, _installs
from autoweave._log import logger
from autoweave._state import run
from autoweave.observe import counting, summary
from autoweave.observe.report_stats import RegionStats, _Stats

# -- counting what compiled -----------------------------------------------------------------


class _Counting(_compat.BackendWrapper):
    """A backend that counts each graph (``counting.Capture``) and times it, then compiles it.

    Each compile gets its own wrapper, so the counts go to its region; yet two
    wrappers compare equal exactly when the backends they wrap do
    (``BackendWrapper``), so per-layer compiles of one block share its graphs with
    the report on, as they do without it (unequal wrappers made each layer
    recompile the shared code, hit the recompile limit after 8 and run eager, or
    raise under ``fullgraph=True``). A shared graph is counted once, in the region
    whose call compiled it.
    """

    def __init__(self, stats: _Stats, region: RegionStats, inner: Any) -> None:
        super().__init__(inner)
        self._stats = stats
        self._region = region
        self._count = region.capture.backend(inner)

    def __call__(self, gm: Any, example_inputs: Any) -> Any:
        self._stats.note_region(self._region)
        start = time.perf_counter()
        try:
            return self._count(gm, example_inputs)
        finally:
            self._region.backend_s += time.perf_counter() - start


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
REPORT = "run report (counting backends, dynamo's compile callbacks, recompile-limit filter)"


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


def instrument(kwargs: dict[str, Any], label: str, kind: str = "woven") -> dict[str, Any]:
    """``torch.compile`` kwargs whose backend counts into region ``label``; unchanged when off.

    The wrapper holds the very callable torch would build from ``backend``,
    ``mode`` and ``options``, so compiling through it is compiling as asked.
    """
    stats = _stats
    if stats is None:
        return kwargs
    try:
        return _compat.wrap_backend(kwargs, lambda inner: _Counting(stats, stats.region(label, kind), inner))
    except Exception as exc:  # AOTInductor options, a torch without the wrappers
        logger.debug("report: not counting %s (%s)", label, exc)
        return kwargs


def plain_kwargs(module: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Kwargs for the plain compile of ``module`` that autoweave routes (counted when reporting)."""
    if _stats is None:
        return kwargs
    with _lock:
        run.plain_count += 1
        label = f"plain_{type(module).__name__}_{run.plain_count}"
    try:
        run.plain_labels[module] = label
    except TypeError:
        return kwargs
    return instrument(kwargs, label, kind="plain")
