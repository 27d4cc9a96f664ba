"""The run report (``AUTOWEAVE_REPORT=path.json``, ``{rank}`` for one file per rank): collecting.

``start`` installs a collector (``_Stats``) and ``stop`` takes it off and
returns its snapshot, the report's JSON (``_Stats.snapshot``). While it runs it
collects:

- per compiled region (``RegionStats``): graphs, ops, compile time, recompiles.
  Woven regions' backends tell it each graph they compile
  (``_events.GRAPH_COMPILED``); a plain compile's graphs are counted as dynamo
  hands them to its backend, which stays the one torch built (``count_plain``).
- for every compile in the process, autoweave's or not, what dynamo signalled:
  its compile callbacks, the recompile-limit warnings, checkpointed regions
  that fell back to eager, and where graph breaks were (``sense.graph_breaks``).
- what the dispatchers publish (``autoweave._events``), to which the collector
  subscribes while it runs: recorded plans name its regions, first-call
  fallbacks woven around are counted.
- one steady call of each compiled module, read from autograd's record.

The measure: when a dispatcher starts running its woven regions, or plain
torch.compile, the collector asks it to hand over one later call
(``observe_next_call``): the forward GEMMs that call left in the autograd graph
outside compiled graphs (``counting.autograd_gemms``) are what ran eager.
The measure marks where autograd's graph stood, lets the call run untouched,
and reads what was added; calls without grad pass to the next, and so do calls
made while ``torch.compiler.set_stance`` makes compiled code run eager (an eval
or debug step under ``force_eager``): what they run is not the steady state.
When only such calls came, the report says the module was not measured. Later
calls pay nothing.

Writing it at exit, with rank 0's one-screen summary, is ``observe.report_exit``.
"""

from __future__ import annotations

import re
import sys
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from autoweave import _compat, _events, _installs, _taps
from autoweave._compat.log_strings import RecompileLimit
from autoweave._failopen import RAN_EAGER
from autoweave._log import logger, rank, world_size
from autoweave._state import run
from autoweave.observe import summary, trace
from autoweave.sense import counting, graph_breaks, names
from autoweave.weave.pieces import CompiledGraph, RegionBackend, graph_name, ops_in

# -- counting what compiled -----------------------------------------------------------------


_stats: _Stats | None = None
_lock = threading.RLock()

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


def count_plain(module: Any, compiled: Any) -> None:
    """Count the graphs of ``compiled``, the plain ``torch.compile`` of ``module`` autoweave routes, when reporting.

    Nothing about the compile changes: the collector knows it by the backend
    object torch built for it (``_compat.backends.compile_wrapper_of``) and counts the
    graphs dynamo hands that backend.
    """
    stats = _stats
    if stats is None:
        return
    with _lock:
        run.plain_count += 1
        label = f"plain_{type(module).__name__}_{run.plain_count}"
    try:  # counting is the report's business: the compile goes on whatever happens here
        backend = _compat.backends.compile_wrapper_of(compiled)
        if backend is None:
            raise LookupError("its backend is not found")
        run.plain_labels[module] = label
        stats.know_plain(backend, stats.region(label, "plain"))
    except Exception as exc:
        logger.debug("report: not counting %s (%s)", label, exc)


def _measuring(key: int) -> Callable[[], Callable[[Any], None] | None]:
    def before() -> Callable[[Any], None] | None:
        # A stance that runs eager by the user's choice, or no grad: the next call is measured.
        if (stance := _compat.dynamo.eager_stance()) is not None:
            _record("unmeasured", key, stance)
            return None
        if (since := counting.autograd_mark()) is None:
            return None

        def after(out: Any) -> None:
            if (found := counting.autograd_gemms(out, since)) is not None:
                _record("gemms", key, found)  # the plan entry's key (summary.keyed_entries)

        return after

    return before


def _record(table: str, key: int, value: Any) -> None:
    # Into the report collecting when the call comes: a report stopped since takes nothing.
    stats = _stats
    if stats is not None:
        with _lock:
            getattr(stats, table)[key] = value


@dataclass
class RegionStats:
    label: str  # the compiled function's name (shared by identical blocks)
    kind: str  # "woven" (a region of a woven plan) or "plain" (a plain compile autoweave routed)
    modules: list[str] = field(default_factory=list)
    capture: counting.Capture = field(default_factory=counting.Capture)
    backend_s: float = 0.0
    compile_s: float = 0.0
    compiles: int = 0
    recompiles: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "kind": self.kind,
            "modules": self.modules,
            "graphs": self.capture.graph_count,
            "ops": self.capture.ops,
            # Graphs dynamo traced that run eager instead (a piece under its checkpoint, a
            # graph the backend failed on): not captured, with why.
            "eager_graphs": len(self.capture.eager),
            "eager_ops": self.capture.eager_ops,
            "eager_reasons": dict(Counter(g.eager for g in self.capture.eager if g.eager).most_common()),
            "compiles": self.compiles,
            "recompiles": self.recompiles,
            "compile_s": round(self.compile_s, 4),
            "backend_s": round(self.backend_s, 4),
        }


_COMPILE_ID = re.compile(r"(\d+)/(\d+)")


class _Stats:
    def __init__(self, path: str | None) -> None:
        self.path = path
        self.started = time.time()
        self.regions: dict[str, RegionStats] = {}
        self.limit_hits: list[str] = []
        self.woven_around = 0
        self.compile_s = 0.0
        self.compiles = 0
        self.recompiles = 0
        # Compiles no region of autoweave's ran (the application's own torch.compile of a
        # function, an inductor kernel it compiles itself): with the regions', dynamo's all.
        self.outside_compiles = 0
        self.outside_recompiles = 0
        self._open: list[tuple[float, list[RegionStats], bool]] = []
        self._lock = threading.Lock()
        self.fallbacks = counting.FallbackCounter()
        # id(dispatcher) -> what one steady call of its module left in the autograd graph
        self.gemms: dict[int, counting.AutogradGemms] = {}
        # id(dispatcher) -> the stance that made a call offered to the measure run eager (passed)
        self.unmeasured: dict[int, str] = {}
        self.break_sites: list[graph_breaks.BreakSite] = []  # where graph breaks were, in order
        # id(backend torch built for a plain compile) -> (a weak reference to it, its region)
        self._plain: dict[int, tuple[weakref.ref, RegionStats]] = {}
        self._undos: list[Callable[[], None]] = []

    def install(self) -> None:
        self._undos = [
            _events.subscribe(_events.GRAPH_COMPILED, self.on_graph),
            _events.subscribe(_events.PLAIN_COMPILED, count_plain),  # before any dispatcher exists
            _compat.backends.listen_to_graphs(self._on_plain_graph),
            self.fallbacks.install().uninstall,
            graph_breaks.listening(self.break_sites).start().stop,  # the user's line of each graph break
            # dynamo's recompile-limit warnings (any compile, autoweave's or not)
            _taps.listening(RecompileLimit, lambda hit: self.limit_hits.append(hit.summary)).start().stop,
            # and the regions under an eager checkpoint that autoweave runs eager at the limit
            _events.subscribe(_events.AT_LIMIT, self._on_at_limit),
            # The dispatchers (``autoweave._events``): recorded plans name the regions, first-call
            # fallbacks woven around are counted, one steady call of each module is measured.
            _events.subscribe(_events.PLAN_RECORDED, self.name_regions),
            _events.subscribe(_events.WOVEN_AROUND, self._on_woven_around),
            _events.subscribe(_events.MOVED, self._on_move),
            # Kept across torch._dynamo.reset(), which clears dynamo's callbacks (trace).
            trace.listen(self._on_start, self._on_end),
        ]

    def uninstall(self) -> None:
        while self._undos:
            self._undos.pop()()

    def _on_woven_around(self, dispatcher: Any, fallbacks: int) -> None:
        # A first call fell back (``fallbacks`` messages); autoweave re-planned around the break.
        with self._lock:
            self.woven_around += fallbacks

    def _on_move(self, dispatcher: Any, state: str, why: str) -> None:
        # Measure one steady call of what the dispatcher runs from now on.
        if state == _events.WOVEN:
            dispatcher.observe_next_call(_measuring(id(dispatcher)))
        elif state == _events.PLAIN:
            # Plain torch.compile compiles at its first call: the one after it is steady.
            dispatcher.observe_next_call(_measuring(id(dispatcher)), skip=1)

    def _on_at_limit(self, label: str) -> None:
        self.limit_hits.append(
            f"woven region {label} at the recompile limit: eager under its checkpoint from then on"
        )

    # dynamo's compile callbacks: time every compile, attribute it to the regions it built
    def _on_start(self, args: Any = None, *_: Any) -> None:
        rank()  # remember the process group's rank while it exists (see _log)
        trigger, compile_id = _compat.dynamo.callback_compile(args)
        match = _COMPILE_ID.search(compile_id)
        recompile = trigger == "DYNAMO" and match is not None and int(match.group(2)) > 0
        # A woven region's own frame, or a resume function of it, is its region's compile
        # whether or not it hands the backend a graph: a frame between two boundaries (or
        # calls dynamo must not trace) can hold no op, and yet recompile for a new size.
        # So is a frame of other code its call reached (a helper it calls that breaks, a
        # shared class forward): compiled by the region's backend, counted under it.
        region = None
        if trigger == "DYNAMO":
            code, backend = _compat.dynamo.compile_in_progress()
            region = self._region_of(code) or self._region_of_backend(backend)
        with self._lock:
            self._open.append((time.perf_counter(), [] if region is None else [region], recompile))
            if trigger == "DYNAMO":
                self.compiles += 1
                self.recompiles += recompile
                if region is None:
                    self.outside_compiles += 1
                    self.outside_recompiles += recompile

    def _on_end(self, *_: Any) -> None:
        with self._lock:
            if not self._open:
                return
            start, regions, recompile = self._open.pop()
        elapsed = time.perf_counter() - start
        self.compile_s += elapsed
        for region in regions:
            region.compile_s += elapsed / len(regions)
            region.compiles += 1
            region.recompiles += recompile

    def _region_of(self, code: Any) -> RegionStats | None:
        """The woven region whose code (or a resume function of it) ``code`` is; None if none."""
        region = self.regions.get(_compat.dynamo.resumed_name(code.co_name)) if code is not None else None
        return region if region is not None and region.kind == "woven" else None

    def _region_of_backend(self, backend: Any) -> RegionStats | None:
        """The region whose backend (a woven region's, or one torch built for a plain compile) ``backend`` is."""
        for within in _compat.backends.backends_within(backend):
            if isinstance(within, RegionBackend):
                return self.region(within.label, "woven")
            ref, region = self._plain.get(id(within), (None, None))
            if ref is not None and ref() is within:
                return region
        return None

    def know_plain(self, backend: Any, region: RegionStats) -> None:
        # ``backend``: the object torch built for a plain compile, known by identity (``_region_of_backend``).
        with self._lock:
            self._plain[id(backend)] = (weakref.ref(backend), region)

    def _on_plain_graph(self, backend: Any, gm: Any) -> Callable[[Any, float], None] | None:
        # dynamo hands ``backend`` a graph: counted here when it is a plain compile's.
        try:
            region = self._region_of_backend(backend)
            if region is None or region.kind != "plain":
                return None
            name, ops = graph_name(gm), ops_in(gm)  # ops before the backend, which may rewrite gm
        except Exception as exc:  # counting is the report's business, never the compile's
            logger.debug("report: a plain graph went uncounted (%s)", exc)
            return None

        def compiled(out: Any, seconds: float) -> None:
            self.on_graph(
                CompiledGraph(region.label, name, ops, getattr(out, RAN_EAGER, None), seconds), "plain"
            )

        return compiled

    def on_graph(self, graph: CompiledGraph, kind: str = "woven") -> None:
        """A region's backend compiled a graph (or runs it eager): count it under its region."""
        region = self.region(graph.label, kind)
        with self._lock:
            # The compile now open (dynamo's callbacks) built this region: it shares that time.
            if self._open and region not in self._open[-1][1]:
                self._open[-1][1].append(region)
        region.capture.add(graph.name, graph.ops, graph.eager)
        region.backend_s += graph.seconds

    def region(self, label: str, kind: str) -> RegionStats:
        with self._lock:
            return self.regions.setdefault(label, RegionStats(label, kind))

    def name_regions(self, entry: summary.Entry) -> None:
        # A woven region is reported from its plan on; a plain compile once it is counted.
        regions = [(path, self.region(label, "woven")) for path, label in entry.regions.items()]
        if not entry.plan.woven and (plain := self.regions.get(entry.plain_label)) is not None:
            regions.append(("", plain))
        for path, region in regions:
            shown = names.join_path(entry.shown, path)
            if shown not in region.modules:
                region.modules.append(shown)

    def compiled_anything(self) -> bool:
        """Did this process compile, plan or see a fallback? If not, it has nothing to report."""
        if self.compiles or self.regions or self.fallbacks.count or summary.entries():
            return True
        return bool(_compat.dynamo.dynamo_counters().get("stats", {}).get("unique_graphs"))

    def snapshot(self) -> dict[str, Any]:
        import torch

        from autoweave import _settings

        counters = _compat.dynamo.dynamo_counters()
        stats = dict(counters.get("stats", {}))
        breaks = Counter(dict(counters.get("graph_break", {})))
        # A plain compile whose module was re-planned woven after its first call
        # ran once: reported, but not as live and not in the totals.
        replaced = {e.plain_label for e in summary.entries() if e.plan.woven and e.plain_label}
        # A woven region is live while a current plan runs it: one whose plan was given
        # up since (re-planned plain, or woven anew) ran for a while but runs no more.
        current = {label for e in summary.entries() for label in e.regions.values()}
        regions = [
            {**r.as_dict(), "live": r.label not in replaced if r.kind == "plain" else r.label in current}
            for r in self.regions.values()
            if r.kind != "plain"
            or r.modules
            or r.capture.graph_count  # a woven module's unused plain compile
        ]
        live = [r for r in regions if r["live"]]
        fallback_messages = Counter(m.strip().splitlines()[0] for m in self.fallbacks.messages if m.strip())
        measured = {
            key: {"eager_gemms": g.eager, "compiled_graphs": g.compiled_graphs}
            for key, g in self.gemms.items()
        }
        # Modules whose every call offered to the measure ran under a stance that forces eager.
        unmeasured = {key: stance for key, stance in self.unmeasured.items() if key not in measured}
        plans = [
            {
                **entry.record(entry.plan.headline()),
                "region": None if entry.plan.woven else entry.plain_label,
                "measured": measured.get(key),
            }
            for key, entry in summary.keyed_entries()
        ]
        return {
            "autoweave": _settings.__version__,
            "torch": torch.__version__,
            "python": sys.version.split()[0],
            "rank": rank(),
            "world_size": world_size(),
            "wall_s": round(time.time() - self.started, 3),
            "settings": _settings.current().as_dict(),
            "plans": plans,
            "regions": regions,
            "totals": {
                "modules": len(plans),
                "woven": sum(1 for p in plans if p["woven"]),
                **{key: sum(r[key] for r in live) for key in ("graphs", "ops", "eager_graphs", "eager_ops")},
                **{key: round(sum(r[key] for r in live), 4) for key in ("compile_s", "backend_s")},
            },
            "dynamo": {
                "unique_graphs": int(stats.get("unique_graphs", 0)),
                "calls_captured": int(stats.get("calls_captured", 0)),
                "compiles": self.compiles,
                "recompiles": self.recompiles,
                "compile_s": round(self.compile_s, 4),
                # Of those, compiles no region ran (see ``outside_compiles``): the regions' and
                # these add up to dynamo's.
                "outside_regions": {"compiles": self.outside_compiles, "recompiles": self.outside_recompiles},
                "graph_breaks": sum(breaks.values()),
                "graph_break_reasons": dict(breaks.most_common()),
                "graph_break_sites": graph_breaks.graph_break_sites(self.break_sites, breaks),
                "recompile_limit_hits": list(self.limit_hits),
            },
            # One steady call of each compiled module, from autograd's record (``_measuring``).
            "measured": {
                "modules": len(measured),
                "fully_compiled": sum(1 for m in measured.values() if m["eager_gemms"] == 0),
                "eager_gemms": sum(m["eager_gemms"] for m in measured.values()),
                # stance -> modules not measured: every call after their compile ran under it
                "not_measured": dict(Counter(unmeasured.values())),
            },
            # Failures of autoweave's own that failed open (slug -> count; _failopen.swallowed).
            "swallowed": dict(sorted(run.swallowed.items())),
            "ac_fallbacks": {
                "count": self.fallbacks.count,
                # Seen at a first call, then compiled around from the next call on.
                "woven_around": min(self.woven_around, self.fallbacks.count),
                "sites": graph_breaks.fallback_sites(self.break_sites),
                "messages": [{"message": m, "count": n} for m, n in fallback_messages.most_common()],
            },
        }
