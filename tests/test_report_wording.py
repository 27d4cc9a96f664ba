"""What the plan summary and the exit report say, where issue 32's Lightning runs found them wrong.

Each test builds a small model in process (``tests.models``), no client: ``AUTOWEAVE_MODE=off``
named as the reason nothing wove (a); modules named through the wrappers frameworks put around
the model (b); regions left out of the exit summary counted (c); the plan summary held back while
a pieces block's memory measure has still to run (d). tests/clients/test_lightning.py asserts the
same on Lightning's own runs.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

from autoweave import _settings
from autoweave._settings import Settings
from autoweave.observe import report, report_exit, summary
from tests.break_models import with_ac
from tests.models import Block


@pytest.fixture
def weave_on(weave_on):  # the shared one (tests/conftest.py), and the report stopped first
    yield
    report.stop()


class Stack(nn.Module):
    def __init__(self, n: int = 2, ac: str = "full") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(
            torch.compile(with_ac(Block(), ac), backend="aot_eager") for _ in range(n)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _step(model: nn.Module) -> None:
    model(torch.randn(4, 8)).sum().backward()


def test_mode_off_is_named_as_why_nothing_wove(weave_on) -> None:
    _settings.reload(Settings.from_environ({"AUTOWEAVE": "1", "AUTOWEAVE_MODE": "off"}))
    try:
        report.start(None)
        _step(Stack())
        data = report.stop()
    finally:
        _settings.reload(Settings.from_environ({"AUTOWEAVE": "1"}))
    text = report_exit.format_exit_summary(data, None)
    assert data["ac_fallbacks"]["count"] >= 1 and data["totals"]["woven"] == 0, text
    assert "AUTOWEAVE_MODE=off is set" in text, text
    # No plan was printed above (a plan weaving nothing is logged at INFO, below the default level).
    assert "the plan above" not in text, text


class _FabricModule(nn.Module):
    """Stands in for Lightning Fabric's wrapper (``fabric.setup``): the model under ``_forward_module``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self._forward_module = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward_module(x)


class DistributedDataParallel(_FabricModule):
    """Stands in for DDP (accelerate's and Lightning's DDP paths): the model under ``module``."""

    def __init__(self, model: nn.Module) -> None:
        nn.Module.__init__(self)
        self.module = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


@pytest.mark.parametrize("wrapper", [_FabricModule, DistributedDataParallel])
def test_modules_are_named_as_the_user_wrote_them_through_framework_wrappers(weave_on, wrapper) -> None:
    model = wrapper(Stack())
    report.start(None)
    for _ in range(2):
        _step(model)
    data = report.stop()
    assert sorted(e.name for e in summary.entries()) == ["layers.0", "layers.1"]
    assert {name for r in data["regions"] for name in r["modules"]} >= {"layers.0", "layers.1"}, data[
        "regions"
    ]


def test_exit_summary_says_how_many_regions_it_left_out(weave_on) -> None:
    report.start(None)
    linears = [torch.compile(nn.Linear(4, 4), backend="aot_eager") for _ in range(6)]
    x = torch.randn(2, 4)
    for linear in linears:
        linear(x)
    data = report.stop()
    assert len(data["regions"]) == 6
    text = report_exit.format_exit_summary(data, "r0.json")
    assert "... and 2 more region(s): the 4 slowest to compile are listed, all are in r0.json" in text, text


def test_plan_summary_waits_for_the_memory_measure_after_no_grad_calls(weave_on, caplog) -> None:
    """Lightning's sanity check: no-grad calls first; the summary comes once pieces are measured."""
    model = Stack(ac="selective")
    x = torch.randn(4, 8)

    def plans() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith("autoweave plan")]

    with caplog.at_level(logging.INFO, logger="autoweave"):
        with torch.no_grad():
            model(x)
            model(x)
        assert plans() == []  # the blocks' first call with grad still has to measure them
        _step(model)
        assert plans() == []  # measured in that call; the summary comes at the next
        _step(model)
    assert len(plans()) == 1, plans()
    # The plan as the measure left it (here: the pieces hold more, so hoist, the measure in its reason).
    assert "measured: pieces hold" in plans()[0], plans()[0]
    assert "not measured yet" not in plans()[0]


def test_plan_summary_at_exit_says_the_measure_has_not_run(weave_on, caplog) -> None:
    model = Stack(ac="selective")
    with caplog.at_level(logging.INFO, logger="autoweave"), torch.no_grad():
        model(torch.randn(4, 8))
        model(torch.randn(4, 8))
        summary.flush()  # what exit does
    text = "\n".join(r.getMessage() for r in caplog.records if r.getMessage().startswith("autoweave plan"))
    assert "2 pieces block(s) not measured yet: no call with grad so far" in text, text
