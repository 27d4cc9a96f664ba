"""``autoweave.disable()`` is the inverse of ``enable()``; and what it does to modules compiled before it.

The snapshot tests run in a fresh interpreter each (``tests/disable_worker.py``):
torch, ``sys.meta_path``, every ``torch``/``autoweave`` logger, logging's level
names, torch's registration hooks and dynamo's callbacks are compared before
``enable()`` and after ``disable()``, once models compiled while autoweave was
on have run (the first calls install things lazily). The environment variants
switch on the run report, ``TORCH_LOGS``, the structured trace and
``AUTOWEAVE_LOG_LEVEL`` so their installs are exercised too.

What disable() does to modules compiled while autoweave was on (in this process):

- compiled but never called: its first forward runs what plain ``torch.compile``
  would (the dispatcher asks ``autoweave._installs.active()`` at its first call);
- already woven: keeps its woven plan (reverting would recompile mid-training);
- ``checkpoint_wrapper(torch.compile(block))``: the wrapper's gate is removed
  when the block's dispatcher has not woven (the wrapper is then exactly what
  plain torch built); a woven block keeps its gate, whose plan may have moved the
  wrapper's checkpoint inside the compiled regions.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw

import autoweave
from autoweave import _installs
from autoweave.dispatch import dispatchers
from tests.models import Block

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "disable_worker.py"

# The environment of each variant; "{tmp}" is the test's temporary directory.
VARIANTS: dict[str, dict[str, str]] = {
    "plain": {},
    "report_trace_torch_logs": {
        "AUTOWEAVE_REPORT": "{tmp}/report.json",
        "TORCH_LOGS": "+autoweave,graph_breaks",
        "TORCH_TRACE": "{tmp}/trace",
    },
    "log_level": {"AUTOWEAVE_LOG_LEVEL": "debug", "TORCH_LOGS": "autoweave"},
}
_CLEARED = ("TORCH_LOGS", "TORCH_LOGS_OUT", "TORCH_TRACE", "TORCH_DTRACE", "TORCH_COMPILE_DEBUG")


def run_worker(scenario: str, variant: str, tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOWEAVE") and k not in _CLEARED}
    env.update({k: v.format(tmp=tmp_path) for k, v in VARIANTS[variant].items()})
    result = subprocess.run(
        [sys.executable, str(WORKER), scenario],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


@pytest.mark.parametrize(
    ("scenario", "variant"),
    [
        ("once", "plain"),
        ("once", "log_level"),
        ("cycle", "report_trace_torch_logs"),
    ],
)
def test_disable_leaves_torch_and_logging_as_before_enable(
    scenario: str, variant: str, tmp_path: Path
) -> None:
    result = run_worker(scenario, variant, tmp_path)
    assert result["import"] == {}, "importing autoweave changed " + json.dumps(result["import"], indent=1)
    assert result["twice"] == {}, "a second enable() installed " + json.dumps(result["twice"], indent=1)
    assert result["disable"] == {}, "disable() left " + json.dumps(result["disable"], indent=1)


# -- modules compiled while autoweave was on, after disable() (in this process) ---------------


def _train(model: nn.Module, x: torch.Tensor, steps: int = 2) -> list[torch.Tensor]:
    """Outputs and gradients of ``steps`` training steps (gradients cleared after each)."""
    got = []
    for _ in range(steps):
        out = model(x)
        out.square().mean().backward()
        got.append(out.detach().clone())
        got.extend(p.grad.clone() for p in model.parameters())
        model.zero_grad()
    return got


def _assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("how", ["torch.compile", "module.compile"])
def test_compiled_before_disable_and_first_called_after_runs_as_plain_torch(weave_on, how: str) -> None:
    from autoweave.sense import counting

    torch.manual_seed(0)
    block, x = Block(), torch.randn(4, 8)
    want = _train(copy.deepcopy(block), x)
    if how == "torch.compile":
        model = torch.compile(cw.checkpoint_wrapper(block), backend="aot_eager")
    else:
        model = cw.checkpoint_wrapper(block)
        model.compile(backend="aot_eager")
    autoweave.disable()
    assert not autoweave.is_enabled()
    with counting.FallbackCounter() as fallbacks:
        got = _train(model, x)
    _assert_same(got, want)
    dispatcher = dispatchers.dispatcher_of(model)
    assert dispatcher is None or (not dispatcher.woven and dispatcher.plan is None)
    # What plain torch.compile does with AC around a boundary: dynamo runs the region eager.
    assert fallbacks.count >= 1


def test_woven_before_disable_keeps_its_plan_and_its_results(weave_on) -> None:
    from autoweave.sense import counting

    torch.manual_seed(0)
    block, x = Block(), torch.randn(4, 8)
    want = _train(copy.deepcopy(block), x, steps=4)
    model = torch.compile(cw.checkpoint_wrapper(block), backend="aot_eager")
    first = _train(model, x)
    dispatcher = dispatchers.dispatcher_of(model)
    assert dispatcher.woven
    autoweave.disable()
    with counting.FallbackCounter() as fallbacks:
        after = _train(model, x)
    assert dispatchers.dispatcher_of(model) is dispatcher and dispatcher.woven
    assert fallbacks.count == 0  # still compiled around the boundary: no region ran eager
    _assert_same(first + after, want)


def test_disable_removes_the_gate_of_a_wrapper_whose_block_has_not_woven(weave_on) -> None:
    torch.manual_seed(0)
    block, x = Block(), torch.randn(4, 8)
    want = _train(copy.deepcopy(block), x)
    wrapper = cw.checkpoint_wrapper(torch.compile(block, backend="aot_eager"))
    with autoweave.disabled():
        plain = cw.checkpoint_wrapper(torch.compile(copy.deepcopy(block), backend="aot_eager"))
    assert "forward" in wrapper.__dict__  # the gate: the block decides before the checkpoint starts
    autoweave.disable()
    # Exactly what plain torch built: no instance forward, no instance __getstate__.
    assert sorted(wrapper.__dict__) == sorted(plain.__dict__)
    _assert_same(_train(wrapper, x), want)


def _selective() -> dict:
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return {"context_fn": functools.partial(create_selective_checkpoint_contexts, policy)}


def test_disable_keeps_the_gate_of_a_wrapper_whose_block_is_woven(weave_on) -> None:
    # Selective AC around the compile: the plan moved the checkpoint into the regions and
    # the gate skips the wrapper's own; removing the gate would checkpoint twice.
    torch.manual_seed(0)
    block, x = Block(), torch.randn(4, 8)
    want = _train(cw.checkpoint_wrapper(copy.deepcopy(block), **_selective()), x, steps=4)
    inner = torch.compile(block, backend="aot_eager")
    wrapper = cw.checkpoint_wrapper(inner, **_selective())
    first = _train(wrapper, x)
    dispatcher = dispatchers.dispatcher_of(inner)
    assert dispatcher.woven and dispatcher.skip_outer_checkpoint
    gate = wrapper.__dict__["forward"]
    autoweave.disable()
    assert wrapper.__dict__.get("forward") is gate
    _assert_same(first + _train(wrapper, x), want)
    assert dispatcher.woven


def test_enable_disable_twice_in_one_process_leaves_no_install(weave_on) -> None:
    from autoweave.dispatch import patches

    autoweave.disable()
    for _ in range(2):
        assert autoweave.enable()
        installed = _installs.keys()
        assert autoweave.enable()
        assert _installs.keys() == installed  # a second enable() installs nothing
        assert _installs.active() and patches.applied()
        model = torch.compile(cw.checkpoint_wrapper(Block()), backend="aot_eager")
        _train(model, torch.randn(4, 8))
        autoweave.disable()
        assert _installs.keys() == [] and not _installs.active() and patches.applied() == []
