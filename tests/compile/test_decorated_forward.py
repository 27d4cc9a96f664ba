"""A decorator on ``forward`` that computes on tensors is compiled and checkpointed as the forward is (issue 31).

A wrapper that merely passes the call on (transformers' ``deprecate_kwarg``, a
``functools.wraps`` pass-through) runs as in eager, so that dynamo compiles from
the function it wraps and no wrapper frame is traced to the break twice
(``test_kind_sharing.test_decorators_on_a_forward_add_no_frames``). A wrapper that
computes (a GEMM on the input, a scale of the output) is part of the block: plain
torch's eager checkpoint recomputes its ops, and a compile of the block captures
them. Run eager under ``pieces`` (AC moved into each compiled piece) they ran
outside any checkpoint and kept their activations.
"""

from __future__ import annotations

import functools
import gc

import pytest
import torch
import torch.nn as nn

import autoweave
from benchmarks.measure import COMPILED_RANGE, GEMM_OPS, heap_in_use
from tests import break_models as bm

pytestmark = pytest.mark.usefixtures("weave_on")

DIM, TOKENS, LAYERS = 64, 128, 3


def _computing(fn):
    """A decorator that computes on tensors: a GEMM and a gate on the input before, a scale of the output after."""

    @functools.wraps(fn)
    def wrapper(self, x, *args, **kwargs):
        x = _gate(x @ self.w_in)
        return fn(self, x, *args, **kwargs) * self.scale_out

    return wrapper


def _gate(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(torch.sigmoid(torch.tanh(x)))


class Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(DIM, DIM) / DIM**0.5)
        self.scale_out = nn.Parameter(torch.rand(DIM) + 0.5)
        self.q = nn.Linear(DIM, DIM)
        self.experts = bm.fsdp_like(bm.StackedExperts(DIM, 2))  # a break inside the checkpoint
        self.out = nn.Linear(DIM, DIM)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.q(x).tanh()
        return h + self.out(self.experts(h).sum(0))


class Decorated(Body):
    @_computing
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class Inlined(Body):
    """The same computation written in ``forward``: what a compile captures of ``Decorated``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(_gate(x @ self.w_in)) * self.scale_out


def _model(block_type: type, ac: str, strategy: str, compiled: bool = True) -> nn.Module:
    torch.manual_seed(0)
    blocks = [bm.with_ac(block_type(), ac) for _ in range(LAYERS)]
    model = bm.Stack(blocks, DIM)
    for i, layer in enumerate(model.layers):
        if compiled:
            model.layers[i] = torch.compile(autoweave.set_mode(layer, strategy=strategy), backend="aot_eager")
    return model


def _ops_outside_graphs(model: nn.Module, x: torch.Tensor) -> dict[str, int]:
    """How many GEMMs and muls one forward of ``model`` runs outside compiled graphs."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(x)
    counts = {"gemm": 0, "mul": 0}
    for event in prof.events():
        kind = "gemm" if event.name in GEMM_OPS else "mul" if event.name == "aten::mul" else None
        if kind is None:
            continue
        parent, nested = event.cpu_parent, False
        while parent is not None and parent.name != COMPILED_RANGE:
            nested = nested or parent.name in GEMM_OPS or parent.name == "aten::mul"
            parent = parent.cpu_parent
        if parent is None and not nested:
            counts[kind] += 1
    return counts


def _train(model: nn.Module, x: torch.Tensor, steps: int = 3) -> tuple[list[float], list[torch.Tensor]]:
    losses = []
    for _ in range(steps):
        model.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        losses.append(loss.item())
    return losses, [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _held(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes one forward leaves behind for backward (the C heap, as ``test_sac_memory`` measures)."""
    gc.collect()
    before = heap_in_use()
    loss = model(x).square().mean()
    held = heap_in_use() - before
    loss.backward()
    return held


@pytest.mark.parametrize("strategy", ["auto", "pieces"])
@pytest.mark.parametrize("ac", ["full", "selective"])
def test_a_computing_decorator_trains_as_plain_torch_and_runs_compiled(ac: str, strategy: str) -> None:
    x = torch.randn(TOKENS, DIM)
    with autoweave.disabled():
        plain_losses, plain_grads = _train(_model(Decorated, ac, strategy), x)
    torch._dynamo.reset()
    model = _model(Decorated, ac, strategy)
    losses, grads = _train(model, x)
    assert losses == pytest.approx(plain_losses, rel=1e-6)
    for got, want in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    # The decorator's GEMM and scale run inside compiled graphs, as the same ops written in
    # ``forward`` do: outside them, only what the inlined block leaves there (the head's GEMM).
    outside = _ops_outside_graphs(model, x)
    torch._dynamo.reset()
    inlined = _model(Inlined, ac, strategy)
    _train(inlined, x, steps=2)
    assert outside == _ops_outside_graphs(inlined, x)


def test_a_computing_decorator_holds_what_its_ops_hold_in_forward() -> None:
    """Selective AC: the default holds at most eager SAC's memory; forced ``pieces`` what the inlined block holds.

    Under ``pieces`` a compiled wrapper is a frame of its own: the tensors that cross into and
    out of the function it wraps are pieces' inputs, kept as a break's are; the inlined block,
    whose forward calls the method holding the break, keeps the same. (This block under forced
    ``pieces`` holds about 1.17x eager SAC, decorated or not: the default measures that and hoists.)
    """
    if heap_in_use() is None:
        pytest.skip("needs glibc's mallinfo2")
    x = torch.randn(TOKENS, DIM)

    def held(block_type: type, strategy: str | None) -> int:
        torch._dynamo.reset()
        model = _model(block_type, "selective", strategy or "auto", compiled=strategy is not None)
        _train(model, x, steps=2)
        return _held(model, x)

    eager_sac = held(Decorated, None)
    assert held(Decorated, "auto") <= 1.05 * eager_sac
    inlined = held(Inlined, "pieces")
    decorated = held(Decorated, "pieces")
    assert decorated <= 1.05 * inlined, (decorated, inlined, eager_sac)
