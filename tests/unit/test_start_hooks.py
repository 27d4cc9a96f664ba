"""The post-import hooks run inside the user's import: a failing hook never fails the import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_PROBE = """
import sys, types
sys.path.insert(0, {root!r})
import _autoweave_start as start
def boom(module):
    raise RuntimeError("hook exploded")
start.register("types", boom)  # imported already: it fires at once
start.register("colorsys", boom)
import colorsys  # the user's import
print("imported", colorsys.__name__)
"""


def _run(**env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-I", "-c", _PROBE.format(root=str(ROOT))],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", **env},
    )


def test_a_failing_hook_warns_and_the_import_goes_on() -> None:
    proc = _run()
    assert proc.returncode == 0, proc.stderr
    assert "imported colorsys" in proc.stdout
    assert proc.stderr.count("[startup-failed] a hook on") == 2 and "hook exploded" in proc.stderr


def test_in_strict_mode_a_failing_hook_raises() -> None:
    proc = _run(AUTOWEAVE_STRICT="1")
    assert proc.returncode != 0 and "hook exploded" in proc.stderr
