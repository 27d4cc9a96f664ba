"""A selective-AC ``context_fn`` that a traced checkpoint cannot take moves its block to ``hoist``.

NeMo Automodel's ``apply_ac`` returns torch's SAC contexts wrapped in ordinary context managers.
Under ``pieces`` every piece raised inside its trace and ran eager (as many eager forward GEMMs
as plain torch's fallback); the planner now tells it from what the ``context_fn`` returns
(``autoweave.planning.checkpoint_calls``) and plans those blocks with eager AC around the compile.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import autoweave
from autoweave._state import run
from autoweave.dispatch import dispatchers, plan_inputs
from autoweave.planning.plans import Action
from autoweave.sense import counting
from benchmarks.measure import forward_gemms_outside_graphs
from tests import break_models as bm
from tests.models import train_steps

DIM, TOKENS, LAYERS, STEPS = 16, 32, 2, 3


@pytest.fixture(autouse=True)
def _weave(weave_on):
    yield


def _model(context_fn) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = [cw.checkpoint_wrapper(bm.GlueGemmBlock(DIM), context_fn=context_fn) for _ in range(LAYERS)]
    return bm.Stack(blocks, DIM)


def _train(model, compile_backend=None) -> list[float]:
    if compile_backend is not None:
        for i, layer in enumerate(model.layers):
            model.layers[i] = torch.compile(layer, backend=compile_backend)
    x = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(1))
    return train_steps(model, x, STEPS)


def test_a_wrapped_context_fn_is_planned_with_hoist_and_compiles_everything_but_the_break():
    bm.wrapped_context_fn.calls = 0
    eager = _train(_model(bm.wrapped_context_fn))
    eager_calls = bm.wrapped_context_fn.calls
    torch._dynamo.reset()
    bm.wrapped_context_fn.calls = 0
    cap = counting.Capture()
    model = _model(bm.wrapped_context_fn)
    got = _train(model, cap.backend("aot_eager"))
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-6)
    root = dispatchers.dispatcher_of(model.layers[0]).plan.decision("")
    assert root.action is Action.HOIST, root
    assert "TorchDispatchModes" in root.reason and "wrapped_context_fn" in root.reason, root.reason
    # Nothing of autoweave's failed: no piece ran eager.
    assert not run.swallowed, run.swallowed
    # Only the head's GEMM runs outside compiled graphs (pieces ran all of the blocks' eager).
    assert forward_gemms_outside_graphs(model, torch.randn(TOKENS, DIM)) == 1
    # Both blocks share one context_fn: probed once, beside the calls plain torch makes.
    assert bm.wrapped_context_fn.calls == eager_calls + 1 + LAYERS, (bm.wrapped_context_fn.calls, eager_calls)


def test_a_traceable_context_fn_of_its_own_keeps_pieces():
    def own_context_fn():  # a plain function returning torch's contexts: traceable
        return create_selective_checkpoint_contexts(bm.save_matmuls)

    assert plan_inputs.probe(own_context_fn) is None
    model = _model(own_context_fn)
    _train(model, "aot_eager")
    assert dispatchers.dispatcher_of(model.layers[0]).plan.decision("").action is Action.PIECES


def test_torchs_factory_is_not_called_to_be_judged():
    calls = []

    def policy(ctx, op, *args, **kwargs):
        calls.append(op)
        return bm.save_matmuls(ctx, op, *args, **kwargs)

    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    assert plan_inputs.probe(context_fn) is None


def test_a_context_fn_that_raises_is_not_judged_and_raises_as_plain_torch_does():
    def raising():
        raise ValueError("the user's context_fn")

    assert plan_inputs.probe(raising) is None


def test_explain_and_plan_say_hoist_for_a_wrapped_context_fn():
    block = cw.checkpoint_wrapper(bm.GlueGemmBlock(DIM), context_fn=bm.wrapped_context_fn)
    plan = autoweave.plan(block)
    assert plan.decision("").action is Action.HOIST
    # A strategy that never traces the checkpoint does not call the user's context_fn.
    bm.wrapped_context_fn.calls = 0
    assert plan_inputs.untraceable(block, strategy="hoist") == {}
    assert bm.wrapped_context_fn.calls == 0


class _NoCheckpointBackend:
    """aot_eager, except that a graph holding a checkpoint operator fails: pieces that will not compile."""

    def __call__(self, gm, example_inputs):
        if any("tag_activation_checkpoint" in str(n.target) for n in gm.graph.nodes):
            raise RuntimeError("this backend cannot compile a checkpoint")
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend("aot_eager")(gm, example_inputs)


@pytest.mark.fail_open
def test_a_block_whose_pieces_will_not_compile_moves_to_hoist_from_its_next_call():
    eager = _train(_model(bm.POLICIES["save-matmuls"]))
    torch._dynamo.reset()
    model = _model(bm.POLICIES["save-matmuls"])
    got = _train(model, _NoCheckpointBackend())
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-6)
    root = dispatchers.dispatcher_of(model.layers[0]).plan.decision("")
    assert root.action is Action.HOIST, root
    assert "pieces ran eager under their checkpoint" in root.reason, root.reason
    # Step 0 ran its pieces eager (told once); from step 1 everything but the head is compiled.
    assert run.swallowed.get("piece-eager", 0) >= 1
    assert forward_gemms_outside_graphs(model, torch.randn(TOKENS, DIM)) == 1


def test_a_block_with_nothing_to_weave_never_has_its_context_fn_called():
    """torchtitan's blocks: selective AC, no boundary inside; plain torch.compile, no probe."""
    bm.wrapped_context_fn.calls = 0
    block = cw.checkpoint_wrapper(bm.GlueGemmBlock(DIM, fsdp=False), context_fn=bm.wrapped_context_fn)
    plan = autoweave.plan(block)
    assert not plan.woven
    assert bm.wrapped_context_fn.calls == 0
