"""The torch names ``_compat`` needs are one registry: what the code looks up is what a newer torch is checked for.

Each ``_compat`` module declares a name where it uses it (``lookup.need``) and
looks it up through the declared constant; ``version.self_check`` probes the
required rows. The source scan below keeps a name from being used without being
declared (the drift that left names unchecked before).
"""

from __future__ import annotations

import ast
import dataclasses
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from autoweave._compat import lookup, version

ROOT = Path(__file__).resolve().parents[2]
COMPAT = ROOT / "autoweave" / "_compat"
TORCH_PATH = re.compile(r"^torch(\.[A-Za-z_][A-Za-z0-9_]*)+$")
DECLARE = {"need", "need_any", "need_source"}
LOOK_UP = {"find", "find_optional"}

# What ``version._needs()`` checked before the registry, copied once: none may be dropped.
CHECKED_BEFORE = (
    "torch._dynamo.eval_frame.OptimizedModule",
    "OptimizedModule._orig_mod/dynamo_ctx",
    "torch.nn.Module._compiled_call_impl",
    "dynamo's inline hook '_torchdynamo_inline'",
    "torch.nn.Module._forward_pre_hooks/_forward_hooks",
    "CheckpointWrapper",
    "CheckpointWrapper._checkpoint_wrapped_module/checkpoint_fn",
    "torch._higher_order_ops.wrap.tag_activation_checkpoint",
    "the checkpoint operator's '_checkpoint_context_fn' key",
    "the recompute hook's 'target_frame_ref'",
    "torch._dynamo.exc.Unsupported",
    "torch._dynamo.disable",
    "torch._dynamo.reset_code",
    "torch._dynamo.utils.counters",
    "dynamo's 'build_guards' timing",
    "torch._dynamo.utils.compilation_time_metrics",
    "torch._dynamo.backends.registry.lookup_backend",
    "torch._TorchCompileInductorWrapper",
    "torch._TorchCompileWrapper",
    "torch._dynamo.callback.callback_handler",
    "torch._dynamo.convert_frame._compile(code, ...)",
    "torch._dynamo.output_graph.OutputGraph.call_user_compiler(self, gm, example_inputs)",
    "torch.nn.modules.module.register_module_module_registration_hook",
    "FSDP2's FSDPState.init/_pre_forward/_post_forward",
    "torch._logging._internal (log registry)",
    "dynamo's fallback message 'fall back to eager-mode PyTorch'",
    "dynamo's recompile-limit message 'hit config.'",
    "dynamo's graph_breaks log artifact",
    "torch._dynamo.config.suppress_errors",
    "torch._dynamo.config.skip_nnmodule_hook_guards",
    "dynamo's per-error 'frame_exec_strategy'",
    "torch._dynamo.convert_frame.ConvertFrame.__call__(frame, ...)",
    "dynamo's suppressed-error message \"WON'T CONVERT\"",
    "torch._C._dynamo.eval_frame.set_code_exec_strategy",
)


def _required() -> list[lookup.Need]:
    return [row for row in lookup.NEEDS if row.required]


def test_this_torch_has_everything_required_and_checking_prints_nothing(capsys) -> None:
    assert version.self_check() == []
    assert [row.what for row in _required() if not row.probe()] == []
    assert capsys.readouterr() == ("", "")


def test_nothing_checked_before_is_dropped_or_made_optional() -> None:
    assert set(CHECKED_BEFORE) <= {row.what for row in _required()}


def _called(node: ast.Call) -> str | None:
    func = node.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def undeclared_paths(source: str) -> list[str]:
    """Torch paths in ``source`` outside a declaring call, and lookups of a literal path: ``line: text``."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    declared: set[int] = set()
    found = []
    for call in (node for node in ast.walk(tree) if isinstance(node, ast.Call)):
        arguments = [*call.args, *(keyword.value for keyword in call.keywords)]
        if _called(call) in DECLARE:
            declared.update(id(inner) for argument in arguments for inner in ast.walk(argument))
        elif _called(call) in LOOK_UP:
            literal = (ast.Constant, ast.JoinedStr)
            for argument in arguments:
                if isinstance(argument, literal) or (
                    isinstance(argument, ast.Starred) and isinstance(argument.value, literal)
                ):
                    found.append(f"{call.lineno}: {_called(call)}({ast.unparse(argument)})")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and TORCH_PATH.match(node.value)
            and id(node) not in docstrings | declared
        ):
            found.append(f"{node.lineno}: {node.value!r}")
    return found


@pytest.mark.parametrize("path", sorted(p for p in COMPAT.glob("*.py") if p.name != "lookup.py"), ids=str)
def test_every_torch_path_in_compat_is_declared_where_it_is_written(path: Path) -> None:
    found = undeclared_paths(path.read_text())
    assert not found, f"{path.name}: declare these with lookup.need and look them up by the constant: {found}"


def test_every_declaring_module_is_imported_before_the_check() -> None:
    declaring = {
        path.stem
        for path in COMPAT.glob("*.py")
        if path.name != "lookup.py"
        and any(
            isinstance(node, ast.Call) and _called(node) in DECLARE
            for node in ast.walk(ast.parse(path.read_text()))
        )
    }
    assert declaring == {module.__name__.rpartition(".")[2] for module in version.DECLARING}


def test_the_scan_sees_a_literal_lookup_and_an_undeclared_path() -> None:
    source = (
        '"""torch.in.a.docstring"""\n'
        '_A = need("torch._dynamo.utils.counters")\n'
        'need_source("x", "torch._dynamo.exc", "needle")\n'
        "def f():\n"
        '    """torch.docstring.too"""\n'
        '    return find(_A), find_optional("torch._dynamo.types"), find(f"{_A}.x"), "torch.nn.Module"\n'
    )
    assert sorted(undeclared_paths(source)) == [
        "6: 'torch._dynamo.types'",
        "6: 'torch.nn.Module'",
        "6: find(f'{_A}.x')",
        "6: find_optional('torch._dynamo.types')",
    ]


def _raises() -> bool:
    raise RuntimeError("a changed signature")


def test_a_probe_that_raises_counts_as_missing() -> None:
    required = next(row for row in lookup.NEEDS if row.required)
    optional = next(row for row in lookup.NEEDS if not row.required)
    rows = list(lookup.NEEDS)
    try:  # in place: ``version`` holds the list itself
        for row in (required, optional):
            lookup.NEEDS[rows.index(row)] = dataclasses.replace(row, probe=_raises)
        assert version.self_check() == [required.what]
        assert optional.what in version.optional_missing()
    finally:
        lookup.NEEDS[:] = rows
    assert version.self_check() == []


def test_what_a_newer_torch_lacks_of_the_optional_names_is_logged_at_debug(monkeypatch) -> None:
    monkeypatch.setattr(version, "_self_check_once", lambda: ())
    monkeypatch.setattr(version, "_optional_missing_once", lambda: ("torch._dynamo.no_such_name",))
    log = logging.getLogger("autoweave")
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append  # type: ignore[method-assign]
    level = log.level
    log.setLevel(logging.DEBUG)  # setLevel, not the attribute: it clears isEnabledFor's cache
    log.addHandler(handler)
    try:
        high = version.TESTED_TORCH[1]
        assert version.torch_support(f"{high[0]}.{high[1] + 1}.0").on
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    assert [r.levelno for r in records] == [logging.DEBUG]
    assert "torch._dynamo.no_such_name" in records[0].getMessage()


def test_declaring_imports_neither_dynamo_nor_runs_a_probe() -> None:
    code = (
        "import sys, torch\n"
        "from autoweave._compat import lookup, version\n"
        "assert len(lookup.NEEDS) > 40, len(lookup.NEEDS)\n"
        "assert not [m for m in sys.modules if m.startswith('torch._dynamo')], 'dynamo imported'\n"
        "print('lazy')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and "lazy" in result.stdout, result.stderr[-2000:]
