"""``p.grad is None`` exactly where plain torch leaves it None (issue 41, item 3).

A router gate whose output only feeds a host read (``.item()``, a load statistic) is not on the
loss's autograd path. Plain torch runs a checkpointed block with that break eager, so the gate's
``grad`` stays None and AdamW's weight decay leaves it alone. A compiled graph's backward runs
when any of its outputs gets a gradient and materialises zeros for the others: woven, the gate
got a zero tensor, and weight decay moved it every step. Compared at every step, per parameter,
with the values of every gradient that exists.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import autoweave
from tests import break_models as bm

DIM = 8
pytestmark = pytest.mark.usefixtures("weave_on")


class StatGateBlock(nn.Module):
    """``gate`` feeds only ``.item()`` (``uses_gate``: False), or also the output (True)."""

    def __init__(self, uses_gate: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.gate = nn.Linear(DIM, 4)
        self.proj = nn.Linear(DIM, DIM)
        self.uses_gate = uses_gate
        self.load = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        scores = self.gate(h).softmax(-1)
        self.load = scores.max().item()  # a graph break; the gate reaches nothing else
        out = x + self.proj(h)
        return out * scores.sum(-1, keepdim=True) if self.uses_gate else out


class FsdpStatBlock(StatGateBlock):
    """The same, with experts in an FSDP-like unit after the statistic (two breaks)."""

    def __init__(self, uses_gate: bool) -> None:
        super().__init__(uses_gate)
        self.experts = bm.fsdp_like(bm.SimpleExperts(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(super().forward(x))


def _ac(block: nn.Module, ac: str) -> nn.Module:
    if ac == "selective":
        return cw.checkpoint_wrapper(
            block, context_fn=functools.partial(create_selective_checkpoint_contexts, bm.save_matmuls)
        )
    return cw.checkpoint_wrapper(block)


def _steps(model: nn.Module, x: torch.Tensor, steps: int = 4) -> list[dict[str, torch.Tensor | None]]:
    seen = []
    for _ in range(steps):
        model(x).square().mean().backward()
        seen.append({n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    return seen


def _run(make, ac: str, plain: bool) -> list[dict[str, torch.Tensor | None]]:
    torch.manual_seed(0)
    blocks = [make() for _ in range(2)]
    x = torch.randn(4, DIM)
    torch._dynamo.reset()
    with autoweave.disabled() if plain else contextlib.nullcontext():
        model = nn.Sequential(*(torch.compile(_ac(b, ac), backend="aot_eager") for b in blocks))
    return _steps(model, x)


@pytest.mark.parametrize("ac", ["full", "selective"])
@pytest.mark.parametrize("uses_gate", [False, True], ids=["gate-only-item", "gate-in-output"])
@pytest.mark.parametrize("block", [StatGateBlock, FsdpStatBlock], ids=["item", "item+fsdp"])
def test_grad_is_none_where_plain_torchs_is(block, uses_gate, ac):
    make = functools.partial(block, uses_gate)
    plain = _run(make, ac, plain=True)
    woven = _run(make, ac, plain=False)
    for step, (p_step, w_step) in enumerate(zip(plain, woven, strict=True)):
        assert [n for n, g in w_step.items() if g is None] == [n for n, g in p_step.items() if g is None], (
            step
        )
        for name, grad in p_step.items():
            if grad is not None:
                torch.testing.assert_close(
                    w_step[name], grad, rtol=1e-6, atol=1e-7, msg=f"{name} step {step}"
                )
    if not uses_gate:  # the case itself: plain leaves the gate's grad None at every step
        assert all(step["0._orig_mod._checkpoint_wrapped_module.gate.weight"] is None for step in plain)
