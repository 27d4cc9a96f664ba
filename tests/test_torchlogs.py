"""TORCH_LOGS=autoweave / +autoweave / -autoweave, in fresh interpreters (torch reads TORCH_LOGS at import)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autoweave.observe.torch_logs import requested_level

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


def _run(script: str, **env_vars: str) -> tuple[tuple[int, int, bool], str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("AUTOWEAVE", "TORCH_LOGS", "TORCH_TRACE"))
    }
    # The checkout's start-up shell: AUTOWEAVE=1 activates autoweave whether or not it is installed.
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "sitecustomize"), str(ROOT)])
    env.update(AUTOWEAVE="1", OMP_NUM_THREADS="1", **env_vars)
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
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
