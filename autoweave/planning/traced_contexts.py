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
be traceable (``known_traceable``); any other ``context_fn`` is called once by
``dispatch/context_probe``, outside any trace, and what it returned is judged
here (``why_not_traceable``, which looks at the value and never enters it).
"""

from __future__ import annotations

from typing import Any

from autoweave import _compat

# The strategies that would trace the user's checkpoint inside compiled graphs.
TRACING_STRATEGIES = ("auto", "pieces")


def context_fn_of(module: Any) -> Any:
    """The ``context_fn`` a CheckpointWrapper passes to torch's checkpoint (None: none, or full AC)."""
    fn = getattr(module, "checkpoint_fn", None)
    keywords = getattr(fn, "keywords", None) or {}
    context_fn = keywords.get("context_fn")
    if context_fn is None or getattr(context_fn, "__name__", "") == "noop_context_fn":
        return None
    return context_fn


def known_traceable(context_fn: Any) -> bool:
    """A ``functools.partial`` of torch's own factory: two dispatch modes, without calling it."""
    factory = _compat.checkpoints.selective_contexts_factory()
    return factory is not None and getattr(context_fn, "func", None) is factory


def _describe(value: Any) -> str:
    return type(value).__name__


def why_not_traceable(context_fn: Any, contexts: Any) -> str | None:
    """Why a traced checkpoint cannot take ``context_fn``, which returned ``contexts``; None when it can."""
    name = getattr(context_fn, "__qualname__", None) or _describe(context_fn)
    if not (isinstance(contexts, tuple) and len(contexts) == 2):
        return f"its context_fn ({name}) returns {_describe(contexts)}, not a pair of contexts"
    if all(_compat.checkpoints.is_dispatch_mode(c) for c in contexts):
        return None
    kinds = " and ".join(_describe(c) for c in contexts)
    return (
        f"its context_fn ({name}) returns {kinds}, not the two TorchDispatchModes a checkpoint "
        "inside a compiled graph requires"
    )
