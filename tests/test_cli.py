"""``python -m autoweave explain`` / ``doctor`` and ``autoweave.explain``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import autoweave
from autoweave import __main__ as cli
from autoweave import _compat
from autoweave.tools import doctor, explainer
from tests.models import Block

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "train_moe.py")

KNOWN_PLAN = """\
autoweave plan: 4 compiled modules, 3 woven
  layers.0 (TransformerBlock): no boundary inside: compiled as plain torch.compile would
  layers.1 (TransformerBlock): woven into 2 compiled regions (mode=auto, strategy=auto -> hoist)
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
    assert "AC in each compiled piece: selective AC moved into each compiled piece below" in selective


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


def test_explain_bad_factory_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = _explain(capsys, f"{EXAMPLE}:NoSuchThing")
    assert (status, out) == (2, "") and "AttributeError" in err and "Traceback" not in err


@pytest.mark.slow  # the same through `python -m autoweave` (whose wiring the known-plan test runs too)
def test_explain_bad_factory_exits_2_from_the_command_line() -> None:
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


class _PythonVersion(tuple):
    """A stand-in for ``sys.version_info``: compares as a tuple, has major/minor/micro."""

    major = property(lambda self: self[0])
    minor = property(lambda self: self[1])
    micro = property(lambda self: self[2])


(_LOW, _HIGH) = _compat.version.TESTED_TORCH
_NEWER = f"{_HIGH[0]}.{_HIGH[1] + 1}.0"
_OLDER = f"{_LOW[0]}.{_LOW[1] - 1}.3"

# (torch version, AUTOWEAVE_UNTESTED_TORCH, doctor's verdict, words its title carries)
_TORCH_CASES = [
    (f"{_LOW[0]}.{_LOW[1]}.0", "check", doctor.OK, ""),  # the oldest tested release
    (f"{_HIGH[0]}.{_HIGH[1]}.2+cu128", "check", doctor.OK, ""),  # the newest, a local build
    (f"{_HIGH[0]}.{_HIGH[1]}.0a0+git1234", "off", doctor.OK, ""),  # tested: the policy does not apply
    (_OLDER, "check", doctor.FAIL, ""),
    (f"{_LOW[0] - 1}.{_HIGH[1] + 5}.0", "check", doctor.FAIL, ""),  # an older major, a bigger minor
    (_NEWER, "check", doctor.WARN, "(newer than tested)"),
    (_NEWER, "off", doctor.FAIL, "(newer than tested)"),
    (f"{_HIGH[0] + 1}.0.0", "check", doctor.WARN, "(newer than tested)"),  # a newer major, minor 0
    ("not-a-version", "check", doctor.FAIL, ""),
]


@pytest.mark.parametrize(
    "version, untested, status, words", _TORCH_CASES, ids=[f"{c[0]}-{c[1]}" for c in _TORCH_CASES]
)
def test_doctor_judges_torch_versions_against_the_tested_range(version, untested, status, words) -> None:
    check = doctor.check_torch(version, untested=untested)
    assert (check.status, check.title) == (status, f"torch {version}{' ' + words if words else ''}")
    if status == doctor.FAIL:
        assert check.fix, check
    if status != doctor.OK and version[0].isdigit():
        assert f"tested: {_LOW[0]}.{_LOW[1]} to {_HIGH[0]}.{_HIGH[1]}" in check.detail


def test_doctor_judges_constructed_python_torch_and_wrapt_versions(monkeypatch) -> None:
    monkeypatch.delenv("AUTOWEAVE_UNTESTED_TORCH", raising=False)
    installed: dict[str, str | None] = {}
    monkeypatch.setattr(doctor, "_version", installed.get)

    def verdicts(python: tuple[int, int, int], torch_version: str | None, wrapt: str | None) -> list:
        installed.update(torch=torch_version, wrapt=wrapt)
        monkeypatch.setattr(doctor.sys, "version_info", _PythonVersion(python))
        return [(c.status, c.title) for c in doctor.check_versions()]

    tested = f"{_HIGH[0]}.{_HIGH[1]}.1"
    assert verdicts((3, 10, 0), tested, "1.14.0") == [
        (doctor.OK, "Python 3.10.0"),
        (doctor.OK, f"torch {tested}"),
        (doctor.OK, "wrapt 1.14.0"),
    ]
    assert verdicts((3, 9, 18), _OLDER, "1.13.3") == [
        (doctor.FAIL, "Python 3.9"),
        (doctor.FAIL, f"torch {_OLDER}"),
        (doctor.FAIL, "wrapt 1.13.3"),
    ]
    assert verdicts((3, 13, 1), _NEWER, "2.2.0") == [
        (doctor.OK, "Python 3.13.1"),
        (doctor.WARN, f"torch {_NEWER} (newer than tested)"),
        (doctor.FAIL, "wrapt 2.2.0"),  # the release with the descriptor bug
    ]
    assert [s for s, _ in verdicts((3, 12, 0), tested, "2.2.1")] == [doctor.OK] * 3
    assert [s for s, _ in verdicts((3, 11, 4), tested, "10.0")] == [doctor.OK] * 3
    assert verdicts((3, 11, 4), None, None)[1:] == [
        (doctor.FAIL, "torch is not installed"),
        (doctor.FAIL, "wrapt is not installed"),
    ]
    monkeypatch.setenv("AUTOWEAVE_UNTESTED_TORCH", "off")
    assert verdicts((3, 11, 4), _NEWER, "1.17.2")[1] == (doctor.FAIL, f"torch {_NEWER} (newer than tested)")


def test_doctor_with_the_start_up_shell_on_the_path_passes() -> None:
    env = _env()
    env["PYTHONPATH"] = str(ROOT / "sitecustomize")
    proc = subprocess.run(
        [sys.executable, "-m", "autoweave", "doctor"], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "live check: a fresh python with AUTOWEAVE=1 has torch.compile patched" in proc.stdout


class EmbeddedStack(nn.Module):
    """Embeddings in a ModuleList *before* the layers: the first container is not the blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.embeddings = nn.ModuleList([nn.Embedding(10, 8), nn.Embedding(10, 8)])
        self.layers = nn.ModuleList([Block(moe=False)] + [Block() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class Dense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(moe=False) for _ in range(2)])


FACTORY = "tests.test_cli:EmbeddedStack"


def _explain(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = cli.main(["explain", *args])
    out, err = capsys.readouterr()
    return status, out, err


def test_explain_picks_the_blocks_not_the_first_container(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = _explain(capsys, FACTORY)
    assert status == 0, err
    head, plan = out.split("\n", 1)
    assert "blocks: layers (ModuleList, 4 × Block)" in head
    assert plan.startswith("autoweave plan: 4 compiled modules, 3 woven\n")
    assert "embeddings" not in plan


def test_explain_blocks_option_names_the_container(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = _explain(capsys, FACTORY, "--blocks", "embeddings")
    assert status == 0, err
    assert "blocks: embeddings (ModuleList, 2 × Embedding)" in out
    assert "  embeddings.0-1 (2 × Embedding): no boundary inside" in out
    status, out, err = _explain(capsys, FACTORY, "--blocks", "layer")
    assert (status, out) == (2, "")
    assert "--blocks 'layer': EmbeddedStack has no submodule by that name" in err
    assert "embeddings, layers" in err


def test_explain_shard_matching_nothing_is_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = _explain(capsys, FACTORY, "--shard", "expert,moe")
    assert (status, out) == (2, "")
    assert "is named expert, moe" in err
    assert "names found in the blocks: norm, ffn, out, router, experts, shared" in err
    assert "Traceback" not in err
    # One good name and one typo is still a typo.
    status, _, err = _explain(capsys, FACTORY, "--shard", "experts,shraed")
    assert status == 2 and "is named shraed;" in err
    status, out, _ = _explain(capsys, FACTORY, "--shard", "")
    assert status == 0 and "FSDP units (simulated): none;" in out


def test_explain_default_shard_on_a_dense_model_says_none_found(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = _explain(capsys, "tests.test_cli:Dense")
    assert status == 0, err
    assert "FSDP units (simulated): experts (none found in the blocks)" in out
    assert "autoweave plan: 2 compiled modules, 0 woven" in out


def test_doctor_names_another_distribution_that_owns_the_autoweave_package(tmp_path) -> None:
    # PyPI's "autoweave" (an unrelated project) ships a top-level autoweave/ package too.
    info = tmp_path / "autoweave-0.1.4.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: autoweave\nVersion: 0.1.4\n")
    (info / "RECORD").write_text("autoweave/__init__.py,,\nautoweave-0.1.4.dist-info/METADATA,,\n")
    ours = tmp_path / "torch_autoweave-0.1.0.dist-info"
    ours.mkdir()
    (ours / "METADATA").write_text("Metadata-Version: 2.1\nName: torch-autoweave\nVersion: 0.1.0\n")
    (ours / "RECORD").write_text("autoweave/__init__.py,,\n")
    (check,) = doctor.check_other_distributions([str(tmp_path)])
    assert check.status == doctor.FAIL and "autoweave 0.1.4" in check.title
    assert check.fix == "pip uninstall autoweave && pip install --force-reinstall torch-autoweave"
    assert doctor.check_other_distributions([str(tmp_path / "nothing")]) == []


def test_doctor_live_fix_names_the_real_cause() -> None:
    reason = (
        "[unsupported-torch] torch 2.16.0 is newer than the newest tested (2.15) and lacks what autoweave "
        "needs: torch._x; staying off, torch runs unpatched. Install a tested torch (2.11 to 2.15) or unset AUTOWEAVE."
    )
    assert (
        doctor._live_fix({"off_reason": reason}, True)
        == "Install a tested torch (2.11 to 2.15) or unset AUTOWEAVE"
    )
    present = doctor._live_fix({}, True)
    assert "start-up file is present" in present and "install autoweave's start-up file" not in present
    assert "pip install torch-autoweave" in doctor._live_fix({}, False)
