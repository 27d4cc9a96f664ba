"""``autoweave.dispatch.patches`` and the public on/off switches, in this process.

These tests patch the real ``torch``; every one of them leaves torch exactly as it
found it (the ``clean`` fixture disables autoweave and checks the originals).
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

import pytest
import torch
import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as cw
import torch.nn as nn
import wrapt

import autoweave
from autoweave import _installs, _settings, startup
from autoweave._settings import Settings
from autoweave.dispatch import dispatchers, patches, routes

ALL_PATCHES = ["checkpoint_wrapper", "compile", "module_compile"]

ORIGINAL_COMPILE = torch.compile
ORIGINAL_MODULE_COMPILE = nn.Module.__dict__["compile"]
ORIGINAL_CHECKPOINT_WRAPPER = cw.checkpoint_wrapper
ORIGINAL_DEFAULTS = cw.apply_activation_checkpointing.__defaults__


def layers(obj: object) -> int:
    """Number of ``AutoweaveWrapper`` layers, walking ``__wrapped__`` down."""
    count = 0
    for _ in range(64):
        if obj is None:
            break
        if isinstance(obj, patches.AutoweaveWrapper):
            count += 1
        obj = getattr(obj, "__wrapped__", None)
    return count


def targets() -> dict[str, object]:
    return {
        "compile": torch.compile,
        "module_compile": nn.Module.__dict__["compile"],
        "checkpoint_wrapper": cw.checkpoint_wrapper,
        "default": cw.apply_activation_checkpointing.__defaults__[0],
    }


def assert_originals() -> None:
    assert torch.compile is ORIGINAL_COMPILE
    assert nn.Module.__dict__["compile"] is ORIGINAL_MODULE_COMPILE
    assert cw.checkpoint_wrapper is ORIGINAL_CHECKPOINT_WRAPPER
    defaults = cw.apply_activation_checkpointing.__defaults__
    assert len(defaults) == len(ORIGINAL_DEFAULTS)
    assert all(a is b for a, b in zip(defaults, ORIGINAL_DEFAULTS, strict=True))
    assert patches.applied() == []


@pytest.fixture(autouse=True)
def clean(monkeypatch: pytest.MonkeyPatch):
    """No AUTOWEAVE* variables; autoweave off before and after; torch's originals checked."""
    for name in list(os.environ):
        if name.startswith("AUTOWEAVE"):
            monkeypatch.delenv(name)
    autoweave.disable()
    assert_originals()
    yield
    try:
        autoweave.disable()
        assert_originals()
    finally:
        # Whatever a failing test left behind, the next test starts from plain torch.
        torch.compile = ORIGINAL_COMPILE
        nn.Module.compile = ORIGINAL_MODULE_COMPILE
        cw.checkpoint_wrapper = ORIGINAL_CHECKPOINT_WRAPPER
        cw.apply_activation_checkpointing.__defaults__ = ORIGINAL_DEFAULTS
        _settings.reload(Settings())


# -- routing: each patched function hands its call to autoweave (or, switched off, does not) ----
#
# What routing leaves behind, seen from outside: a compiled module has a dispatcher
# (``dispatchers.dispatcher_of``), and an AC wrapper put around a compiled module is
# watched by that module's dispatcher (``outer``). A wrapper that only passed calls
# through would leave neither.


def _compile_routed() -> bool:
    linear = nn.Linear(2, 2)
    compiled = torch.compile(linear, backend="eager")
    x = torch.randn(3, 2)
    assert torch.allclose(compiled(x), linear(x))  # routed or not, it computes what the module does
    return dispatchers.dispatcher_of(compiled) is not None


def _module_compile_routed() -> bool:
    linear = nn.Linear(2, 2)
    assert linear.compile(backend="eager") is None
    x = torch.randn(3, 2)
    assert torch.allclose(linear(x), torch.nn.functional.linear(x, linear.weight, linear.bias))
    return dispatchers.dispatcher_of(linear) is not None


def _checkpoint_wrapper_routed() -> bool:
    # A compiled module autoweave routed (in place, or through torch.compile when that is off).
    target = nn.Linear(2, 2)
    target.compile(backend="eager")
    if dispatchers.dispatcher_of(target) is None:
        target = torch.compile(nn.Linear(2, 2), backend="eager")
    dispatcher = dispatchers.dispatcher_of(target)
    wrapper = cw.checkpoint_wrapper(target)
    assert isinstance(wrapper, cw.CheckpointWrapper)
    if dispatcher is None:  # no compile routed either: plain torch, nothing to watch
        return "forward" in vars(wrapper)  # False unless something else routed the wrapper
    return dispatcher.outer is wrapper and "forward" in vars(wrapper)


ROUTED = {
    "compile": _compile_routed,
    "module_compile": _module_compile_routed,
    "checkpoint_wrapper": _checkpoint_wrapper_routed,
}


def routed() -> dict[str, bool]:
    return {name: check() for name, check in ROUTED.items()}


def test_every_patch_routes_and_nothing_routes_when_off() -> None:
    assert routed() == dict.fromkeys(ROUTED, False)  # plain torch: nothing attached
    autoweave.enable()
    assert routed() == dict.fromkeys(ROUTED, True)
    with autoweave.disabled():
        assert routed() == dict.fromkeys(ROUTED, False)
    assert routed() == dict.fromkeys(ROUTED, True)
    autoweave.disable()
    assert routed() == dict.fromkeys(ROUTED, False)


def test_the_disabled_context_stops_checkpoint_wrapper_routing() -> None:
    autoweave.enable()
    target = torch.compile(nn.Linear(2, 2), backend="eager")
    dispatcher = dispatchers.dispatcher_of(target)
    with autoweave.disabled():
        wrapper = cw.checkpoint_wrapper(target)
    assert isinstance(wrapper, cw.CheckpointWrapper) and dispatcher.outer is None
    assert "forward" not in vars(wrapper)  # torch's wrapper, untouched


def test_the_routes_receive_the_call_and_its_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def spy(route):
        def record(wrapped, instance, args, kwargs):
            calls.append((route.__name__, wrapped, instance, args, dict(kwargs)))
            return route(wrapped, instance, args, kwargs)

        return record

    for name in ("route_compile", "route_module_compile", "route_checkpoint_wrapper"):
        monkeypatch.setattr(routes, name, spy(getattr(routes, name)))
    autoweave.enable()
    linear = nn.Linear(2, 2)
    compiled = torch.compile(linear, backend="eager", dynamic=False)
    assert [c[0] for c in calls] == ["route_compile"]
    assert calls[0][1] is ORIGINAL_COMPILE
    assert calls[0][3] == (linear,) and calls[0][4] == {"backend": "eager", "dynamic": False}
    calls.clear()
    linear.compile(backend="eager")
    # The in-place route compiles the module's _call_impl through torch.compile (a function: passed on).
    assert calls[0][0] == "route_module_compile" and calls[0][2] is linear
    assert [c[0] for c in calls[1:]] == ["route_compile"] * (len(calls) - 1)
    calls.clear()
    cw.checkpoint_wrapper(compiled)
    assert [c[0] for c in calls] == ["route_checkpoint_wrapper"]
    assert calls[0][1] is ORIGINAL_CHECKPOINT_WRAPPER and calls[0][3] == (compiled,)


def test_enable_patches_all_three_once() -> None:
    assert autoweave.enable() is True
    assert autoweave.is_enabled()
    assert patches.applied() == ALL_PATCHES
    for name, obj in targets().items():
        assert layers(obj) == 1, name
    assert cw.apply_activation_checkpointing.__defaults__[0] is cw.checkpoint_wrapper
    for name in ("compile", "module_compile", "checkpoint_wrapper"):
        assert layers(patches.original(name)) == 0


def test_enable_disable_enable_leaves_one_layer() -> None:
    autoweave.enable()
    autoweave.enable()
    autoweave.disable()
    assert_originals()
    assert not autoweave.is_enabled()
    autoweave.enable()
    autoweave.enable()
    startup.install()
    patches.apply_torch(_settings.current())
    patches.apply_checkpoint_wrapper(_settings.current(), cw)
    for name, obj in targets().items():
        assert layers(obj) == 1, name
    assert patches.applied() == ALL_PATCHES


def test_disable_restores_identity_and_hooks() -> None:
    import _autoweave_start as hooks  # the one finder, which autoweave._installs re-exports

    autoweave.enable()
    assert hooks._finder in sys.meta_path and _installs.registered("torch")
    autoweave.disable()
    assert_originals()
    assert hooks._finder not in sys.meta_path
    assert not hooks._hooks
    assert not autoweave.is_enabled()
    autoweave.disable()  # twice is fine
    assert_originals()


def test_disabled_patches_setting_is_respected() -> None:
    _settings.reload(Settings(enabled=True, disabled_patches=frozenset({"compile"})))
    startup.install()
    assert patches.applied() == ["checkpoint_wrapper", "module_compile"]
    assert torch.compile is ORIGINAL_COMPILE
    assert layers(nn.Module.__dict__["compile"]) == 1


def test_enable_refused_when_disable_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOWEAVE_DISABLE", "1")
    assert autoweave.enable() is False
    assert not autoweave.is_enabled()
    assert_originals()


def test_revert_leaves_a_foreign_wrapper_on_top() -> None:
    autoweave.enable()
    ours = torch.compile

    @functools.wraps(ours)
    def theirs(*args, **kwargs):
        return ours(*args, **kwargs)

    their_module_compile = wrapt.FunctionWrapper(
        nn.Module.__dict__["compile"], lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs)
    )
    torch.compile = theirs
    nn.Module.compile = their_module_compile
    try:
        autoweave.disable()  # must not raise
        assert torch.compile is theirs
        assert nn.Module.__dict__["compile"] is their_module_compile
        # checkpoint_wrapper had nobody on top: restored.
        assert cw.checkpoint_wrapper is ORIGINAL_CHECKPOINT_WRAPPER
        assert cw.apply_activation_checkpointing.__defaults__[0] is ORIGINAL_CHECKPOINT_WRAPPER
        assert patches.applied() == []
        # Theirs still works, through whatever it wrapped; ours under it passes calls straight through.
        assert theirs(lambda x: x + 1, backend="eager")(torch.ones(1)).item() == 2.0
        assert dispatchers.dispatcher_of(theirs(nn.Linear(2, 2), backend="eager")) is None
        in_place = nn.Linear(2, 2)
        in_place.compile(backend="eager")
        assert dispatchers.dispatcher_of(in_place) is None
    finally:
        torch.compile = ORIGINAL_COMPILE
        nn.Module.compile = ORIGINAL_MODULE_COMPILE


def test_foreign_wrapper_below_ours_is_kept() -> None:
    @functools.wraps(ORIGINAL_COMPILE)
    def theirs(*args, **kwargs):
        return ORIGINAL_COMPILE(*args, **kwargs)

    torch.compile = theirs
    try:
        autoweave.enable()
        assert layers(torch.compile) == 1
        assert torch.compile.__wrapped__ is theirs
        autoweave.disable()
        assert torch.compile is theirs
    finally:
        torch.compile = ORIGINAL_COMPILE


def test_disabled_context_compiles_as_plain_torch() -> None:
    autoweave.enable()
    x = torch.randn(3, 2)

    plain = patches.original("compile")(nn.Linear(2, 2), backend="eager")
    woven = torch.compile(nn.Linear(2, 2), backend="eager")
    assert dispatchers.dispatcher_of(woven) is not None
    with autoweave.disabled():
        linear = nn.Linear(2, 2)
        compiled = torch.compile(linear, backend="eager")
        in_place = nn.Linear(2, 2)
        in_place.compile(backend="eager")
    assert type(compiled) is type(plain)
    assert dispatchers.dispatcher_of(compiled) is None
    assert sorted(vars(compiled)) == sorted(vars(plain))
    assert not isinstance(compiled.forward, dispatchers._Dispatcher)
    assert dispatchers.dispatcher_of(in_place) is None
    assert not isinstance(in_place._compiled_call_impl, dispatchers._Dispatcher)
    assert torch.allclose(compiled(x), linear(x))
    # Outside the block, routing is back.
    assert dispatchers.dispatcher_of(torch.compile(nn.Linear(2, 2), backend="eager")) is not None


def test_disabled_context_nests_and_resets_on_error() -> None:
    autoweave.enable()
    with pytest.raises(RuntimeError), autoweave.disabled():
        with autoweave.disabled():
            pass
        assert routes._off.get()
        raise RuntimeError("boom")
    assert not routes._off.get()


def test_functions_pass_straight_through() -> None:
    from autoweave.sense import counting

    autoweave.enable()
    calls = []

    def fn(x):
        calls.append(1)
        return x * 3

    # Dynamo's own wrapper straight around fn (no autoweave layer between), compiled by
    # dynamo (one graph each, not run eager), and the body's side effect kept.
    direct, called = counting.Capture(), counting.Capture()
    compiled = torch.compile(fn, backend=direct.backend("eager"))
    assert compiled._torchdynamo_orig_callable is fn
    assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 3.0))
    assert calls == [1] and direct.graph_count == 1
    decorated = torch.compile(backend=called.backend("eager"))(fn)
    assert decorated._torchdynamo_orig_callable is fn
    assert torch.equal(decorated(torch.ones(2)), torch.full((2,), 3.0))
    assert calls == [1, 1] and called.graph_count == 1


@pytest.mark.parametrize("name", _settings.PATCH_NAMES)
def test_each_disabled_patch_name_leaves_that_function_alone(name: str) -> None:
    # Every name AUTOWEAVE_DISABLED_PATCHES accepts switches off exactly the patch it names.
    settings = Settings.from_environ({"AUTOWEAVE": "1", "AUTOWEAVE_DISABLED_PATCHES": name})
    assert settings.problems == ()
    _settings.reload(settings)
    startup.install()
    assert patches.applied() == [n for n in ALL_PATCHES if n != name]
    current = targets()
    originals = {
        "compile": ORIGINAL_COMPILE,
        "module_compile": ORIGINAL_MODULE_COMPILE,
        "checkpoint_wrapper": ORIGINAL_CHECKPOINT_WRAPPER,
    }
    for patch, original in originals.items():
        assert (current[patch] is original) == (patch == name), patch
        assert layers(current[patch]) == (0 if patch == name else 1), patch
    # The switched-off function is torch's own; the others still route.
    assert routed() == {patch: patch != name for patch in ROUTED}


def test_checkpoint_wrapper_still_wraps() -> None:
    autoweave.enable()
    wrapped = cw.checkpoint_wrapper(nn.Linear(2, 2))
    assert isinstance(wrapped, cw.CheckpointWrapper)
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    cw.apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, nn.Linear))
    assert isinstance(model[0], cw.CheckpointWrapper)


# -- the one patch primitive (``_installs.patch``) that every patch above goes through ------------


def _counting(original: Any, on: Any) -> Any:
    def wrapper(*args: Any) -> Any:
        wrapper.calls += on()
        return original(*args)

    wrapper.calls = 0
    wrapper.__wrapped__ = original
    return wrapper


def test_the_primitive_puts_the_original_back_only_where_ours_is_on_top() -> None:
    import types

    from autoweave import _installs

    owner = types.SimpleNamespace(f=lambda: 1)
    original = owner.f
    undo = _installs.patch(owner, "f", _counting)
    assert owner.f() == 1 and owner.f.calls == 1 and list(_installs.chain(owner.f)) == [owner.f, original]
    assert undo() is True and owner.f is original
    told: list[str] = []
    undo = _installs.patch(owner, "f", _counting, told.append)
    ours = owner.f
    owner.f = lambda: ours() + 1  # someone else's on top since
    assert undo() is False and told == ["SimpleNamespace.f"]
    assert owner.f() == 2 and ours.calls == 0  # ours left below theirs, passing calls straight through


def test_the_primitive_tells_who_asked_of_a_wrapper_on_top_and_restores_each_kind_of_attribute() -> None:
    import logging
    import types

    from autoweave import _installs

    class Registry:
        def clear(self) -> str:
            return "class"

    registry = Registry()
    told: list[str] = []
    undo = _installs.patch(registry, "clear", lambda original, on: lambda: "ours", told.append)
    assert (
        registry.clear() == "ours" and undo() is True and "clear" not in vars(registry)
    )  # inherited: deleted

    def f(a: int = 1) -> int:
        return a

    defaults = f.__defaults__
    undo = _installs.patch(f, "__defaults__", lambda original, on: (2,))
    assert f() == 2 and undo() is True and f.__defaults__ is defaults  # a data descriptor: set back

    log = logging.getLogger("autoweave.test.primitive")
    undo = _installs.patch(log, "propagate", lambda original, on: False)
    log.propagate = True  # set since: kept, and told
    undo = _installs.patch(log, "propagate", lambda original, on: False, told.append)
    log.propagate = "theirs"
    assert undo() is False and log.propagate == "theirs" and told == ["Logger.propagate"]
    log.propagate = True

    module = types.ModuleType("config")
    module.flag = True
    undo = _installs.patch(module, "flag", lambda original, on: False)
    assert module.flag is False and undo() is True and module.flag is True
