"""Can a checkpoint that dynamo traces take a wrapper's ``context_fn``?

``pieces`` puts the user's checkpoint inside compiled graphs,
where torch's checkpoint demands that ``context_fn`` return two
``TorchDispatchMode`` objects ("In torch.compile mode, `context_fn` ... must
generate a tuple of two `TorchDispatchMode`s", torch/utils/checkpoint.py).
``create_selective_checkpoint_contexts`` does. A ``context_fn`` that wraps
those modes in ordinary context managers does not: NeMo Automodel's
``apply_ac`` composes its per-op policy with an attention-backend snapshot and,
for MoE blocks, a ``@contextmanager`` that swaps the gate's expert-load buffer
around the recompute. Every piece of such a block would raise inside the trace
and run eager (21 of 28 forward GEMMs on NeMo's DeepSeek-V3, as many as plain
torch); eager AC around the compiled block (``hoist``) calls that ``context_fn``
exactly as the user's wrapper does, and compiles everything but the breaks.

Told, not guessed: a ``functools.partial`` of torch's own factory is known to
be traceable; any other ``context_fn`` is called once, at planning, outside any
trace, and what it returns is looked at (never entered). Plain torch calls it
at every checkpointed forward, so one more call before the first one changes
nothing a ``context_fn`` may rely on (it must hand out fresh contexts per
call). One that raises is the user's to raise, at the forward: nothing is
decided from it. The verdict is kept per ``context_fn`` object.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from autoweave import _compat
from autoweave._log import logger
from autoweave._state import run


def _checkpoint_context_fn(module: Any) -> Any:
    """The ``context_fn`` a CheckpointWrapper passes to torch's checkpoint (None: none, or full AC)."""
    fn = getattr(module, "checkpoint_fn", None)
    keywords = getattr(fn, "keywords", None) or {}
    context_fn = keywords.get("context_fn")
    if context_fn is None or getattr(context_fn, "__name__", "") == "noop_context_fn":
        return None
    return context_fn


def _describe(value: Any) -> str:
    return type(value).__name__


def why_not_traceable(context_fn: Any) -> str | None:
    """Why a traced checkpoint cannot take ``context_fn``; None when it can (or it cannot be told)."""
    if context_fn is None:
        return None
    cached = run.context_verdicts.get(id(context_fn))
    if cached is not None and cached[0] is context_fn:
        return cached[1]
    verdict = _probe(context_fn)
    run.context_verdicts[id(context_fn)] = (context_fn, verdict)
    return verdict


def _probe(context_fn: Any) -> str | None:
    factory = _compat.selective_contexts_factory()
    if factory is not None and getattr(context_fn, "func", None) is factory:
        return None  # torch's own: two dispatch modes
    try:
        contexts = context_fn()
    except Exception as exc:  # the user's error, raised again by their checkpoint at the forward
        logger.debug("context_fn %r raised when probed; not judged", context_fn, exc_info=exc)
        return None
    name = getattr(context_fn, "__qualname__", None) or _describe(context_fn)
    if not (isinstance(contexts, tuple) and len(contexts) == 2):
        return f"its context_fn ({name}) returns {_describe(contexts)}, not a pair of contexts"
    if all(_compat.is_dispatch_mode(c) for c in contexts):
        return None
    kinds = " and ".join(_describe(c) for c in contexts)
    return (
        f"its context_fn ({name}) returns {kinds}, not the two TorchDispatchModes a checkpoint "
        "inside a compiled graph requires"
    )


# The strategies that would trace the user's checkpoint inside compiled graphs.
TRACING_STRATEGIES = ("auto", "pieces")


def known(target: Any, outer: Any = None, *, strategy: str = "auto", mode: str = "auto") -> dict[int, str]:
    """Checkpoint wrappers under ``target`` (and ``outer``) whose ``context_fn`` cannot be traced.

    Keyed by ``id`` of the wrapper's ``checkpoint_fn`` (what ``plans.CheckpointSpec``
    carries), with why: for ``planner.plan``'s ``untraceable``. Nothing is probed
    where the plan would not trace a checkpoint (blocks under ``hoist``,
    anything under ``mode=off``).
    """
    found: dict[int, str] = {}
    if mode == "off":
        return found
    # A selective AC outside the compile is moved into the regions under every strategy;
    # the blocks inside are traced only under the tracing ones.
    modules = list(target.modules()) if strategy in TRACING_STRATEGIES else []
    if outer is not None:
        modules.append(outer)
    try:
        wrapper_cls = _compat.checkpoint_wrapper_class()
    except _compat.UnsupportedTorch:
        return found
    for module in modules:
        if not isinstance(module, wrapper_cls):
            continue
        context_fn = _checkpoint_context_fn(module)
        if context_fn is None:
            continue
        why = why_not_traceable(context_fn)
        if why is not None:
            found[id(module.checkpoint_fn)] = why
    return found


class Lazily(Mapping[int, str]):
    """``known(...)``'s answer, probed at the first lookup: a plan that weaves nothing calls no ``context_fn``.

    The planner looks a checkpoint up only when it plans a checkpointed block
    with a boundary inside (or an AC outside one): blocks with nothing to
    weave (torchtitan's, whose compile has no break) are never probed.
    """

    def __init__(self, target: Any, outer: Any = None, *, strategy: str = "auto", mode: str = "auto") -> None:
        self._args = (target, outer)
        self._options = {"strategy": strategy, "mode": mode}
        self._found: dict[int, str] | None = None

    def _probed(self) -> dict[int, str]:
        if self._found is None:
            self._found = known(*self._args, **self._options)
        return self._found

    def __getitem__(self, key: int) -> str:
        return self._probed()[key]

    def __iter__(self) -> Iterator[int]:
        return iter(self._probed())

    def __len__(self) -> int:
        return len(self._probed())
