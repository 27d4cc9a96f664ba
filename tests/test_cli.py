"""``python -m autoweave explain`` / ``doctor`` and ``autoweave.explain``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import autoweave
from autoweave import doctor, explainer

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "train_moe.py")

KNOWN_PLAN = """\
autoweave plan: 4 compiled modules, 3 woven
  layers.0 (TransformerBlock): no boundary inside: compiled as plain torch.compile would
  layers.1 (TransformerBlock): woven into 2 compiled regions (mode=auto, strategy=auto)
    layers.1 [CheckpointWrapper] AC eager: full AC stays eager around a compile of the inner block
    layers.1 [TransformerBlock] compiled, split at boundaries: compiled under eager AC; dynamo splits it at the boundaries inside
        layers.1.moe.experts [GroupedExperts] boundary: FSDP unit (fully_shard, simulated) → hooks stay eager, forward compiled
  layers.2-3 (2 × TransformerBlock): same plan as layers.1"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOWEAVE")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def test_explain_prints_the_known_plan_for_the_example() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "autoweave", "explain", f"{EXAMPLE}:Transformer(ModelArgs())"],
        env=_env(), capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n", 1)[1].rstrip() == KNOWN_PLAN


def test_explain_python_api_builds_on_meta_and_folds() -> None:
    module = explainer._load_module(EXAMPLE)
    text = autoweave.explain(lambda: module.Transformer(module.ModelArgs(n_layers=32)))
    assert "  layers.2-31 (30 × TransformerBlock): same plan as layers.1" in text
    selective = autoweave.explain(lambda: module.Transformer(module.ModelArgs()), ac="selective")
    assert "AC pushed down: selective AC moved into each compiled region below" in selective


def test_explain_with_a_user_recipe() -> None:
    module = explainer._load_module(EXAMPLE)

    def recipe(model):
        module.apply_ac(model, "full")
        for block in model.layers.values():
            inner = block._checkpoint_wrapped_module
            if inner.moe_enabled:
                autoweave.boundary(inner.moe.experts, "my FSDP unit")

    text = autoweave.explain(lambda: module.Transformer(module.ModelArgs()), recipe=recipe)
    assert "layers.1.moe.experts [GroupedExperts] boundary: my FSDP unit" in text


def test_load_object_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="MODULE:NAME"):
        explainer.load_object("no_colon")
    with pytest.raises(FileNotFoundError):
        explainer.load_object("nowhere/missing.py:f")


def test_explain_bad_factory_exits_2() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "autoweave", "explain", f"{EXAMPLE}:NoSuchThing"],
        env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2 and "AttributeError" in proc.stderr


def test_doctor_names_invalid_settings() -> None:
    checks = doctor.check_settings({"AUTOWEAVE": "1", "AUTOWEAVE_MODE": "sometimes"})
    assert checks[0].status == doctor.OK
    assert any(c.status == doctor.WARN and "AUTOWEAVE_MODE='sometimes'" in c.detail for c in checks)
    hard_off = doctor.check_settings({"AUTOWEAVE": "1", "AUTOWEAVE_DISABLE": "1"})
    assert hard_off[0].status == doctor.FAIL and hard_off[0].fix


def test_doctor_versions_are_supported_here() -> None:
    assert all(c.status == doctor.OK for c in doctor.check_versions())


def test_doctor_with_the_start_up_shell_on_the_path_passes() -> None:
    env = _env()
    env["PYTHONPATH"] = str(ROOT / "sitecustomize")
    proc = subprocess.run(
        [sys.executable, "-m", "autoweave", "doctor"], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "live check: a fresh python with AUTOWEAVE=1 has torch.compile patched" in proc.stdout
