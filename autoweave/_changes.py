"""One number that changes whenever a compiled module's plan might: the tree-change signal.

A plan depends on the module tree under the compile target (which children,
which of them are FSDP units, what the user marked). Re-reading the tree at
every forward costs time proportional to the number of submodules; instead
each dispatcher remembers the generation it planned at and re-reads the tree
only after the generation moved. It moves when:

- a submodule is registered anywhere (torch's global registration hook:
  ``parent.child = ...``, ``add_module``, FSDP1 wrapping a child);
- ``fully_shard`` runs (it swaps a module's class in place, which no hook
  sees; ``FSDPState.init`` runs once per call, whatever name the user imported
  ``fully_shard`` under);
- autoweave's own marks change (``boundary``, ``set_mode``, ``register_boundary``).

A spurious bump costs one tree walk per compiled module; a missed one would
keep a stale plan, so every source above bumps.
"""

from __future__ import annotations

import threading
from typing import Any

from autoweave._log import logger
from autoweave._state import run

_lock = threading.Lock()
_handle: Any = None
_fsdp_init: tuple[type, Any] | None = None  # (FSDPState, its original init) while wrapped


def bump() -> None:
    """Something a plan depends on may have changed."""
    run.generation += 1


def _on_registration(module: Any, name: str, submodule: Any) -> None:
    bump()


def install() -> None:
    """Start watching (idempotent); called when the patches go on."""
    global _handle
    from autoweave import _compat, _importhook

    with _lock:
        if _handle is None:
            _handle = _compat.register_module_registration_hook(_on_registration)
    # FSDP2 loads when the user imports it, not with torch: hook its module
    # (at once if it is already imported) rather than import it here.
    for name in _compat.FSDP2_STATE_MODULES:
        _importhook.register(name, _watch_fully_shard)
    bump()


def _watch_fully_shard(state_module: Any) -> None:
    global _fsdp_init
    with _lock:
        state_cls = getattr(state_module, "FSDPState", None)
        original = getattr(state_cls, "__dict__", {}).get("init")
        if _fsdp_init is not None or original is None:
            if original is None:
                logger.debug("FSDPState.init not found: fully_shard after a first forward is not watched")
            return

        def init(self: Any, *args: Any, **kwargs: Any) -> Any:
            bump()
            return original(self, *args, **kwargs)

        init.__wrapped__ = original  # type: ignore[attr-defined]
        state_cls.init = init  # type: ignore[union-attr]
        _fsdp_init = (state_cls, original)


def uninstall() -> None:
    """Stop watching and put FSDP2's ``init`` back (only if ours is still on top)."""
    global _handle, _fsdp_init
    with _lock:
        if _handle is not None:
            _handle.remove()
            _handle = None
        if _fsdp_init is not None:
            state_cls, original = _fsdp_init
            current = state_cls.__dict__.get("init")
            if getattr(current, "__wrapped__", None) is original:
                state_cls.init = original
            _fsdp_init = None
    bump()
