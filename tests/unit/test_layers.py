"""The house has one direction: every module imports only modules below it.

``LAYERS`` is the order, written once, lowest first (README "How it works" tells
it in words). Every import counts, at module level or inside a function: a
lazy import of a higher module is a cycle waiting for its first caller. Only
imports under ``if TYPE_CHECKING:`` are free (they never run).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

LAYERS: tuple[tuple[str, ...], ...] = (
    # Start-up, standard library only: the post-import hooks (hooks named by string).
    ("_autoweave_start", "autoweave._importhook"),
    # Foundations, standard library only: settings, run-time state, logging, fail-open, torch names.
    (
        "autoweave._version",
        "autoweave._settings",
        "autoweave._state",
        "autoweave._codegen",
        "autoweave._instances",
        "autoweave._compat",
        "autoweave._log",
        "autoweave._torchlogs",
        "autoweave._failopen",
    ),
    # Reading torch: tree changes, source places, dynamo's signals, checkpoints in code, boundaries,
    # what pieces hold for backward.
    (
        "autoweave._changes",
        "autoweave._where",
        "autoweave.capture",
        "autoweave.checkpoints",
        "autoweave.boundaries",
        "autoweave.breaks",
        "autoweave.memory",
    ),
    # The decision, pure: a module tree in, a plan out.
    ("autoweave.planner",),
    # The side effects: installing a plan's compiled regions.
    ("autoweave.pieces", "autoweave.weave", "autoweave.decorated_checkpoints"),
    # Reporting, fed by callbacks: the plan summary, the structured trace, the run report.
    ("autoweave.plan_log", "autoweave._trace", "autoweave.report"),
    # Routing: the dispatcher, and the wrappers on torch that route calls to it.
    ("autoweave.runtime", "autoweave.patches"),
    # Wiring and entry points.
    (
        "autoweave._bootstrap",
        "autoweave.explainer",
        "autoweave.doctor",
        "autoweave._run",
        "autoweave",
        "autoweave.__main__",
    ),
)
ORDER = [name for layer in LAYERS for name in layer]


def _modules() -> dict[str, Path]:
    found = {"_autoweave_start": ROOT / "_autoweave_start.py"}
    for path in sorted((ROOT / "autoweave").glob("*.py")):
        found["autoweave" if path.stem == "__init__" else f"autoweave.{path.stem}"] = path
    return found


def _type_checking_only(tree: ast.Module) -> set[int]:
    """Ids of import nodes under ``if TYPE_CHECKING:``."""
    free: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for inner in node.body:
                for sub in ast.walk(inner):
                    free.add(id(sub))
    return free


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The project modules ``path`` imports anywhere (``from autoweave import x`` imports ``autoweave.x``)."""
    tree = ast.parse(path.read_text())
    free = _type_checking_only(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in free:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "autoweave":
                for alias in node.names:
                    sub = f"autoweave.{alias.name}"
                    found.add(sub if sub in known else "autoweave")
            elif node.module in known:
                found.add(node.module)
    return found


def test_every_module_has_a_place_in_the_order() -> None:
    assert sorted(_modules()) == sorted(ORDER), "place new modules in LAYERS"
    assert len(ORDER) == len(set(ORDER))


@pytest.mark.parametrize("module", ORDER)
def test_imports_run_one_way(module: str) -> None:
    known = set(ORDER)
    above = set(ORDER[ORDER.index(module) :])
    upward = sorted(imports_of(_modules()[module], known) & above - {module})
    assert not upward, f"{module} imports {upward}, which sit at or above it in LAYERS"


def test_the_checker_sees_lazy_and_from_imports(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "from autoweave import planner, _log\n"
        "def f():\n    from autoweave.runtime import x\n    import _autoweave_start\n"
        "TYPE_CHECKING = False\nif TYPE_CHECKING:\n    from autoweave import report\n"
    )
    assert imports_of(source, set(ORDER)) == {
        "autoweave.planner",
        "autoweave._log",
        "autoweave.runtime",
        "_autoweave_start",
    }


def test_importing_every_module_changes_nothing() -> None:
    # No side effects at import time: with AUTOWEAVE unset, importing the whole
    # package patches nothing, registers no hook, no exit handler, no listener.
    code = (
        "import atexit, sys, importlib\n"
        "import torch\n"
        "before = (torch.compile, torch.nn.Module.compile, list(sys.meta_path), atexit._ncallbacks())\n"
        f"for name in {ORDER!r}:\n"
        "    if name != 'autoweave.__main__':\n"
        "        importlib.import_module(name)\n"
        "import _autoweave_start\n"
        "from autoweave import patches, plan_log\n"
        "after = (torch.compile, torch.nn.Module.compile, list(sys.meta_path), atexit._ncallbacks())\n"
        "assert after == before, (before, after)\n"
        "assert not patches.applied() and not _autoweave_start._hooks, _autoweave_start._hooks\n"
        "assert not plan_log._listeners, plan_log._listeners\n"
        "print('clean')\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("AUTOWEAVE")}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "clean" in result.stdout, result.stderr[-2000:]
