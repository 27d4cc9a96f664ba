"""Human-readable plans: the one summary logged at the first woven forward."""

from __future__ import annotations

import re

from autoweave._log import logger
from autoweave.planner import Action, Plan

_WRAPPER_SEGMENTS = re.compile(r"(^|\.)(_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module)(?=\.|$)")

_VERBS = {
    Action.PLAIN: "plain torch.compile",
    Action.COMPILE: "compiled whole",
    Action.SPLIT: "compiled, split at boundaries",
    Action.WEAVE: "woven",
    Action.BOUNDARY: "boundary",
    Action.HOIST: "AC eager",
    Action.PUSH_DOWN: "AC pushed down",
    Action.EAGER: "eager",
}


def display_path(path: str) -> str:
    """A plan path as the user names it (wrapper segments dropped, like state_dict keys)."""
    cleaned = _WRAPPER_SEGMENTS.sub("", path).strip(".")
    return cleaned or "<root>"


def format_plan(plan: Plan, *, name: str = "") -> str:
    """One line per decision, indented by depth."""
    head = f"{name or plan.root_type} ({plan.root_type}): "
    if not plan.woven:
        return head + plan.decisions[0].reason
    lines = [
        head + f"woven, {len(plan.regions())} compiled regions (mode={plan.mode}, strategy={plan.strategy})"
    ]
    for decision in plan.decisions:
        shown = display_path(decision.path)
        depth = 0 if shown == "<root>" else shown.count(".") + 1
        lines.append(
            f"  {'  ' * depth}{shown} [{decision.module_type}] {_VERBS[decision.action]}: {decision.reason}"
        )
    return "\n".join(lines)


_logged: set[str] = set()


def log_plan(plan: Plan) -> None:
    """Log a woven plan at INFO once per distinct plan text (identical blocks fold)."""
    text = format_plan(plan)
    if text in _logged:
        logger.debug("same plan again for another %s", plan.root_type)
        return
    _logged.add(text)
    logger.info("autoweave plan:\n%s", text)
