"""Identical blocks share compiled code under every strategy (issue 20): one region per kind of region."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import autoweave
from autoweave import _state
from autoweave.dispatch import dispatchers
from autoweave.sense import counting
from tests.break_models import Stack, save_matmuls
from tests.models import Block

pytestmark = pytest.mark.usefixtures("weave_on")


def _selective(block):
    # A partial per block, as recipes build them: equal by value, not by identity.
    return cw.checkpoint_wrapper(
        block, context_fn=functools.partial(create_selective_checkpoint_contexts, save_matmuls)
    )


def _compiled(depth: int, strategy: str) -> tuple[int, int]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Stack([_selective(Block()) for _ in range(depth)], dim=8)
    autoweave.set_mode(model, strategy=strategy)
    cap = counting.Capture()
    compiled = torch.compile(model, backend=cap.backend())
    for _ in range(2):
        compiled(torch.randn(4, 8)).square().mean().backward()
    labels = set(dispatchers.dispatcher_of(compiled)._applied.regions.values())
    return len(labels), cap.graph_count


@pytest.mark.parametrize("strategy", ["pieces", "hoist"])
def test_identical_blocks_share_regions_and_graphs(strategy: str) -> None:
    shallow = _compiled(2, strategy)
    deep = _compiled(6, strategy)
    assert deep == shallow, (strategy, shallow, deep)  # labels and compiled graphs flat in depth


def _per_block_closure(state: dict | None = None):
    """A context_fn built per block, as torchtitan's SelectiveAC builds one: a fresh closure each time."""
    save_ops = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}

    def make_policy():
        counts = {"forward": 0, "recompute": 0}

        def policy(ctx, op, *args, **kwargs):
            from torch.utils.checkpoint import CheckpointPolicy

            counts["recompute" if ctx.is_recompute else "forward"] += 1
            return CheckpointPolicy.MUST_SAVE if op in save_ops else CheckpointPolicy.PREFER_RECOMPUTE

        return policy

    if state is None:
        return lambda: create_selective_checkpoint_contexts(make_policy())
    # A closure over per-block state (a dict it may change): never shared.
    return lambda: (state.setdefault("calls", 0), create_selective_checkpoint_contexts(make_policy()))[1]


def _compiled_closures(depth: int, own_state: bool) -> tuple[int, int]:
    torch._dynamo.reset()
    _state.reset()  # nothing learned from the previous model
    torch.manual_seed(0)
    blocks = [
        cw.checkpoint_wrapper(Block(), context_fn=_per_block_closure({} if own_state else None))
        for _ in range(depth)
    ]
    model = Stack(blocks, dim=8)
    autoweave.set_mode(model, strategy="pieces")  # the checkpoint, and so its closure, in the regions
    cap = counting.Capture()
    compiled = torch.compile(model, backend=cap.backend())
    for _ in range(2):
        compiled(torch.randn(4, 8)).square().mean().backward()
    labels = set(dispatchers.dispatcher_of(compiled)._applied.regions.values())
    return len(labels), cap.graph_count


def test_blocks_with_a_closure_each_for_their_policy_share_regions() -> None:
    shallow = _compiled_closures(2, own_state=False)
    deep = _compiled_closures(6, own_state=False)
    assert deep == shallow, (shallow, deep)


def test_closures_over_per_block_state_are_not_shared() -> None:
    shallow = _compiled_closures(2, own_state=True)
    deep = _compiled_closures(6, own_state=True)
    # Each block its own regions (the block's and its experts'), compiled on their own.
    assert deep[0] > shallow[0] and deep[1] > shallow[1], (shallow, deep)


class _Leaf(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class _OwnForward(torch.nn.Module):
    """A block whose forward is set on the instance (as hooks and adapters do): one function for all."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.leaf, self.b = torch.nn.Linear(8, 8), _Leaf(), torch.nn.Linear(8, 8)
        self.forward = functools.partial(_OwnForward.body, self)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.leaf(self.a(x))))


def test_blocks_with_an_instance_forward_share_the_graphs_past_their_break() -> None:
    # Each block's region is compiled on its own code, but the frame after the break
    # (``body``'s resume) is one code object for all: with a backend per block dynamo
    # recompiled it per block (BACKEND_MATCH) until the recompile limit.
    from tests.models import RecompileLimitHits, recompiles

    torch._dynamo.reset()
    model = Stack([cw.checkpoint_wrapper(_OwnForward()) for _ in range(10)], dim=8)
    cap = counting.Capture()
    compiled = torch.compile(model, backend=cap.backend())
    with RecompileLimitHits() as hits, recompiles() as again:
        for _ in range(2):
            compiled(torch.randn(4, 8, requires_grad=True)).sum().backward()
    assert dispatchers.dispatcher_of(compiled).plan.woven
    assert (hits.messages, len(again)) == ([], 0)
    assert cap.graph_count <= 4, cap.graph_count


def _keep(index: int, module, args, output):
    return output  # a hook of each block's own: part of its identity, so each block is a kind of its own


def test_a_submodule_frame_reached_from_many_kinds_of_region_compiles_once_per_kind_of_graph() -> None:
    # Each block its own kind of region (a hook of its own); each block's MoE breaks at its
    # experts, so dynamo traces ``MoE.forward`` as a frame of its own, on the class's shared
    # code, from every block's region. Region backends that compile alike must compare equal,
    # as torch's own wrappers do, or that frame recompiles per block up to the recompile limit
    # and then runs eager (accelerate's Qwen3-MoE at 10 layers hit it).
    from tests.models import RecompileLimitHits

    torch.manual_seed(0)
    blocks = []
    for index in range(10):
        block = Block()
        block.out.register_forward_hook(functools.partial(_keep, index))
        blocks.append(torch.compile(cw.checkpoint_wrapper(block), backend="aot_eager"))
    x = torch.randn(4, 8, requires_grad=True)
    with RecompileLimitHits() as hits:
        for _ in range(2):
            y = x
            for block in blocks:
                y = block(y)
            y.square().mean().backward()
    assert all(dispatchers.dispatcher_of(b).woven for b in blocks)
    assert (
        len({label for b in blocks for label in dispatchers.dispatcher_of(b)._applied.regions.values()}) >= 10
    )
    assert hits.messages == []
