"""Looking torch names up by their dotted path, and the one list of every torch name autoweave needs.

Each ``_compat`` module declares the names it uses where it uses them
(``_COUNTERS = need("torch._dynamo.utils.counters")``) and looks them up lazily
(``find(_COUNTERS)``), so the list ``version.self_check`` probes on a torch newer
than tested is the list the code reads: a name cannot be used without being
checked. Declaring only appends a record; nothing imports torch until a lookup
or a probe runs. A torch that moved a name fails with ``UnsupportedTorch``
naming the paths it tried.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class UnsupportedTorch(RuntimeError):
    """The installed torch lacks something autoweave needs."""


def torch_version(raw: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string (``"2.13.0+cpu"`` -> ``(2, 13)``)."""
    match = re.match(r"(\d+)\.(\d+)", str(raw))
    if not match:
        raise UnsupportedTorch(f"cannot read torch version {raw!r}")
    return int(match.group(1)), int(match.group(2))


def find(*paths: str) -> Any:
    """The first of ``paths`` (``"torch.x.y.Name"``, or a module) this torch has; ``UnsupportedTorch`` if none."""
    errors = []
    for path in paths:
        module_name, _, attr = path.rpartition(".")
        try:
            return getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            errors.append(f"{path}: {exc}")
        try:  # a submodule its package does not import
            return importlib.import_module(path)
        except ImportError:
            pass
    raise UnsupportedTorch("none of these torch names exist: " + "; ".join(errors))


def find_optional(*paths: str) -> Any:
    """``find``, or None where this torch has none of them (a name autoweave can do without)."""
    try:
        return find(*paths)
    except UnsupportedTorch:
        return None


@dataclass(frozen=True)
class Need:
    """One thing autoweave relies on from torch, as ``version.self_check`` probes it."""

    what: str  # how a message names it
    probe: Callable[[], Any]  # truthy when this torch has it; raising counts as missing
    required: bool  # False: autoweave does without it (looked up with ``find_optional``)


# Every row the ``_compat`` modules declared, in import order (``version`` imports them all).
NEEDS: list[Need] = []


def need(
    path: str, *, required: bool = True, probe: Callable[[], Any] | None = None, what: str | None = None
) -> str:
    """Declare ``path`` (probed as ``find(path)``, unless ``probe`` is given) and return it."""
    return need_any(path, required=required, probe=probe, what=what)[0]


def need_any(
    *paths: str, required: bool = True, probe: Callable[[], Any] | None = None, what: str | None = None
) -> tuple[str, ...]:
    """Declare alternatives (newest first) as one row, there when any one is; return them."""
    NEEDS.append(Need(what or " or ".join(paths), probe or functools.partial(_has, *paths), required))
    return paths


def need_source(what: str, module_name: str, needle: str, *, required: bool = True) -> str:
    """Declare a string ``module_name``'s source must hold (a hook's name, a message's wording); return the module."""
    NEEDS.append(Need(what, functools.partial(_in_source, module_name, needle), required))
    return module_name


def _has(*paths: str) -> bool:
    # ``is not None``: a flag set to False is there.
    return find(*paths) is not None


def _in_source(module_name: str, needle: str) -> bool:
    return needle in inspect.getsource(importlib.import_module(module_name))
