"""The wrappers autoweave puts on torch, and one registry that applies and reverts them.

Each patch is (owner, attribute, original, wrapper). Applying twice is a no-op;
reverting restores the original only if our wrapper is still on top, and says
so otherwise. The wrappers do nothing but route the call to ``runtime``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import wrapt

from autoweave._log import logger
from autoweave._settings import Settings


class AutoweaveWrapper(wrapt.FunctionWrapper):
    """Our wrapper type: counting layers by it tells our patches from torch's own."""


@dataclass
class _Patch:
    name: str  # the switch name in AUTOWEAVE_DISABLED_PATCHES
    owner: Any
    attribute: str
    original: Any
    wrapper: AutoweaveWrapper


_lock = threading.RLock()
_applied: dict[tuple[int, str], _Patch] = {}
# Keys of the patches that route calls; a wrapper we could not remove stays, inactive.
_active: set[tuple[int, str]] = set()
# apply_activation_checkpointing captures checkpoint_wrapper as a default
# argument, so patching the module attribute alone does not reach it.
_defaults_patched: list[tuple[Any, tuple[Any, ...]]] = []


def _current(owner: Any, attribute: str) -> Any:
    # Read through the class __dict__ so descriptors are not bound.
    if isinstance(owner, type):
        return owner.__dict__.get(attribute)
    return getattr(owner, attribute, None)


def _ours_in_chain(current: Any) -> AutoweaveWrapper | None:
    """Our wrapper, on top or buried under someone else's ``functools.wraps`` layers."""
    for _ in range(16):
        if isinstance(current, AutoweaveWrapper):
            return current
        current = getattr(current, "__wrapped__", None)
        if current is None:
            return None
    return None


def _apply(name: str, owner: Any, attribute: str, route: Callable[..., Any]) -> bool:
    with _lock:
        key = (id(owner), attribute)
        current = _current(owner, attribute)
        if current is None:
            raise AttributeError(f"{owner!r} has no attribute {attribute!r} to patch")
        buried = _ours_in_chain(current)
        if buried is not None:
            # Never two layers: a wrapper left under someone else's is switched back on.
            _active.add(key)
            return False
        wrapper = AutoweaveWrapper(current, route, enabled=lambda: key in _active)
        setattr(owner, attribute, wrapper)
        _applied[key] = _Patch(name, owner, attribute, current, wrapper)
        _active.add(key)
        logger.debug("patched %s.%s", getattr(owner, "__name__", owner), attribute)
        return True


def _revert(key: tuple[int, str], patch: _Patch) -> bool:
    _active.discard(key)
    current = _current(patch.owner, patch.attribute)
    if current is not patch.wrapper:
        logger.warning(
            "not restoring %s.%s: something else wrapped autoweave's wrapper; "
            "leaving both, autoweave's now passes calls straight through",
            getattr(patch.owner, "__name__", patch.owner),
            patch.attribute,
        )
        return False
    setattr(patch.owner, patch.attribute, patch.original)
    del _applied[key]
    return True


def apply_torch(settings: Settings) -> None:
    """Wrap ``torch.compile`` and ``torch.nn.Module.compile`` (unless switched off)."""
    from autoweave import _compat

    _compat.check_torch_version(untested=settings.untested_torch)
    import torch

    from autoweave.dispatch import routes
    from autoweave.planning import tree_changes

    tree_changes.install()
    if "compile" not in settings.disabled_patches:
        _apply("compile", torch, "compile", routes.route_compile)
    if "module_compile" not in settings.disabled_patches:
        _apply("module_compile", torch.nn.Module, "compile", routes.route_module_compile)


def apply_checkpoint_wrapper(settings: Settings, module: Any) -> None:
    """Wrap ``checkpoint_wrapper`` and the default argument that captured it."""
    if "checkpoint_wrapper" in settings.disabled_patches:
        return
    from autoweave.dispatch import routes

    with _lock:
        original = _current(module, "checkpoint_wrapper")
        if not _apply("checkpoint_wrapper", module, "checkpoint_wrapper", routes.route_checkpoint_wrapper):
            return
        wrapper = module.checkpoint_wrapper
        apply_ac = getattr(module, "apply_activation_checkpointing", None)
        defaults = getattr(apply_ac, "__defaults__", None)
        if defaults and any(d is original for d in defaults):
            apply_ac.__defaults__ = tuple(wrapper if d is original else d for d in defaults)
            _defaults_patched.append((apply_ac, defaults))


def revert_all() -> None:
    """Restore every original that is still under our wrapper."""
    with _lock:
        for key, patch in list(_applied.items()):
            _revert(key, patch)
        for function, defaults in _defaults_patched:
            function.__defaults__ = defaults
        _defaults_patched.clear()
        from autoweave.planning import tree_changes

        tree_changes.uninstall()


def applied() -> list[str]:
    """Names of the patches in place now, e.g. ``['compile', 'module_compile']``."""
    with _lock:
        return sorted(p.name for key, p in _applied.items() if key in _active)


def original(name: str) -> Any:
    """The unpatched callable behind patch ``name`` (or the live attribute when unpatched)."""
    with _lock:
        for patch in _applied.values():
            if patch.name == name:
                return patch.original
    import torch

    if name == "compile":
        return torch.compile
    if name == "module_compile":
        return torch.nn.Module.__dict__["compile"]
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as module

    return module.checkpoint_wrapper
