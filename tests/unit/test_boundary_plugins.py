"""Boundary plug-ins: third-party packages name their boundary kinds under a published entry-point group."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch.nn as nn

from autoweave import _state
from autoweave.dispatch import plan_inputs
from autoweave.planning import boundaries


class Opaque(nn.Module):
    def forward(self, x):  # pragma: no cover - never called
        return x


def _install_plugin(root: Path, value: str) -> None:
    """A distribution on ``root`` declaring ``value`` under the ``autoweave.boundaries`` group."""
    (root / "awplugin.py").write_text(
        "def opaque(module):\n    return 'opaque kernel (plug-in)' if type(module).__name__ == 'Opaque' else None\n"
    )
    info = root / "awplugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: awplugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[autoweave.boundaries]\nopaque = {value}\n")


@pytest.fixture
def fresh_plugins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    monkeypatch.setattr(plan_inputs, "_plugins_loaded", False)
    monkeypatch.setattr(boundaries, "_predicates", [])
    monkeypatch.setattr(_state.run, "swallowed", {})
    monkeypatch.setattr(_state.run, "warned_keys", set())
    yield tmp_path
    sys.modules.pop("awplugin", None)


def test_the_entry_point_group_is_the_published_one() -> None:
    # Plug-ins in the wild name this group: a rename would drop them silently.
    assert boundaries.ENTRY_POINT_GROUP == "autoweave.boundaries"


def test_a_plugin_declared_under_the_group_classifies_modules(fresh_plugins: Path) -> None:
    _install_plugin(fresh_plugins, "awplugin:opaque")
    plan_inputs.load_boundary_plugins()  # before the first plan
    assert boundaries.classify(Opaque()) == "opaque kernel (plug-in)"
    assert boundaries.classify(nn.Linear(2, 2)) is None


@pytest.mark.fail_open
def test_a_plugin_that_fails_to_load_is_one_warning_and_planning_goes_on(
    fresh_plugins: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    _install_plugin(fresh_plugins, "awplugin:missing_function")
    plan_inputs.load_boundary_plugins()
    assert boundaries.classify(Opaque()) is None
    err = capfd.readouterr().err
    assert err.count("[boundary-plugin]") == 1 and "'opaque'" in err
    assert _state.run.swallowed == {"boundary-plugin": 1}
