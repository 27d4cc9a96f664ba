"""TORCH_LOGS=autoweave / +autoweave / -autoweave, in fresh interpreters (torch reads TORCH_LOGS at import)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

import autoweave
from autoweave import _compat, _taps
from autoweave.sense.graph_breaks import requested_level
from tests.models import Block

ROOT = Path(__file__).resolve().parents[1]

# The logger's state after torch (and, with AUTOWEAVE=1, autoweave) loaded.
_STATE = """
import logging, torch
from torch._logging import _internal
log = logging.getLogger("autoweave")
torch_handlers = sum(1 for h in log.handlers if _internal._is_torch_handler(h))
print("STATE", log.level, torch_handlers, _internal.log_registry.is_log("autoweave"))
"""

# A block whose child has a dynamo-disabled hook (a break, as FSDP's) under full AC:
# autoweave weaves it, and the plan summary is logged at SUMMARY by default.
_WOVEN = (
    _STATE
    + """
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw
from tests.models import Block
model = torch.compile(cw.checkpoint_wrapper(Block()), backend="eager")
x = torch.randn(4, 8)
for _ in range(2):
    model(x).sum().backward()
"""
)


def _proc(script: str, **env_vars: str) -> subprocess.CompletedProcess[str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("AUTOWEAVE", "TORCH_LOGS", "TORCH_TRACE"))
    }
    # The checkout's start-up shell: AUTOWEAVE=1 activates autoweave whether or not it is installed.
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "sitecustomize"), str(ROOT)])
    env.update({"AUTOWEAVE": "1", "OMP_NUM_THREADS": "1", **env_vars})
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _run(script: str, **env_vars: str) -> tuple[tuple[int, int, bool], str]:
    proc = _proc(script, **env_vars)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("STATE"))
    level, handlers, registered = line.split()[1:]
    return (int(level), int(handlers), registered == "True"), proc.stderr


@pytest.mark.parametrize(
    ("value", "level"),
    [
        ("autoweave", logging.INFO),
        ("+autoweave", logging.DEBUG),
        ("-autoweave", logging.ERROR),
        ("+dynamo, -autoweave", logging.ERROR),
        ("+dynamo,graph_breaks", None),
        ("all", None),  # torch's "all" is torch's loggers
        ("+autoweave_x", None),
        ("", None),
    ],
)
def test_requested_level_reads_torch_logs_like_torch(value: str, level: int | None) -> None:
    assert requested_level({"TORCH_LOGS": value}) == level


def test_requested_level_is_none_without_torch_logs() -> None:
    assert requested_level({}) is None


@pytest.mark.slow
def test_plus_autoweave_shows_debug_lines_through_torchs_handler() -> None:
    (level, torch_handlers, registered), err = _run(_STATE, TORCH_LOGS="+autoweave")
    assert (level, torch_handlers, registered) == (logging.DEBUG, 1, True)
    # patches.py logs each patch at DEBUG; torch's format names the file and line.
    debug = [line for line in err.splitlines() if "patched torch.compile" in line]
    assert len(debug) == 1, err
    assert debug[0].startswith("V") and "autoweave/dispatch/patches.py:" in debug[0]


@pytest.mark.slow
def test_autoweave_log_level_wins_over_torch_logs() -> None:
    (level, torch_handlers, registered), err = _run(
        _STATE, TORCH_LOGS="+autoweave", AUTOWEAVE_LOG_LEVEL="warning"
    )
    assert (level, torch_handlers, registered) == (logging.WARNING, 0, True)
    assert "patched torch.compile" not in err


@pytest.mark.slow
def test_torch_logs_without_autoweave_leaves_the_logger_alone() -> None:
    (level, torch_handlers, registered), _ = _run(_STATE, TORCH_LOGS="graph_breaks")
    assert (level, torch_handlers) == (logging.NOTSET, 0)
    assert registered  # TORCH_LOGS set: named in torch's registry, nothing more


@pytest.mark.slow
def test_minus_autoweave_silences_the_default_plan_summary() -> None:
    _, shown = _run(_WOVEN)
    assert "autoweave plan: 1 compiled module, 1 woven" in shown  # what -autoweave must hide
    (level, _, _), hidden = _run(_WOVEN, TORCH_LOGS="-autoweave")
    assert level == logging.ERROR
    assert "autoweave plan" not in hidden, hidden


# A function with a graph break, compiled by plain torch.compile in every lane.
_BREAK = """
import torch

def broken(x):
    x = x + 1
    torch._dynamo.graph_break()
    return x * 2

torch.compile(broken, backend="eager")(torch.randn(3))
"""


def _graph_break_lines(stderr: str) -> list[str]:
    # torch's format: "V1203 11:13:14.952000 4506 torch/...py:5124] [0/0] [__graph_breaks] text".
    return [
        line.split("[__graph_breaks]", 1)[1] for line in stderr.splitlines() if "[__graph_breaks]" in line
    ]


@pytest.mark.slow
def test_torch_logs_graph_breaks_prints_what_plain_torch_prints(tmp_path: Path) -> None:
    # The report's tap attaches during ``import torch``, before torch applies TORCH_LOGS:
    # what it lets through must follow the level torch sets afterwards.
    plain = _graph_break_lines(_proc(_BREAK, AUTOWEAVE="0", TORCH_LOGS="graph_breaks").stderr)
    assert any("Graph break in user code" in line for line in plain), plain
    woven = _graph_break_lines(_proc(_BREAK, TORCH_LOGS="graph_breaks").stderr)
    report = tmp_path / "report.json"
    reported = _proc(_BREAK, TORCH_LOGS="graph_breaks", AUTOWEAVE_REPORT=str(report))
    assert report.exists()  # the report (and its taps) were on
    assert (woven, _graph_break_lines(reported.stderr)) == (plain, plain)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _broken(x: torch.Tensor) -> torch.Tensor:
    x = x + 1
    torch._dynamo.graph_break()
    return x * 2


_TAPPED = (
    _compat.log_strings.FALLBACK_LOGGER,
    _compat.log_strings.GRAPH_BREAK_LOGGER,
    _compat.log_strings.RECOMPILE_LIMIT_LOGGER,
)


def _dynamo_shows(**settings: Any) -> list[tuple[str, int, str]]:
    """What torch's handlers get from the tapped loggers compiling ``_broken`` under ``set_logs(**settings)``."""
    torch._dynamo.reset()
    seen = _Records()
    dynamo = logging.getLogger("torch._dynamo")  # torch's registered logger: the tapped ones propagate to it
    dynamo.addHandler(seen)
    torch._logging.set_logs(**settings)
    try:
        with autoweave.disabled():  # the same plain compile in both lanes
            torch.compile(_broken, backend="eager")(torch.randn(3))
    finally:
        torch._logging.set_logs()
        dynamo.removeHandler(seen)
    return [(r.name, r.levelno, r.getMessage().splitlines()[0]) for r in seen.records if r.name in _TAPPED]


def _loggers_state() -> list[tuple[int, int, bool]]:
    return [
        (log.level, log.getEffectiveLevel(), log.propagate)
        for log in map(logging.getLogger, ("torch._dynamo", *_TAPPED))
    ]


@pytest.mark.skipif("TORCH_LOGS" in os.environ, reason="set_logs does nothing while TORCH_LOGS is set")
def test_set_logs_after_a_woven_plan_shows_what_plain_torch_shows(weave_on: None) -> None:
    _dynamo_shows(dynamo=logging.DEBUG)  # dynamo logs each skipped file once per process: not compared
    plain = _dynamo_shows(dynamo=logging.DEBUG)
    plain_reset, plain_state = _dynamo_shows(), _loggers_state()
    assert any(name == _compat.log_strings.GRAPH_BREAK_LOGGER for name, _, _ in plain), plain
    model = torch.compile(cw.checkpoint_wrapper(Block()), backend="eager")
    x = torch.randn(4, 8)
    for _ in range(2):
        model(x).sum().backward()
    assert autoweave.plan(model).woven
    tapped = [
        name for name in _TAPPED if any(isinstance(f, _taps.Tap) for f in logging.getLogger(name).filters)
    ]
    assert tapped, "no tap attached after a woven plan: nothing tested"
    assert _dynamo_shows(dynamo=logging.DEBUG) == plain
    # set_logs() resets torch's logging; then it shows (and the loggers are) as in plain torch.
    assert (_dynamo_shows(), _loggers_state()) == (plain_reset, plain_state)
