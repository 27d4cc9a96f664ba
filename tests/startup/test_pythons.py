"""The start-up path on every other CPython this machine has (3.10+), without torch.

``requires-python`` says 3.10+, but torch (and so the rest of the suite) runs on
one Python here. What runs in *every* process, torch or not, must work on all of
them: the ``.pth`` line, ``_autoweave_start``, the settings reader, the
bootstrap, the checkout's ``sitecustomize`` shell and ``doctor``. Every module
must at least compile. Pythons are found under pyenv; none found, nothing runs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import venvs

ROOT = venvs.REPO_ROOT
PYENV = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"


def _other_pythons() -> list[Path]:
    found = []
    for directory in sorted(PYENV.glob("3.*")) if PYENV.is_dir() else []:
        match = re.match(r"3\.(\d+)\.\d+$", directory.name)
        python = directory / "bin" / "python3"
        if match and int(match.group(1)) >= 10 and python.is_file():
            if int(match.group(1)) != sys.version_info.minor:
                found.append(python)
    return found


PYTHONS = _other_pythons()
pytestmark = pytest.mark.skipif(not PYTHONS, reason=f"no other CPython 3.10+ under {PYENV}")


def _run(python: Path, code: str, tmp: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(python), "-c", code],
        env=venvs.child_env({"PYTHONDONTWRITEBYTECODE": "1", **env}),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp,
    )


_COMPILE_ALL = """
import pathlib, py_compile, sys
root, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
files = [*sorted((root / "autoweave").rglob("*.py")), root / "_autoweave_start.py", root / "sitecustomize" / "sitecustomize.py"]
for f in files:
    py_compile.compile(str(f), cfile=str(out / (f.name + "c")), doraise=True)
print("COMPILED", len(files))
"""

_VIA_PTH = """
import site, sys
site.addsitedir(sys.argv[1])  # processes autoweave.pth as Python's start-up would
import _autoweave_start
from autoweave._settings import Settings
from autoweave import _settings, startup
import autoweave
settings = Settings.from_environ({"AUTOWEAVE": "1", "AUTOWEAVE_MODE": "always", "AUTOWEAVE_REPORT": "r{rank}.json"})
assert settings.enabled and settings.mode == "always" and not settings.problems, settings
assert _settings.current().enabled and autoweave.__version__
assert _autoweave_start.registered("torch") and "torch" not in sys.modules and "wrapt" not in sys.modules
print("STARTED")
"""

_UNUSUAL = """
import site, sys
site.addsitedir(sys.argv[1])
import _autoweave_start
from autoweave import _settings, startup
assert not _settings.current().enabled and not _autoweave_start.registered("torch")
print("OFF")
"""

_VIA_SHELL = """
import sys, _autoweave_start
assert _autoweave_start.registered("torch") and "torch" not in sys.modules
print("STARTED", sys.modules["sitecustomize"].__file__)
"""


@pytest.mark.parametrize("python", PYTHONS, ids=[p.parent.parent.name for p in PYTHONS])
def test_start_up_path_works_without_torch(python: Path, tmp_path: Path) -> None:
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "autoweave.pth").write_text((ROOT / "autoweave.pth").read_text())
    out = tmp_path / "pyc"
    out.mkdir()
    code = _COMPILE_ALL.replace("sys.argv[1]", repr(str(ROOT))).replace("sys.argv[2]", repr(str(out)))
    proc = _run(python, code, tmp_path)
    assert proc.returncode == 0 and "COMPILED" in proc.stdout, proc.stderr

    proc = _run(python, "import torch", tmp_path)
    assert proc.returncode != 0, "this test means a Python without torch"

    code = _VIA_PTH.replace("sys.argv[1]", repr(str(tmp_path / "site")))
    proc = _run(python, code, tmp_path, AUTOWEAVE="1", PYTHONPATH=str(ROOT))
    assert proc.returncode == 0 and "STARTED" in proc.stdout and proc.stderr == "", proc.stderr

    # An unusual value goes through the full settings reader and bootstrap, is explained, stays off.
    code = _UNUSUAL.replace("sys.argv[1]", repr(str(tmp_path / "site")))
    proc = _run(python, code, tmp_path, AUTOWEAVE="maybe", PYTHONPATH=str(ROOT))
    assert proc.returncode == 0 and "OFF" in proc.stdout, proc.stderr
    assert "AUTOWEAVE='maybe' not understood" in proc.stderr and "Traceback" not in proc.stderr

    shell = str(ROOT / "sitecustomize")
    proc = _run(python, _VIA_SHELL, tmp_path, AUTOWEAVE="1", PYTHONPATH=shell)
    assert proc.returncode == 0 and f"STARTED {shell}" in proc.stdout and proc.stderr == "", proc.stderr

    proc = subprocess.run(
        [str(python), "-m", "autoweave", "doctor", "--no-live"],
        env=venvs.child_env({"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(ROOT)}),
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert f"ok    Python {python.parent.parent.name}" in proc.stdout
    assert "FAIL  torch is not installed" in proc.stdout
