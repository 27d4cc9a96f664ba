"""Identical blocks that differ in a value train as plain torch trains them (issue 31, item 1).

Blocks of one kind share one compiled region. When they differ in a value dynamo
reads (a private float attribute, a float argument, a public one read just before
the break), the second block makes dynamo recompile the shared code with that
value dynamic while the first block still waits for its checkpoint's recompute.
That recompute must run the graph its forward ran (pytorch/pytorch#166926), or
torch raises ``CheckpointError``. Plain torch runs these blocks eager and trains.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn

import autoweave
from tests.break_models import with_ac
from tests.models import Experts, make_break

pytestmark = pytest.mark.usefixtures("weave_on")

DIM = 8
SCALES = (0.5, 0.75, 1.25)


class ScaledLayer(nn.Module):
    """A block with a break inside whose forward reads a per-block float (``where`` says how)."""

    def __init__(self, scale: float, where: str) -> None:
        super().__init__()
        self.where = where
        self._scale = scale
        self.scale = scale
        self.q = nn.Linear(DIM, DIM)
        self.experts = make_break(Experts(DIM))
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        if self.where == "private":
            h = self.q(x) * self._scale
        elif self.where == "argument":
            h = self.q(x) * scale
        else:  # "public, break last": no graph after the break to read the guards before
            return self.experts(self.q(x).tanh() * self.scale)
        return h + self.out(self.experts(h))


class Stack(nn.Module):
    def __init__(self, where: str, ac: str) -> None:
        super().__init__()
        self.where = where
        self.embed = nn.Linear(DIM, DIM)  # every block's input requires grad, the first's too
        self.layers = nn.ModuleList(with_ac(ScaledLayer(s, where), ac) for s in SCALES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for scale, layer in zip(SCALES, self.layers, strict=True):
            x = layer(x, scale=scale) if self.where == "argument" else layer(x)
        return x


def _train(where: str, ac: str, *, on: bool, steps: int = 3) -> tuple[list[float], list[torch.Tensor]]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Stack(where, ac)
    with contextlib.nullcontext() if on else autoweave.disabled():
        for layer in model.layers:
            layer.compile(backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        loss = model(x).square().mean()
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    model(x).square().mean().backward()
    return losses, [None if p.grad is None else p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("ac", ["full", "selective"])
@pytest.mark.parametrize("where", ["private", "argument", "public, break last"])
def test_blocks_that_differ_in_a_float_train_as_plain(where: str, ac: str) -> None:
    plain_losses, plain_grads = _train(where, ac, on=False)
    losses, grads = _train(where, ac, on=True)
    assert losses == pytest.approx(plain_losses, rel=1e-6)
    torch.testing.assert_close(grads, plain_grads, rtol=1e-6, atol=1e-7)
