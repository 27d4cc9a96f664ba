"""Identical layers that differ in a number dynamo specializes on (transformers' ``layer_idx``).

The pattern of transformers' decoder layers under accelerate's FSDP2 plugin: the
same class ten times, each reading ``self.layer_idx`` to update its slot of a
cache threaded through the layers, a boundary (the experts' FSDP unit) inside,
full AC outside each compiled layer, the layer's ``forward`` wrapped by
decorators (``functools.wraps``). dynamo guards on ``layer_idx`` and on the cache
slot's state, so each layer needs its own graphs, twice (the forward, then the
recompute, which sees the slot filled). Sharing one code object across the ten
layers ran past dynamo's recompile limit (8): the recompute of a compiled
forward then ran eager, and the checkpoint raised ``CheckpointError``.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

import autoweave
from autoweave.dispatch import dispatchers
from tests.models import make_break, train_steps

DIM = 8


class Slot:
    """One layer's part of a cache: empty until the first update (``DynamicLayer``)."""

    def __init__(self) -> None:
        self.is_initialized = False
        self.keys: torch.Tensor | None = None

    def update(self, keys: torch.Tensor) -> torch.Tensor:
        if not self.is_initialized:
            self.keys = keys.new_zeros((0, keys.shape[-1]))
            self.is_initialized = True
        self.keys = torch.cat([self.keys, keys])
        return self.keys


class Cache:
    def __init__(self, layers: int) -> None:
        self.layers = [Slot() for _ in range(layers)]


def _decorated(fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapped


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(DIM, DIM) / DIM**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.w)


class Layer(nn.Module):
    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.q = nn.Linear(DIM, DIM)
        self.experts = make_break(Experts())
        self.out = nn.Linear(DIM, DIM)

    @_decorated
    def forward(self, x: torch.Tensor, cache: Cache) -> torch.Tensor:
        keys = cache.layers[self.layer_idx].update(self.q(x))
        h = x + keys[-x.shape[0] :].tanh()
        return h + self.out(self.experts(h))


class Stack(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(cw.checkpoint_wrapper(Layer(i)) for i in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cache = Cache(len(self.layers))
        for layer in self.layers:
            x = layer(x, cache)
        return x


def _train(on: bool, layers: int = 3, steps: int = 2) -> list[float]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Stack(layers)
    with autoweave.disabled() if not on else contextlib.nullcontext():
        for layer in model.layers:
            layer.compile(backend="aot_eager")  # regional compile, after AC (accelerate's order)
    return train_steps(model, torch.randn(4, DIM), steps)


@pytest.mark.usefixtures("weave_on")
def test_layers_that_read_their_index_train_as_plain_torch_does() -> None:
    # Three layers under a recompile limit of 4 stand for ten under dynamo's 8.
    with torch._dynamo.config.patch(recompile_limit=4):
        plain = _train(on=False)
        woven = _train(on=True)
    assert woven == pytest.approx(plain, rel=1e-5)


@pytest.mark.usefixtures("weave_on")
def test_layers_that_differ_in_an_index_they_read_get_their_own_region() -> None:
    torch._dynamo.reset()
    model = Stack(3)
    for layer in model.layers:
        layer.compile(backend="aot_eager")
    model(torch.randn(4, DIM)).sum().backward()
    labels = {
        dispatchers.dispatcher_of(layer)._applied.regions.get(
            "_checkpoint_wrapped_module",
            next(iter(dispatchers.dispatcher_of(layer)._applied.regions.values())),
        )
        for layer in model.layers
    }
    assert len(labels) == 3
