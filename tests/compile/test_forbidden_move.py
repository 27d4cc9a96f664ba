"""A move the dispatcher's state machine forbids is refused in every mode: the module still runs compiled.

Forced PLAIN -> WOVEN (or TRIAL) would leave a dispatcher that runs its
"regions" with none installed: the module's forward uncompiled, silently.
Refused, it runs what plain torch.compile makes of it: strict mode raises
and nothing moves; otherwise one ``[internal-error]`` warning.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

from autoweave import _settings
from autoweave._failopen import AutoweaveError
from autoweave.dispatch import dispatchers
from autoweave.dispatch.dispatchers import State, Why

pytestmark = pytest.mark.usefixtures("weave_on")

FORCED = [(State.WOVEN, Why.COMPILED), (State.TRIAL, Why.APPLIED)]


class CountingBackend:
    """Counts the graphs dynamo hands it and every run of what it returned (compiled code running)."""

    def __init__(self) -> None:
        self.graphs = 0
        self.runs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        self.graphs += 1
        forward = gm.forward

        def run(*args: Any) -> Any:
            self.runs += 1
            return forward(*args)

        return run


def _planned_plain() -> tuple[nn.Module, CountingBackend, torch.Tensor]:
    torch.manual_seed(0)
    backend = CountingBackend()
    model = torch.compile(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)), backend=backend)
    x = torch.randn(4, 8)
    model(x)  # planned: nothing to weave, plain torch.compile
    assert dispatchers.dispatcher_of(model).state is State.PLAIN
    assert backend.graphs == 1 and backend.runs == 1
    return model, backend, x


def _runs_compiled_as_plain_torch(model: nn.Module, backend: CountingBackend, x: torch.Tensor) -> None:
    runs = backend.runs
    out = model(x)
    assert backend.runs == runs + 1  # the compiled graph ran, not the forward eagerly
    torch.testing.assert_close(out, model._orig_mod(x))  # what eager computes


@pytest.mark.fail_open
@pytest.mark.parametrize("state, why", FORCED, ids=[s.name for s, _ in FORCED])
def test_forbidden_move_is_refused_with_one_warning_and_the_module_runs_compiled(
    state: State, why: Why, capsys: pytest.CaptureFixture[str]
) -> None:
    model, backend, x = _planned_plain()
    dispatcher = dispatchers.dispatcher_of(model)
    capsys.readouterr()
    dispatcher._enter(state, why)
    assert dispatcher.state is State.PLAIN and dispatcher.history[-1] == (State.PLAIN, Why.REFUSED)
    assert not dispatcher.woven
    _runs_compiled_as_plain_torch(model, backend, x)
    _runs_compiled_as_plain_torch(model, backend, x)
    err = capsys.readouterr().err
    assert err.count("[internal-error]") == 1 and "refused the move plain -> " in err, err


@pytest.mark.parametrize("state, why", FORCED, ids=[s.name for s, _ in FORCED])
def test_forbidden_move_raises_in_strict_mode_and_nothing_moves(
    state: State, why: Why, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, backend, x = _planned_plain()
    dispatcher = dispatchers.dispatcher_of(model)
    strict = _settings.Settings.from_environ({"AUTOWEAVE": "1", "AUTOWEAVE_STRICT": "1"})
    monkeypatch.setattr(_settings, "_current", strict)
    history = list(dispatcher.history)
    with pytest.raises(AutoweaveError, match="refused the move plain -> "):
        dispatcher._enter(state, why)
    assert dispatcher.state is State.PLAIN and dispatcher.history == history
    _runs_compiled_as_plain_torch(model, backend, x)
