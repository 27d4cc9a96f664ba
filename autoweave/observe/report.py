"""The run report (``AUTOWEAVE_REPORT=path.json``, ``{rank}`` for one file per rank).

Counts what compiled, region by region (graphs, ops, compile time, recompiles:
woven regions' backends tell the report, plain compiles are counted by a wrapper),
and what dynamo signalled for every compile in the process, autoweave's or not
(graph breaks, recompile-limit hits, checkpointed regions that fell back to
eager). Written at exit; rank 0 also prints a one-screen summary, after the plan
summary (``plan_log``) if that is still waiting. A process that compiled nothing
(torchrun's launcher inherits ``AUTOWEAVE_REPORT`` and imports torch) writes and
prints nothing: it would otherwise pose as rank 0 and overwrite rank 0's report.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from autoweave import _compat, _installs
from autoweave._failopen import RAN_EAGER
from autoweave._log import logger, rank, world_size
from autoweave._state import run
from autoweave.observe import counting, graph_breaks, summary, trace
from autoweave.weave.region_backend import CompiledGraph, graph_name, observe_graphs, ops_in

# -- the report: counting what compiled ---------------------------------------------------


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


class _CountingPlain(_compat.BackendWrapper):
    """A plain compile's backend while reporting (a woven region's tells the report itself).

    One wrapper per compile, so the counts go to its label; yet two compare equal
    when the backends they wrap do (``BackendWrapper``): per-layer compiles of one
    block share its graphs with the report on, as without it (unequal wrappers made
    each layer recompile the shared code up to the recompile limit, then run eager).
    A shared graph is counted once, under the label whose call compiled it.
    """

    def __init__(self, stats: _Stats, label: str, inner: Any) -> None:
        super().__init__(inner)
        self._stats, self._label = stats, stats.region(label, "plain").label

    def __call__(self, gm: Any, example_inputs: Any) -> Any:
        ops, start = ops_in(gm), time.perf_counter()  # ops before the backend, which may rewrite gm
        compiled = self.inner(gm, example_inputs)
        seconds = time.perf_counter() - start
        graph = CompiledGraph(self._label, graph_name(gm), ops, getattr(compiled, RAN_EAGER, None), seconds)
        self._stats.on_graph(graph, kind="plain")
        return compiled


class _LimitFilter(logging.Filter):
    """Records dynamo's recompile-limit warnings (any compile, autoweave's or not)."""

    def __init__(self, stats: _Stats) -> None:
        super().__init__()
        self._stats = stats

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if counting.RECOMPILE_LIMIT_NEEDLE in message:
            lines = [line.strip() for line in message.splitlines()]
            self._stats.limit_hits.append(" ".join(lines[:3]))
        return True


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
        self._open: list[tuple[float, list[RegionStats], bool]] = []
        self._lock = threading.Lock()
        self.fallbacks = counting.FallbackCounter()
        # id(dispatcher) -> what one steady call of its module left in the autograd graph
        self.gemms: dict[int, counting.AutogradGemms] = {}
        self._filter = _LimitFilter(self)
        self._callbacks: Any = None
        self._unobserve: Callable[[], None] | None = None

    def install(self) -> None:
        self._unobserve = observe_graphs(self.on_graph)
        self.fallbacks.install()
        graph_breaks.watch_graph_breaks()  # the user's line of each graph break (autoweave/observe/graph_breaks.py)
        logging.getLogger(counting.RECOMPILE_LIMIT_LOGGER).addFilter(self._filter)
        self._callbacks = _compat.compile_callbacks()
        if self._callbacks is not None:
            self._callbacks.register_start_callback(self._on_start)
            self._callbacks.register_end_callback(self._on_end)

    def uninstall(self) -> None:
        if self._unobserve is not None:
            self._unobserve()
            self._unobserve = None
        self.fallbacks.uninstall()
        logging.getLogger(counting.RECOMPILE_LIMIT_LOGGER).removeFilter(self._filter)
        if self._callbacks is not None:
            for remove, fn in (
                (self._callbacks.remove_start_callback, self._on_start),
                (self._callbacks.remove_end_callback, self._on_end),
            ):
                try:
                    remove(fn)
                except ValueError:
                    pass

    # dynamo's compile callbacks: time every compile, attribute it to the regions it built
    def _on_start(self, args: Any = None, *_: Any) -> None:
        rank()  # remember the process group's rank while it exists (see _log)
        trigger = getattr(getattr(args, "callback_trigger", None), "name", "DYNAMO")
        match = _COMPILE_ID.search(str(getattr(args, "compile_id", "")))
        recompile = trigger == "DYNAMO" and match is not None and int(match.group(2)) > 0
        with self._lock:
            self._open.append((time.perf_counter(), [], recompile))
            if trigger == "DYNAMO":
                self.compiles += 1
                self.recompiles += recompile

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
            if label not in self.regions:
                self.regions[label] = RegionStats(label, kind)
            return self.regions[label]

    def name_regions(self, entry: summary.Entry) -> None:
        # A woven region is reported from its plan on; a plain compile once it is counted.
        regions = [(path, self.region(label, "woven")) for path, label in entry.regions.items()]
        plain = self.regions.get(entry.plain_label) if entry.plain_label is not None else None
        if plain is not None and not entry.plan.woven:
            regions.append(("", plain))
        for path, region in regions:
            shown = summary.join_path(entry.shown, path)
            if shown not in region.modules:
                region.modules.append(shown)

    def compiled_anything(self) -> bool:
        """Did this process compile, plan or see a fallback? If not, it has nothing to report."""
        if self.compiles or self.regions or self.fallbacks.count or summary.entries():
            return True
        return bool(_compat.dynamo_counters().get("stats", {}).get("unique_graphs"))

    def snapshot(self) -> dict[str, Any]:
        import torch

        from autoweave import _settings, _version

        counters = _compat.dynamo_counters()
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
        plans = []
        measured = {
            key: {"eager_gemms": g.eager, "compiled_graphs": g.compiled_graphs}
            for key, g in self.gemms.items()
        }
        for key, entry in summary.keyed_entries():
            plans.append(
                {
                    "name": entry.shown,
                    "type": entry.type_name,
                    "woven": entry.plan.woven,
                    "mode": entry.plan.mode,
                    "strategy": entry.plan.strategy,
                    "summary": entry.plan.headline(),
                    "decisions": summary.decision_records(entry),
                    "region": None if entry.plan.woven else entry.plain_label,
                    "measured": measured.get(key),
                }
            )
        return {
            "autoweave": _version.__version__,
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
                "graphs": sum(r["graphs"] for r in live),
                "ops": sum(r["ops"] for r in live),
                "eager_graphs": sum(r["eager_graphs"] for r in live),
                "eager_ops": sum(r["eager_ops"] for r in live),
                "compile_s": round(sum(r["compile_s"] for r in live), 4),
                "backend_s": round(sum(r["backend_s"] for r in live), 4),
            },
            "dynamo": {
                "unique_graphs": int(stats.get("unique_graphs", 0)),
                "calls_captured": int(stats.get("calls_captured", 0)),
                "compiles": self.compiles,
                "recompiles": self.recompiles,
                "compile_s": round(self.compile_s, 4),
                "graph_breaks": sum(breaks.values()),
                "graph_break_reasons": dict(breaks.most_common()),
                "graph_break_sites": graph_breaks.graph_break_sites(
                    breaks
                ),  # autoweave/observe/graph_breaks.py
                "recompile_limit_hits": list(self.limit_hits),
            },
            # One steady call of each compiled module, from autograd's record (measure_next_call).
            "measured": {
                "modules": len(measured),
                "fully_compiled": sum(1 for m in measured.values() if m["eager_gemms"] == 0),
                "eager_gemms": sum(m["eager_gemms"] for m in measured.values()),
            },
            # Failures of autoweave's own that failed open (slug -> count; _failopen.swallowed).
            "swallowed": dict(sorted(run.swallowed.items())),
            "ac_fallbacks": {
                "count": self.fallbacks.count,
                # Seen at a first call, then compiled around from the next call on.
                "woven_around": min(self.woven_around, self.fallbacks.count),
                "sites": graph_breaks.fallback_sites(),  # autoweave/observe/graph_breaks.py
                "messages": [{"message": m, "count": n} for m, n in fallback_messages.most_common()],
            },
        }


_stats: _Stats | None = None
_lock = threading.RLock()


def plain_label(module: Any) -> str | None:
    """The label under which a plain (not woven) compile of ``module`` is counted."""
    return run.plain_labels.get(module)


def active() -> bool:
    """Is the report collecting?"""
    return _stats is not None


def measure_next_call(dispatcher: Any, attr: str, *, skip: int = 0) -> None:
    """Measure one call through ``dispatcher.<attr>`` (after ``skip`` calls): its forward GEMMs outside graphs.

    Read from the autograd graph the call leaves (``counting.autograd_gemms``),
    at a call with grad; then the attribute is what it was, so the run pays
    nothing per call. A no-op when the report is off.
    """
    if _stats is None:
        return
    original = getattr(dispatcher, attr, None)
    if original is None or getattr(original, "_autoweave_measure", False):
        return
    left = [skip]

    def measuring(*args: Any, **kwargs: Any) -> Any:
        import torch

        since = None
        if (
            getattr(dispatcher, attr, None) is measuring
            and not torch.compiler.is_compiling()
            and not _compat.in_backward()  # a checkpoint's recompute: not a call of the forward
        ):
            if left[0] > 0:
                left[0] -= 1
                return original(*args, **kwargs)
            since = counting.autograd_mark()  # None without grad: the next call is measured
            if since is not None:
                setattr(dispatcher, attr, original)  # one call: a recompute inside runs plain
        out = original(*args, **kwargs)
        if since is not None:
            found = counting.autograd_gemms(out, since)
            stats = _stats
            if found is not None and stats is not None:
                with _lock:
                    stats.gemms[id(dispatcher)] = found  # the plan entry's key (summary.keyed_entries)
        return out

    measuring._autoweave_measure = True  # type: ignore[attr-defined]
    setattr(dispatcher, attr, measuring)


def on_woven_around(fallbacks: int) -> None:
    """A first call fell back (``fallbacks`` messages); autoweave re-planned around the break."""
    if _stats is not None:
        with _lock:
            _stats.woven_around += fallbacks


def on_plan(entry: summary.Entry) -> None:
    """A ``plan_log`` listener: name the regions of a recorded plan in the report."""
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
        return _compat.wrap_backend(kwargs, lambda inner: _CountingPlain(stats, label, inner))
    except Exception as exc:  # AOTInductor options, a torch without the wrappers
        logger.debug("report: not counting %s (%s)", label, exc)
        return kwargs


# -- at exit ------------------------------------------------------------------------------


def report_path(template: str) -> str | None:
    """Where this rank writes: ``{rank}`` filled in; without it only rank 0 writes."""
    if "{rank}" not in template and rank() != 0:
        return None
    return template.format(rank=rank())


def write(data: dict[str, Any], path: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def format_exit_summary(data: dict[str, Any], path: str | None) -> str:
    """The one-screen summary rank 0 prints at exit."""
    totals, dyn, fallbacks = data["totals"], data["dynamo"], data["ac_fallbacks"]
    lines = [
        f"autoweave report (rank {data['rank']} of {data['world_size']})" + (f" -> {path}" if path else "")
    ]
    lines.append(f"  modules planned: {totals['modules']}, woven: {totals['woven']}")
    measured = data.get("measured") or {}
    if measured.get("modules"):
        lines.append(
            f"  measured (one call of each compiled module, autoweave's or not): "
            f"{measured['eager_gemms']} forward GEMMs ran outside compiled graphs; "
            f"{measured['fully_compiled']} of {measured['modules']} modules ran every GEMM compiled"
        )
    kinds = Counter(r["kind"] for r in data["regions"])
    lines.append(
        f"  regions: {kinds.get('woven', 0)} woven, {kinds.get('plain', 0)} plain; "
        f"{totals['graphs']} graphs, {totals['ops']} ops captured, "
        f"compile {totals['compile_s']:.1f} s (backend {totals['backend_s']:.1f} s)"
    )
    if totals.get("eager_graphs"):
        lines.append(
            f"  not captured: {totals['eager_graphs']} traced graph(s), {totals['eager_ops']} ops, "
            "run eager instead (below, per region)"
        )
    for region in sorted(data["regions"], key=lambda r: -r["compile_s"])[:4]:
        where = summary.fold_names(region["modules"]) if region["modules"] else "?"
        eager = region.get("eager_graphs", 0)
        lines.append(
            f"    {where}: {region['graphs']} graphs, {region['ops']} ops, "
            f"{region['recompiles']} recompiles, {region['compile_s']:.2f} s"
            + (f", {eager} graph(s) ({region['eager_ops']} ops) ran eager" if eager else "")
            + ("" if region.get("live", True) else " (first call only, replaced by the weave)")
        )
        for why, count in list(region.get("eager_reasons", {}).items())[:2]:
            lines.append(f"      x{count}: {why[:160]}")
    lines.append(
        f"  dynamo (whole process): {dyn['unique_graphs']} graphs, {dyn['compiles']} compiles, "
        f"{dyn['recompiles']} recompiles, {dyn['graph_breaks']} graph breaks, "
        f"{len(dyn['recompile_limit_hits'])} recompile-limit hits, {dyn['compile_s']:.1f} s"
    )
    reasons: Counter[str] = Counter()
    for reason, count in dyn["graph_break_reasons"].items():
        reasons[reason.splitlines()[0][:100] if reason else "?"] += count
    for reason, count in reasons.most_common(3):
        site = graph_breaks.first_site(
            dyn.get("graph_break_sites", {}), reason
        )  # autoweave/observe/graph_breaks.py
        lines.append(f"    break x{count}: {reason}{site}")
    for hit in dyn["recompile_limit_hits"][:2]:
        lines.append(f"    limit: {hit[:100]}")
    swallowed = data.get("swallowed") or {}
    if swallowed:
        lines.append(
            f"  autoweave failed open {sum(swallowed.values())} time(s): "
            + ", ".join(f"[{slug}] x{n}" for slug, n in swallowed.items())
            + " (the warnings above say where; AUTOWEAVE_STRICT=1 raises instead)"
        )
    around = fallbacks.get("woven_around", 0)
    if around:
        lines.append(
            f"  {around} checkpointed region(s) fell back to eager at their first call only: autoweave "
            "located the break and compiles around it from the next call on"
        )
    if fallbacks["count"] > around:
        lines.append(
            f"  WARNING: {fallbacks['count'] - around} checkpointed region(s) fell back to eager "
            "(forward and recompute ran uncompiled)"
        )
        for item in fallbacks["messages"][:2]:
            lines.append(f"    x{item['count']}: {item['message'][:100]}")
        if not totals["woven"] and not data.get("settings", {}).get("enabled"):
            lines.append(
                "    these compiles were not woven: with AUTOWEAVE=1 (and outside autoweave.disabled()) "
                "autoweave compiles around the boundaries"
            )
        elif not totals["woven"]:
            lines.append(
                "    autoweave was on but wove none of these compiles: the plan above says why for each; "
                "AUTOWEAVE_MODE=always weaves wherever a boundary is inside"
            )
    elif not around:
        lines.append("  checkpointed regions that fell back to eager: 0")
    return "\n".join(lines)


def _quietly(what: str, step: Any, *args: Any) -> Any:
    # Exit-time output must never turn a clean exit into a traceback (stderr may
    # be closed already: test runners close their capture files before atexit).
    try:
        return step(*args)
    except Exception:
        try:
            logger.debug("at exit: could not %s", what, exc_info=True)
        except Exception:
            pass
        return None


def _write_and_summarise(stats: _Stats) -> None:
    if not stats.compiled_anything():
        stop()
        return
    data = stop()
    if data is None:
        return
    path = report_path(stats.path) if stats.path is not None else None
    if path is not None:
        try:
            write(data, path)
        except OSError as exc:
            sys.stderr.write(
                f"autoweave: could not write the report to {path}: {exc}; "
                "set AUTOWEAVE_REPORT to a writable path\n"
            )
            path = None
    if rank() == 0:
        sys.stderr.write(format_exit_summary(data, path) + "\n")
        sys.stderr.flush()


def at_exit() -> None:
    """Log any pending plan summary; write the report and print its summary (rank 0). Never raises."""
    if summary.waiting():
        _quietly("log the plan summary", summary.flush)
    stats = _stats
    if stats is None or stats.path is None:
        return
    _quietly("write the report", _write_and_summarise, stats)


def install(settings: Any) -> None:
    """Called when the patches load: plan listeners, the exit hook, and the report when asked for.

    Each is an install of its own (``autoweave._installs``). ``disable()`` does
    first what exit would have done (the pending plan summary, the report
    written and summarised), then stops the report and takes the listeners off.
    """
    _listen(on_plan, "plan listener: the report names its regions")
    _listen(trace.emit_plan, "plan listener: TORCH_TRACE writes each plan")
    if settings.report:
        start(settings.report)
    _installs.install("exit hook: the plan summary and the report", _register_exit)


def _listen(listener: Callable[[summary.Entry], None], key: str) -> None:
    _installs.install(key, lambda: summary.subscribe(listener), lambda: summary.unsubscribe(listener))


def _register_exit() -> Callable[[], None]:
    atexit.register(at_exit)

    def undo() -> None:
        atexit.unregister(at_exit)
        at_exit()  # what exit would have done, now: after disable() nothing is left to do it

    return undo
