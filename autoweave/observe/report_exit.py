"""The run report at exit (its JSON file, rank 0's one-screen summary), and who listens to the dispatchers.

At exit (or at ``disable()``, which does first what exit would have done) the
plan summary still waiting is logged, then the report is stopped, written
where ``AUTOWEAVE_REPORT`` says (``{rank}`` for one file per rank) and
summarised on rank 0, after the plan summary. A process that compiled nothing
(torchrun's launcher inherits ``AUTOWEAVE_REPORT`` and imports torch) writes and
prints nothing: it would otherwise pose as rank 0 and overwrite rank 0's report.

``install`` wires the observers when the patches load. The dispatchers publish
their moves, plans and fallbacks (``autoweave._events``): the plan summary
records each plan and logs itself when the next step begins, and the
structured trace writes each recorded plan; the report, when asked for,
subscribes its own listeners while it collects (``observe.report``). Each
subscription, the report and the exit hook is an install of its own
(``autoweave._installs``): ``disable()`` does first what exit would have done
(the pending plan summary, the report written and summarised), then takes
every listener off.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

from autoweave import _events, _installs
from autoweave._log import logger, rank
from autoweave._state import run
from autoweave.observe import report, summary, trace
from autoweave.observe.report import _Stats
from autoweave.sense import graph_breaks

_REGIONS_SHOWN = 4  # the exit summary lists the regions slowest to compile, up to this many


def report_path(template: str) -> str | None:
    """Where this rank writes: ``{rank}`` filled in; without it only rank 0 writes."""
    return template.format(rank=rank()) if "{rank}" in template or rank() == 0 else None


def write(data: dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def format_exit_summary(data: dict[str, Any], path: str | None) -> str:
    """The one-screen summary rank 0 prints at exit."""
    totals, dyn, fallbacks = data["totals"], data["dynamo"], data["ac_fallbacks"]
    lines = [
        f"autoweave report (rank {data['rank']} of {data['world_size']})" + (f" -> {path}" if path else ""),
        f"  modules planned: {totals['modules']}, woven: {totals['woven']}",
    ]
    measured = data.get("measured") or {}
    unmeasured = "; ".join(
        f"every call of {count} module(s) ran under torch.compiler.set_stance('{stance}')"
        for stance, count in (measured.get("not_measured") or {}).items()
    )
    if measured.get("modules"):
        lines.append(
            f"  measured (one call of each compiled module, autoweave's or not): "
            f"{measured['eager_gemms']} forward GEMMs ran outside compiled graphs; "
            f"{measured['fully_compiled']} of {measured['modules']} modules ran every GEMM compiled"
            + (f"; not measured: {unmeasured}" if unmeasured else "")
        )
    elif unmeasured:
        lines.append(f"  steady state not measured: {unmeasured}")
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
    regions = sorted(data["regions"], key=lambda r: -r["compile_s"])
    for region in regions[:_REGIONS_SHOWN]:
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
    if len(regions) > _REGIONS_SHOWN:
        lines.append(
            f"    ... and {len(regions) - _REGIONS_SHOWN} more region(s): the {_REGIONS_SHOWN} slowest to "
            "compile are listed" + (f", all are in {path}" if path else "")
        )
    lines.append(
        f"  dynamo (whole process): {dyn['unique_graphs']} graphs, {dyn['compiles']} compiles, "
        f"{dyn['recompiles']} recompiles, {dyn['graph_breaks']} graph breaks, "
        f"{len(dyn['recompile_limit_hits'])} recompile-limit hits, {dyn['compile_s']:.1f} s"
    )
    reasons: Counter[str] = Counter()
    for reason, count in dyn["graph_break_reasons"].items():
        reasons[reason.splitlines()[0][:100] if reason else "?"] += count
    for reason, count in reasons.most_common(3):
        site = graph_breaks.first_site(dyn.get("graph_break_sites", {}), reason)
        lines.append(f"    break x{count}: {reason}{site}")
    lines.extend(f"    limit: {hit[:100]}" for hit in dyn["recompile_limit_hits"][:2])
    if swallowed := data.get("swallowed"):
        lines.append(
            f"  autoweave failed open {sum(swallowed.values())} time(s): "
            + ", ".join(f"[{slug}] x{n}" for slug, n in swallowed.items())
            + " (the warnings above say where; AUTOWEAVE_STRICT=1 raises instead)"
        )
    at_limit = sum(hit.startswith("woven region ") for hit in dyn["recompile_limit_hits"])
    if around := fallbacks.get("woven_around", 0):
        lines.append(
            f"  {around} checkpointed region(s) fell back to eager at their first call only: autoweave "
            "located the break and compiles around it from the next call on"
            + (
                f", up to the recompile limit ({at_limit} woven region(s) reached it, see limit:)"
                if at_limit
                else ""
            )
        )
    if fallbacks["count"] > around:
        lines.append(
            f"  WARNING: {fallbacks['count'] - around} checkpointed region(s) fell back to eager "
            "(forward and recompute ran uncompiled)"
        )
        lines.extend(f"    x{item['count']}: {item['message'][:100]}" for item in fallbacks["messages"][:2])
        if not totals["woven"] and not data.get("settings", {}).get("enabled"):
            lines.append(
                "    these compiles were not woven: with AUTOWEAVE=1 (and outside autoweave.disabled()) "
                "autoweave compiles around the boundaries"
            )
        elif not totals["woven"] and data.get("settings", {}).get("mode") == "off":
            lines.append(
                "    autoweave was on, but AUTOWEAVE_MODE=off is set: it wove none of these compiles; "
                "without it (mode auto) autoweave compiles around the boundaries"
            )
        elif not totals["woven"]:
            # A plan that weaves nothing is logged at INFO: printed above only at that level.
            why = (
                "the plan above says" if logger.isEnabledFor(logging.INFO) else "the plans in the report say"
            )
            lines.append(
                f"    autoweave was on but wove none of these compiles: {why} why for each; "
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
    anything = stats.compiled_anything()  # asked before the report stops
    data = report.stop()
    if data is None or not anything:
        return
    if (path := report_path(stats.path)) is not None:  # at_exit calls only with a path
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
    if run.summary_pending:  # plans recorded since the last summary
        _quietly("log the plan summary", summary.flush)
    stats = report._stats
    if stats is None or stats.path is None:
        return
    _quietly("write the report", _write_and_summarise, stats)


# (topic, listener, install key): what the plan summary and the trace listen to (the report
# subscribes its own listeners while it collects: ``report._Stats.install``).
_SUBSCRIPTIONS: tuple[tuple[str, Callable[..., None], str], ...] = (
    (_events.PLANNED, summary.on_planned, "plan listener: the plan summary records each plan"),
    (_events.CALLED_AGAIN, summary.on_called_again, "call listener: the plan summary at the next step"),
    (_events.PLAN_RECORDED, trace.emit_plan, "plan listener: TORCH_TRACE writes each plan"),
)


def install(settings: Any) -> None:
    """Called when the patches load: the listeners, the exit hook, and the report when asked for."""
    for topic, listener, key in _SUBSCRIPTIONS:
        _installs.install(key, lambda topic=topic, listener=listener: _events.subscribe(topic, listener))
    if settings.report:
        report.start(settings.report)
    _installs.install("exit hook: the plan summary and the report", _register_exit)


def _register_exit() -> Callable[[], None]:
    atexit.register(at_exit)

    def undo() -> None:
        atexit.unregister(at_exit)
        at_exit()  # what exit would have done, now: after disable() nothing is left to do it

    return undo
