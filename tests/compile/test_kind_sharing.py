"""Identical blocks share one region unless dynamo specializes on what differs (issue 27).

transformers' decoder layers mention ``self.layer_idx`` in their forward but read
it only when a cache is passed. Without a cache dynamo does not guard on it, so
every layer shares one region (compile cost flat in depth); with a cache it does,
and each layer then needs a region of its own, or they stack past dynamo's
recompile limit. A hook on one of several identical blocks changes what that
block runs, which dynamo does not guard on: it is part of the block's identity.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

import autoweave
from autoweave import _state
from autoweave.dispatch import dispatchers
from autoweave.sense import counting
from tests.break_models import BreakBlock
from tests.compile.test_layer_state import Cache, Experts, _decorated
from tests.models import Block, RecompileLimitHits, make_break, train_steps

pytestmark = pytest.mark.usefixtures("weave_on")

DIM = 8


class Layer(nn.Module):
    """A decoder layer that picks its cache slot by ``layer_idx`` only when given a cache."""

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.scaling = DIM**-0.5  # the same on every layer; dynamo guards on it, which splits nothing
        self.q = nn.Linear(DIM, DIM)
        self.experts = make_break(Experts())
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, cache: Cache | None = None) -> torch.Tensor:
        keys = self.q(x) * self.scaling
        if cache is not None:
            keys = cache.layers[self.layer_idx].update(keys)[-x.shape[0] :]
        h = x + keys.tanh()
        return h + self.out(self.experts(h))


class Stack(nn.Module):
    def __init__(self, layers: int, use_cache: bool) -> None:
        super().__init__()
        self.use_cache = use_cache
        # as in a language model: every layer's input requires grad, the first's too
        self.embed = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList(cw.checkpoint_wrapper(Layer(i)) for i in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cache = Cache(len(self.layers)) if self.use_cache else None
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x, cache)
        return x


def _train(layers: int, *, use_cache: bool, on: bool = True, steps: int = 2) -> tuple[list[float], int, int]:
    """Losses, compiled graphs and woven region labels of a regionally compiled stack (accelerate's order)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Stack(layers, use_cache)
    cap = counting.Capture()
    with autoweave.disabled() if not on else contextlib.nullcontext():
        for layer in model.layers:
            layer.compile(backend=cap.backend())
    losses = train_steps(model, torch.randn(4, DIM), steps)
    labels = {
        label
        for layer in model.layers
        if on
        for label in dispatchers.dispatcher_of(layer)._applied.regions.values()
    }
    return losses, cap.graph_count, len(labels)


def test_layers_that_mention_an_index_they_do_not_read_share_one_region() -> None:
    # One layer against six: the first layer compiles on the same region as the rest
    # (dynamo guards on values every layer shares, ``training``, which split nothing).
    _, graphs_1, labels_1 = _train(1, use_cache=False)
    _, graphs_6, labels_6 = _train(6, use_cache=False)
    assert (graphs_6, labels_6) == (graphs_1, labels_1), ((graphs_1, labels_1), (graphs_6, labels_6))


def test_layers_that_read_their_index_train_past_the_recompile_limit() -> None:
    # Ten layers, each guarded on its index and its slot's state: twenty graphs for one code
    # object would pass dynamo's limit (8), and the checkpoint's recompute would then fail.
    plain, _, _ = _train(10, use_cache=True, on=False)
    with RecompileLimitHits() as hits:
        woven, _, labels = _train(10, use_cache=True)
    assert hits.messages == []
    assert woven == pytest.approx(plain, rel=1e-5)
    assert labels > 1  # split off the shared region on dynamo's guards


def test_a_hook_on_one_of_identical_blocks_runs_at_every_step() -> None:
    def run(on: bool) -> list[float]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        blocks = [Block(DIM) for _ in range(4)]
        # On a submodule: traced inside the block's region, where dynamo does not guard on it.
        blocks[2].out.register_forward_hook(lambda module, args, out: out * 3.0)
        model = nn.Sequential(*(cw.checkpoint_wrapper(b) for b in blocks))
        with autoweave.disabled() if not on else contextlib.nullcontext():
            compiled = torch.compile(model, backend="aot_eager") if on else model
        x = torch.randn(4, DIM)
        losses = []
        for _ in range(3):
            loss = compiled(x).square().mean()
            loss.backward()
            losses.append(loss.item())
        return losses

    assert run(on=True) == pytest.approx(run(on=False), rel=1e-5)


class PlainBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(DIM, DIM)
        self.experts = make_break(Experts())
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.q(x).tanh()
        return h + self.out(self.experts(h))


class DecoratedBlock(PlainBlock):
    # transformers' layers: ``forward_with_checkpointing`` twice (the class and FSDP's
    # subclass), ``deprecate_kwarg``; each a wrapper that only passes the call on.
    forward = _decorated(_decorated(PlainBlock.forward))


def test_decorators_on_a_forward_add_no_frames() -> None:
    # A break inside a decorated forward: dynamo would break at each wrapper's call of the
    # next and compile every wrapper as a frame of its own (traced to the break, twice);
    # the wrappers run as in eager, the frames compiled are those of the bare forward.
    def frames(cls: type[nn.Module]) -> tuple[int, list[float]]:
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(DIM, DIM), *(cw.checkpoint_wrapper(cls()) for _ in range(3)))
        for layer in list(model)[1:]:
            layer.compile(backend="aot_eager")
        losses = train_steps(model, torch.randn(4, DIM), 2)
        return counters["frames"]["total"], losses

    bare, bare_losses = frames(PlainBlock)
    got, losses = frames(DecoratedBlock)
    assert got == bare, (got, bare)
    assert losses == pytest.approx(bare_losses, rel=1e-6)


def test_a_break_learned_at_the_first_block_costs_the_others_nothing() -> None:
    # A break no plan can see ahead (``torch._dynamo.graph_break()`` in the experts): the first
    # block compiles plain, falls back once, and is woven from its next call; every other block
    # plans with what it taught and compiles once, on the region the first one then shares.
    def compiled(blocks: int) -> tuple[int, int]:
        torch._dynamo.reset()
        _state.reset()  # the break is learned afresh: the process remembers it by forward code
        counters.clear()
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(8, 8),
            *(
                torch.compile(cw.checkpoint_wrapper(BreakBlock(8)), backend="aot_eager")
                for _ in range(blocks)
            ),
        )
        with counting.FallbackCounter() as fallbacks:
            train_steps(model, torch.randn(4, 8), 3)
        return counters["frames"]["total"], fallbacks.count

    frames_1, fallbacks_1 = compiled(1)
    frames_6, fallbacks_6 = compiled(6)
    assert fallbacks_1 == fallbacks_6 == 1
    assert frames_6 <= frames_1, (frames_1, frames_6)


# -- hooks added (and removed) after the first step (issue 31, item 3) ----------------------
# Dynamo does not guard on hooks: a region that inlined a submodule never sees one added
# later. Plain torch runs a woven block eager (its checkpoint falls back at the break), so
# a hook added there runs from the next call, and one removed stops.


def _add_hook(kind: str, module: nn.Module, calls: list[int]) -> Any:
    def count() -> None:
        calls[0] += 1

    if kind == "forward":

        def forward(mod: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
            count()
            return out * 3.0

        return module.register_forward_hook(forward)
    if kind == "pre":

        def pre(mod: nn.Module, args: tuple) -> tuple:
            count()
            return (args[0] * 0.5,)

        return module.register_forward_pre_hook(pre)

    def backward(mod: nn.Module, grad_input: tuple, grad_output: tuple) -> tuple:
        count()
        return tuple(None if g is None else g * 2.0 for g in grad_input)

    return module.register_full_backward_hook(backward)


Step = tuple[float, int, list[torch.Tensor]]


def _regions(model: nn.Module, form: str) -> list[set[str]]:
    """The region labels each block runs on."""
    if form == "per-block":
        return [set(dispatchers.dispatcher_of(layer)._applied.regions.values()) for layer in model]
    regions = dispatchers.dispatcher_of(model)._applied.regions
    return [{label for path, label in regions.items() if path.split(".")[0] == str(i)} for i in range(4)]


def _hooked_steps(kind: str, form: str, on: bool, added: int = 1) -> tuple[list[Step], list[tuple]]:
    """Each step's loss, hook calls and grads, a hook on ``blocks[2].out`` from step ``added``
    to step 3; and, woven, the graphs compiled and each block's regions after each step."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    cap = counting.Capture()
    blocks = [Block(DIM) for _ in range(4)]
    layers = [cw.checkpoint_wrapper(b) for b in blocks]
    with autoweave.disabled() if not on else contextlib.nullcontext():
        if form == "per-block":
            model = nn.Sequential(*(torch.compile(layer, backend=cap.backend()) for layer in layers))
        else:
            model = torch.compile(nn.Sequential(*layers), backend=cap.backend())
    x = torch.randn(4, DIM)
    calls = [0]
    handle = None
    steps = []
    compiled: list[tuple] = []
    # The recompute's early stop ends inside a compiled graph, before dynamo replays the
    # graph's side effects: a pre-hook eager runs again in the recompute (2 calls a step)
    # counts once woven, with the hook there from the start too. Off, counts compare as calls.
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        for step in range(5):
            if step == added:
                handle = _add_hook(kind, blocks[2].out, calls)
            if step == 3 and handle is not None:
                handle.remove()
            before = calls[0]
            loss = model(x).square().mean()
            loss.backward()
            grads = [p.grad.clone() for p in model.parameters()]
            model.zero_grad()
            steps.append((loss.item(), calls[0] - before, grads))
            if on:
                compiled.append((cap.graph_count, _regions(model, form)))
    return steps, compiled


def _assert_same_steps(woven: list[Step], plain: list[Step]) -> None:
    assert [calls for _, calls, _ in woven] == [calls for _, calls, _ in plain]
    assert [loss for loss, _, _ in woven] == pytest.approx([loss for loss, _, _ in plain], rel=1e-6)
    for step, ((_, _, got), (_, _, want)) in enumerate(zip(woven, plain, strict=True)):
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7, msg=f"step {step}")


@pytest.mark.parametrize("form", ["per-block", "whole-model"])
@pytest.mark.parametrize("kind", ["forward", "pre", "backward"])
def test_a_hook_added_after_the_first_step_runs_as_in_plain_torch(kind: str, form: str) -> None:
    plain, _ = _hooked_steps(kind, form, on=False)
    woven, compiled = _hooked_steps(kind, form, on=True)
    _assert_same_steps(woven, plain)
    assert [calls > 0 for _, calls, _ in plain] == [False, True, True, False, False]
    # The hooked block alone moves to a region of its own; the others stay on theirs (their
    # graphs cached), and it moves back when the hook is removed, compiling nothing more.
    graphs = [count for count, _ in compiled]
    regions = [blocks for _, blocks in compiled]
    assert regions[3] == regions[4] == regions[0]
    for hooked in regions[1:3]:
        assert [r == s for r, s in zip(hooked, regions[0], strict=True)] == [True, True, False, True]
    assert graphs[4] == graphs[2] > graphs[0], graphs


@pytest.mark.parametrize("form", ["per-block", "whole-model"])
def test_a_hook_there_from_the_start_stops_when_removed(form: str) -> None:
    plain, _ = _hooked_steps("forward", form, on=False, added=0)
    woven, _ = _hooked_steps("forward", form, on=True, added=0)
    _assert_same_steps(woven, plain)
    assert [calls > 0 for _, calls, _ in plain] == [True, True, True, False, False]


class ItemBlock(nn.Module):
    """A block whose own forward breaks (``.item()``), ``out`` after the break."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.q(x).tanh()
        h = h * (1.0 if h.detach().abs().sum().item() >= 0 else 2.0)
        return x + self.out(h)


class CheckpointingLayer(nn.Module):
    """AC written in the forward: ``checkpoint(self.inner, x)``, which autoweave cannot read."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


@pytest.mark.parametrize("kind", ["forward", "pre", "backward"])
def test_a_hook_added_after_the_first_step_runs_under_a_checkpoint_called_in_forward(kind: str) -> None:
    # The inner block breaks in its own forward: compiled from the class's shared code,
    # the frames dynamo makes at the break (and their graphs, without the hook) would
    # serve every region of every kind, the hooked block's new one too.
    def steps(on: bool) -> list[Step]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        blocks = [ItemBlock() for _ in range(3)]
        with autoweave.disabled() if not on else contextlib.nullcontext():
            model = nn.Sequential(
                *(torch.compile(CheckpointingLayer(b), backend="aot_eager") for b in blocks)
            )
        x = torch.randn(4, DIM, requires_grad=True)
        calls = [0]
        out = []
        # As in ``_hooked_steps``: a pre-hook's side effect in a recompute stopped early
        # inside a compiled graph is not replayed; counts compare as calls without the stop.
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            for step in range(4):
                if step == 1:
                    handle = _add_hook(kind, blocks[1].out, calls)
                if step == 3:
                    handle.remove()
                before = calls[0]
                loss = model(x).square().mean()
                loss.backward()
                grads = [p.grad.clone() for p in model.parameters()]
                model.zero_grad()
                out.append((loss.item(), calls[0] - before, grads))
        return out

    plain = steps(on=False)
    assert [calls > 0 for _, calls, _ in plain] == [False, True, True, False]
    _assert_same_steps(steps(on=True), plain)
