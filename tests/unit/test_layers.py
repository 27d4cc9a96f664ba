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
    ("_autoweave_start",),
    # Foundations, at the package root, standard library only (``_compat`` imports torch lazily):
    # settings, run-time state, the install registry, what autoweave attaches to instances,
    # torch names, logging, dynamo's loggers, fail-open.
    (
        "autoweave._settings",
        "autoweave._state",
        "autoweave._installs",
        "autoweave._instances",
        # _compat, one module per concern; the package re-exports them all.
        "autoweave._compat.lookup",
        "autoweave._compat.modules",
        "autoweave._compat.checkpoints",
        "autoweave._compat.backends",
        "autoweave._compat.dynamo",
        "autoweave._compat.regions",
        "autoweave._compat.log_strings",
        "autoweave._compat.version",
        "autoweave._compat",
        "autoweave._log",
        # one tap per dynamo logger (under the fail-open guard, which listens to one)
        "autoweave._taps",
        "autoweave._failopen",
        "autoweave._events",
    ),
    # plan/: the decision. Reading the tree and the user's code (changes, source places,
    # checkpoints in code, boundaries, learned breaks, what pieces hold), what the run learned,
    # then the plan's data types, the tree read for one pass, the strategies and the planner's walk.
    (
        "autoweave.planning",
        "autoweave.planning.sources",
        "autoweave.planning.kinds",
        "autoweave.planning.wrappers",
        "autoweave.planning.boundaries",
        "autoweave.planning.checkpoint_calls",
        "autoweave.planning.learned",
        "autoweave.planning.plans",
        "autoweave.planning.planner",
    ),
    # weave/: the side effects, the only code that changes modules.
    (
        "autoweave.weave",
        "autoweave.weave.grad_none",
        "autoweave.weave.guarded_state",
        "autoweave.weave.pieces",
        "autoweave.weave.first_call_memory",
        "autoweave.weave.shared_kinds",
        "autoweave.weave.keep_checkpoint",
        "autoweave.weave.apply",
    ),
    # sense/: what the machine senses of dynamo and the model (counting, graph-break places and
    # TORCH_LOGS, a compiled module's name in its model), below the hot path that acts on it.
    (
        "autoweave.sense",
        "autoweave.sense.counting",
        "autoweave.sense.graph_breaks",
        "autoweave.sense.names",
    ),
    # dispatch/: the hot path. The tree watch, the context probe and the planner's inputs, dispatchers
    # behind compiled modules, the routes, the patches on torch.
    (
        "autoweave.dispatch",
        "autoweave.dispatch.tree_watch",
        "autoweave.dispatch.plan_inputs",
        "autoweave.dispatch.states",
        "autoweave.dispatch.first_call",
        "autoweave.dispatch.dispatchers",
        "autoweave.dispatch.routes",
        "autoweave.dispatch.patches",
    ),
    # observe/: what autoweave reports (the plan summary, the structured trace, the run report,
    # the exit report), on top of the hot path: it subscribes to ``_events``, which the hot path
    # publishes, and the hot path imports none of it.
    (
        "autoweave.observe",
        "autoweave.observe.summary",
        "autoweave.observe.trace",
        "autoweave.observe.report",
        "autoweave.observe.report_exit",
    ),
    # Wiring: start-up.
    ("autoweave.startup",),
    # Beside the runtime, which never imports them (only the entry points above do): the tools.
    (
        "autoweave.tools",
        "autoweave.tools.explainer",
        "autoweave.tools.doctor",
        "autoweave.tools.commands",
    ),
    # Entry points: the public API (``autoweave.explain`` calls the explainer), ``python -m autoweave``.
    ("autoweave", "autoweave.__main__"),
)
ORDER = [name for layer in LAYERS for name in layer]


def _modules() -> dict[str, Path]:
    found = {"_autoweave_start": ROOT / "_autoweave_start.py"}
    for path in sorted((ROOT / "autoweave").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
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
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module in known:
            # ``from autoweave.planning import planner`` imports autoweave.planning.planner (and the
            # package's empty __init__, which sits first in its layer).
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
    return found


def _layer_of(module: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if module in layer)


def test_each_folder_is_one_layer() -> None:
    # The tree shows the architecture: every module of a subpackage sits in that
    # subpackage's layer, and the layers run root foundations -> plan -> weave ->
    # sense -> dispatch -> observe (reporting) -> entry points.
    folders = ("planning", "weave", "sense", "dispatch", "observe")
    layers = []
    for folder in folders:
        members = {
            name for name in ORDER if name.startswith(f"autoweave.{folder}.") or name == f"autoweave.{folder}"
        }
        assert {_layer_of(name) for name in members} == {_layer_of(f"autoweave.{folder}")}, folder
        layers.append(_layer_of(f"autoweave.{folder}"))
    assert layers == sorted(layers) and _layer_of("autoweave._compat") < layers[0] < layers[-1] < _layer_of(
        "autoweave.tools"
    )


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
        "from autoweave.planning import planner\nfrom autoweave import _log\n"
        "def f():\n    from autoweave.dispatch.dispatchers import x\n    import _autoweave_start\n"
        "TYPE_CHECKING = False\nif TYPE_CHECKING:\n    from autoweave.observe import report\n"
    )
    assert imports_of(source, set(ORDER)) == {
        "autoweave.planning.planner",
        "autoweave._log",
        "autoweave.dispatch.dispatchers",
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
        "from autoweave.dispatch import patches\nfrom autoweave import _events\n"
        "after = (torch.compile, torch.nn.Module.compile, list(sys.meta_path), atexit._ncallbacks())\n"
        "assert after == before, (before, after)\n"
        "assert not patches.applied() and not _autoweave_start._hooks, _autoweave_start._hooks\n"
        "assert not any(_events._listeners.values()), _events._listeners\n"
        # A subpackage named like a public function would replace it on import (autoweave.plan).
        "import autoweave, types\n"
        "shadowed = [n for n in autoweave.__all__ if isinstance(getattr(autoweave, n), types.ModuleType)]\n"
        "assert not shadowed, shadowed\n"
        "print('clean')\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("AUTOWEAVE")}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "clean" in result.stdout, result.stderr[-2000:]


# -- package-level contracts ------------------------------------------------------------------

# Private attributes of torch's modules and wrappers: read and written in _compat only, so a
# torch that renames one breaks one module, which names the torch range and the upstream fix.
PRIVATE_TORCH_ATTRS = {
    "_orig_mod",
    "_compiled_call_impl",
    "_checkpoint_wrapped_module",
    "_fsdp_wrapped_module",
    "_call_impl",
    "_modules",
    "_parameters",
    "_buffers",
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_get_name",
    # a tensor's version counter; where dynamo's fx nodes keep what they compute; what a
    # CheckpointWrapper runs; what a compile callback is told
    "_version",
    "example_value",
    "checkpoint_impl",
    "callback_trigger",
    "compile_id",
    # torch._logging._internal's, which TORCH_LOGS handling borrows
    "_is_torch_handler",
    "_setup_handlers",
    "_StderrHandler",
}
# _autoweave_start names checkpoint_wrapper's private module path as a string: start-up may
# not import _compat (it costs every process); _compat.modules.CHECKPOINT_WRAPPER_MODULE is the same.
_PRIVATE_NAME_EXEMPT = {name for name in ORDER if name.startswith("autoweave._compat")} | {"_autoweave_start"}


def _is_private_torch_path(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] == "torch" and any(
        part.startswith("_") and not part.startswith("__") for part in parts[1:]
    )


def private_torch_names(path: Path) -> list[str]:
    """Where ``path`` touches a private torch name: ``file:line name``."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Attribute) and node.attr in PRIVATE_TORCH_ATTRS:
            name = node.attr
        elif (
            isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch"
        ):
            name = (
                f"torch.{node.attr}" if node.attr.startswith("_") and not node.attr.startswith("__") else None
            )
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in PRIVATE_TORCH_ATTRS or _is_private_torch_path(node.value):
                name = repr(node.value)
        elif isinstance(node, ast.ImportFrom) and node.module and _is_private_torch_path(node.module):
            name = f"from {node.module}"
        elif isinstance(node, ast.Import):
            name = next((a.name for a in node.names if _is_private_torch_path(a.name)), None)
        if name is not None:
            found.append(f"{path.name}:{node.lineno} {name}")
    return found


@pytest.mark.parametrize("module", [m for m in ORDER if m not in _PRIVATE_NAME_EXEMPT])
def test_only_compat_touches_a_private_torch_name(module: str) -> None:
    found = private_torch_names(_modules()[module])
    assert not found, f"{module} names private torch names; move them into autoweave/_compat/: {found}"


def test_the_private_name_check_sees_attributes_strings_and_imports(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "import torch._dynamo\nfrom torch._dynamo.utils import counters\n"
        "def f(m):\n    return m._orig_mod, getattr(m, '_modules'), torch._C, 'torch.distributed._x'\n"
        "def g(m):\n    return m.forward, 'torch.nn', torch.nn\n"
    )
    assert sorted(entry.split(" ", 1)[1] for entry in private_torch_names(source)) == sorted(
        [
            "torch._dynamo",
            "from torch._dynamo.utils",
            "_orig_mod",
            "'_modules'",
            "torch._C",
            "'torch.distributed._x'",
        ]
    )


def test_only_patches_assigns_to_a_torch_attribute() -> None:
    # ``torch.x = ...`` (or deeper: torch._dynamo.config.x = ...) changes torch for everyone:
    # the install registry in dispatch/patches does it, with the undo.
    offenders = []
    for module, path in _modules().items():
        if module == "autoweave.dispatch.patches" or module in _PRIVATE_NAME_EXEMPT:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for target in targets:
                root = target
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(target, ast.Attribute) and isinstance(root, ast.Name) and root.id == "torch":
                    offenders.append(f"{module}:{node.lineno}")
    assert not offenders, offenders


# What ``setattr`` may change outside ``_installs.patch`` (the one way autoweave patches torch and
# logging, with its undo): autoweave's own functions and dispatcher (named so below), and the
# compiled-call slot of a module the user compiled, which torch.compile itself sets.
_OWN_OBJECTS = {"self", "forward", "wrapper", "in_order", "fn", "module"}


def test_only_the_patch_primitive_sets_attributes_on_objects_not_autoweaves() -> None:
    offenders = []
    for module, path in _modules().items():
        if module == "autoweave._installs" or module.startswith("autoweave.tools"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("setattr", "delattr")
                and not (isinstance(node.args[0], ast.Name) and node.args[0].id in _OWN_OBJECTS)
            ):
                offenders.append(f"{module}:{node.lineno}")
    assert not offenders, f"patch through autoweave._installs.patch: {offenders}"


# What start-up imports before torch (``startup``, and the patch registry that start-up hooks and
# their tests reach for before ``import torch``) imports no torch: torch's import would fire
# autoweave's own post-import hook while these modules are half-initialized (a merge of the
# routes into ``patches`` did that: "partially initialized module ... apply_torch").
@pytest.mark.parametrize(
    "module", ["autoweave.startup", "autoweave.dispatch.patches", "autoweave.observe.report_exit"]
)
def test_what_start_up_imports_before_torch_imports_no_torch(module: str) -> None:
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False", out.stderr
