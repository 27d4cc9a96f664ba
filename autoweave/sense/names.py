"""Naming a compiled module by its place in the model (``layers.3``), for every message and table.

Where a compile target sits is read from the frames that call it when its plan is recorded
(``locate``), the model told apart by its class and an index (``model_of``; several models in
one process are named ``Policy.layers.3``, ``Transformer#1.layers.3``). The recorded plans
(``_state.run.plans``, the plan summary's entries) hold the names; ``name_of`` reads them.
"""

from __future__ import annotations

import re
import threading
from collections import Counter
from typing import Any

from autoweave import _compat
from autoweave._instances import dispatcher_of
from autoweave._state import run
from autoweave.planning import sources

_WRAPPER_SEGMENTS = re.compile(r"(^|\.)(" + "|".join(_compat.modules.WRAPPED_CHILD_ATTRS) + r")(?=\.|$)")
_lock = threading.RLock()  # the models seen, numbered per class


def display_path(path: str) -> str:
    """A plan path as the user names it (wrapper segments dropped, like state_dict keys)."""
    return _WRAPPER_SEGMENTS.sub("", path).strip(".") or "<root>"


def join_path(name: str, path: str) -> str:
    """A decision's path shown under the compiled module's name (``layers.3.moe.experts``)."""
    shown = display_path(path)
    return name or shown if shown == "<root>" else (f"{name}.{shown}" if name else shown)


def inner_type(module: Any) -> str:
    """The user's module type under compile / checkpoint / FSDP1 wrappers."""
    return type(sources._user_module(module)).__name__  # the unwrapping the plan's sources use


def _path_in(owner: Any, module: Any) -> str | None:
    return next((name for name, child in owner.named_modules() if child is module), None)


# Wrappers frameworks put around the user's model, and the attribute holding it: not part of
# the names the user wrote (DDP's ``module.``, as accelerate's and Lightning's DDP paths wrap;
# Lightning Fabric's ``_forward_module.``). By class name: no framework is imported for it.
_FRAMEWORK_WRAPPERS = {"DistributedDataParallel": "module", "_FabricModule": "_forward_module"}


def _without_framework_wrapper(owner: Any, path: str) -> str:
    """``path`` (of a module under ``owner``) without the segment of a framework's wrapper."""
    head, _, rest = path.partition(".")
    return rest if _FRAMEWORK_WRAPPERS.get(type(owner).__name__) == head else path


def locate(target: Any, dispatcher: Any, frame: Any) -> tuple[str, Any]:
    """``layers.3``: where ``target`` sits in the model whose forward calls it now, and that model.

    Best effort: walks the calling frames outward from ``frame``; each frame whose
    ``self`` is a module holding the one found so far extends the name. ("", None)
    when no caller holds it (a module compiled and called on its own).
    """
    import torch.nn as nn

    current: Any = None
    path = ""
    for _ in range(256):
        if frame is None:
            break
        owner = frame.f_locals.get("self") if "self" in frame.f_code.co_varnames else None
        if isinstance(owner, nn.Module) and owner is not current:
            if current is None:
                if owner is target or (dispatcher is not None and dispatcher_of(owner) is dispatcher):
                    current = owner
                elif found := _path_in(owner, target):
                    # Called from a module holding it (a block compiled in place inside
                    # its checkpoint wrapper is first called from the wrapper's forward).
                    path, current = found, owner
            elif found := _path_in(owner, current):
                path = ".".join(p for p in (_without_framework_wrapper(owner, found), path) if p)
                current = owner
        frame = frame.f_back
    shown = display_path(path)
    # "<root>": no path, or only wrapper segments: no name but its type.
    return ("", None) if shown == "<root>" else (shown, current)


def model_of(root: Any) -> tuple[str, int] | None:
    """The model ``root`` is: its class's name and its index among the models of that class."""
    if root is None:
        return None
    with _lock:
        known = run.models.get(root)
        if known is None:
            cls = inner_type(root)
            known = (cls, sum(1 for c, _ in run.models.values() if c == cls))
            run.models[root] = known
    return known


def model_names() -> dict[tuple[str, int], str]:
    """How each model is named in front of its modules: nothing with one model, else its class (#index)."""
    models = {e.model for e in list(run.plans.values()) if e.model is not None and e.name}
    if len(models) < 2:
        return {}
    per_class = Counter(cls for cls, _ in models)
    return {(cls, i): cls if per_class[cls] == 1 else f"{cls}#{i}" for cls, i in models}


def name_of(dispatcher: Any) -> str:
    """How the summary names a compile target: ``layers.3 (Block)``, or its type alone."""
    entry = run.plans.get(id(dispatcher))
    type_name = inner_type(dispatcher.target)
    return f"{entry.full_name} ({type_name})" if entry is not None and entry.name else type_name
