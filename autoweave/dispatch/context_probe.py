"""The probe of a checkpoint's ``context_fn``: called once, outside any trace, to see what it returns.

``planning/traced_contexts`` judges the returned value; this module is the only
place that calls the user's ``context_fn`` for it. Plain torch calls it at every
checkpointed forward, so one more call before the first one changes nothing a
``context_fn`` may rely on (it must hand out fresh contexts per call). One that
raises is the user's to raise, at the forward: nothing is decided from it. The
verdict is kept per ``context_fn`` object (``planning/learned``).

Lazily: the planner looks a checkpoint up only when it plans a checkpointed
block with a boundary inside (or an AC outside one), so blocks with nothing to
weave (torchtitan's, whose compile has no break) are never probed.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from autoweave import _compat
from autoweave._log import logger
from autoweave.planning import learned, traced_contexts


def probe(context_fn: Any) -> str | None:
    """Why a traced checkpoint cannot take ``context_fn``; None when it can (or it cannot be told)."""
    if context_fn is None:
        return None
    verdict = learned.context_verdict(context_fn)
    if verdict is learned.UNJUDGED:
        verdict = _call_and_judge(context_fn)
        learned.learn_context(context_fn, verdict)
    return verdict


def _call_and_judge(context_fn: Any) -> str | None:
    if traced_contexts.known_traceable(context_fn):
        return None  # torch's own: two dispatch modes, not called
    try:
        contexts = context_fn()
    except Exception as exc:  # the user's error, raised again by their checkpoint at the forward
        logger.debug("context_fn %r raised when probed; not judged", context_fn, exc_info=exc)
        return None
    return traced_contexts.why_not_traceable(context_fn, contexts)


def untraceable(
    target: Any, outer: Any = None, *, strategy: str = "auto", mode: str = "auto"
) -> dict[int, str]:
    """Checkpoint wrappers under ``target`` (and ``outer``) whose ``context_fn`` cannot be traced.

    Keyed by ``id`` of the wrapper's ``checkpoint_fn`` (what ``planner.CheckpointSpec``
    carries), with why: ``Learned.untraceable``. Nothing is probed where the plan
    would not trace a checkpoint (blocks under ``hoist``, anything
    under ``mode=off``).
    """
    found: dict[int, str] = {}
    if mode == "off":
        return found
    # A selective AC outside the compile is moved into the regions under every strategy;
    # the blocks inside are traced only under the tracing ones.
    modules = list(target.modules()) if strategy in traced_contexts.TRACING_STRATEGIES else []
    if outer is not None:
        modules.append(outer)
    try:
        wrapper_cls = _compat.modules.checkpoint_wrapper_class()
    except _compat.lookup.UnsupportedTorch:
        return found
    for module in modules:
        if not isinstance(module, wrapper_cls):
            continue
        context_fn = traced_contexts.context_fn_of(module)
        if context_fn is None:
            continue
        why = probe(context_fn)
        if why is not None:
            found[id(module.checkpoint_fn)] = why
    return found


class Lazily(Mapping[int, str]):
    """``untraceable(...)``'s answer, probed at the first lookup: a plan that weaves nothing calls no ``context_fn``."""

    def __init__(self, target: Any, outer: Any = None, *, strategy: str = "auto", mode: str = "auto") -> None:
        self._args = (target, outer)
        self._options = {"strategy": strategy, "mode": mode}
        self._found: dict[int, str] | None = None

    def _probed(self) -> dict[int, str]:
        if self._found is None:
            self._found = untraceable(*self._args, **self._options)
        return self._found

    def __getitem__(self, key: int) -> str:
        return self._probed()[key]

    def __iter__(self) -> Iterator[int]:
        return iter(self._probed())

    def __len__(self) -> int:
        return len(self._probed())
