"""The wrappers autoweave puts on torch: each one an install in ``autoweave._installs``.

Each patch is (owner, attribute, original, wrapper), installed with its undo.
Applying twice is a no-op; the undo restores the original only if our wrapper
is still on top, and otherwise leaves both, switches ours to pass calls
straight through and says so once (``[patch-shadowed]``). The wrappers do
nothing but route the call to ``routes``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import wrapt

from autoweave import _installs
from autoweave._failopen import warn_each
from autoweave._log import logger
from autoweave._settings import Settings


class AutoweaveWrapper(wrapt.FunctionWrapper):
    """Our wrapper type: counting layers by it tells our patches from torch's own."""


@dataclass
class _Patch:
    name: str  # the switch name in AUTOWEAVE_DISABLED_PATCHES
    original: Any
    undo: Callable[[], bool]  # ``_installs.patch``'s: True if the original went back


_lock = threading.RLock()
# Every wrapper of ours still on its attribute (on top, or left under someone else's).
_applied: dict[tuple[int, str], _Patch] = {}
# Keys of the patches that route calls; a wrapper we could not remove stays, inactive.
_active: set[tuple[int, str]] = set()


def _label(owner: Any, attribute: str) -> str:
    return f"{getattr(owner, '__name__', owner)}.{attribute}"


def _apply(name: str, owner: Any, attribute: str, route: Callable[..., Any]) -> bool:
    """Install the patch ``name`` (once); True if a new wrapper went on now."""
    fresh: list[Any] = []  # the original our new wrapper went on, as the patch read it

    def wrap(original: Any, _on: Callable[[], bool]) -> AutoweaveWrapper:
        fresh.append(original)
        return AutoweaveWrapper(original, route, enabled=lambda: key in _active)

    def apply() -> Callable[[], None]:
        with _lock:
            # Switched on before it goes on top; never two layers: a wrapper
            # left under someone else's is switched back on.
            _active.add(key)
            if not any(
                isinstance(layer, AutoweaveWrapper) for layer in _installs.chain(getattr(owner, attribute))
            ):
                undo = _installs.patch(owner, attribute, wrap, shadowed)
                _applied[key] = _Patch(name, fresh[-1], undo)
                logger.debug("patched %s", _label(owner, attribute))
            return lambda: _revert(key)

    key = (id(owner), attribute)
    _installs.install(f"patch {_label(owner, attribute)}", apply)
    return bool(fresh)


def _revert(key: tuple[int, str]) -> bool:
    """The undo of a patch: the original back if our wrapper is on top; else ours passes through."""
    with _lock:
        _active.discard(key)
        patch = _applied.get(key)
        if patch is None or not patch.undo():
            return False
        del _applied[key]
        return True


def shadowed(what: str) -> None:
    """Told once per patch: something wrapped ours since, so the original cannot come back."""
    warn_each(f"patch-shadowed:{what}", _installs.shadowed_message(what))


def apply_torch(settings: Settings) -> None:
    """Wrap ``torch.compile`` and ``torch.nn.Module.compile`` (unless switched off)."""
    from autoweave import _compat

    _compat.version.check_torch_version(untested=settings.untested_torch)
    import torch

    from autoweave.dispatch import routes, tree_watch

    _installs.begin()
    tree_watch.install()
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
        original = module.checkpoint_wrapper
        if not _apply("checkpoint_wrapper", module, "checkpoint_wrapper", routes.route_checkpoint_wrapper):
            return
        # apply_activation_checkpointing captures checkpoint_wrapper as a default
        # argument, so patching the module attribute alone does not reach it.
        apply_ac = getattr(module, "apply_activation_checkpointing", None)
        defaults = getattr(apply_ac, "__defaults__", None)
        if defaults and any(d is original for d in defaults):
            _installs.install(
                "patch apply_activation_checkpointing's default checkpoint_wrapper",
                lambda: _installs.patch(
                    apply_ac,
                    "__defaults__",
                    lambda defaults, _on: tuple(
                        module.checkpoint_wrapper if d is original else d for d in defaults
                    ),
                ),
            )


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
    from autoweave import _compat

    return _compat.modules.checkpoint_wrapper_module().checkpoint_wrapper
