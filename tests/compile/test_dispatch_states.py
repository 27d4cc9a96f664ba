"""The dispatcher's life as one state machine (``dispatch/dispatchers.State``): each path, named."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

import autoweave
from autoweave import _settings
from autoweave.dispatch import dispatchers
from autoweave.dispatch.dispatchers import _TRANSITIONS, State, Why
from tests import break_models as bm
from tests.models import Block

pytestmark = pytest.mark.usefixtures("weave_on")


def _step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).square().mean().backward()


def _life(model: nn.Module) -> list[tuple[str, str]]:
    return [(state.name, why.name) for state, why in dispatchers.dispatcher_of(model).history]


def test_every_state_has_its_moves_and_every_move_lands_on_a_state() -> None:
    assert set(_TRANSITIONS) == set(State)
    assert all(targets <= set(State) for targets in _TRANSITIONS.values())
    # Only planning leaves UNPLANNED, and nothing goes back to it.
    assert not any(State.UNPLANNED in targets for targets in _TRANSITIONS.values())


def test_a_woven_block_plans_at_its_first_call_and_is_woven_after_it() -> None:
    model = torch.compile(cw.checkpoint_wrapper(Block()), backend="aot_eager")
    dispatcher = dispatchers.dispatcher_of(model)
    assert dispatcher.state is State.UNPLANNED
    x = torch.randn(4, 8)
    _step(model, x)
    assert _life(model) == [("TRIAL", "PLANNED"), ("WOVEN", "COMPILED")]
    _step(model, x)
    assert dispatcher.state is State.WOVEN and len(dispatcher.history) == 2  # steady: no move


def test_a_tree_change_plans_again() -> None:
    model = torch.compile(cw.checkpoint_wrapper(Block()), backend="aot_eager")
    x = torch.randn(4, 8)
    _step(model, x)
    model._orig_mod._checkpoint_wrapped_module.extra = nn.Identity()
    _step(model, x)
    assert ("TRIAL", "TREE_CHANGED") in _life(model)
    assert dispatchers.dispatcher_of(model).state is State.WOVEN


def test_a_break_found_only_at_the_first_call_is_learned_then_woven() -> None:
    # The break (.item()) is not a boundary the planner can see: plain, watched;
    # dynamo's AC fallback at the first call teaches it; woven from the next call.
    model = torch.compile(cw.checkpoint_wrapper(bm.ItemRouterBlock()), backend="aot_eager")
    x = torch.randn(6, bm.DIM)
    for _ in range(3):
        _step(model, x)
    life = _life(model)
    assert life[:4] == [
        ("PLAIN", "PLANNED"),
        ("WATCHING", "PLANNED"),
        ("PLAIN", "WATCHED"),
        ("LEARNED", "FELL_BACK"),
    ]
    assert life[4:] == [("TRIAL", "APPLIED"), ("WOVEN", "COMPILED")]


def test_a_module_compiled_before_disable_runs_plain_at_its_first_call_after_it() -> None:
    model = torch.compile(cw.checkpoint_wrapper(Block()), backend="aot_eager")
    autoweave.disable()
    try:
        _step(model, torch.randn(4, 8))
        assert _life(model) == [("PLAIN", "OFF")]
        assert not dispatchers.dispatcher_of(model).woven
    finally:
        assert autoweave.enable()


def test_a_move_the_table_does_not_allow_raises_in_strict_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    model = torch.compile(cw.checkpoint_wrapper(Block()), backend="aot_eager")
    dispatcher = dispatchers.dispatcher_of(model)
    dispatcher._enter(State.PLAIN, Why.PLANNED)  # allowed: UNPLANNED -> PLAIN
    strict = _settings.Settings.from_environ({"AUTOWEAVE": "1", "AUTOWEAVE_STRICT": "1"})
    monkeypatch.setattr(_settings, "_current", strict)
    with pytest.raises(autoweave.AutoweaveError if hasattr(autoweave, "AutoweaveError") else Exception):
        dispatcher._enter(State.WOVEN, Why.COMPILED)  # PLAIN -> WOVEN skips the first woven call
    assert dispatcher.state is State.PLAIN


def test_a_plan_learned_before_disable_is_not_applied_after_it() -> None:
    model = torch.compile(cw.checkpoint_wrapper(bm.ItemRouterBlock()), backend="aot_eager")
    x = torch.randn(6, bm.DIM)
    _step(model, x)  # the fallback teaches the break: a plan waits for the next call
    assert dispatchers.dispatcher_of(model).state is State.LEARNED
    autoweave.disable()
    try:
        _step(model, x)
        assert _life(model)[-1] == ("PLAIN", "OFF")
        assert not dispatchers.dispatcher_of(model).woven
    finally:
        assert autoweave.enable()
