"""``autoweave.plan(model)`` is the plan the dispatcher runs, also after the run learned something.

The dispatcher and the public ``plan()`` assemble the planner's inputs in one
place (``dispatch/plan_inputs``): how the module was compiled, the AC around an
in-place compile, what a fallback taught it and what the run learned
(``planning/learned``). Before, ``plan()`` left out what the run learned: after
a fallback located a break (an ``.item()``, a ``torch._dynamo.graph_break()``)
inside a checkpointed block it said "no boundary inside" of a block the
dispatcher runs woven around that break.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

import autoweave
from autoweave.dispatch import dispatchers
from tests import break_models as bm

pytestmark = pytest.mark.usefixtures("weave_on")

BACKEND = "aot_eager"


def _train(model: nn.Module, steps: int = 3) -> None:
    torch.manual_seed(0)
    x = torch.randn(6, bm.DIM)
    for _ in range(steps):
        model(x).square().mean().backward()
    with torch.no_grad():
        model(x)  # a plan the run taught at the last step is applied at the next call


def _compiled(block: nn.Module, how: str) -> nn.Module:
    if how == "torch.compile":
        return torch.compile(block, backend=BACKEND)
    block.compile(backend=BACKEND)
    return block


@pytest.mark.parametrize("how", ["torch.compile", "in place"])
@pytest.mark.parametrize(
    "make, ac",
    [(bm.BreakBlock, "full"), (bm.BreakBlock, "selective"), (bm.ItemRouterBlock, "full")],
    ids=["graph_break-full", "graph_break-selective", "item-full"],
)
def test_plan_after_a_learned_break_is_the_plan_that_runs(make, ac, how):
    wrapper = bm.with_ac(make(), ac)
    model = _compiled(wrapper, how)
    _train(model)
    running = dispatchers.dispatcher_of(model).plan
    # What the fallback taught: the block is woven around a break it did not declare.
    assert running.woven and any("graph break in its forward" in d.reason for d in running.decisions)
    assert autoweave.plan(model) == running
    # The module handed to compile, asked about on its own: what the run learned applies too.
    assert autoweave.plan(wrapper) == running


def test_plan_of_an_in_place_compile_under_an_outer_selective_ac_is_the_plan_that_runs():
    # How it was compiled is part of the plan: in place (its __call__ is not traced) and
    # under a selective AC wrapper, whose checkpoint moves into the regions.
    block = bm.PlainMoE()
    bm.fsdp_like(block.experts)
    block.compile(backend=BACKEND)
    model = bm.with_ac(block, "selective")
    _train(model)
    running = dispatchers.dispatcher_of(block).plan
    assert running.woven and running.outer_push_down is not None
    assert autoweave.plan(block) == running


def test_a_learned_break_reaches_every_block_that_runs_its_code():
    stack = nn.Sequential(*(cw.checkpoint_wrapper(bm.BreakBlock()) for _ in range(2)))
    model = torch.compile(stack, backend=BACKEND)
    _train(model)
    running = dispatchers.dispatcher_of(model).plan
    assert running.woven and autoweave.plan(model) == running
    # The second block never logged its own fallback (it shares the first one's cached code).
    assert running.decision("1").action == running.decision("0").action
