"""A checkpoint's recompute meets the Python state its forward saw, and leaves it as plain torch does (issue 41).

The defect (fuzzer seed 10090, `tests/fuzz/test_regressions.py`, which fails before the fix): a
forward bumps ``self.calls``, which dynamo guards on; the recompute met the bumped value, fit none
of the region's graphs and compiled another (under a freeze, with a float made dynamic), which
saved other tensors: ``CheckpointError``. The fix presents the recompute the forward's guarded
scalars (``weave.guarded_state``) and applies the recompute's own change after it. Here: that the
counter still ends where plain torch's two eager runs leave it (fails if the recompute's bump is
dropped), and what is presented and kept, value by value.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

import autoweave
from autoweave.weave.guarded_state import GuardedState

DIM = 8
STEPS = 4
pytestmark = pytest.mark.usefixtures("weave_on")


class CountingBlock(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 16)
        self.down = nn.Linear(16, DIM)
        self.scale = scale
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1  # guarded by the frame before the break
        h = torch.relu(self.up(x)) * self.scale
        h = h * (1.0 if h.detach().abs().sum().item() >= 0 else 2.0)  # a break
        return x + self.down(h)


def _train(plain: bool) -> tuple[list[float], list[int]]:
    torch.manual_seed(0)
    blocks = [CountingBlock(0.5), CountingBlock(0.75)]
    x = torch.randn(4, DIM)
    torch._dynamo.reset()
    with autoweave.disabled() if plain else contextlib.nullcontext():
        model = nn.Sequential(*(torch.compile(cw.checkpoint_wrapper(b), backend="aot_eager") for b in blocks))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(STEPS):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, [b.calls for b in blocks]


def test_a_counter_bumped_before_a_break_trains_as_plain_torch() -> None:
    plain_losses, plain_calls = _train(plain=True)
    woven_losses, woven_calls = _train(plain=False)
    assert woven_losses == pytest.approx(plain_losses, rel=1e-6)
    # Bumped in forward and in recompute, as plain torch's two eager runs bump it.
    assert woven_calls == plain_calls == [2 * STEPS, 2 * STEPS]


class _Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls, self.ready, self.load, self.name = 0, False, 0.0, "a"


def test_the_recompute_is_presented_the_forwards_guarded_values(monkeypatch: pytest.MonkeyPatch) -> None:
    from autoweave import _compat

    monkeypatch.setattr(
        _compat.backends, "guarded_attributes", lambda fn, codes=(): frozenset({"calls", "ready", "name"})
    )
    module = _Holder()
    state = GuardedState(lambda: None)
    noted = state.note((module,), entries=0, made=0)
    module.calls, module.ready, module.load, module.name = 1, True, 0.5, "b"  # the forward
    restore = state.present(noted, made=1)
    # Guarded: as the forward saw them; not guarded (load): as the forward left it.
    assert (module.calls, module.ready, module.load, module.name) == (0, False, 0.5, "a")
    module.calls, module.ready, module.name = 1, True, "c"  # the recompute
    restore()
    # A counter: bumped once more; a flag or a name the recompute set: as it set them.
    assert (module.calls, module.ready, module.load, module.name) == (2, True, 0.5, "c")


class _Slot:
    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None


class _Slotted:
    __slots__ = ("keys",)  # no __dict__: not a holder


class _Lazy:
    def __getattr__(self, name: str):  # never run by the walk
        raise RuntimeError(f"read {name}")


def test_plain_objects_the_arguments_hold_are_presented_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache made per call (transformers' DynamicCache): its slot, empty in the forward, stays so for the recompute."""
    from autoweave import _compat

    monkeypatch.setattr(_compat.backends, "guarded_attributes", lambda fn, codes=(): frozenset({"keys"}))
    cache = [_Slot(), _Slot()]
    state = GuardedState(lambda: None)
    noted = state.note((torch.ones(1), (cache, _Slotted(), _Lazy())), entries=0, made=0)
    filled = torch.ones(2)
    cache[0].keys = filled  # the forward
    restore = state.present(noted, made=1)
    assert cache[0].keys is None and cache[1].keys is None
    again = torch.zeros(2)
    cache[0].keys = again  # the recompute
    restore()
    assert cache[0].keys is again  # not a number: as the recompute left it
