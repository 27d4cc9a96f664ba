"""Boundaries and graph breaks named by the user's file:line (autoweave/sense/graph_breaks.py), in one process."""

from __future__ import annotations

import inspect
import logging

import pytest
import torch
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

import autoweave
from autoweave import _compat, _state
from autoweave._compat import log_strings
from autoweave.observe import report, report_exit
from autoweave.planning import planner
from autoweave.sense import graph_breaks
from tests import models


def _line_of(fn: object, needle: str) -> int:
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if needle in line)


CALL = f"{inspect.getsourcefile(models.MoE)}:{_line_of(models.MoE.forward, 'self.experts(')}"
FORWARD = f"{inspect.getsourcefile(models.Experts)}:{_line_of(models.Experts.forward, 'def forward')}"


def test_boundary_source_is_the_call_in_the_parent_and_the_forward_definition() -> None:
    plan = planner.plan(cw.checkpoint_wrapper(models.Block()))
    [(path, _)] = plan.boundaries
    source = plan.source(path)
    assert source is not None
    assert (source.call, source.forward) == (CALL, FORWARD)
    assert str(source) == f"called at {CALL}, forward at {FORWARD}"


def test_plain_plan_names_its_boundaries_too() -> None:
    plan = planner.plan(models.Block())  # no AC: plain torch.compile copes, not woven
    assert not plan.woven
    assert plan.source("ffn.experts").call == CALL


def test_no_source_outside_user_code() -> None:
    # A torch.nn leaf as the boundary: its forward is torch's, its caller the user's.
    block = models.Block(moe=False)
    models.make_break(block.ffn)
    source = planner.plan(block).source("ffn")
    assert source.forward is None
    assert (
        source.call == f"{inspect.getsourcefile(models.Block)}:{_line_of(models.Block.forward, 'self.ffn(')}"
    )


def _site_of_record(text: str) -> str | None:
    # A record as dynamo's graph_breaks logger emits it, read and placed as the watch does.
    record = logging.LogRecord(
        _compat.log_strings.GRAPH_BREAK_LOGGER, logging.DEBUG, __file__, 1, text, None, None
    )
    return graph_breaks.site_of(log_strings.read(record))


def test_site_of_record_takes_the_innermost_user_frame() -> None:
    torch_file = torch.nn.modules.module.__file__
    text = (
        f"Graph break in user code at {torch_file}:1800\n"
        "Graph Break Reason: Skip calling `torch.compiler.disable()`d function\n"
        "User code traceback:\n"
        f'  File "/home/u/train.py", line 10, in <module>\n'
        f'  File "{torch_file}", line 1775, in _call_impl\n'
        f'  File "/home/u/model.py", line 38, in forward\n'
        f'  File "{torch_file}", line 1800, in inner\n'
    )
    assert _site_of_record(text) == "/home/u/model.py:38"
    assert _site_of_record(f"Graph break in user code at {torch_file}:5\nGraph Break Reason: x") is None


@pytest.fixture
def plain_torch():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    autoweave.disable()
    yield
    torch._dynamo.reset()


def test_report_names_where_dynamo_broke_and_where_ac_fell_back(plain_torch: None) -> None:
    report.start()
    try:
        # Plain torch on AC around a boundary: the checkpointed region falls back
        # to eager; dynamo's break is at the user's call of the boundary.
        model = torch.compile(cw.checkpoint_wrapper(models.Block()), backend="eager")
        model(torch.randn(4, 8)).sum().backward()
        data = report.stop()
    finally:
        report.stop()
    assert data["ac_fallbacks"]["count"] >= 1
    assert data["ac_fallbacks"]["sites"] == [CALL]
    sites = data["dynamo"]["graph_break_sites"]
    assert set(sites) <= set(data["dynamo"]["graph_break_reasons"])
    assert CALL in {site for found in sites.values() for site in found}
    summary = report_exit.format_exit_summary(data, None)
    assert f"at {CALL}" in summary


def test_report_decisions_carry_the_boundary_source() -> None:
    torch._dynamo.reset()
    assert autoweave.enable()
    report.start()
    try:
        model = torch.compile(cw.checkpoint_wrapper(models.Block()), backend="eager")
        model(torch.randn(4, 8)).sum().backward()
        data = report.stop()
    finally:
        report.stop()
        autoweave.disable()
        torch._dynamo.reset()
        _state.reset()  # no summary of this plan at the test run's exit
    decisions = [d for p in data["plans"] for d in p["decisions"] if d["action"] == "boundary"]
    assert {"call": CALL, "forward": FORWARD} in [d["source"] for d in decisions]
