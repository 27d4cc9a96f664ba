"""A woven model the user drops is freed, as plain torch frees it (issue 31, item 4).

What autoweave keeps for the life of the process (the table of kinds of region, each
kind's backend in dynamo's backend cache, the dispatchers' table, the taps on dynamo's
loggers) must hold no block: eval models, sweeps, notebooks and RL (a policy and a
reference model) build and drop models in one process, and each kept block holds its
parameters (on the GPU).
"""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

import autoweave
from autoweave.dispatch import dispatchers
from autoweave.dispatch.states import State
from tests.break_models import BreakBlock, Stack, with_ac
from tests.models import Block

pytestmark = pytest.mark.usefixtures("weave_on")

DIM = 8
FORMS = ["method", "function", "whole"]  # layer.compile(), torch.compile(layer), torch.compile(model)

# A boundary (a disabled hook, as FSDP's) under full AC: woven by hoist. A break dynamo
# meets under selective AC: learned at the first call, woven by pieces, whose plan listens
# on dynamo's logger for the recompile limit while it is applied.
MODELS = {
    "boundary-full-ac": lambda: cw.checkpoint_wrapper(Block(DIM)),
    "break-selective-ac": lambda: with_ac(BreakBlock(DIM), "selective"),
}


def _build(form: str, model: str, on: bool) -> nn.Module:
    # A plain compile's cached frames would answer the woven one's first call: the break
    # would never be learned, and nothing woven (``docs/how-it-works.md``).
    torch._dynamo.reset()
    torch.manual_seed(0)
    stack = Stack([MODELS[model]() for _ in range(3)], dim=DIM)
    with contextlib.nullcontext() if on else autoweave.disabled():
        if form == "whole":
            return torch.compile(stack, backend="aot_eager")
        for i, layer in enumerate(stack.layers):
            if form == "method":
                layer.compile(backend="aot_eager")
            else:
                stack.layers[i] = torch.compile(layer, backend="aot_eager")
    return stack


def _train(model: nn.Module, steps: int = 2) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _trained_and_dropped(form: str, model: str, on: bool) -> list[weakref.ref]:
    """Weak references to every parameter of a model built, compiled, trained and dropped."""
    compiled = _build(form, model, on)
    _train(compiled)
    assert _woven(compiled) == on
    params = [weakref.ref(p) for p in compiled.parameters()]
    del compiled
    gc.collect()
    return params


def _woven(model: nn.Module) -> bool:
    found = (dispatchers.dispatcher_of(m) for m in model.modules())
    return any(d is not None and d.state is State.WOVEN for d in found)


def _alive(params: list[weakref.ref]) -> int:
    return sum(p() is not None for p in params)


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("form", FORMS)
def test_a_dropped_woven_model_is_freed_as_plain_torch_frees_it(form: str, model: str) -> None:
    plain = _trained_and_dropped(form, model, on=False)
    woven = _trained_and_dropped(form, model, on=True)
    # Whatever plain torch frees, autoweave frees too, and as soon: before dynamo is reset.
    assert _alive(woven) <= _alive(plain), f"{_alive(woven)} of {len(woven)} parameters still alive"
    torch._dynamo.reset()
    gc.collect()
    assert _alive(woven) == _alive(plain) == 0


@pytest.mark.parametrize("model", sorted(MODELS))
def test_a_model_built_after_one_was_dropped_weaves_and_trains(model: str) -> None:
    # The kind the first model made is shared by the second (same class, same shapes):
    # it must not point to the dropped blocks, and the second model must weave and train.
    first = _trained_and_dropped("whole", model, on=True)
    assert _alive(first) == 0
    second = _build("whole", model, on=True)
    woven = _train(second, steps=3)
    assert _woven(second)
    del second
    plain = _train(_build("whole", model, on=False), steps=3)
    assert woven == pytest.approx(plain, rel=1e-5)
