"""The plan summary: every compiled module's plan, named by its place in the model, logged once.

Every compiled module's plan is recorded when its dispatcher applies it
(``_events.PLANNED``), named by its place in the model (``layers.3``; with
several models compiled in one process, by their root's class first, with an
index when two share it: ``Policy.layers.3``, ``Transformer#1.layers.3``). Once
all of them have planned (the first planned module is called again: the next
step began) or at exit, rank 0 logs one compact tree, identical blocks folded
into one line; in a job of several ranks the head line says which modules it
covers (under pipeline parallel, one stage's). A module planned again after it
was summarised gets one line saying what changed.

A plan says "compiled"; the summary says what ran: a region whose backend was
handed no graph is told as "not run yet" (its module has not run the plan) or
"ran eager (0 graphs)", its plan after it (``region_ran``).
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from autoweave import _events
from autoweave._failopen import guard
from autoweave._log import SUMMARY, logger, rank, world_size
from autoweave._state import run
from autoweave.planning import plans, sources
from autoweave.planning.plans import Action, Plan
from autoweave.sense import names

_VERBS = {
    Action.PLAIN: "plain torch.compile",
    Action.COMPILE: "compiled whole",
    Action.SPLIT: "compiled, split at boundaries",
    Action.WEAVE: "woven",
    Action.BOUNDARY: "boundary",
    Action.EAGER: "eager",
    **plans.VERBS,  # an AC wrapper's action, worded with its strategy
}


# -- formatting ---------------------------------------------------------------------------


def region_notes(label: str | None) -> list[str]:
    """What a region's compile had to do differently (``pieces``: a piece left unchecked, a measure)."""
    return list(run.region_notes.get(label, ())) if label else []


def region_ran(label: str | None, ran: bool) -> str | None:
    """What a region's compile came to, where "compiled" would say more than what ran; else None.

    Read from the graphs its backend was handed (``_state.run.region_graphs``): None
    when it compiled every one, or is not counted (no label: a plan that has not been
    applied; a region compiled without autoweave's backend). ``ran``: its module has
    run the plan (its first woven call is over).
    """
    counts = run.region_graphs.get(label) if label else None
    if counts is None:
        return None
    compiled, eager = counts
    if compiled:
        return f"{compiled} graph(s) compiled, {eager} ran eager" if eager else None
    if not ran:
        return "not run yet"
    return f"ran eager (0 graphs compiled, {eager} traced and run eager)" if eager else "ran eager (0 graphs)"


def _decision_lines(
    plan: Plan, name: str, indent: str, regions: dict[str, str] | None = None, ran: bool = True
) -> list[str]:
    lines = []
    for decision in plan.decisions:
        shown = names.display_path(decision.path)
        depth = 0 if shown == "<root>" else shown.count(".") + 1
        action = f"{_VERBS[decision.action]}: {decision.reason}"
        label = (regions or {}).get(decision.path)
        status = region_ran(label, ran) if decision.region else None
        lines.append(
            f"{indent}{'  ' * depth}{names.join_path(name, decision.path)} [{decision.module_type}] "
            + (f"{status}; planned {action}" if status else action)
        )
        lines.extend(f"{indent}{'  ' * (depth + 1)}note: {note}" for note in region_notes(label))
    return lines


def format_plan(plan: Plan, *, name: str = "", type_name: str | None = None) -> str:
    """One plan: a head line, then (when woven) one line per decision, indented by depth."""
    head = f"{name or plan.root_type} ({type_name or plan.root_type}): {plan.headline()}"
    if not plan.woven:
        return head
    return "\n".join([head, *_decision_lines(plan, name, "  ")])


_DIGITS = re.compile(r"(\d+)")


def fold_names(names: list[str]) -> str:
    """``layers.1 … layers.3`` -> ``layers.1-3`` (also ``layers.1-3.moe.experts``); else comma-joined."""
    if len(names) == 1:
        return names[0]
    split = [_DIGITS.split(n) for n in names]
    skeletons = {tuple(parts[0::2]) for parts in split}
    if len(skeletons) == 1:
        columns = list(zip(*(parts[1::2] for parts in split), strict=True))
        varying = [i for i, column in enumerate(columns) if len(set(column)) > 1]
        if len(varying) == 1:
            i = varying[0]
            numbers = sorted(int(v) for v in columns[i])
            if numbers == list(range(numbers[0], numbers[0] + len(numbers))):
                folded = f"{numbers[0]}-{numbers[-1]}"
            else:
                folded = "{" + ",".join(map(str, numbers)) + "}"
            parts = list(split[0])
            parts[2 * i + 1] = folded
            return "".join(parts)
    shown = ", ".join(names[:4])
    return shown + (f", … (+{len(names) - 4})" if len(names) > 4 else "")


@dataclass
class Entry:
    """One compiled module's plan, as the summary and the report show it."""

    name: str  # qualified name in its model ("layers.3"), or "" when unknown
    type_name: str  # the user's block type under any wrappers
    plan: Plan
    regions: dict[str, str] = field(default_factory=dict)  # plan path -> region label
    plain_label: str | None = None  # the counted plain compile, when not woven
    model: tuple[str, int] | None = None  # the model it was found in: its root's class, an index per class
    # A weak reference to the dispatcher that applied the plan (None: no dispatcher, ``explain``).
    dispatcher: Any = field(default=None, repr=False, compare=False)

    @property
    def full_name(self) -> str:
        """``name``, after its model's when several models planned (``Policy.layers.3``)."""
        if not self.name or self.model is None:
            return self.name
        prefix = names.model_names().get(self.model)
        return f"{prefix}.{self.name}" if prefix else self.name

    @property
    def shown(self) -> str:
        return self.full_name or self.type_name

    def key(self) -> tuple[str, str]:
        return (self.type_name, format_plan(self.plan, type_name=self.type_name).split(": ", 1)[1])

    def ran(self) -> bool:
        """Has its module run this plan (the first call of its regions is over)?

        A dispatcher gone (its model deleted before exit) had its calls: taken as run.
        """
        dispatcher = self.dispatcher() if self.dispatcher is not None else None
        return (
            dispatcher is None or getattr(getattr(dispatcher, "state", None), "value", None) == _events.WOVEN
        )

    def region_statuses(self) -> tuple[str | None, ...]:
        """``region_ran`` of each of its regions, in plan order."""
        ran = self.ran()
        return tuple(region_ran(self.regions.get(d.path), ran) for d in self.plan.regions())

    def headline(self) -> str:
        """The plan's headline, and what its regions came to where that is not "compiled"."""
        statuses = Counter(s for s in self.region_statuses() if s is not None)
        counted = ", ".join(f"{n} of them {status}" for status, n in statuses.items())
        return self.plan.headline() + (f"; {counted}" if counted else "")

    def record(self, summary: str) -> dict[str, Any]:
        """What the report and the structured trace both write of this plan, ``summary`` its text (JSON-ready)."""
        return {
            "name": self.shown,
            "type": self.type_name,
            "woven": self.plan.woven,
            "mode": self.plan.mode,
            "strategy": self.plan.strategy,
            "summary": summary,
            "decisions": decision_records(self),
        }


def _fold(entries: list[Entry]) -> str:
    """The entries' names folded (``layers.1-3``), model by model: two models' layers never fold into one."""
    by_model: dict[Any, list[str]] = {}
    for entry in entries:
        by_model.setdefault(entry.model, []).append(entry.shown)
    return ", ".join(fold_names(names) for names in by_model.values())


def format_summary(entries: list[Entry], *, covers: str = "") -> str:
    """The plan log: one tree for all modules, identical plans folded into one line.

    ``covers``: what the head line says this rank's plans cover, in a job of several ranks.
    """
    groups: dict[tuple, list[Entry]] = {}
    for entry in entries:
        # Equal plans whose regions came to different things are not "the same plan".
        groups.setdefault((*entry.key(), entry.region_statuses()), []).append(entry)
    woven = sum(1 for e in entries if e.plan.woven)
    lines = [
        f"autoweave plan: {len(entries)} compiled module{'s' * (len(entries) != 1)}, {woven} woven"
        + (f"; {covers}" if covers else "")
    ]
    for members in groups.values():
        first = members[0]
        if not first.plan.woven:
            count = f"{len(members)} × " if len(members) > 1 else ""
            lines.append(f"  {_fold(members)} ({count}{first.type_name}): {first.plan.headline()}")
            continue
        lines.append(f"  {first.shown} ({first.type_name}): {first.headline()}")
        lines.extend(_decision_lines(first.plan, first.full_name, "    ", first.regions, first.ran()))
        if rest := members[1:]:
            if all(m.name for m in rest):
                lines.append(f"  {_fold(rest)} ({len(rest)} × {first.type_name}): same plan as {first.shown}")
            else:
                lines.append(f"  {len(rest)} more × {first.type_name}: same plan")
    return "\n".join(lines)


# -- the plan summary ---------------------------------------------------------------------

# The plans live on ``_state.run`` (``plans``, ``unsummarised``, and
# ``summary_pending``, read by the dispatcher on every call: a summary is
# waiting for the next step).
_lock = threading.RLock()


def on_planned(dispatcher: Any, plan: Plan) -> None:
    """``_events.PLANNED``: record the plan a dispatcher applied (or gave up for plain)."""
    record_plan(dispatcher, plan, plain_label=run.plain_labels.get(dispatcher.target))


def on_called_again(dispatcher: Any) -> None:
    """``_events.CALLED_AGAIN``: an already planned module is called again: every block has planned.

    Unless this call is the first of a plan it applied just now (learned from a fallback
    in the last call): the summary would have nothing but "not run yet" to say of it;
    it is logged at the module's next call, once that plan ran.
    """
    with _lock:
        entry = run.plans.get(id(dispatcher))
    if entry is not None and entry.plan.woven and not entry.ran():
        return
    if unmeasured():
        # Calls without grad so far (Lightning's sanity check): the pieces blocks' memory
        # measure comes at their first call with grad and may re-plan them with hoist.
        return
    with guard("logging the plan summary", quiet=True):
        flush()


def record_plan(dispatcher: Any, plan: Plan, *, plain_label: str | None = None) -> Entry | None:
    """Record ``plan``, which ``dispatcher`` applied; the summary is logged later. Never raises.

    ``plain_label`` is the name the report counts the plain compile under. The
    recorded entry is published (``_events.PLAN_RECORDED``: the report, the trace).
    """
    with guard(f"recording the plan of {type(dispatcher.target).__name__}", quiet=True) as failed:
        rank()  # remember the process group's rank while it exists: the summary may come at exit
        target = dispatcher.target
        applied = getattr(dispatcher, "_applied", None)
        name, root = names.locate(target, dispatcher, sys._getframe(1))
        entry = Entry(
            name=name,
            type_name=names.inner_type(target),
            plan=plan,
            regions=dict(applied.regions) if applied is not None else {},
            plain_label=plain_label,
            model=names.model_of(root),
            dispatcher=_weak(dispatcher),
        )
        with _lock:
            key = id(dispatcher)
            run.plans[key] = entry
            if key not in run.unsummarised:
                run.unsummarised.append(key)
            run.summary_pending = True
    if failed:
        return None
    _events.publish(_events.PLAN_RECORDED, entry)
    return entry


def _weak(dispatcher: Any) -> Any:
    try:
        return weakref.ref(dispatcher)
    except TypeError:  # a stand-in without weak references: its state is not known
        return None


def unmeasured() -> int:
    """How many pieces blocks still wait for the first call with grad that measures them."""
    return sum(1 for first in list(run.measuring) if not first.finished)


def entries() -> list[Entry]:
    return [entry for _, entry in keyed_entries()]


def keyed_entries() -> list[tuple[int, Entry]]:
    """The plan entries with their keys (``id`` of the dispatcher that recorded each)."""
    with _lock:
        return list(run.plans.items())


def flush() -> None:
    """Log the summary of the plans recorded since the last one (rank 0 only).

    Modules planned for the first time get the tree (``format_summary``); a
    module planned again since it was summarised gets one line saying what
    changed (``format_replans``), or nothing when its plan did not.
    """
    with _lock:
        keys, run.unsummarised[:] = list(run.unsummarised), []
        run.summary_pending = False
        batch = [(k, run.plans[k]) for k in keys if k in run.plans]
        before = {k: run.summarised.get(k) for k, _ in batch}
        run.summarised.update(batch)
        everything = list(run.plans.values())
    fresh = [e for k, e in batch if before[k] is None]
    changed = [(old, e) for k, e in batch if (old := before[k]) is not None and old.key() != e.key()]
    if not (fresh or changed) or rank() != 0:
        return
    from autoweave import _log, _settings

    woven = any(e.plan.woven for e in fresh) or any(e.plan.woven for _, e in changed)
    if woven and _settings.current().log_level is None:
        _log.configure_default()
    replans = format_replans(changed)
    if waiting_for := unmeasured():
        replans.append(f"{waiting_for} pieces block(s) not measured yet: no call with grad so far")
    if fresh:
        lines = [format_summary(fresh, covers=_covers(everything)), *(f"  {line}" for line in replans)]
    elif len(replans) == 1:
        lines = [f"autoweave plan: {replans[0]}"]
    else:
        lines = [f"autoweave plan: {len(changed)} modules re-planned", *(f"  {line}" for line in replans)]
    logger.log(SUMMARY if woven else logging.INFO, "%s", "\n".join(lines))


def _covers(entries: list[Entry]) -> str:
    """In a job of several ranks: which modules this rank's plans cover (one stage under pipeline parallel)."""
    world = world_size()
    if world < 2:
        return ""
    return f"rank {rank()} of {world} covers {_fold(entries)}"


def _kind(plan: Plan) -> str:
    """What a plan does with its root, in a word (``pieces``, ``hoist``, ``plain``)."""
    root = plan.decision("")
    return root.action.value if plan.woven and root is not None else "plain"


def format_replans(changes: list[tuple[Entry, Entry]]) -> list[str]:
    """One line per kind of change: ``layers.1-3 (3 × Block): re-planned: pieces -> hoist: why``."""
    groups: dict[tuple[str, str, str], list[str]] = {}
    for old, new in changes:
        was, now = _kind(old.plan), _kind(new.plan)
        change = f"{was} -> {now}" if was != now else "plan changed"
        root = new.plan.decision("")
        why = root.reason if root is not None else new.plan.headline()
        groups.setdefault((new.type_name, change, why), []).append(new)
    lines = []
    for (type_name, change, why), members in groups.items():
        count = f"{len(members)} × " if len(members) > 1 else ""
        lines.append(f"{_fold(members)} ({count}{type_name}): re-planned: {change}: {why}")
    return lines


def decision_records(entry: Entry) -> list[dict[str, Any]]:
    """An entry's decisions as the report and the structured trace write them (JSON-ready)."""
    return [
        {
            "path": names.join_path(entry.full_name, d.path),
            "type": d.module_type,
            "action": d.action.value,
            "reason": d.reason,
            "region": entry.regions.get(d.path),
            "source": sources.source_dict(entry.plan, d.path),
            "notes": region_notes(entry.regions.get(d.path)),
        }
        for d in entry.plan.decisions
    ]
