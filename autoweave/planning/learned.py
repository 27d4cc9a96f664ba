"""What the run learned, as the one value a plan reads: ``Learned``.

Three things a compile cannot read from the module tree are learned while the
run goes, each from one block, and kept for every block like it:

- breaks (``learned_breaks``): where dynamo broke a checkpointed region, from
  its fallback at a first call. Kept by forward code: identical blocks share
  dynamo's cache for the checkpoint wrapper's code, so only the first block to
  compile logs the fallback; the others silently run the cached eager one.
- memory verdicts (``memory``): what a block woven as pieces held at its first
  call against eager selective AC. Kept by kind of block (``memory.kind``).
- context verdicts (``traced_contexts``): whether a checkpoint traced inside a
  compiled graph can take a ``context_fn``. Kept per ``context_fn`` object.

The tables live on ``_state.run`` (``_state.reset()`` forgets them) and are
written and read only here. ``Learned.for_target`` turns them into one frozen
value for a compile target; ``planner.plan`` reads nothing else of the run.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from autoweave._state import run
from autoweave.planning import tree_changes
from autoweave.planning.learned_breaks import forward_code
from autoweave.planning.memory import Verdict, kind

_lock = threading.Lock()


def _nothing() -> Mapping[int, str]:
    return MappingProxyType({})


@dataclass(frozen=True)
class Learned:
    """What the run learned about the modules under one compile target, keyed by ``id``.

    ``breaks``: modules dynamo was seen breaking in, with why (boundaries of the
    plan). ``measured``: AC wrappers whose pieces held more than eager selective
    AC would, with why (``auto`` plans them with hoist). ``untraceable``:
    checkpoints, by ``id`` of their ``checkpoint_fn``, whose ``context_fn`` a
    traced checkpoint cannot take, with why; it may be a lazy mapping that
    probes at its first lookup (``dispatch/context_probe``), so a plan that
    looks nothing up calls no ``context_fn``.
    """

    breaks: Mapping[int, str] = field(default_factory=_nothing)
    measured: Mapping[int, str] = field(default_factory=_nothing)
    untraceable: Mapping[int, str] = field(default_factory=_nothing)

    @classmethod
    def for_target(
        cls,
        target: Any,
        *,
        breaks: Mapping[int, str] | None = None,
        untraceable: Mapping[int, str] | None = None,
    ) -> Learned:
        """What the run learned under ``target``.

        ``breaks``: the target's own, from a fallback it saw (they win over
        what other blocks taught); ``untraceable``: its checkpoints' context
        verdicts (nothing is probed here).
        """
        return cls(
            breaks=MappingProxyType({**_breaks_under(target), **(breaks or {})}),
            measured=MappingProxyType(_measured_under(target)),
            untraceable=_nothing() if untraceable is None else untraceable,
        )


# -- breaks --------------------------------------------------------------------------------


def learn_breaks(target: Any, located: Mapping[int, str]) -> None:
    """Remember the forward code of each located module (ids from ``learned_breaks.locate``) as breaking."""
    for module in target.modules():
        reason = located.get(id(module))
        if reason is not None:
            code = forward_code(module)
            if code is not None:
                run.learned_breaks.setdefault(code, reason)


def _breaks_under(target: Any) -> dict[int, str]:
    learned = run.learned_breaks
    if not learned:
        return {}
    found = {}
    for module in target.modules():
        code = forward_code(module)
        if code is not None and code in learned:
            found[id(module)] = learned[code]
    return found


# -- memory verdicts -----------------------------------------------------------------------


def learn_verdict(wrapper: Any, verdict: Verdict) -> None:
    """Remember ``verdict`` for every block of ``wrapper``'s kind; a hoist verdict re-plans them."""
    key = kind(wrapper)
    if key is None:
        return
    with _lock:
        run.learned_memory.setdefault(key, verdict)
    if verdict.hoist:
        tree_changes.bump()  # the dispatchers holding blocks of this kind re-read their tree


def verdict_of(module: Any) -> Verdict | None:
    """What a block of ``module``'s kind was measured to hold (None: not measured yet)."""
    if not run.learned_memory:
        return None
    key = kind(module)
    return None if key is None else run.learned_memory.get(key)


def hoist_reason(module: Any) -> str | None:
    """Why a block of ``module``'s kind is to be planned with hoist; None when it is not."""
    verdict = verdict_of(module)
    return verdict.describe() if verdict is not None and verdict.hoist else None


def _measured_under(target: Any) -> dict[int, str]:
    if not run.learned_memory:
        return {}
    return {id(m): why for m in target.modules() if (why := hoist_reason(m)) is not None}


# -- context verdicts ----------------------------------------------------------------------

UNJUDGED = object()  # context_verdict's answer for a context_fn nobody judged yet


def context_verdict(context_fn: Any) -> Any:
    """Why a traced checkpoint cannot take ``context_fn`` (None: it can), or ``UNJUDGED``."""
    kept = run.context_verdicts.get(id(context_fn))
    # By id, with the object kept: an id reused by a new function is not its verdict.
    return kept[1] if kept is not None and kept[0] is context_fn else UNJUDGED


def learn_context(context_fn: Any, verdict: str | None) -> None:
    """Remember what ``context_fn`` was judged (``traced_contexts.why_not_traceable``)."""
    run.context_verdicts[id(context_fn)] = (context_fn, verdict)
