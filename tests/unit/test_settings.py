"""``autoweave._settings``: every accepted and rejected value of every variable."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from autoweave import _settings
from autoweave._settings import Settings

REPO_ROOT = Path(__file__).resolve().parents[2]

TRUE = ["1", "true", "yes", "on", "TRUE", "Yes", " on ", "On\n"]
FALSE = ["", "0", "false", "no", "off", "FALSE", " No ", "\toff"]
BAD_FLAGS = ["maybe", "2", "-1", "y", "n", "enable", "tru", "1 1", "on,off"]


def parse(**env: str) -> Settings:
    return Settings.from_environ(env)


def assert_problem_names(problem: str, variable: str, accepted: tuple[str, ...] | list[str]) -> None:
    assert problem.startswith(f"{variable}=") or problem.startswith(f"{variable} "), problem
    listed = problem.split("accepted:", 1)[1].split(")", 1)[0]
    assert [a.strip() for a in listed.split(",")] == [a for a in accepted if a], problem


def test_defaults() -> None:
    s = Settings.from_environ({})
    assert s == Settings()
    assert (s.enabled, s.disabled_patches, s.log_level, s.strict, s.mode, s.strategy, s.problems) == (
        False,
        frozenset(),
        None,
        False,
        "auto",
        "auto",
        (),
    )


def test_ignores_unrelated_variables() -> None:
    assert Settings.from_environ({"PATH": "/bin", "AUTOWEAVEX": "1", "autoweave": "1"}) == Settings()


@pytest.mark.parametrize("value", TRUE)
def test_autoweave_on(value: str) -> None:
    s = parse(AUTOWEAVE=value)
    assert s.enabled and s.problems == ()


@pytest.mark.parametrize("value", FALSE)
def test_autoweave_off(value: str) -> None:
    s = parse(AUTOWEAVE=value)
    assert not s.enabled and s.problems == ()


@pytest.mark.parametrize("variable", ["AUTOWEAVE", "AUTOWEAVE_DISABLE", "AUTOWEAVE_STRICT"])
@pytest.mark.parametrize("value", BAD_FLAGS)
def test_invalid_flag_names_variable_and_accepted_values(variable: str, value: str) -> None:
    s = parse(**{variable: value})
    assert s == Settings(problems=s.problems)  # every field at its default
    assert len(s.problems) == 1
    problem = s.problems[0]
    assert repr(value) in problem
    assert_problem_names(problem, variable, ["1", "true", "yes", "on", "0", "false", "no", "off"])
    assert problem.endswith("using off")


@pytest.mark.parametrize("value", TRUE)
def test_strict(value: str) -> None:
    assert parse(AUTOWEAVE_STRICT=value).strict
    assert not parse(AUTOWEAVE_STRICT="0").strict


@pytest.mark.parametrize("on", TRUE)
@pytest.mark.parametrize("off", TRUE)
def test_disable_wins(on: str, off: str) -> None:
    s = parse(AUTOWEAVE=on, AUTOWEAVE_DISABLE=off)
    assert not s.enabled and s.problems == ()


@pytest.mark.parametrize("value", FALSE)
def test_disable_off_leaves_autoweave_on(value: str) -> None:
    assert parse(AUTOWEAVE="1", AUTOWEAVE_DISABLE=value).enabled


def test_disable_invalid_is_reported_and_does_not_disable() -> None:
    s = parse(AUTOWEAVE="1", AUTOWEAVE_DISABLE="perhaps")
    assert s.enabled
    assert len(s.problems) == 1 and s.problems[0].startswith("AUTOWEAVE_DISABLE=")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("compile", {"compile"}),
        ("module_compile", {"module_compile"}),
        ("module-compile", {"module_compile"}),
        ("checkpoint_wrapper", {"checkpoint_wrapper"}),
        ("Checkpoint-Wrapper", {"checkpoint_wrapper"}),
        ("compile,module_compile,checkpoint_wrapper", {"compile", "module_compile", "checkpoint_wrapper"}),
        (" compile , , checkpoint_wrapper ,", {"compile", "checkpoint_wrapper"}),
        ("compile,compile", {"compile"}),
        ("", set()),
        (" , ", set()),
    ],
)
def test_disabled_patches(value: str, expected: set[str]) -> None:
    s = parse(AUTOWEAVE_DISABLED_PATCHES=value)
    assert s.disabled_patches == frozenset(expected)
    assert s.problems == ()


def test_disabled_patches_unknown_names_each_reported() -> None:
    s = parse(AUTOWEAVE_DISABLED_PATCHES="compile,fsdp,Torch.Compile")
    assert s.disabled_patches == frozenset({"compile"})
    assert len(s.problems) == 2
    assert "'fsdp'" in s.problems[0] and "'torch.compile'" in s.problems[1]
    for problem in s.problems:
        assert_problem_names(problem, "AUTOWEAVE_DISABLED_PATCHES", _settings.PATCH_NAMES)


CHOICES = [
    ("AUTOWEAVE_LOG_LEVEL", "log_level", _settings.LOG_LEVELS, None),
    ("AUTOWEAVE_MODE", "mode", _settings.MODES, "auto"),
    ("AUTOWEAVE_STRATEGY", "strategy", _settings.STRATEGIES, "auto"),
]


def _documented_values(variable: str) -> list[str]:
    """The values README.md's switches table lists for ``variable`` (its second column)."""
    text = (REPO_ROOT / "README.md").read_text()
    row = re.search(rf"^\|\s*`{variable}`\s*\|([^|]*)\|", text, flags=re.M)
    assert row, f"README.md's switches table has no row for {variable}"
    tokens = re.findall(r"`([^`]*)`", row.group(1))
    return [v for token in tokens for v in re.split(r"[/,]", token) if v]


@pytest.mark.parametrize(("variable", "field", "accepted", "default"), CHOICES)
def test_documented_choices_are_exactly_the_accepted_ones(
    variable: str, field: str, accepted: tuple[str, ...], default: str | None
) -> None:
    documented = _documented_values(variable)
    assert documented, variable
    for value in documented:
        s = parse(**{variable: value})
        assert getattr(s, field) == value and s.problems == (), (variable, value)
    # ... and nothing the parser accepts is missing from the table.
    assert sorted(documented) == sorted(accepted)


def test_documented_flag_and_patch_values_parse() -> None:
    on, off = _documented_values("AUTOWEAVE")[:4], _documented_values("AUTOWEAVE")[4:]
    assert on and off
    assert all(parse(AUTOWEAVE=v).enabled and not parse(AUTOWEAVE=v).problems for v in on)
    assert all(not parse(AUTOWEAVE=v).enabled and not parse(AUTOWEAVE=v).problems for v in off)
    names = _documented_values("AUTOWEAVE_DISABLED_PATCHES")
    s = parse(AUTOWEAVE_DISABLED_PATCHES=",".join(names))
    assert s.disabled_patches == frozenset(names) and s.problems == ()


def test_every_accepted_mode_and_strategy_is_understood_by_the_planner() -> None:
    # The settings reader and the planner each validate these names: they must agree, or a
    # value accepted from the environment fails later, at the first compile.
    import torch.nn as nn

    from autoweave.planning import planner

    for mode in _settings.MODES:
        assert planner.plan(nn.Linear(2, 2), mode=parse(AUTOWEAVE_MODE=mode).mode).mode == mode
    for strategy in _settings.STRATEGIES:
        plan = planner.plan(nn.Linear(2, 2), strategy=parse(AUTOWEAVE_STRATEGY=strategy).strategy)
        assert plan.strategy == strategy
    for rejected in ("sometimes", "push_down", "push-down", "siblings"):
        with pytest.raises(ValueError):
            planner.plan(nn.Linear(2, 2), mode=rejected, strategy=rejected)


@pytest.mark.parametrize("level", _settings.LOG_LEVELS)
def test_every_accepted_log_level_sets_the_logger(level: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import logging

    from autoweave import _log

    monkeypatch.setattr(_log, "_handler", None)
    saved_level = _log.logger.level
    try:
        _log.configure(parse(AUTOWEAVE_LOG_LEVEL=level.upper()).log_level)
        assert _log.logger.level == getattr(logging, level.upper())
        assert _log._handler in _log.logger.handlers
    finally:
        if _log._handler is not None:
            _log.logger.removeHandler(_log._handler)
        _log.logger.setLevel(saved_level)


@pytest.mark.parametrize(("variable", "field", "accepted", "default"), CHOICES)
def test_choice_accepted_values(
    variable: str, field: str, accepted: tuple[str, ...], default: str | None
) -> None:
    for value in accepted:
        for spelled in (value, value.upper(), f"  {value}\n"):
            s = parse(**{variable: spelled})
            assert getattr(s, field) == value and s.problems == ()
    for blank in ("", "   "):
        s = parse(**{variable: blank})
        assert getattr(s, field) == default and s.problems == ()


@pytest.mark.parametrize(("variable", "field", "accepted", "default"), CHOICES)
@pytest.mark.parametrize(
    "value", ["bogus", "1", "push_down", "push-down", "siblings", "warn", "hoist,siblings", "offf"]
)
def test_choice_invalid_value(
    variable: str, field: str, accepted: tuple[str, ...], default: str | None, value: str
) -> None:
    if value.lower() in accepted:
        pytest.skip("accepted here")
    s = parse(**{variable: value})
    assert getattr(s, field) == default
    assert len(s.problems) == 1
    assert repr(value) in s.problems[0]
    assert_problem_names(s.problems[0], variable, accepted)


def test_problems_from_several_variables_are_all_kept() -> None:
    s = parse(
        AUTOWEAVE="1",
        AUTOWEAVE_STRICT="sure",
        AUTOWEAVE_MODE="never",
        AUTOWEAVE_STRATEGY="up",
        AUTOWEAVE_LOG_LEVEL="loud",
        AUTOWEAVE_DISABLED_PATCHES="nope",
    )
    assert s.enabled
    named = sorted(re.match(r"(AUTOWEAVE_[A-Z_]+)", p).group(1) for p in s.problems)
    assert named == sorted(
        [
            "AUTOWEAVE_STRICT",
            "AUTOWEAVE_MODE",
            "AUTOWEAVE_STRATEGY",
            "AUTOWEAVE_LOG_LEVEL",
            "AUTOWEAVE_DISABLED_PATCHES",
        ]
    )


@given(st.text(max_size=12))
def test_any_autoweave_value_is_on_off_or_reported(value: str) -> None:
    s = parse(AUTOWEAVE=value)
    normalized = value.strip().lower()
    if normalized in _settings.TRUE_VALUES:
        assert s.enabled and not s.problems
    elif normalized in _settings.FALSE_VALUES:
        assert not s.enabled and not s.problems
    else:
        assert not s.enabled
        assert len(s.problems) == 1 and s.problems[0].startswith("AUTOWEAVE=")


def test_start_up_prechecks_agree_with_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import sys
    import types

    import _autoweave_start

    assert _autoweave_start.OFF == _settings.FALSE_VALUES
    assert _autoweave_start.ON == _settings.TRUE_VALUES
    # The .pth line: off values (any case, any spaces) never import anything; the rest
    # hand over to the start-up module.
    line = (REPO_ROOT / "autoweave.pth").read_text().strip()
    calls: list[int] = []
    monkeypatch.setitem(sys.modules, "_autoweave_start", types.SimpleNamespace(main=lambda: calls.append(1)))
    monkeypatch.delenv("AUTOWEAVE", raising=False)
    exec(line, {})
    for value in (*_settings.FALSE_VALUES, " OFF ", "No", "FALSE"):
        monkeypatch.setenv("AUTOWEAVE", value)
        exec(line, {})
    assert calls == []
    for value in (*_settings.TRUE_VALUES, " On ", "maybe"):
        monkeypatch.setenv("AUTOWEAVE", value)
        exec(line, {})
    assert len(calls) == len(_settings.TRUE_VALUES) + 2

    # The checkout's start-up shell makes the same off/on decision (its _start, run alone so the
    # shadowed-sitecustomize chaining and the real start-up never run here).
    import ast

    from autoweave import startup

    shell = REPO_ROOT / "sitecustomize" / "sitecustomize.py"
    tree = ast.parse(shell.read_text())
    start = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_start")
    namespace: dict = {"os": os, "sys": sys, "__file__": str(shell)}
    exec(compile(ast.Module(body=[start], type_ignores=[]), "sitecustomize.py", "exec"), namespace)
    started: list[int] = []
    monkeypatch.setattr(startup, "startup", lambda: started.append(1))
    monkeypatch.setattr(sys, "path", list(sys.path))  # _start may put the checkout first
    for value in (*_settings.FALSE_VALUES, " OFF ", "No", "FALSE"):
        monkeypatch.setenv("AUTOWEAVE", value)
        namespace["_start"]()
    monkeypatch.delenv("AUTOWEAVE")
    namespace["_start"]()
    assert started == []
    for value in (*_settings.TRUE_VALUES, " On ", "maybe"):
        monkeypatch.setenv("AUTOWEAVE", value)
        namespace["_start"]()
    assert len(started) == len(_settings.TRUE_VALUES) + 2


def test_settings_is_frozen_and_hashable() -> None:
    s = parse(AUTOWEAVE="1", AUTOWEAVE_DISABLED_PATCHES="compile")
    with pytest.raises(AttributeError):
        s.enabled = False  # type: ignore[misc]
    assert hash(s) == hash(parse(AUTOWEAVE="1", AUTOWEAVE_DISABLED_PATCHES="compile"))
    assert s.as_dict()["disabled_patches"] == ["compile"]
    assert "enabled=True" in repr(s)


def test_variables_table_covers_every_constant() -> None:
    constants = {v for k, v in vars(_settings).items() if k.startswith("AUTOWEAVE") and isinstance(v, str)}
    assert constants == set(_settings.VARIABLES)
    assert all(_settings.VARIABLES.values())


def test_readme_switches_table_lists_every_variable() -> None:
    readme = REPO_ROOT / "README.md"
    if not readme.is_file():
        pytest.skip("README.md is not written yet")
    documented = set(re.findall(r"^\|\s*`(AUTOWEAVE[A-Z_]*)`", readme.read_text(), flags=re.M))
    missing = set(_settings.VARIABLES) - documented
    assert not missing, f"README.md's switches table lacks {sorted(missing)}"
    unknown = documented - set(_settings.VARIABLES)
    assert not unknown, f"README.md documents variables autoweave does not read: {sorted(unknown)}"
