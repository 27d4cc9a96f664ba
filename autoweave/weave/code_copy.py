"""Functions on code objects of their own: standard library only, every supported Python.

Dynamo keeps its cache (and its recompile limit) per code object, so where a
compiled region's code comes from decides which modules share graphs; see
``weave`` for why regions get their own code.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any


def on_own_code(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
    """``fn`` again (same globals, defaults and closure), on a copy of its code named ``label``.

    The copy keeps the file name and line numbers, so tracebacks and dynamo's
    messages still point at the user's source.
    """
    # co_qualname exists from Python 3.11; on 3.10 the name is all there is.
    renames: dict[str, Any] = {"co_name": label}
    if hasattr(fn.__code__, "co_qualname"):
        renames["co_qualname"] = label
    code = fn.__code__.replace(**renames)
    copy = types.FunctionType(code, fn.__globals__, label, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = label
    return copy
