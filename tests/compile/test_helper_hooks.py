"""A hook on a submodule a helper method reaches runs as under plain torch (issue 41, item 1).

Two identical blocks, each ``torch.compile(checkpoint_wrapper(block))``, experts in their own
unit; ``forward`` calls a helper method (``self.ffn(x)``) with the experts' break inside, so
dynamo breaks at the helper's call and converts ``Block.ffn`` as a frame of its own: one code
object shared by both blocks. A forward hook added on the second block's ``norm`` after the
first step moved that block to a region of its own, but the helper's frame kept the graph
compiled for the first block (dynamo does not guard hooks by default,
``skip_nnmodule_hook_guards``): the hook never ran, and losses and grads differed from plain
torch, which runs both blocks eager and runs the hook.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

import autoweave
from tests.break_models import SimpleExperts, fsdp_like

DIM = 8
pytestmark = pytest.mark.usefixtures("weave_on")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.experts = fsdp_like(SimpleExperts(DIM))
        self.out = nn.Linear(DIM, DIM)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.experts(self.norm(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ffn(x)


def _run(
    base: nn.Module, x: torch.Tensor, plain: bool, hook_at: int
) -> tuple[list[float], list[torch.Tensor], int]:
    torch._dynamo.reset()
    blocks = copy.deepcopy(base)
    calls = []

    def scale(module, args, output):
        calls.append(1)
        return output * 2.0

    with autoweave.disabled() if plain else contextlib.nullcontext():
        model = nn.Sequential(*(torch.compile(cw.checkpoint_wrapper(b), backend="aot_eager") for b in blocks))
    losses = []
    for step in range(4):
        if step == hook_at:
            blocks[1].norm.register_forward_hook(scale)
        loss = model(x).square().mean()
        loss.backward()
        losses.append(loss.item())
    return losses, [p.grad.clone() for p in blocks.parameters()], len(calls)


@pytest.mark.parametrize("hook_at", [0, 1, 2])
def test_a_hook_on_a_submodule_a_helper_reaches_runs(hook_at: int) -> None:
    torch.manual_seed(0)
    base = nn.Sequential(Block(), Block())
    x = torch.randn(4, DIM)
    plain_losses, plain_grads, plain_calls = _run(base, x, plain=True, hook_at=hook_at)
    losses, grads, calls = _run(base, x, plain=False, hook_at=hook_at)
    assert losses == pytest.approx(plain_losses, rel=1e-6)
    for got, want in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    # Once per forward at least (a compiled recompute does not replay it), plain's at most.
    assert 4 - hook_at <= calls <= plain_calls
