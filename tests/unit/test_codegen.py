"""Code-object synthesis (``autoweave.weave.on_own_code``) on every Python this machine has.

The torch wheel here is for 3.11 only, so the other Pythons run the synthesis
alone (it is standard library only): a copy named after its region, with the
original's defaults, keyword defaults, closure and source lines.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest

CODEGEN = Path(__file__).resolve().parents[2] / "autoweave" / "weave" / "__init__.py"

PROBE = r"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("codegen", sys.argv[1])
codegen = importlib.util.module_from_spec(spec)
spec.loader.exec_module(codegen)

def outer():
    scale = 3
    def forward(self, x, y=2, *, z=5):
        return (x + y + z) * scale
    return forward

original = outer()
copy = codegen.on_own_code(original, "autoweave_Block_layers_0_7")
assert copy is not original and copy.__code__ is not original.__code__
assert copy.__name__ == copy.__qualname__ == copy.__code__.co_name == "autoweave_Block_layers_0_7"
if sys.version_info >= (3, 11):
    assert copy.__code__.co_qualname == "autoweave_Block_layers_0_7"
assert copy(None, 1) == original(None, 1) == 24
assert copy(None, 1, 0, z=0) == 3
assert copy.__code__.co_filename == original.__code__.co_filename
assert copy.__code__.co_firstlineno == original.__code__.co_firstlineno
assert original.__code__.co_name == "forward"
print("ok", sys.version_info[:2])
"""


def _pythons() -> list[str]:
    found = {sys.executable}
    for path in sorted(glob.glob("/root/.pyenv/versions/3.1[0-9]*/bin/python3")):
        if os.access(path, os.X_OK):
            found.add(path)
    return sorted(found)


@pytest.mark.parametrize("python", _pythons())
def test_code_synthesis_on_every_python(python: str) -> None:
    result = subprocess.run(
        [python, "-I", "-c", PROBE, str(CODEGEN)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok")
