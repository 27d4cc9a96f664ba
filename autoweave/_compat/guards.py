"""What dynamo guards a compiled function on: its cache entries' guard text (torch 2.4+).

A shared region splits only where dynamo really specializes on something that
differs between the blocks sharing it (``weave/shared_kinds``). The evidence is
dynamo's own: the guards of the cache entries it made for the region's code and
for the resume functions it made at each graph break. Nothing here changes a
cache; reading one costs a walk of a few entries, done only after a compile.

TODO: ``_debug_get_cache_entry_list`` and ``GuardManagerWrapper.code_parts``
(checked on torch 2.13) are debugging surfaces with no stability promise; a
public "guards of this code" query would retire this module (pytorch#114082 asked
for one and was closed by pointing at this same debug API). Where they are missing nothing is read and nothing splits.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

from autoweave._compat.lookup import find_optional

# dynamo names the resume functions it makes at a graph break ``__resume_at_<offset>_<n>``
# and stores them in the globals of the function that broke.
RESUME_PREFIX = "__resume_at_"

# ``L['self']._modules['attn'].layer_idx == 3``, ``L['m'].causal is None``: the attribute
# an equality or identity guard reads (the name right before the comparison).
_GUARDED_ATTRIBUTE = re.compile(r"\.([A-Za-z_]\w*)\s*(?:==|!=|is\b)")


def _cache_entries(code: Any) -> list[Any]:
    entries = find_optional("torch._dynamo.eval_frame._debug_get_cache_entry_list")
    if entries is None:
        return []
    try:
        return list(entries(code))
    except Exception:  # a code object dynamo never saw, or a torch that moved the field
        return []


def guard_texts(fn: Callable[..., Any]) -> Iterator[str]:
    """The guard text of every cache entry of ``fn``'s code, the functions it wraps and its resume functions."""
    seen: set[int] = set()
    todo = [fn]
    while todo:
        current = todo.pop()
        code = getattr(current, "__code__", None)
        if code is None or id(code) in seen:
            continue
        seen.add(id(code))
        # A decorator's copied wrapper breaks at its call of the wrapped copy: a frame of its own.
        todo.append(getattr(current, "__wrapped__", None))
        for entry in _cache_entries(code):
            manager = getattr(entry, "guard_manager", None)
            yield from getattr(manager, "code_parts", None) or ()
            transformed = getattr(entry, "code", None)
            for name in getattr(transformed, "co_names", ()):
                if name.startswith(RESUME_PREFIX):
                    todo.append(current.__globals__.get(name))


def guarded_attributes(fn: Callable[..., Any]) -> frozenset[str]:
    """Names of attributes whose value ``fn``'s compiled code is guarded on (``==``, ``is``)."""
    return frozenset(name for text in guard_texts(fn) for name in _GUARDED_ATTRIBUTE.findall(text))
