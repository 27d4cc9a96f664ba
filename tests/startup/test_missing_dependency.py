"""A missing dependency is the environment's fault, not autoweave's: one clear message, then off.

Run from a checkout (``PYTHONPATH=<checkout>/sitecustomize``) in a real venv that
sees torch but not wrapt: ``import wrapt`` fails there exactly as it would where
wrapt was never installed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import venvs

_USE_TORCH = """
import types
import torch
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as cw
print("UNPATCHED", isinstance(torch.compile, types.FunctionType), isinstance(cw.checkpoint_wrapper, types.FunctionType))
model = torch.nn.Linear(2, 2)
print("RAN", tuple(model(torch.ones(1, 2)).shape))
"""


@pytest.fixture(scope="module")
def no_wrapt_venv(tmp_path_factory: pytest.TempPathFactory) -> venvs.Venv:
    return venvs.make_venv(tmp_path_factory.mktemp("no-wrapt") / "venv", without=("wrapt",))


def test_missing_wrapt_is_one_clear_message_and_autoweave_stays_off(no_wrapt_venv: venvs.Venv) -> None:
    probe = no_wrapt_venv.run(["-c", "import torch, wrapt"])
    assert "No module named 'wrapt'" in probe.stderr, probe.stderr  # the premise: torch yes, wrapt no
    env = venvs.child_env({"AUTOWEAVE": "1", "PYTHONPATH": str(venvs.REPO_ROOT / "sitecustomize")})
    proc = no_wrapt_venv.run(["-c", _USE_TORCH], env=env)
    assert proc.returncode == 0, proc.stderr
    assert "UNPATCHED True True" in proc.stdout and "RAN (1, 2)" in proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr  # once per process, though both hooks fired
    message = lines[0]
    assert message.startswith("autoweave: [missing-dependency]")
    assert "'wrapt'" in message and "pip install 'wrapt" in message and "staying off" in message
    assert "internal" not in message and "Traceback" not in proc.stderr


def test_doctor_names_the_missing_dependency(no_wrapt_venv: venvs.Venv) -> None:
    env = venvs.child_env({"PYTHONPATH": str(venvs.REPO_ROOT)})
    proc = no_wrapt_venv.run(["-m", "autoweave", "doctor", "--no-live"], env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL  wrapt is not installed" in proc.stdout
    assert "fix: pip install 'wrapt>=1.14,!=2.2.0'" in proc.stdout


def test_the_view_hides_only_what_it_was_asked_to(tmp_path: Path) -> None:
    view = venvs.site_view(tmp_path / "view", without=("wrapt",))
    names = {p.name for p in view.iterdir()}
    assert "torch" in names and not any(n.lower().startswith("wrapt") for n in names)
