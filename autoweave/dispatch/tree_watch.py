"""What moves the tree-change signal from outside autoweave: registrations, and ``fully_shard``.

``planning/boundaries`` keeps the counter; this module installs the two
watches that bump it, each through the install registry with its undo:

- a submodule registered into a module some compiled tree was read from
  (torch's global registration hook: ``parent.child = ...``, ``add_module``,
  FSDP1 wrapping a child, ``apply_activation_checkpointing``);
- ``fully_shard`` running: it swaps a module's class in place, which no hook
  sees; ``FSDPState.init`` runs once per call, whatever name the user imported
  ``fully_shard`` under;
- a hook registered on a module of a compiled tree (``nn.Module``'s
  ``register_*_hook``), or removed through its handle: dynamo does not guard on
  hooks (``skip_nnmodule_hook_guards``), so a region that inlined the module
  would never run a hook added after it traced, nor stop running one removed.
  The block's region key holds its hooks (``planning/kinds.hooks_key``), so the
  block re-plans alone onto a region of its own. FSDP's and autoweave's own
  hooks, which the key leaves out, do not bump.

Registrations that change no compiled tree do not bump:

- into a module no tree walk has read (``boundaries.watch``): a fresh
  container, such as the ``ModuleList`` that ``self.layers[:n]`` builds at
  every forward of a transformers decoder, or the graph modules a backend
  builds. A tree can only grow through a module it already holds, and a module
  attached to a tree is read by the walk its own registration triggers, so
  nothing is missed;
- of the child a module already holds under that name (assigned again);
- while dynamo traces (the slice inside ``torch.compile(model)``): the hook is
  traced too, and a write to ``run.generation`` there would make dynamo guard
  on autoweave's counter and recompile the model at every call. Under
  ``torch.compiler.is_compiling()``, which dynamo folds to True, the hook does
  nothing; nothing of it reaches the graph or its guards.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

from autoweave import _compat, _installs
from autoweave._failopen import warn_each
from autoweave._log import logger
from autoweave._state import run
from autoweave.planning.boundaries import bump
from autoweave.planning.kinds import uniform_hook

_is_compiling: Any = None  # torch.compiler.is_compiling, once torch is imported (install)


def _on_registration(module: Any, name: str, submodule: Any) -> None:
    # Cheapest test first; dynamo folds it to True while tracing, so the
    # rest is never traced (see the module docstring).
    if _is_compiling():
        return
    if module in run.watched and _compat.modules.children_of(module).get(name) is not submodule:
        bump()


# nn.Module's registrations into the hook stores a region key reads (``_compat.HOOK_STORES``).
_HOOK_METHODS = (
    "register_forward_pre_hook",
    "register_forward_hook",
    "register_full_backward_pre_hook",
    "register_full_backward_hook",
    "register_backward_hook",
)


def _on_hook(module: Any, hook: Any, handle: Any) -> None:
    if uniform_hook(hook):
        return
    if module in run.watched:
        bump()
    # The handle removes from the store itself: its ``remove`` (``with handle:`` calls it
    # too) bumps as well. An instance attribute, which the handle's pickled state leaves out.
    handle.remove = functools.partial(_removed, handle.remove, weakref.ref(module))


def _on_removal(owner: Callable[[], Any]) -> None:
    if owner() in run.watched:
        bump()


def _nothing(*args: Any) -> None:
    """What a compile tracing a registration or a removal meets instead of the two above."""


# _on_hook and _on_removal, never traced or converted by dynamo (install): a registration
# a compile traces (transformers' output hooks, in the first forward) compiles as in plain
# torch. Dynamo breaks inside torch's ``register_*_hook`` and runs the call eager; the
# frames of autoweave's that call runs are not converted (``_compat.dynamo.outside_dynamo``,
# ``skip_own_frame``), which added frames to that compile.
_note_hook: Callable[[Any, Any, Any], None] = _on_hook
_note_removal: Callable[[Callable[[], Any]], None] = _on_removal


def _removed(remove: Callable[[], None], owner: Callable[[], Any]) -> None:
    remove()
    _note_removal(owner)


def _watch_hooks(original: Any, on: Callable[[], bool]) -> Any:
    @functools.wraps(original)
    def register(self: Any, hook: Any, *args: Any, **kwargs: Any) -> Any:
        handle = original(self, hook, *args, **kwargs)
        if on():
            _note_hook(self, hook, handle)
        return handle

    _compat.dynamo.skip_own_frame(register)
    return register


def install() -> None:
    """Start watching (each part installed once, undone by ``autoweave.disable()``)."""
    global _is_compiling, _note_hook, _note_removal
    import torch

    _is_compiling = torch.compiler.is_compiling
    _note_hook = _compat.dynamo.outside_dynamo(_on_hook, traced_as=_nothing)
    _note_removal = _compat.dynamo.outside_dynamo(_on_removal, traced_as=_nothing)
    _compat.dynamo.skip_own_frame(_removed)
    _installs.install("module registration hook (tree changes)", _add_registration_hook)
    for name in _HOOK_METHODS:
        if name in vars(torch.nn.Module):
            _installs.install(
                f"patch torch.nn.Module.{name} (hook watch)",
                lambda name=name: _installs.patch(torch.nn.Module, name, _watch_hooks, _shadowed),
            )
    # FSDP2 loads when the user imports it, not with torch: hook its module
    # (at once if it is already imported) rather than import it here.
    for name in _compat.modules.FSDP2_STATE_MODULES:
        _installs.install(f"import hook on {name} (fully_shard watch)", lambda name=name: _hook_import(name))
    bump()


def _add_registration_hook() -> Callable[[], None] | None:
    handle = _compat.modules.register_module_registration_hook(_on_registration)
    if handle is None:
        return None

    def undo() -> None:
        handle.remove()
        bump()  # plans made while watching are read again if autoweave comes back

    return undo


def _hook_import(name: str) -> Callable[[], None]:
    _installs.register(name, _watch_fully_shard)
    return lambda: _installs.unregister(name, _watch_fully_shard)


def _watch_fully_shard(state_module: Any) -> None:
    state_cls = getattr(state_module, "FSDPState", None)
    original = getattr(state_cls, "__dict__", {}).get("init")
    if original is None:
        logger.debug("FSDPState.init not found: fully_shard after a first forward is not watched")
        return
    # Both FSDP2 module paths may name one class: one patch.
    _installs.install(
        f"patch {state_cls.__module__}.FSDPState.init (fully_shard watch)",
        lambda: _installs.patch(state_cls, "init", _watch_init, _shadowed),
    )


def _watch_init(original: Any, on: Callable[[], bool]) -> Any:
    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> Any:
        if on():
            bump()
        return original(self, *args, **kwargs)

    return init


def _shadowed(what: str) -> None:
    warn_each(f"patch-shadowed:{what}", _installs.shadowed_message(what))
