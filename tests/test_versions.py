"""torch versions: pip never caps them; the start-up check and ``doctor`` agree.

A torch older than tested turns autoweave off; one newer than tested is checked
name by name (``_compat.version.self_check``): on with one notice when everything is
there, off naming what is missing otherwise, off outright with
``AUTOWEAVE_UNTESTED_TORCH=off``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from autoweave import _compat
from autoweave._compat import version
from autoweave.tools import doctor

ROOT = Path(__file__).resolve().parents[1]
LOW, HIGH = _compat.version.TESTED_TORCH
NEWER = f"{HIGH[0]}.{HIGH[1] + 1}.0"
OLDER = f"{LOW[0]}.{LOW[1] - 1}.0"


def _torch_requirement() -> str:
    # Not tomllib: it is 3.11+, and the tests run on 3.10 too.
    text = (ROOT / "pyproject.toml").read_text()
    dependencies = text.split("\ndependencies = [", 1)[1].split("\n]", 1)[0]
    (requirement,) = re.findall(r'^\s*"(torch\b[^"]*)"', dependencies, flags=re.M)
    return requirement


def test_pyproject_sets_no_torch_upper_bound() -> None:
    # A newer torch must not make pip downgrade the user's (or refuse); the start-up check decides.
    assert _torch_requirement().replace(" ", "") == f"torch>={LOW[0]}.{LOW[1]}"


def test_torch_2_15_is_tested() -> None:
    assert (
        _compat.version.torch_support("2.15.0+cu132").on
        and not _compat.version.torch_support("2.15.0").untested
    )


def test_an_older_torch_is_off_and_a_newer_one_is_decided_by_the_self_check() -> None:
    old = _compat.version.torch_support(OLDER)
    assert not old.on and "not supported" in old.message and f"{LOW[0]}.{LOW[1]}" in old.message
    fine = _compat.version.torch_support(NEWER, check=list)
    assert fine.on and fine.untested and "newer than the newest tested" in fine.message
    broken = _compat.version.torch_support(NEWER, check=lambda: ["torch._dynamo.eval_frame.OptimizedModule"])
    assert not broken.on and broken.missing == ("torch._dynamo.eval_frame.OptimizedModule",)
    assert "lacks what autoweave needs: torch._dynamo.eval_frame.OptimizedModule" in broken.message
    strict = _compat.version.torch_support(NEWER, untested="off", check=list)
    assert not strict.on and "AUTOWEAVE_UNTESTED_TORCH=off" in strict.message


def test_the_self_check_finds_everything_on_this_torch_and_names_what_is_missing(monkeypatch) -> None:
    assert _compat.version.self_check() == []
    needs = version._needs()
    monkeypatch.setattr(
        version,
        "_needs",
        lambda: (*needs, ("torch._no_such_name", lambda: _compat.lookup.find("torch._no_such_name"))),
    )
    assert _compat.version.self_check() == ["torch._no_such_name"]


def test_doctor_and_start_up_check_agree_on_torch_versions() -> None:
    old = doctor.check_torch(OLDER, untested="check")
    assert old.status == doctor.FAIL and old.title == f"torch {OLDER}" and "<" in old.fix
    new = doctor.check_torch(NEWER, untested="check")
    assert new.status == doctor.WARN and "newer than tested" in new.title
    strict = doctor.check_torch(NEWER, untested="off")
    assert strict.status == doctor.FAIL and "AUTOWEAVE_UNTESTED_TORCH" in strict.fix
    assert doctor.check_torch(f"{HIGH[0]}.{HIGH[1]}.3", untested="check").status == doctor.OK
    assert doctor.check_torch(None).fix.startswith("pip install 'torch>=")


# The hooks as torch's import would call them, on the real torch with its version faked.
_FAKE_VERSION = """
import os
import torch
torch.__version__ = "{version}"
os.environ["AUTOWEAVE"] = "1"  # after torch's import: the start-up file's hooks saw nothing
from autoweave import _compat, _settings, startup
_settings.reload()
{missing}
startup._on_torch_import(torch)
import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as cw
startup._on_checkpoint_wrapper_import(cw)
from autoweave.dispatch import patches
print("OFF", startup.off_reason() is not None, "PATCHED", sorted(patches.applied()))
"""
_MISSING = """
from autoweave._compat import version
needs = version._needs
version._needs = lambda: (*needs(), ("torch._dynamo.no_such_hook", lambda: _compat.lookup.find("torch._dynamo.no_such_hook")))
"""


def _run(version: str, *, missing: bool = False, **env_extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOWEAVE") and k != "RANK"}
    env.update(PYTHONPATH=str(ROOT), **env_extra)
    code = _FAKE_VERSION.replace("{version}", version).replace("{missing}", _MISSING if missing else "")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc


def _autoweave_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("autoweave")]


@pytest.mark.slow
def test_a_newer_torch_with_everything_in_place_turns_on_with_one_notice() -> None:
    proc = _run(NEWER)
    assert "OFF False PATCHED ['checkpoint_wrapper', 'compile', 'module_compile']" in proc.stdout, proc.stderr
    (line,) = _autoweave_lines(proc)  # once, though two hooks fired
    assert line.startswith(f"autoweave: [untested-torch] torch {NEWER} is newer than the newest tested")


@pytest.mark.slow
def test_a_newer_torch_missing_a_name_stays_off_naming_it() -> None:
    proc = _run(NEWER, missing=True)
    assert "OFF True PATCHED []" in proc.stdout, proc.stderr
    (line,) = _autoweave_lines(proc)
    assert line.startswith(f"autoweave: [unsupported-torch] torch {NEWER} is newer than the newest tested")
    assert "lacks what autoweave needs: torch._dynamo.no_such_hook;" in line and "internal" not in line


@pytest.mark.slow
def test_untested_torch_off_keeps_the_strict_behaviour_and_ranks_other_than_0_stay_quiet() -> None:
    proc = _run(NEWER, AUTOWEAVE_UNTESTED_TORCH="off")
    assert "OFF True PATCHED []" in proc.stdout
    (line,) = _autoweave_lines(proc)
    assert "AUTOWEAVE_UNTESTED_TORCH=off" in line
    quiet = _run(NEWER, RANK="1")
    assert "OFF False" in quiet.stdout and _autoweave_lines(quiet) == []


@pytest.mark.slow
def test_an_older_torch_at_start_up_is_a_clear_message_not_an_internal_error() -> None:
    proc = _run(OLDER)
    assert "OFF True PATCHED []" in proc.stdout
    (line,) = _autoweave_lines(proc)
    assert line.startswith(f"autoweave: [unsupported-torch] torch {OLDER} is not supported")
    assert f"{HIGH[0]}.{HIGH[1]}" in line and "internal" not in line
