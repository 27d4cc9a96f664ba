"""Checkpointing each compiled piece of a region that dynamo splits (the ``pieces`` strategy).

A checkpoint that dynamo traces cannot hold a graph break: the whole region
would run eager. A region compiled *without* a checkpoint may break: dynamo
splits its forward at each break and hands every graph between two breaks to
the backend. ``CheckpointPieces`` is that backend: it wraps each graph in
torch's own checkpoint operator (``tag_activation_checkpoint``, what dynamo
emits for a traced ``checkpoint(...)``) with the user's ``context_fn`` and
options, then compiles it with the user's backend. So every op of the region
(the block's glue between its children and an FSDP unit included) is compiled
and checkpointed under the user's policy, applied to the aten ``.default`` ops
it was written for, and no checkpoint contains a break.

What it costs: a piece's inputs are kept for its backward (the whole block
kept only its input), so activation memory grows by the tensors that cross a
break (``benchmarks/`` measure it against eager selective AC).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

from autoweave import _compat
from autoweave._failopen import _strict, warn_each
from autoweave._log import logger

# The keyword options of torch.utils.checkpoint that the operator takes as they are.
_OPTIONS = ("preserve_rng_state", "determinism_check", "debug")
# In-place operators dynamo writes as functions (``x += y``, ``x[i] = y``).
_INPLACE_OPERATORS = {
    operator.iadd,
    operator.isub,
    operator.imul,
    operator.itruediv,
    operator.ifloordiv,
    operator.ipow,
    operator.setitem,
}


def _has_ops(gm: Any) -> bool:
    return any(node.op in ("call_function", "call_method", "call_module") for node in gm.graph.nodes)


def _returns_only_tensors(gm: Any) -> bool:
    """The checkpoint operator returns tensors: a piece returning anything else is left unwrapped."""
    import torch
    import torch.fx as fx

    (output,) = (n for n in gm.graph.nodes if n.op == "output")
    results = output.args[0]
    if not isinstance(results, (tuple, list)):
        results = (results,)
    return all(
        isinstance(r, fx.Node) and isinstance(r.meta.get("example_value"), torch.Tensor) for r in results
    )


def _mutates_a_grad_input(gm: Any, example_inputs: Any) -> bool:
    """Does the piece change, in place, an input that requires grad? (Heuristic: views not followed.)

    Inside the checkpoint operator that fails at backward ("modified by an
    inplace operation"), and any recompute would apply the change twice.
    """
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    grad_inputs = {
        node
        for node, value in zip(placeholders, example_inputs, strict=False)
        if getattr(value, "requires_grad", False)
    }
    for node in gm.graph.nodes:
        if node.op == "call_method":
            name = str(node.target)
        elif node.op == "call_function":
            if node.target in _INPLACE_OPERATORS:
                name = "_"
            else:
                name = getattr(node.target, "__name__", "")
        else:
            continue
        inplace = name.endswith("_") and not name.endswith("__")
        if inplace and node.args and node.args[0] in grad_inputs:
            return True
    return False


class CheckpointPieces:
    """A dynamo backend: each graph piece compiled as ``checkpoint(piece, context_fn=..., ...)``.

    One object per (inner backend, checkpoint): dynamo guards on the backend's
    identity, so identical blocks must share it to share their graphs.
    """

    def __init__(self, inner: Callable[..., Any], checkpoint_fn: Any) -> None:
        self.inner = inner
        keywords = dict(getattr(checkpoint_fn, "keywords", {}) or {})
        self.context_fn = keywords.pop("context_fn", None)
        if getattr(self.context_fn, "__name__", "") == "noop_context_fn":
            self.context_fn = None  # full AC: the operator's own always-recompute policy
        self.options = {k: v for k, v in keywords.items() if k in _OPTIONS}
        self.__name__ = f"checkpoint_pieces({getattr(inner, '__name__', 'backend')})"

    def __call__(self, gm: Any, example_inputs: Any) -> Any:
        if not _has_ops(gm):
            return self.inner(gm, example_inputs)  # nothing to checkpoint
        if not _returns_only_tensors(gm):
            logger.info("a piece of a woven region returns non-tensors: compiled without its checkpoint")
            return self.inner(gm, example_inputs)
        if _mutates_a_grad_input(gm, example_inputs):
            # Recomputing it would change that input a second time: compiled
            # without the checkpoint (its activations are kept), numerics intact.
            logger.info("a piece of a woven region changes an input in place: compiled without its checkpoint")
            return self.inner(gm, example_inputs)
        try:
            return self.inner(self.wrap(gm), example_inputs)
        except Exception as exc:
            if _strict():
                raise
            # Never a crash plain torch would not have had, nor a checkpoint lost:
            # this piece runs eager under the user's checkpoint, as eager AC would.
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            logger.debug("checkpointing a compiled piece failed", exc_info=exc)
            warn_each(
                f"piece:{type(exc).__name__}:{first}",
                f"[piece-eager] a piece of a woven region could not be compiled under its checkpoint "
                f"({type(exc).__name__}: {first}); it runs eager under the same checkpoint. "
                "Set AUTOWEAVE_STRICT=1 to raise, AUTOWEAVE_LOG_LEVEL=debug for the traceback.",
            )
            return self.eager(gm)

    def eager(self, gm: Any) -> Callable[..., Any]:
        """``gm`` run eagerly under torch's checkpoint with the same policy and options."""
        from torch.utils.checkpoint import checkpoint

        extra = {} if self.context_fn is None else {"context_fn": self.context_fn}

        def run(*args: Any) -> Any:
            return checkpoint(gm, *args, use_reentrant=False, **extra, **self.options)

        return run

    def wrap(self, gm: Any) -> Any:
        """A graph module calling ``gm`` under the checkpoint operator, same inputs and outputs."""
        import torch.fx as fx
        import torch.nn as nn

        hop = _compat.tag_activation_checkpoint()
        if self.context_fn is not None:
            gm.meta["_checkpoint_context_fn"] = self.context_fn  # read by the operator's implementation
        root = nn.Module()
        root.piece = gm
        graph = fx.Graph()
        inputs = []
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                placeholder = graph.placeholder(node.name, type_expr=node.type)
                placeholder.meta.update(node.meta)
                inputs.append(placeholder)
        (output,) = (n for n in gm.graph.nodes if n.op == "output")
        results = output.args[0]
        call = graph.call_function(hop, (graph.get_attr("piece"), *inputs), dict(self.options))
        values = tuple(r.meta.get("example_value") if isinstance(r, fx.Node) else r for r in results)
        call.meta["example_value"] = values
        outputs = []
        for i, value in enumerate(values):
            item = graph.call_function(operator.getitem, (call, i))
            item.meta["example_value"] = value
            outputs.append(item)
        graph.output(tuple(outputs) if isinstance(results, (tuple, list)) else outputs[0])
        return fx.GraphModule(root, graph)

    def reset(self) -> None:
        reset = getattr(self.inner, "reset", None)
        if reset is not None:
            reset()
