"""``p.grad is None`` where plain torch leaves it None: inputs that reach only some of a graph's outputs.

Plain torch runs a block whose checkpoint holds a graph break eager. There, a parameter whose
output only feeds a host read (a router gate's statistic, ``.item()``) is not on the loss's
autograd path: backward never reaches it and its ``grad`` stays ``None``. Compiled, the same
ops are one graph whose backward (AOTAutograd's ``CompiledFunction``) runs as soon as *any*
of its outputs gets a gradient, with zeros materialised for the others: the parameter gets a
zero tensor, and an optimizer's weight decay then moves it every step.

So the region backend wraps a compiled graph whose differentiable inputs reach only part of
its outputs, one of them a single value (what a host read takes): each such input enters the
graph through an identity node (``Reached``) whose backward passes the gradient on only when at least one output the input reaches got a gradient
of its own (``register_multi_grad_hook`` tells which did), and ``None`` otherwise, as eager
autograd would. Inputs that reach every output need nothing: when none of them gets a
gradient, autograd never runs the graph's backward at all. Most graphs have no such input and
are returned as they are (no per-call cost).

Which outputs an input reaches is read from the graph, through every op (differentiable or
not): a superset, so an input is never cut off from a gradient it has.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from autoweave import _compat
from autoweave._failopen import RAN_EAGER


def partial_inputs(gm: Any, example_inputs: Sequence[Any]) -> dict[int, frozenset[int]]:
    """Input index -> the output indices it reaches, for differentiable inputs that miss one."""
    import torch

    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    outputs = [node for node in gm.graph.nodes if node.op == "output"]
    if len(outputs) != 1 or len(placeholders) != len(example_inputs):
        return {}
    index = {node: i for i, node in enumerate(placeholders)}
    reaches: dict[Any, frozenset[int]] = {}  # node -> the placeholders it depends on
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            reaches[node] = frozenset((index[node],))
        elif node.op != "output":
            reaches[node] = frozenset().union(
                *(reaches.get(arg, frozenset()) for arg in node.all_input_nodes)
            )
    flat = outputs[0].args[0]
    flat = list(flat) if isinstance(flat, (tuple, list)) else [flat]
    differentiable = [
        i for i, out in enumerate(flat) if isinstance(out, torch.fx.Node) and _may_need_grad(out)
    ]
    found: dict[int, set[int]] = {}
    for i in differentiable:
        for source in reaches.get(flat[i], frozenset()):
            found.setdefault(source, set()).add(i)
    every = set(differentiable)
    # Only inputs that reach a single value (what ``.item()`` reads): an input that reaches
    # only part of the outputs is common (a router's weights reach its logits alone), and each
    # one wrapped costs an autograd node and a view per call.
    return {
        source: frozenset(outs)
        for source, outs in found.items()
        if outs != every and any(_single(flat[i]) for i in outs) and _requires_grad(example_inputs[source])
    }


def _example(node: Any) -> Any:
    """What dynamo recorded ``node`` computes (a fake tensor), or None."""
    return _compat.checkpoints.traced_value(node)


def _may_need_grad(node: Any) -> bool:
    import torch

    value = _example(node)
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    return value is None  # not recorded: it may


def _single(node: Any) -> bool:
    shape = getattr(_example(node), "shape", None)
    # Plain ints only: asking a symbolic size for its value would guard on it (specialise a
    # dynamic length, and recompile at every new one).
    if shape is None or not all(type(size) is int for size in shape):
        return False
    return all(size == 1 for size in shape)


def _requires_grad(value: Any) -> bool:
    return bool(getattr(value, "requires_grad", False))


@functools.cache
def _reached() -> Any:
    import torch  # imported by the time a graph compiles; not at start-up

    class Reached(torch.autograd.Function):
        """Identity in forward; in backward, the gradient only if an output the input reaches got one."""

        @staticmethod
        def forward(ctx: Any, x: Any, got: list[bool], outs: frozenset[int]) -> Any:
            ctx.got, ctx.outs = got, outs
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> tuple[Any, None, None]:
            reached = any(ctx.got[i] for i in ctx.outs)
            return (grad if reached else None), None, None

    return Reached


def keep_none_grads(
    compiled: Callable[..., Any], gm: Any, example_inputs: Sequence[Any]
) -> Callable[..., Any]:
    """``compiled``, or a wrapper that leaves ``grad`` None where eager would (see the module docstring)."""
    if getattr(compiled, RAN_EAGER, None) is not None:
        return compiled  # it runs the graph's own ops eagerly: autograd already does it
    partial = partial_inputs(gm, example_inputs)
    if not partial:
        return compiled
    import torch

    reached = _reached()

    def run(*args: Any) -> Any:
        if not torch.is_grad_enabled():
            return compiled(*args)
        got: list[bool] = []
        args = list(args)
        for i, outs in partial.items():
            if _requires_grad(args[i]):
                args[i] = reached.apply(args[i], got, outs)
        result = compiled(*args)
        flat = list(result) if isinstance(result, (tuple, list)) else [result]
        got.extend(False for _ in flat)
        needing = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if needing:
            # Indices only: a closure holding the outputs would keep them alive until backward.
            def seen(grads: Sequence[torch.Tensor | None]) -> None:
                for i, grad in zip(needing, grads, strict=True):
                    got[i] = grad is not None

            torch.autograd.graph.register_multi_grad_hook([flat[i] for i in needing], seen, mode="all")
        return result

    run.__dict__.update(getattr(compiled, "__dict__", {}))
    return run
