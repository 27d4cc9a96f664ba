"""A compile of the whole model over blocks compiled on their own: dynamo never meets autoweave's code.

Users compile both (``torch.compile(model)`` over ``torch.compile(block)``s,
``model.compile()`` over ``block.compile()``). The outer trace must see each
compiled block as plain torch shows it, and where the outer compile breaks its
graph at a block, the block's own compile (autoweave's plan) takes over; no
frame of the dispatcher, planner, summary or report is traced or converted.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch._dynamo.backends.registry import lookup_backend
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

import autoweave
from autoweave import _compat
from autoweave._state import run
from tests.break_models import DIM, BreakBlock
from tests.models import Block, train_steps

pytestmark = pytest.mark.usefixtures("weave_on")

AUTOWEAVE_DIR = os.path.dirname(os.path.abspath(autoweave.__file__))


class Counting:
    """aot_eager, counting the graphs it is handed (one object per compile: no per-layer recompile)."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        self.graphs += 1
        return lookup_backend("aot_eager")(gm, example_inputs)


class Model(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


BLOCKS = {
    # No break anywhere: the outer compile inlines every block, as plain torch does.
    "no break": lambda i: Block(DIM, moe=False),
    # A break under the checkpoint, found by dynamo's fallback: the outer graph breaks at
    # each block, whose own compile runs it (woven from the second step on).
    "hidden break": lambda i: BreakBlock(),
    # A boundary the planner sees: the outer model is woven too, its regions over compiled blocks.
    "boundary": lambda i: Block(DIM, moe=i > 0),
}


def _build(blocks: str, form: str, outer: Counting, inner: Counting) -> nn.Module:
    torch.manual_seed(0)
    model = Model([BLOCKS[blocks](i) for i in range(3)])
    for i, block in enumerate(model.layers):
        if form == "AC outside":  # the checkpoint wrapper's forward is gated (dispatch.routes)
            model.layers[i] = cw.checkpoint_wrapper(torch.compile(block, backend=inner))
            continue
        wrapped = cw.checkpoint_wrapper(block)
        if form == "in place":
            model.layers[i] = wrapped
            wrapped.compile(backend=inner)
        else:
            model.layers[i] = torch.compile(wrapped, backend=inner)
    if form != "in place":
        return torch.compile(model, backend=outer)
    model.compile(backend=outer)
    return model


@contextlib.contextmanager
def _dynamo_meets() -> Iterator[list[Any]]:
    """Every code object dynamo converts as a frame or inlines into one, while inside."""
    from torch._dynamo.symbolic_convert import InliningInstructionTranslator

    seen: list[Any] = []
    inline = InliningInstructionTranslator.inline_call_

    def recording(self: Any) -> Any:
        seen.append(self.f_code)
        return inline(self)

    def on_start(*_: Any) -> None:
        code = _compat.dynamo.code_being_compiled()
        if code is not None:
            seen.append(code)

    callbacks = torch._dynamo.callback.callback_handler
    InliningInstructionTranslator.inline_call_ = recording
    callbacks.register_start_callback(on_start)
    try:
        yield seen
    finally:
        InliningInstructionTranslator.inline_call_ = inline
        callbacks.remove_start_callback(on_start)


def _autoweave_code(codes: list[Any]) -> set[str]:
    # A woven region's own code is a copy named for its region (``autoweave_<Type>_<path>_<n>``,
    # its resume functions after it); everything else under autoweave/ is autoweave's machinery.
    return {
        f"{code.co_name} ({os.path.relpath(code.co_filename, AUTOWEAVE_DIR)})"
        for code in codes
        if os.path.abspath(code.co_filename).startswith(AUTOWEAVE_DIR + os.sep)
        and "autoweave_" not in code.co_name
    }


def _train(model: nn.Module, steps: int = 3) -> list[float]:
    return train_steps(model, torch.randn(4, DIM), steps)


@pytest.mark.parametrize("form", ["torch.compile", "in place", "AC outside"])
@pytest.mark.parametrize("blocks", list(BLOCKS))
def test_outer_compile_never_traces_autoweave(blocks: str, form: str) -> None:
    plain_outer, plain_inner = Counting(), Counting()
    with autoweave.disabled():
        plain = _build(blocks, form, plain_outer, plain_inner)
    plain_losses = _train(plain)
    torch._dynamo.reset()

    outer, inner = Counting(), Counting()
    model = _build(blocks, form, outer, inner)
    with _dynamo_meets() as met, warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        losses = _train(model)

    assert not _autoweave_code(met), sorted(_autoweave_code(met))
    assert not run.swallowed, run.swallowed  # no [region-eager] from a frame of autoweave's
    assert not [str(w.message) for w in warned if "lru_cache" in str(w.message)]
    torch.testing.assert_close(losses, plain_losses)
    if blocks != "boundary":  # (there autoweave weaves the outer model itself)
        # The outer compile sees what plain torch shows it: the same graphs, no more.
        assert outer.graphs == plain_outer.graphs
    if blocks == "no break":
        assert inner.graphs == plain_inner.graphs  # nothing to weave: exactly plain torch
