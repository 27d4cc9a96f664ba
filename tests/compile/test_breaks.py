"""Issue 11: no checkpointed region falls back to eager, whatever breaks the graph and wherever
the checkpoint is written. In one process, aot_eager; the counts that matter are AC fallbacks
per step, forward GEMMs outside compiled graphs, and numerics against eager.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import autoweave
from autoweave import _state
from autoweave.dispatch import dispatchers
from autoweave.planning import checkpoint_calls, planner
from autoweave.planning.learned import hoist_reason
from autoweave.planning.plans import Action
from autoweave.sense import counting
from benchmarks.measure import forward_gemms_outside_graphs as _eager_gemms
from tests import break_models as bm
from tests.models import make_break

BACKEND = "aot_eager"


pytestmark = pytest.mark.usefixtures("weave_on")


_ac = bm.with_ac


def _train(model: nn.Module, x: torch.Tensor, steps: int = 3) -> dict:
    fallbacks, outs, grads = [], [], []
    for _ in range(steps):
        with counting.FallbackCounter() as watch:
            out = model(x)
            out.square().mean().backward()
        fallbacks.append(watch.count)
        outs.append(out.detach().clone())
        grads.append(
            torch.cat(
                [
                    (p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                    for p in model.parameters()
                ]
            )
        )
        model.zero_grad()
    return {"fallbacks": fallbacks, "outs": outs, "grads": grads}


def _assert_numerics(got: dict, ref: dict) -> None:
    for a, b in zip(got["outs"] + got["grads"], ref["outs"] + ref["grads"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# Each with how many separate breaks dynamo meets in it (it stops at the first one per call).
BREAKING = [(bm.BreakBlock, 1), (bm.LoopBlock, 1), (bm.ItemRouterBlock, 2)]


@pytest.mark.parametrize("ac", ["full", "selective"])
@pytest.mark.parametrize("make, n_breaks", BREAKING, ids=[c.__name__ for c, _ in BREAKING])
def test_any_break_under_ac_is_compiled_around(make, n_breaks, ac):
    torch.manual_seed(0)
    x = torch.randn(6, bm.DIM)
    block = make()
    ref = _train(_ac(copy.deepcopy(block), ac), x, steps=2 + n_breaks)

    # Plain torch: the whole checkpointed block runs eager.
    with autoweave.disabled():
        plain = torch.compile(_ac(copy.deepcopy(block), ac), backend=BACKEND)
    plain_run = _train(plain, x)
    assert plain_run["fallbacks"][0] >= 1  # logged once, at the compile; it runs eager every step
    plain_gemms = _eager_gemms(plain, x)
    # Plain torch's cached fallback for the wrapper's code would answer our first
    # call without a message (identical blocks share it): start from a clean cache.
    torch._dynamo.reset()

    model = torch.compile(_ac(block, ac), backend=BACKEND)
    got = _train(model, x, steps=2 + n_breaks)
    # The checkpoint is in the tree, the break is not: the first calls are the safety
    # net, one fallback per break at most (under full AC, hoist copes with all at once).
    assert sum(got["fallbacks"]) <= (1 if ac == "full" else n_breaks)
    assert got["fallbacks"][-2:] == [0, 0]
    _assert_numerics(got, ref)
    plan = dispatchers.dispatcher_of(model).plan
    assert plan.woven and plan.asked == "auto" and plan.mode == "auto"
    root = plan.decision("")
    # Selective AC: pieces, unless they were measured holding more than eager SAC (then hoist, saying so).
    measured = hoist_reason(model._orig_mod)
    assert root.action is (Action.HOIST if ac == "full" or measured else Action.PIECES)
    assert plan.strategy == root.action.value  # the plan records what auto resolved to
    assert measured is None or f"measured: {measured}" in root.reason
    assert any("graph break in its forward at break_models.py:" in d.reason for d in plan.decisions)
    gemms = _eager_gemms(model, x)
    assert gemms < plain_gemms
    if ac == "full":
        # What AC outside the compile gets on the same block (plain torch copes in that order).
        with autoweave.disabled():
            outer = cw.checkpoint_wrapper(torch.compile(copy.deepcopy(block), backend=BACKEND))
        _train(outer, x, steps=2)
        assert gemms == _eager_gemms(outer, x)


def test_selective_ac_splits_at_the_break_and_checkpoints_each_piece():
    torch.manual_seed(0)
    for make in (bm.BreakBlock, bm.LoopBlock):
        x = torch.randn(6, bm.DIM)
        model = torch.compile(
            autoweave.set_mode(_ac(make(), "selective"), strategy="pieces"), backend=BACKEND
        )
        _train(model, x, steps=2)
        plan = dispatchers.dispatcher_of(model).plan
        assert plan.decision("").action is Action.PIECES
        inner = plan.decision("_checkpoint_wrapped_module")
        assert inner.action is Action.SPLIT and inner.pieces and inner.checkpoint.selective
        experts = plan.decision("_checkpoint_wrapped_module.experts")
        assert (
            experts.action is Action.BOUNDARY and not experts.region and "break_models.py" in experts.reason
        )
        # Every forward GEMM compiled, the per-expert loop included (dynamo resumes after the break).
        assert _eager_gemms(model, x) == 0


def test_a_custom_checkpoint_fn_is_called_as_written_around_a_compile_that_splits():
    # A checkpoint_fn of the user's own (not torch's checkpoint) cannot move into the
    # compiled pieces: the wrapper stays eager and calls it once per forward, as written.
    calls = []

    def my_checkpoint(fn, *args, **kwargs):
        calls.append(1)
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)

    torch.manual_seed(0)
    x = torch.randn(6, bm.DIM)
    block = bm.BreakBlock()
    ref = _train(cw.checkpoint_wrapper(copy.deepcopy(block), checkpoint_fn=my_checkpoint), x)
    calls.clear()
    for strategy in ("auto", "pieces"):
        torch._dynamo.reset()
        wrapped = cw.checkpoint_wrapper(copy.deepcopy(block), checkpoint_fn=my_checkpoint)
        model = torch.compile(autoweave.set_mode(wrapped, strategy=strategy), backend=BACKEND)
        got = _train(model, x)
        assert got["fallbacks"][-2:] == [0, 0]
        _assert_numerics(got, ref)
        plan = dispatchers.dispatcher_of(model).plan
        root = plan.decision("")
        assert root.action is Action.HOIST and "custom checkpoint_fn" in root.reason, root.reason
        assert (plan.asked, plan.strategy) == (strategy, "hoist")
        assert len(calls) == 3  # once per forward: no region calls it again
        # Every forward GEMM compiled (dynamo resumes after the break), as full AC's hoist does.
        assert _eager_gemms(model, x) == 0
        calls.clear()


# A checkpoint autoweave cannot read from the code (looked up in a table).
_HIDDEN = {"checkpoint": torch.utils.checkpoint.checkpoint}


class _HiddenCheckpoint(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = bm.BreakBlock()
        self.head = make_break(nn.Linear(bm.DIM, bm.DIM))  # a boundary: the first call is watched

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(_HIDDEN["checkpoint"](self.inner, x, use_reentrant=False))


def test_a_checkpoint_autoweave_cannot_read_gets_its_children_compiled_one_by_one():
    # Dynamo falls back in a checkpoint autoweave did not see; weaving around the located
    # break would still trace that checkpoint, so the last resort compiles the children
    # one by one under it (a plan the user cannot ask for: no strategy says so).
    torch.manual_seed(0)
    x = torch.randn(6, bm.DIM)
    block = _HiddenCheckpoint()
    assert not planner.traces_checkpoint(block)
    ref = _train(copy.deepcopy(block), x)
    model = torch.compile(block, backend=BACKEND)
    got = _train(model, x)
    assert got["fallbacks"] == [1, 0, 0]
    _assert_numerics(got, ref)
    plan = dispatchers.dispatcher_of(model).plan
    for path in ("", "inner"):
        weave = plan.decision(path)
        assert weave.action is Action.WEAVE and weave.reason.endswith("children compiled one by one")
    assert not any(d.splits for d in plan.decisions if d.action is not Action.BOUNDARY)
    assert _eager_gemms(model, x) == 0  # every GEMM in a compiled region, none under a fallback


def test_a_break_the_user_disabled_stays_eager():
    torch.manual_seed(0)
    block = bm.BreakBlock()
    block.experts.forward = torch.compiler.disable(block.experts.forward)
    model = torch.compile(_ac(block, "full"), backend=BACKEND)
    got = _train(model, torch.randn(6, bm.DIM))
    assert got["fallbacks"] == [0, 0, 0]  # a known boundary: planned before the first call
    experts = dispatchers.dispatcher_of(model).plan.decision("_checkpoint_wrapped_module.experts")
    assert experts.action is Action.EAGER and "as the user asked" in experts.reason


def test_checkpoint_calls_are_read_from_code():
    assert planner.calls_checkpoint(bm.AliasCheckpointBlock())
    assert planner.calls_checkpoint(bm.AttributeCheckpointBlock())
    assert planner.calls_checkpoint(bm.HelperCheckpointBlock())
    assert not planner.calls_checkpoint(bm.FlagNamedCheckpoint())
    assert not planner.calls_checkpoint(bm.PlainMoE())
    layer = bm.CallCheckpointLayer()
    assert not checkpoint_calls.call_checkpoints(layer)  # checkpointing not enabled: nothing to call
    assert checkpoint_calls.call_checkpoints(layer.enable_checkpointing(use_reentrant=False))
    assert checkpoint_calls.is_checkpoint(
        functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    )
    assert not checkpoint_calls.is_checkpoint(torch.relu)


CODE_CHECKPOINTS = [bm.AliasCheckpointBlock, bm.AttributeCheckpointBlock, bm.HelperCheckpointBlock]


@pytest.mark.parametrize("make", CODE_CHECKPOINTS, ids=lambda c: c.__name__)
def test_checkpoint_in_code_over_a_boundary_is_woven_from_the_first_call(make):
    torch.manual_seed(0)
    x = torch.randn(6, bm.DIM)
    block = make()
    make_break(block.experts)  # stands in for FSDP's hooks
    ref = _train(copy.deepcopy(block), x)
    model = torch.compile(block, backend=BACKEND)
    got = _train(model, x)
    assert got["fallbacks"] == [0, 0, 0]
    _assert_numerics(got, ref)
    assert dispatchers.dispatcher_of(model).plan.woven


def test_layer_that_checkpoints_in_call_is_woven_from_the_first_call():
    torch.manual_seed(0)
    x = torch.randn(6, bm.DIM)
    layer = bm.CallCheckpointLayer().enable_checkpointing(use_reentrant=False)
    make_break(layer.experts)
    ref = _train(copy.deepcopy(layer), x)
    with autoweave.disabled():
        plain = torch.compile(copy.deepcopy(layer), backend=BACKEND)
    assert _train(plain, x)["fallbacks"][0] >= 1

    model = torch.compile(layer, backend=BACKEND)
    got = _train(model, x)
    assert got["fallbacks"] == [0, 0, 0]
    _assert_numerics(got, ref)
    plan = dispatchers.dispatcher_of(model).plan
    assert plan.decision("").action is Action.HOIST and "__call__" in plan.decision("").reason
    assert _eager_gemms(model, x) == 0  # all of it compiled: experts' forward in its own region


@pytest.mark.parametrize("how", ["torch.compile", "model.compile"])
@pytest.mark.parametrize("ac", ["full", "selective"])
def test_whole_model_compile_is_woven_from_the_first_step(how, ac):
    torch.manual_seed(0)
    x = torch.randn(6, bm.DIM)
    blocks = []
    for _ in range(3):
        block = bm.PlainMoE()
        make_break(block.experts)  # the experts' FSDP unit
        # AC, then the block's own FSDP unit (fully_shard(checkpoint_wrapper(block))), marked here.
        blocks.append(autoweave.boundary(_ac(block, ac), "FSDP unit (fully_shard)"))
    model = bm.Stack(blocks)
    ref = _train(copy.deepcopy(model), x)
    if how == "torch.compile":
        compiled = torch.compile(model, backend=BACKEND)
    else:
        model.compile(backend=BACKEND)
        compiled = model
    got = _train(compiled, x)
    assert got["fallbacks"] == [0, 0, 0]
    _assert_numerics(got, ref)
    plan = dispatchers.dispatcher_of(compiled).plan
    assert plan.woven and plan.mode == "auto" and plan.asked == "auto"
    layer = plan.decision("layers.0")
    measured = hoist_reason(model.layers[0])  # selective AC: pieces unless measured heavier
    assert layer.action is (Action.HOIST if ac == "full" or measured else Action.PIECES)
    assert layer.action.value in plan.strategy.split("+")  # the plan records what auto resolved to
    # At least the capture of compiling each block (which leaves the head eager): the root's
    # forward loops over the blocks, so it is woven and its head is a region of its own.
    per_block = copy.deepcopy(model if how == "model.compile" else compiled._orig_mod)
    for layer_module in per_block.layers:
        layer_module.compile(backend=BACKEND)
    _train(per_block, x, steps=2)
    assert _eager_gemms(per_block, x) == 1
    assert _eager_gemms(compiled, x) == 0
    assert plan.decision("").action is Action.WEAVE and "loops over blocks" in plan.decision("").reason


def test_report_tells_a_one_time_first_call_fallback_from_a_lasting_one():
    from autoweave.observe import report, report_exit

    _state.reset()
    report.start(None)
    try:
        torch.manual_seed(0)
        # A size no other test uses: regions shared with an earlier test's identical
        # blocks were compiled before this report started, and would not be counted.
        model = torch.compile(_ac(bm.BreakBlock(dim=12), "full"), backend=BACKEND)
        got = _train(model, torch.randn(6, 12))
        data = report.stop()
    finally:
        report.stop()
    assert got["fallbacks"] == [1, 0, 0]
    assert data["ac_fallbacks"]["count"] == data["ac_fallbacks"]["woven_around"] == 1
    plain = [r for r in data["regions"] if r["kind"] == "plain"]
    woven = [r for r in data["regions"] if r["kind"] == "woven"]
    assert plain and not any(r["live"] for r in plain), data[
        "regions"
    ]  # compiled at the first call, replaced since
    assert woven and all(r["live"] for r in woven)
    assert data["totals"]["graphs"] == sum(r["graphs"] for r in woven)
    summary = report_exit.format_exit_summary(data, None)
    assert "WARNING" not in summary
    assert "at their first call only" in summary and "replaced by the weave" in summary


@pytest.mark.slow
@pytest.mark.parametrize("make", [bm.BreakBlock, bm.LoopBlock], ids=lambda c: c.__name__)
def test_selective_policy_sees_the_ops_it_was_written_for_with_inductor(make):
    # With inductor, an eager SAC wrapper around compiled code would hand the policy
    # inductor's ``.out`` kernels; around a break pieces keep the policy inside (the default
    # is pieces unless they hold more than eager SAC: see test_sac_memory).
    seen: set[tuple[str, str]] = set()

    def recording(ctx, op, *args, **kwargs):
        decision = bm.save_matmuls(ctx, op, *args, **kwargs)
        seen.add((str(op), decision.name))
        return decision

    def run(model: nn.Module) -> set[tuple[str, str]]:
        seen.clear()
        _train(model, torch.randn(6, bm.DIM), steps=3)
        return set(seen)

    torch.manual_seed(0)
    block = make()
    context = functools.partial(create_selective_checkpoint_contexts, recording)
    eager = run(cw.checkpoint_wrapper(copy.deepcopy(block), context_fn=context))
    wrapped = autoweave.set_mode(cw.checkpoint_wrapper(block, context_fn=context), strategy="pieces")
    model = torch.compile(wrapped, backend="inductor")
    woven = run(model)
    assert dispatchers.dispatcher_of(model).plan.woven
    assert not [op for op, _ in woven if op.endswith(".out")], woven
    saved = {op for op, decision in woven if decision == "MUST_SAVE"}
    assert saved and saved <= {op for op, decision in eager if decision == "MUST_SAVE"}
    assert "aten.addmm.default" in saved


@pytest.mark.slow
def test_a_policy_outside_the_compile_sees_the_ops_it_was_written_for_with_inductor():
    """checkpoint_wrapper(torch.compile(block), context_fn=policy): the policy moved into the regions.

    Left outside, around inductor's code, it would be handed inductor's ``.out`` kernels and the
    ops it pins (here the matmuls) would not be saved as asked.
    """
    seen: set[tuple[str, str]] = set()

    def recording(ctx, op, *args, **kwargs):
        decision = bm.save_matmuls(ctx, op, *args, **kwargs)
        seen.add((str(op), decision.name))
        return decision

    def run(model: nn.Module) -> set[tuple[str, str]]:
        seen.clear()
        _train(model, torch.randn(6, bm.DIM), steps=3)
        return set(seen)

    torch.manual_seed(0)
    block = bm.GlueGemmBlock(bm.DIM)
    context = functools.partial(create_selective_checkpoint_contexts, recording)
    eager = run(cw.checkpoint_wrapper(copy.deepcopy(block), context_fn=context))
    compiled = torch.compile(block, backend="inductor")
    woven = run(cw.checkpoint_wrapper(compiled, context_fn=context))
    plan = dispatchers.dispatcher_of(compiled).plan
    assert plan.woven and plan.outer_push_down is not None and plan.outer_push_down.selective
    assert not [op for op, _ in woven if op.endswith(".out")], woven
    saved = {op for op, decision in woven if decision == "MUST_SAVE"}
    assert "aten.addmm.default" in saved and saved <= {op for op, d in eager if d == "MUST_SAVE"}


@pytest.mark.parametrize("strategy", ["auto", "hoist", "pieces"])
def test_selective_ac_around_a_forward_that_loops_over_boundaries_holds_what_plain_torch_holds(strategy):
    # Issue 33: one rule for the wrapped block's shape, whatever the strategy. dynamo cannot
    # resume a looping forward after a break, so the AC stays eager around children compiled
    # one by one. Before: pieces ran the loop's glue eager and unchecked (about 10x plain
    # torch's saved bytes), hoist compiled the forward whole and ran the head after the loop eager.
    from tests.models import saved_bytes

    def make() -> nn.Module:
        torch.manual_seed(0)
        blocks = [bm.PlainMoE() for _ in range(2)]
        for block in blocks:
            bm.fsdp_like(block.experts)
        return _ac(bm.Stack(blocks), "selective")

    x = torch.randn(64, bm.DIM, requires_grad=True)
    ref = _train(make(), x)
    with autoweave.disabled():
        plain = torch.compile(make(), backend=BACKEND)
    _train(plain, x, steps=1)
    model = autoweave.set_mode(make(), strategy=strategy)
    compiled = torch.compile(model, backend=BACKEND)
    got = _train(compiled, x)
    _assert_numerics(got, ref)
    assert got["fallbacks"] == [0, 0, 0]
    assert saved_bytes(compiled, x) <= saved_bytes(plain, x)
    assert _eager_gemms(compiled, x) == 0 < _eager_gemms(plain, x)
    plan = dispatchers.dispatcher_of(compiled).plan
    assert plan.decision("").action is Action.CHILDREN_ONE_BY_ONE, plan.decision("").reason
