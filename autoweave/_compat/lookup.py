"""Looking torch names up by their dotted path, with one error for a torch that lacks them.

Every other ``_compat`` module resolves the private names it needs through
these two, so a torch that moved one fails with ``UnsupportedTorch`` naming the
paths it tried (``version.self_check`` turns that into "autoweave stays off").
"""

from __future__ import annotations

import importlib
from typing import Any


class UnsupportedTorch(RuntimeError):
    """The installed torch lacks something autoweave needs."""


def find(*paths: str) -> Any:
    """The first of ``paths`` (``"torch.x.y.Name"``) this torch has; ``UnsupportedTorch`` if none."""
    errors = []
    for path in paths:
        module_name, _, attr = path.rpartition(".")
        try:
            return getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            errors.append(f"{path}: {exc}")
    raise UnsupportedTorch("none of these torch names exist: " + "; ".join(errors))


def find_optional(*paths: str) -> Any:
    """``find``, or None where this torch has none of them (a name autoweave can do without)."""
    try:
        return find(*paths)
    except UnsupportedTorch:
        return None
