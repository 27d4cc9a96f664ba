"""torch versions: pip never caps them; the start-up check and ``doctor`` agree on the range."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from autoweave import _compat, doctor

ROOT = Path(__file__).resolve().parents[1]


def _torch_requirement() -> str:
    # Not tomllib: it is 3.11+, and the tests run on 3.10 too.
    text = (ROOT / "pyproject.toml").read_text()
    dependencies = text.split("\ndependencies = [", 1)[1].split("\n]", 1)[0]
    (requirement,) = re.findall(r'^\s*"(torch\b[^"]*)"', dependencies, flags=re.M)
    return requirement


def test_pyproject_sets_no_torch_upper_bound() -> None:
    low = _compat.SUPPORTED_TORCH[0]
    # A newer torch must not make pip downgrade the user's (or refuse); the start-up check decides.
    assert _torch_requirement().replace(" ", "") == f"torch>={low[0]}.{low[1]}"


def test_doctor_and_start_up_check_agree_on_a_torch_too_new() -> None:
    high = _compat.SUPPORTED_TORCH[1]
    newer = f"{high[0]}.{high[1] + 1}.0"
    check = doctor.check_torch(newer)
    assert check.status == doctor.FAIL and check.title == f"torch {newer}"
    assert f"to {high[0]}.{high[1]}" in check.detail and "<" in check.fix
    assert doctor.check_torch(f"{high[0]}.{high[1]}.3").status == doctor.OK
    assert doctor.check_torch(None).fix.startswith("pip install 'torch>=")


_FAKE_TORCH = """
import types
from autoweave import _bootstrap
fake = types.ModuleType("torch")
fake.__version__ = "{version}"
_bootstrap._on_torch_import(fake)
_bootstrap._on_checkpoint_wrapper_import(types.ModuleType("checkpoint_wrapper"))
print("OFF", _bootstrap.off_reason() is not None)
"""


def test_unsupported_torch_at_start_up_is_a_clear_message_not_an_internal_error() -> None:
    # The hook as torch's import would call it, on a torch newer than the supported range.
    high = _compat.SUPPORTED_TORCH[1]
    newer = f"{high[0]}.{high[1] + 1}.0"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOWEAVE")}
    env.update(PYTHONPATH=str(ROOT), AUTOWEAVE="1")
    code = _FAKE_TORCH.replace("{version}", newer)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "OFF True" in proc.stdout, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr  # once, though two hooks fired
    assert lines[0].startswith(f"autoweave: [unsupported-torch] torch {newer} is not supported")
    assert f"{high[0]}.{high[1]}" in lines[0] and "internal" not in lines[0]
