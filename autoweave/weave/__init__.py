"""Applying a plan: the only code that changes the user's modules (in place, state_dict keys unchanged).

The package module itself holds ``on_own_code``: a function on a code object of its own.
Dynamo keeps its cache (and its recompile limit) per code object, so where a compiled
region's code comes from decides which modules share graphs (``weave.apply`` says why regions
get their own code). Standard library only, on every supported Python:
``tests/unit/test_codegen.py`` loads this file by path on each.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any


def on_own_code(fn: Callable[..., Any], label: str, *, through_wrappers: bool = False) -> Callable[..., Any]:
    """``fn`` again (same globals, defaults and closure), on a copy of its code named ``label``.

    The copy keeps the file name and line numbers, so tracebacks and dynamo's
    messages still point at the user's source.

    ``through_wrappers``: when ``fn`` is a decorator's wrapper (``functools.wraps``
    sets ``__wrapped__``) that calls the function it wraps from its closure, that
    function is copied too, all the way down, and the copy's closure holds the
    copy. A graph break inside the wrapped function makes dynamo compile it as a
    frame of its own: on the shared original, every region calling it would
    share one cache (and its recompile limit).
    """
    # co_qualname exists from Python 3.11; on 3.10 the name is all there is.
    renames: dict[str, Any] = {"co_name": label}
    if hasattr(fn.__code__, "co_qualname"):
        renames["co_qualname"] = label
    code = fn.__code__.replace(**renames)
    closure = fn.__closure__
    wrapped = getattr(fn, "__wrapped__", None) if through_wrappers else None
    wrapped_copy = None
    if isinstance(wrapped, types.FunctionType) and any(_holds(cell, wrapped) for cell in closure or ()):
        wrapped_copy = on_own_code(wrapped, label, through_wrappers=True)
        closure = tuple(types.CellType(wrapped_copy) if _holds(cell, wrapped) else cell for cell in closure)
    copy = types.FunctionType(code, fn.__globals__, label, fn.__defaults__, closure)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__dict__.update(fn.__dict__)  # what functools.wraps copied (``__wrapped__`` among it)
    if wrapped_copy is not None:
        copy.__wrapped__ = wrapped_copy
    copy.__qualname__ = label
    return copy


def _holds(cell: types.CellType, value: Any) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell (a name assigned later)
        return False
